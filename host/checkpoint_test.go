package host

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

const counterScript = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0 if c.text == "a" else 0.0)
    train(c)
    n = state.update("calls", lambda n: n + 1, 0)
    log(calls = n)
`

func metricsWithoutTimings(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	return WithoutTimings(string(b))
}

func TestCheckpointResumeEqualsUninterrupted(t *testing.T) {
	script := writeScript(t, counterScript)
	seeded := func(r scripted.Request) string { return []string{"a", "b"}[r.Seed%2] }
	open := func(out string) *Run {
		cfg := testConfig(4, "p")
		cfg.Run.KeepCheckpoints = 2
		r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(4),
			Engines: map[string]engines.Engine{"p": scripted.New(seeded)}})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	dir := t.TempDir()
	whole := filepath.Join(dir, "whole")
	r := open(whole)
	if err := r.Steps(context.Background(), 6); err != nil {
		t.Fatal(err)
	}
	r.Close()

	split := filepath.Join(dir, "split")
	r = open(split)
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Step 4 runs and is written before the "crash": resume must drop it.
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.Close()
	found, err := FindCheckpoint(split)
	if err != nil || found != ck {
		t.Fatalf("FindCheckpoint = %q, %v; want %q", found, err, ck)
	}
	r = open(split)
	if err := r.Resume(context.Background(), found); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if a, b := metricsWithoutTimings(t, whole), metricsWithoutTimings(t, split); a != b {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", a, b)
	}
}

func TestCorruptCheckpoints(t *testing.T) {
	script := writeScript(t, counterScript)
	out := t.TempDir()
	cfg := testConfig(2, "p")
	cfg.Run.SaveInterval = 1
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
		Engines: map[string]engines.Engine{"p": scripted.Echo("a")}})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	r.Close()
	root := filepath.Join(out, "checkpoints")
	if got := checkpointSteps(root); fmt.Sprint(got) != "[3 2 1]" {
		t.Fatalf("checkpoints: %v", got)
	}
	// A truncated file: the error names it and offers the previous checkpoint.
	f := filepath.Join(root, "step_3", "state.json")
	b, _ := os.ReadFile(f)
	os.WriteFile(f, b[:len(b)/2], 0o644)
	_, err = FindCheckpoint(out)
	if err == nil || !strings.Contains(err.Error(), "file state.json has") || !strings.Contains(err.Error(), "--resume "+filepath.Join(root, "step_2")) {
		t.Fatalf("truncated: %v", err)
	}
	if _, err := FindCheckpoint(filepath.Join(root, "step_2")); err != nil {
		t.Errorf("the previous checkpoint: %v", err)
	}
	// A checkpoint whose write never finished (no manifest) is refused.
	os.Remove(filepath.Join(root, "step_2", manifestFile))
	if err := VerifyCheckpoint(filepath.Join(root, "step_2")); err == nil || !strings.Contains(err.Error(), "incomplete") {
		t.Errorf("no manifest: %v", err)
	}
}

func TestStateRoundTrip(t *testing.T) {
	s := NewState()
	d := starlark.NewDict(2)
	d.SetKey(starlark.MakeInt(1), starlark.Tuple{starlark.String("x"), starlark.Float(0.1)})
	d.SetKey(starlark.String("big"), starlark.MakeInt64(1<<62))
	for k, v := range map[string]starlark.Value{"d": d, "l": starlark.NewList([]starlark.Value{starlark.None, starlark.True}), "f": starlark.Float(1.0)} {
		if err := s.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	b, err := encodeState(s)
	if err != nil {
		t.Fatal(err)
	}
	s2 := NewState()
	if err := decodeState(b, s2); err != nil {
		t.Fatal(err)
	}
	for _, k := range s.Keys() {
		a, _ := s.Get(k)
		c, _ := s2.Get(k)
		if a.String() != c.String() || a.Type() != c.Type() {
			t.Errorf("%s: %s (%s) became %s (%s)", k, a, a.Type(), c, c.Type())
		}
	}
}
