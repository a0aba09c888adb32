package host

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

const honestScript = `
load("@slimen//answers.star", "boxed")

def rollout(task):
    cs = generate("p", task.prompt, n = 2)
    outs = parallel(lambda c: generate("p", "check " + c.text), cs)
    for c in cs + outs:
        reward(c, 1.0 if boxed(c.text) == "1" else 0.0)
    train(cs + outs)
    n = state.update("seen", lambda n: n + 1, 0)
    print("rollout", task.id)
    log(seen = n >= 1)
`

// TestSandboxMatchesInProcess: a sandboxed run trains on exactly what an in-process run does.
func TestSandboxMatchesInProcess(t *testing.T) {
	seeded := func(r scripted.Request) string { return []string{`\boxed{1}`, `\boxed{2}`}[r.Seed%2] }
	run := func(sandbox bool) string {
		cfg := testConfig(4, "p")
		r, err := Load(context.Background(), writeScript(t, honestScript), Options{Config: cfg, Tasks: numberedTasks(4),
			Engines: map[string]engines.Engine{"p": scripted.New(seeded)}, Sandbox: sandbox})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		var lines []string
		for i := 0; i < 2; i++ {
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Failed) > 0 {
				t.Fatalf("sandbox=%v: %v", sandbox, res.Failed[0])
			}
			for _, m := range append(res.Policies, res.Run) {
				for _, k := range TimingFields {
					delete(m, k)
				}
				b, _ := json.Marshal(m)
				lines = append(lines, string(b))
			}
		}
		v, _ := r.State().Get("seen")
		return v.String() + "\n" + joinLines(lines)
	}
	in, sb := run(false), run(true)
	if in != sb {
		t.Errorf("sandboxed run differs:\n%s\n---\n%s", in, sb)
	}
}

func joinLines(l []string) string {
	out := ""
	for _, s := range l {
		out += s + "\n"
	}
	return out
}

// TestHostileScripts is issue 8's acceptance: each script of testdata/hostile attacks from one
// task (t3) of a normal run. The run completes, every honest task's sample is trained, the
// attacking rollout fails with the budget or rule it broke, and the host's memory stays small.
func TestHostileScripts(t *testing.T) {
	files, _ := filepath.Glob("../testdata/hostile/*.star")
	if len(files) < 15 {
		t.Fatalf("%d hostile scripts, want at least 15", len(files))
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".star")
		t.Run(name, func(t *testing.T) {
			src, _ := os.ReadFile(f)
			header, _, _ := strings.Cut(string(src), "\n")
			cfg := testConfig(8, "p", "judge")
			cfg.Policies[1].Trainable = false
			// The wall-time budget is tight only where it is what the script attacks: on a loaded
			// machine a memory bomb may take seconds to reach its limit.
			wall := 60.0
			if name == "wall_time" {
				wall = 2
			}
			cfg.Sandbox = config.SandboxConfig{Steps: 2_000_000, GenerateCalls: 32, Tokens: 4096, WallSeconds: wall,
				PrintBytes: 4096, StateBytes: 4096, ParallelItems: 256, MemoryMB: 256, Processes: 2,
				Policies: []string{"p", "judge"}, Train: []string{"p"}}
			if name == "not_granted" {
				cfg.Sandbox.Policies = []string{"p"}
			}
			engs := map[string]engines.Engine{"p": scripted.Echo(`\boxed{1}`), "judge": scripted.Echo("yes")}
			r, err := Load(context.Background(), f, Options{Config: cfg, Engines: engs, Tasks: numberedTasks(8), Sandbox: true})
			if want, ok := strings.CutPrefix(header, "# load-time: "); ok {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("Load: %v, want an error containing %q", err, want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatalf("the run did not survive: %v", err)
			}
			want := regexp.MustCompile(strings.TrimPrefix(header, "# expect: "))
			if len(res.Failed) != 1 || res.Failed[0].TaskID != "t3" || !want.MatchString(res.Failed[0].Msg) {
				for _, f := range res.Failed {
					t.Logf("failed: %s", f.Error())
				}
				t.Fatalf("want exactly task t3 failed with %q", want)
			}
			for _, m := range res.Policies {
				if m.Policy() == "p" && m.Float("samples") != 7 {
					t.Errorf("policy p trained %v samples, want the 7 honest ones", m.Float("samples"))
				}
			}
			if rss := residentMB(t); rss > 400 {
				t.Errorf("host resident memory %d MiB, want under 400", rss)
			}
		})
	}
}

func residentMB(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skip("no /proc/self/status")
	}
	for _, line := range strings.Split(string(b), "\n") {
		if kb, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.Atoi(strings.Fields(kb)[0])
			return n / 1024
		}
	}
	return 0
}
