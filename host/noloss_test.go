package host

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// A policy that did not train in a step has no loss, not a loss of 0 (issue 35: absent is absent;
// a frozen judge's loss curve sat at 0): a frozen policy, one with no samples this step.
func TestNoTrainingIsNoLoss(t *testing.T) {
	cfg := testConfig(2, "p", "judge", "idle")
	cfg.Policies[1].Trainable = false
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    c = generate("p", task.prompt)
    j = generate("judge", c.text)
    if False:
        generate("idle", task.prompt)
    reward([c, j], 1.0 if task.id.endswith("0") else 0.0)
    train(c)
`), Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x"), "judge": scripted.Echo("y"), "idle": scripted.Echo("z")}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range res.Policies {
		_, has := m["loss"]
		if want := m.Policy() == "p"; has != want {
			t.Errorf("policy %s: loss %v; want one only for p, which trained", m.Policy(), m["loss"])
		}
	}
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if (strings.Contains(line, `"policy":"judge"`) || strings.Contains(line, `"policy":"idle"`)) && strings.Contains(line, `"loss"`) {
			t.Errorf("metrics.jsonl writes a loss for a policy that did not train:\n%s", line)
		}
	}
}
