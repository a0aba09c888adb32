package host

import (
	"context"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// A registered engine kind is one a config may name and a run opens: nothing else in the host
// knows its name. A kind no package registered (torch, when host/torch is not linked) is an
// error that says how to link it.
func TestRegisteredEngineKind(t *testing.T) {
	opened := 0
	RegisterEngineKind("echo-test", EngineKind{Open: func(_ context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
		opened++
		env.Logf("policy %q: echo-test engine", p.Name)
		return scripted.Echo(`\boxed{1}`), nil
	}})
	cfg, err := config.Parse([]byte("policies:\n  - {name: p, hf_checkpoint: builtin:tiny-arith, engine: {kind: echo-test}}\nrollout: {batch_size: 2}\n"), "echo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	r, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n"),
		Options{Config: cfg, Tasks: numberedTasks(2), Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if opened != 1 || !strings.Contains(log.String(), `policy "p": echo-test engine`) {
		t.Fatalf("the registered kind was opened %d times; log:\n%s", opened, log.String())
	}

	_, err = openEngine(context.Background(), config.PolicyConfig{Name: "g", Engine: config.EngineConfig{Kind: "torch"}}, "", engineLogs{})
	if err == nil || !strings.Contains(err.Error(), `engine kind "torch" is not available in this build (known: echo-test, openai, remote, tiny)`) ||
		!strings.Contains(err.Error(), "github.com/slimen/slimen/host/torch") {
		t.Fatalf("opening an unlinked torch engine: %v", err)
	}
	if _, err := config.Parse([]byte("policies:\n  - {name: p, engine: {kind: gpu}}\n"), "gpu.yaml"); err == nil ||
		!strings.Contains(err.Error(), `engine kind "gpu" is not one of tiny, torch, remote, openai, echo-test`) {
		t.Fatalf("an unknown kind: %v", err)
	}
}
