package host

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/slimen/slimen/host/config"
)

// TestZeroConfigChatWithTools: in a zero-config run, a policy that a chat() with tool schemas
// names is created on the embedded chat model, whose template holds the schemas, so the docs'
// first agent snippet trains with no config; a policy used only by generate stays on
// builtin:tiny-arith.
func TestZeroConfigChatWithTools(t *testing.T) {
	src := `
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluates integer arithmetic with + - *.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}

def rollout(task):
    c = chat("agent", system = "You can use a calculator.", tools = [CALC])
    c.user(task.prompt)
    c.generate(max_tokens = 32)
    reward(c, 1.0 if "boxed" in c.turns[-1].text else 0.0)
    train(c)
    g = generate("solver", task.prompt, max_tokens = 8)
    reward(g, 0.0)
    train(g)
`
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(deadline(t, 2*time.Minute), writeScript(t, src), Options{Out: out, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	want := map[string]string{"agent": config.BuiltinChatCheckpoint, "solver": config.BuiltinCheckpoint}
	for _, p := range r.Config().Policies {
		if p.HFCheckpoint != want[p.Name] || p.Engine.ModelPath != want[p.Name] {
			t.Errorf("policy %q on %s (engine model %s), want %s", p.Name, p.HFCheckpoint, p.Engine.ModelPath, want[p.Name])
		}
	}
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range res.Policies {
		if _, over := m["overflow"]; m.Policy() == "agent" && (m.Float("samples") < 1 || over) {
			t.Errorf("the chat with tools did not train whole: %v", m)
		}
	}
}
