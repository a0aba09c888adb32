package main

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host"
)

// These tests run the slimen binary the way a user does.

var slimenBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "slimen-bin")
	if err != nil {
		panic(err)
	}
	slimenBin = filepath.Join(dir, "slimen")
	if out, err := exec.Command("go", "build", "-o", slimenBin, ".").CombinedOutput(); err != nil {
		panic(string(out))
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// smallRun writes a random tiny model and a two-policy debate config of a few small steps.
func smallRun(t *testing.T, steps string, extra string) (cfg string) {
	t.Helper()
	dir := t.TempDir()
	model := filepath.Join(dir, "model")
	e, err := tiny.New(tiny.ModelConfig{Hidden: 32, Intermediate: 64, Layers: 1, Heads: 2, KVHeads: 1, MaxSeqLen: 256}, 7, tiny.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Save(context.Background(), model); err != nil {
		t.Fatal(err)
	}
	cfg = filepath.Join(dir, "config.yaml")
	y := `policies:
  - {name: generator, hf_checkpoint: ` + model + `, engine: {kind: tiny}, train: {lr: 1.0e-2, global_batch_size: 0}}
  - {name: critic, hf_checkpoint: ` + model + `, engine: {kind: tiny}, train: {lr: 1.0e-2, global_batch_size: 0}}
rollout: {batch_size: 4, max_response_len: 6}
run: {steps: ` + steps + `, seed: 3` + extra + `}
`
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func slimen(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(slimenBin, args...)
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func metricsNoTimings(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	return host.WithoutTimings(string(b))
}

func TestSameSeedSameMetrics(t *testing.T) {
	cfg := smallRun(t, "3", "")
	a, b := filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")
	for _, out := range []string{a, b} {
		if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg, "--out", out); err != nil {
			t.Fatalf("%v\n%s", err, log)
		}
	}
	ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b)
	if ma != mb {
		t.Errorf("same seed, different metrics:\n%s\n---\n%s", ma, mb)
	}
	if strings.Count(ma, `"_run"`) != 3 {
		t.Errorf("want 3 steps:\n%s", ma)
	}
}

// TestResumeAfterSIGTERM is issue 9's acceptance: 6 steps in one go, and 6 steps with a SIGTERM
// after step 3 and a resume, write the same metrics apart from timings.
func TestResumeAfterSIGTERM(t *testing.T) {
	cfg := smallRun(t, "6", "")
	whole, split := filepath.Join(t.TempDir(), "whole"), filepath.Join(t.TempDir(), "split")
	if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg, "--out", whole); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	cmd := exec.Command(slimenBin, "exec", "examples/debate/debate.star", "--config", cfg, "--out", split)
	cmd.Dir = "../.."
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(sc.Text(), "step 3/6") {
			cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("SIGTERM: exit %v, want 0\n%s", err, log.String())
	}
	if !strings.Contains(log.String(), "stopped after") {
		t.Fatalf("no graceful stop:\n%s", log.String())
	}
	if out, err := slimen(t, nil, "exec", "--resume", split); err != nil {
		t.Fatalf("resume: %v\n%s", err, out)
	}
	if a, b := metricsNoTimings(t, whole), metricsNoTimings(t, split); a != b {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", a, b)
	}
}

// TestSIGKILLDuringCheckpoint kills the process halfway through writing step 2's checkpoint: the
// partial write is never taken for a checkpoint, and resume goes on from step 1's.
func TestSIGKILLDuringCheckpoint(t *testing.T) {
	cfg := smallRun(t, "3", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	_, err := slimen(t, []string{"SLIMEN_TEST_SIGKILL_IN_CHECKPOINT=2"}, "exec", "examples/debate/debate.star", "--config", cfg, "--out", out)
	if ee, ok := err.(*exec.ExitError); !ok || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the run was not killed: %v", err)
	}
	ck, err := host.FindCheckpoint(out)
	if err != nil || filepath.Base(ck) != "step_1" {
		t.Fatalf("FindCheckpoint = %q, %v; want step_1", ck, err)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoints", "step_2")); err == nil {
		t.Fatal("a half-written step_2 exists")
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
			t.Errorf("resume: %v\n%s", err, log)
		}
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("resume did not finish")
	}
	if n := strings.Count(metricsNoTimings(t, out), `"_run"`); n != 3 {
		t.Errorf("%d steps in metrics after resume, want 3", n)
	}
}
