package host

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
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
