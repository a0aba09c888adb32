package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
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

// recordSteps lists the step of each line of a run's rollouts.jsonl.
func recordSteps(t *testing.T, out string) []int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "rollouts.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var steps []int
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var rec struct{ Step int }
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("rollouts.jsonl: %v: %s", err, line)
		}
		steps = append(steps, rec.Step)
	}
	return steps
}

// TestSIGKILLRolloutsResume: a run killed after step 2's rollouts were saved, while it wrote step
// 2's checkpoint, resumes from step 1's; rollouts.jsonl then holds every step's rollouts once.
func TestSIGKILLRolloutsResume(t *testing.T) {
	cfg := smallRun(t, "3", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	_, err := slimen(t, []string{"SLIMEN_TEST_SIGKILL_IN_CHECKPOINT=2"}, "exec", debate, "--config", cfg, "--out", out)
	if ee, ok := err.(*exec.ExitError); !ok || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the run was not killed: %v", err)
	}
	if got := recordSteps(t, out); !slices.Equal(got, []int{1, 1, 2, 2}) {
		t.Fatalf("before the resume, rollouts.jsonl holds steps %v; want steps 1 and 2's", got)
	}
	if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
		t.Fatalf("resume: %v\n%s", err, log)
	}
	if got := recordSteps(t, out); !slices.Equal(got, []int{1, 1, 2, 2, 3, 3}) {
		t.Errorf("after the resume, rollouts.jsonl holds steps %v; want each step's 2 rollouts once", got)
	}
}
