package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestExecTensorBoard: --tensorboard DIR writes an event file with every policy's metrics there,
// and the run keeps its rollouts in rollouts.jsonl; an empty folder is refused naming the flag.
func TestExecTensorBoard(t *testing.T) {
	dir := t.TempDir()
	tb, out := filepath.Join(dir, "tb"), filepath.Join(dir, "run")
	if log, err := slimen(t, nil, "exec", debate, "--config", smallRun(t, "2", ""), "--out", out, "--tensorboard", tb); err != nil {
		t.Fatalf("slimen exec: %v\n%s", err, log)
	}
	files, _ := filepath.Glob(filepath.Join(tb, "events.out.tfevents.*"))
	if len(files) != 1 {
		t.Fatalf("event files in %s: %v", tb, files)
	}
	b, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"generator/reward_mean", "critic/loss", "_run/rollouts", "generator/reward", "rollouts/0"} {
		if !strings.Contains(string(b), tag) {
			t.Errorf("the event file has no %s", tag)
		}
	}
	rec, err := os.ReadFile(filepath.Join(out, "rollouts.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(rec), "\n"); n != 4 {
		t.Errorf("rollouts.jsonl has %d lines, want the 2 rollouts of each of 2 steps", n)
	}
	log, err := slimen(t, nil, "exec", debate, "--config", smallRun(t, "1", ""), "--out", filepath.Join(dir, "run2"), "--tensorboard", "")
	if err == nil || !strings.Contains(log, "--tensorboard") {
		t.Errorf("--tensorboard \"\": %v\n%s", err, log)
	}
}
