package host

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/script/sandbox"
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
		cfg.Sandbox.Train = []string{"p"}
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

// hostileSandbox is the sandbox config of the hostile scripts' runs: budgets far below the
// defaults, so that each attack meets its limit quickly.
func hostileSandbox() config.SandboxConfig {
	sb := config.DefaultSandbox()
	sb.Steps, sb.GenerateCalls, sb.Tokens, sb.WallSeconds = 2_000_000, 32, 4096, 60
	sb.PrintBytes, sb.StateBytes, sb.StateTotalBytes, sb.ParallelItems = 4096, 4096, 1<<20, 256
	sb.PromptBytes, sb.MessageBytes, sb.MemoryMB, sb.Processes = 64<<10, 1<<20, 256, 2
	sb.Policies, sb.Train = []string{"p", "judge"}, []string{"p"}
	if raceEnabled {
		sb.MemoryMB = 4096 // the race runtime alone needs more than 256 MB
	}
	return sb
}

// hostPeakMiB is the bound on the host's peak resident memory while one hostile script runs. The
// host itself (the test binary with scripted engines) peaks near 20 MiB; what a script makes it
// hold comes on top.
const hostPeakMiB = 100

// TestHostileScripts is issue 8's acceptance: each script of testdata/hostile attacks from one
// task (t3) of a normal run. The run completes, every honest task's sample is trained, the
// attacking rollout fails with the budget or rule it broke, and the host's peak memory while the
// script runs stays under hostPeakMiB.
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
			cfg.Sandbox = hostileSandbox()
			// The wall-time budget is tight only where it is what the script attacks: on a loaded
			// machine a memory bomb may take seconds to reach its limit.
			if strings.Contains(header, "wall_seconds") {
				cfg.Sandbox.WallSeconds = 2
			}
			if raceEnabled && strings.Contains(header, "memory_mb") {
				t.Skip("a memory bomb cannot meet its memory_mb limit under the race detector's larger budget")
			}
			if name == "not_granted" {
				cfg.Sandbox.Policies = []string{"p"}
			}
			peak := resetPeak(t)
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
			trained := -1.0
			for _, m := range res.Policies {
				if m.Policy() == "p" {
					trained = m.Float("samples")
				}
			}
			if trained != 7 {
				t.Errorf("policy p trained %v samples (-1: it has no metrics line), want the 7 honest ones", trained)
			}
			mib := peak()
			t.Logf("host peak resident memory: %d MiB", mib)
			if mib > hostPeakMiB && !raceEnabled {
				t.Errorf("host peak resident memory %d MiB while the script ran, want under %d", mib, hostPeakMiB)
			}
		})
	}
}

// resetPeak starts measuring the process's peak resident memory (VmHWM) and returns a function
// that reads it in MiB. Writing 5 to /proc/self/clear_refs resets the high-water mark to the
// current resident size (Linux 4.0 and later); where it cannot, the peak is the whole test
// process's, a bound all the same.
func resetPeak(t *testing.T) func() int {
	t.Helper()
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("no /proc/self/status")
	}
	debug.FreeOSMemory() // what earlier subtests left in the heap does not count
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Logf("cannot reset the peak (%v): measuring the whole process's", err)
	}
	return func() int { return statusMiB(t, "VmHWM:") }
}

// statusMiB reads a field of /proc/self/status in MiB.
func statusMiB(t *testing.T, field string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if kb, ok := strings.CutPrefix(line, field); ok {
			n, _ := strconv.Atoi(strings.Fields(kb)[0])
			return n / 1024
		}
	}
	t.Fatalf("no %s in /proc/self/status", field)
	return 0
}

// TestSandboxRogueChild: the host does not rely on the child to keep its messages small. A child
// that sends a 200 MB line is stopped once the line passes message_bytes; its rollout fails
// naming the budget, and the host never holds the line.
func TestSandboxRogueChild(t *testing.T) {
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	cfg := testConfig(1, "p")
	cfg.Sandbox = hostileSandbox()
	cfg.Rollout.MaxFailedFraction = 1
	// Answers the init, then sends a 200 MB line with no newline for the rollout (on the
	// channel: fd 3 from the host, fd 4 to it).
	rogue := []string{"/bin/sh", "-c", `read a <&3; echo '{"t":"ready"}' >&4; read b <&3; exec head -c 200000000 /dev/zero >&4`}
	peak := resetPeak(t)
	r, err := Load(context.Background(), writeScript(t, honestScript), Options{Config: cfg, Tasks: numberedTasks(1),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: true, SandboxCommand: rogue})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Msg, "sandbox budget message_bytes (1048576) exceeded") {
		t.Fatalf("failed: %v; want the rollout failed with message_bytes", res.Failed)
	}
	if mib := peak(); mib > hostPeakMiB && !raceEnabled {
		t.Errorf("host peak resident memory %d MiB, want under %d", mib, hostPeakMiB)
	}
}

// TestSandboxCPUSeconds: a child past sandbox.cpu_seconds (RLIMIT_CPU) dies; the honest rollouts
// it took with it run again and are trained, and the looping one fails naming cpu_seconds.
func TestSandboxCPUSeconds(t *testing.T) {
	cfg := testConfig(4, "p")
	cfg.Sandbox = hostileSandbox()
	cfg.Sandbox.Steps = 1 << 62 // only the CPU limit stops the loop
	cfg.Sandbox.CPUSeconds = 1
	cfg.Sandbox.Policies, cfg.Sandbox.Train = nil, []string{"p"}
	src := `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t1":
        while True:
            pass
`
	before := childrenCPU(t)
	r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(4),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// The looping rollout killed two children (the shared one, then its own): about a CPU second
	// each, not the 6 of the hard limit. CPU time, unlike wall time, does not depend on the load.
	if cpu := childrenCPU(t) - before; cpu > 5*time.Second {
		t.Errorf("the children that died used %v of CPU: they did not stop at the soft limit", cpu)
	}
	// The child stops itself at the soft limit (SIGXCPU, which the Go runtime would ignore), not
	// at the hard one 5 CPU seconds later.
	want := "sandbox budget cpu_seconds (1) exceeded: the script's process used up its CPU time"
	if len(res.Failed) != 1 || res.Failed[0].TaskID != "t1" || strings.TrimSpace(res.Failed[0].Msg) != want {
		t.Fatalf("failed: %v; want task t1 failed with cpu_seconds", res.Failed)
	}
	if n := res.Policies[0].Float("samples"); n != 3 {
		t.Errorf("trained %v samples, want the 3 honest ones", n)
	}
}

// childrenCPU is the CPU time of this process's children that have ended.
func childrenCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestSandboxGrants: what sandbox.policies and sandbox.train grant (docs/sandbox.md). generate
// may use every policy of the config unless policies lists some; train only what train lists,
// except in a zero-config run, whose policies are the run's own fresh models (at most 8 of them).
func TestSandboxGrants(t *testing.T) {
	src := `
def rollout(task):
    c = generate(task.metadata["policy"], task.prompt)
    reward(c, 1.0)
    train(c)
`
	tasks := func(policies ...string) listTasks {
		var out listTasks
		for i, p := range policies {
			out = append(out, Task{ID: fmt.Sprintf("t%d", i), Prompt: "q", Metadata: map[string]any{"policy": p}})
		}
		return out
	}
	echo := func(_ context.Context, p config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }
	step := func(t *testing.T, cfg *config.Config, zero bool, ts listTasks) *StepResult {
		t.Helper()
		if cfg == nil {
			cfg = config.Default(nil)
		}
		cfg.Rollout.BatchSize, cfg.Rollout.MaxFailedFraction = len(ts), 1
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Zero: zero, Tasks: ts, OpenEngine: echo, Sandbox: true})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	failures := func(res *StepResult) string {
		var out []string
		for _, f := range res.Failed {
			out = append(out, f.TaskID+": "+f.Msg)
		}
		return strings.Join(out, "\n")
	}

	t.Run("train not listed", func(t *testing.T) {
		res := step(t, testConfig(1, "p", "q"), false, tasks("p"))
		if !strings.Contains(failures(res), `train: policy "p" is not granted to this script for training (sandbox.train is not set`) {
			t.Fatalf("failures:\n%s\nwant train refused: sandbox.train is not set", failures(res))
		}
	})
	t.Run("train listed", func(t *testing.T) {
		cfg := testConfig(1, "p", "q")
		cfg.Sandbox.Train = []string{"q"}
		res := step(t, cfg, false, tasks("q", "p"))
		if f := failures(res); !strings.HasPrefix(f, "t1: ") || strings.Count(f, "\n") > 3 || !strings.Contains(f, `sandbox.train: [q]`) {
			t.Fatalf("failures:\n%s\nwant only t1 (policy p) refused", f)
		}
	})
	t.Run("policies listed", func(t *testing.T) {
		cfg := testConfig(1, "p", "q")
		cfg.Sandbox.Policies, cfg.Sandbox.Train = []string{"p"}, []string{"p"}
		res := step(t, cfg, false, tasks("p", "q"))
		if f := failures(res); !strings.HasPrefix(f, "t1: ") || !strings.Contains(f, `generate: policy "q" is not granted to this script (sandbox.policies: [p])`) {
			t.Fatalf("failures:\n%s\nwant only t1 (policy q) refused", f)
		}
	})
	t.Run("zero-config trains", func(t *testing.T) {
		res := step(t, nil, true, tasks("a", "b"))
		if len(res.Failed) > 0 {
			t.Fatalf("failures:\n%s", failures(res))
		}
	})
	t.Run("zero-config creates at most 8", func(t *testing.T) {
		var names []string
		for i := range 10 {
			names = append(names, fmt.Sprintf("p%d", i))
		}
		res := step(t, nil, true, tasks(names...))
		if len(res.Failed) != 2 || !strings.Contains(failures(res), "a sandboxed run without a config creates at most 8 policies") {
			t.Fatalf("failures:\n%s\nwant 2 policies refused", failures(res))
		}
	})
}

// TestSandboxReportGrants: the host checks the grants of what a child reports for training
// itself, rather than trusting the child.
func TestSandboxReportGrants(t *testing.T) {
	cfg := testConfig(1, "p", "q")
	cfg.Sandbox.Train = []string{"p"}
	r := &Run{cfg: cfg}
	for _, tc := range []struct {
		policy, teacher, want string
	}{
		{"p", "", ""},
		{"q", "", `train: policy "q" is not granted to this script (sandbox.train: [p])`},
	} {
		ro := reported(tc.policy)
		err := r.applyReport(ro, sandbox.Done{Queued: []sandbox.Queued{{ID: "t0/0#0", Group: "t0", Teacher: tc.teacher}}})
		if got := fmt.Sprint(err); (tc.want == "" && err != nil) || (tc.want != "" && !strings.Contains(got, tc.want)) {
			t.Errorf("%s: applyReport: %v, want %q", tc.policy, err, tc.want)
		}
	}
	cfg.Sandbox.Policies = []string{"p"}
	ro := reported("p")
	err := r.applyReport(ro, sandbox.Done{Queued: []sandbox.Queued{{ID: "t0/0#0", Group: "t0", Teacher: "q"}}})
	if err == nil || !strings.Contains(err.Error(), `train: teacher: policy "q" is not granted to this script (sandbox.policies: [p])`) {
		t.Errorf("teacher q: applyReport: %v, want it refused", err)
	}
}

// reported is the host's copy of a sandboxed rollout whose child generated completion t0/0#0 of
// policy.
func reported(policy string) *script.Rollout {
	ro := &script.Rollout{}
	for _, c := range script.CompletionsOf(policy, engines.GenerateRequest{ID: "t0/0"}, []engines.Completion{{Text: "x"}}) {
		ro.Note(c)
	}
	return ro
}

// TestSandboxPredeclared: a sandboxed script meets exactly the names script's TestPredeclared
// pins: no clock, no files, no environment.
func TestSandboxPredeclared(t *testing.T) {
	for _, name := range []string{"time", "now", "sleep", "open", "exec", "eval", "getenv", "random", "json", "math"} {
		src := "def rollout(task):\n    return " + name + "\n"
		_, err := Load(context.Background(), writeScript(t, src), Options{Config: testConfig(1, "p"), Sandbox: true,
			Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(1)})
		if err == nil || !strings.Contains(err.Error(), "undefined: "+name) {
			t.Errorf("a sandboxed script naming %s: %v, want undefined", name, err)
		}
	}
}

// TestSandboxCallsInFlight: a child has at most sandbox.MaxCallsInFlight calls at the host at once, so a
// fan-out cannot make the host hold one goroutine and one message per thread; the fan-out still
// completes.
func TestSandboxCallsInFlight(t *testing.T) {
	cfg := testConfig(1, "p")
	cfg.Sandbox.Processes, cfg.Sandbox.Train, cfg.Sandbox.GenerateCalls = 1, []string{"p"}, 1000
	src := `
def rollout(task):
    cs = parallel(lambda i: generate("p", "q%d" % i, max_tokens = 1), range(1000))
    reward(cs, 1.0)
    train(cs)
`
	r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(1),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Failed) > 0 || res.Policies[0].Float("samples") != 1000 {
		t.Fatalf("failed %v, trained %v samples; want 1000 trained", res.Failed, res.Policies[0].Float("samples"))
	}
	r.sandbox.mu.Lock()
	defer r.sandbox.mu.Unlock()
	for _, c := range r.sandbox.children {
		c.mu.Lock()
		peak := c.peakCalls
		c.mu.Unlock()
		if peak > sandbox.MaxCallsInFlight || peak == 0 {
			t.Errorf("the host answered up to %d calls of a child at once, want 1 to %d", peak, sandbox.MaxCallsInFlight)
		}
	}
}

// nestedFanout nests parallel calls a thousand wide, each under the default parallel_items: a
// contributed script that tries to stall its step rather than break a budget outright.
const nestedFanout = `
def honest(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)

def rollout(task):
    honest(task)
    if task.id == "t3":
        parallel(lambda i: parallel(lambda j: parallel(lambda k: k, range(1000)), range(1000)), range(1000))
`

// TestSandboxNestedFanout: at the default budgets, a rollout that nests parallel calls a
// thousand wide fails on its steps budget alone, and containing it costs the step little: the
// step ends within nestedStepBound and the host's peak memory stays under hostPeakMiB
// (docs/sandbox.md has the numbers before and after sandbox.threads).
func TestSandboxNestedFanout(t *testing.T) {
	if raceEnabled {
		t.Skip("timing bound; the race detector multiplies the cost of every thread")
	}
	cfg := testConfig(8, "p")
	cfg.Sandbox.Train = []string{"p"}
	peak := resetPeak(t)
	r, err := Load(context.Background(), writeScript(t, nestedFanout), Options{Config: cfg, Tasks: numberedTasks(8),
		Engines: map[string]engines.Engine{"p": scripted.Echo(`\boxed{1}`)}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	t0 := time.Now()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(t0)
	mib := peak()
	r.Close() // reaps the children: their peak shows in RUSAGE_CHILDREN
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru)
	t.Logf("step with the nested fan-out: %.1fs; host peak resident memory %d MiB, the largest child's %d MiB", took.Seconds(), mib, ru.Maxrss/1024)
	for _, f := range res.Failed {
		t.Logf("failed: %s", f.Msg)
	}
	if len(res.Failed) != 1 || res.Failed[0].TaskID != "t3" || !strings.Contains(res.Failed[0].Msg, "sandbox budget") {
		for _, f := range res.Failed {
			t.Logf("failed: %s", f.Error())
		}
		t.Fatalf("want exactly task t3 failed on a sandbox budget")
	}
	if got := res.Policies[0].Float("samples"); got != 7 {
		t.Errorf("trained %v samples, want the 7 honest ones", got)
	}
	if took > nestedStepBound {
		t.Errorf("the step took %v, want under %v", took, nestedStepBound)
	}
	if mib > hostPeakMiB {
		t.Errorf("host peak resident memory %d MiB, want under %d", mib, hostPeakMiB)
	}
}

const nestedStepBound = 30 * time.Second

// nestedRandom nests parallel three deep; every leaf draws from its thread's generator and
// generates, so what the rollout logs and trains depends on each item's call-tree position.
const nestedRandom = `
load("@slimen//random.star", "randint", "random")

def leaf(k):
    c = generate("p", "q%d" % randint(0, 1000000))
    reward(c, random())
    train(c)
    return randint(0, 1000000)

def rollout(task):
    xs = parallel(lambda i: parallel(lambda j: parallel(leaf, range(3)), range(3)), range(3))
    total = 0
    for x in xs:
        for y in x:
            for z in y:
                total += z
    log(total = total)
`

// TestParallelThreadsBound: with sandbox.threads down to 1 (every item runs on its caller's
// goroutine) nested parallel calls neither deadlock nor change what a rollout computes: the run
// equals the in-process one, which has threads to spare.
func TestParallelThreadsBound(t *testing.T) {
	run := func(sandboxed bool, threads int) string {
		cfg := testConfig(2, "p")
		cfg.Sandbox.Train, cfg.Sandbox.Threads = []string{"p"}, threads
		r, err := Load(context.Background(), writeScript(t, nestedRandom), Options{Config: cfg, Tasks: numberedTasks(2),
			Engines: map[string]engines.Engine{"p": scripted.New(func(r scripted.Request) string { return fmt.Sprint(r.Seed % 97) })}, Sandbox: sandboxed})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatalf("threads %d: %v", threads, res.Failed[0])
		}
		var lines []string
		for _, m := range append(res.Policies, res.Run) {
			for _, k := range TimingFields {
				delete(m, k)
			}
			b, _ := json.Marshal(m)
			lines = append(lines, string(b))
		}
		return joinLines(lines)
	}
	want := run(false, 0)
	if !strings.Contains(want, `"total"`) || !strings.Contains(want, `"samples":54`) {
		t.Fatalf("the in-process run did not log its total or train 54 samples:\n%s", want)
	}
	for _, threads := range []int{1, 3} {
		if got := run(true, threads); got != want {
			t.Errorf("sandbox.threads %d changes the run:\n%s\n---\n%s", threads, got, want)
		}
	}
}

// TestSandboxedEvalRunsEvalRollout: a sandboxed run's host only parses the script, yet its eval
// goes through the script's eval_rollout (run by the children), as in process: it used to fall
// back to the default eval (and, in a zero-config run, to an eval of no policy at all).
func TestSandboxedEvalRunsEvalRollout(t *testing.T) {
	src := `
def rollout(task):
    train(generate("p", task.prompt))

def eval_rollout(task):
    return {"mine": 0.25, "len": len(generate("p", task.prompt).text)}
`
	run := func(sandboxed bool) Metrics {
		cfg := testConfig(2, "p")
		cfg.Sandbox.Train = []string{"p"}
		cfg.Eval.Datasets = []config.EvalDataset{{Name: "arith", Path: "synthetic:arith", Limit: 3, Temperature: 1, NSamples: 1}}
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(2),
			Engines: map[string]engines.Engine{"p": scripted.Echo("abc")}, Sandbox: sandboxed})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		ms, err := r.Eval(context.Background())
		if err != nil || len(ms) != 1 {
			t.Fatalf("sandboxed %v: eval %v, %v", sandboxed, ms, err)
		}
		return ms[0]
	}
	for _, sandboxed := range []bool{false, true} {
		m := run(sandboxed)
		if m.Float("mine") != 0.25 || m.Float("len") != 3 || m.Float("failed") != 0 {
			t.Errorf("sandboxed %v: eval %v, want eval_rollout's mine 0.25 and len 3", sandboxed, m)
		}
	}
}
