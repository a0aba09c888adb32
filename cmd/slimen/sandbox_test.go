package main

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// sandboxConfig is a two-step debate on builtin:tiny-arith with a sandbox: section that grants
// training of both policies (a sandboxed script trains only what sandbox.train lists). The debate
// trains no role on a task whose answers are all right or all wrong; with seed 1 each policy has
// tasks to train on at both steps.
const sandboxConfig = `policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
  - {name: critic, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
rollout: {batch_size: 4, max_response_len: 24}
run: {steps: 2, seed: 1}
sandbox: {train: [generator, critic], memory_mb: 512}
`

func writeConfig(t *testing.T, y string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestSandboxCLI runs the debate example with `slimen exec --sandbox` (the rollouts in child
// processes of the slimen binary) and without: the same seed gives the same metrics apart from
// the timings, and both policies train.
func TestSandboxCLI(t *testing.T) {
	cfg := writeConfig(t, sandboxConfig)
	in, sb := filepath.Join(t.TempDir(), "in"), filepath.Join(t.TempDir(), "sandboxed")
	if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg, "--out", in); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg, "--out", sb, "--sandbox"); err != nil {
		t.Fatalf("--sandbox: %v\n%s", err, log)
	}
	mi, ms := metricsNoTimings(t, in), metricsNoTimings(t, sb)
	if mi != ms {
		t.Errorf("the sandboxed run's metrics differ:\n%s\n---\n%s", mi, ms)
	}
	if n := strings.Count(ms, `"_run"`); n != 2 {
		t.Errorf("want 2 steps, got %d:\n%s", n, ms)
	}
	checkTrained(t, ms, 2)
	resolved, err := os.ReadFile(filepath.Join(sb, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(resolved), "sandbox:\n  enabled: true\n") {
		t.Errorf("the sandboxed run's config.yaml does not say sandbox.enabled: true:\n%s", resolved)
	}
}

// TestSandboxCLIZeroConfig: without a config, a sandboxed run trains the policies the script
// names (they are fresh models of this run; sandbox.train is for configs).
func TestSandboxCLIZeroConfig(t *testing.T) {
	out := filepath.Join(t.TempDir(), "zero")
	if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--sandbox", "--steps", "1", "--batch-size", "2", "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	checkTrained(t, metricsNoTimings(t, out), 1)
}

// checkTrained checks metrics.jsonl lines: both debate policies trained samples at every one of
// steps steps, and no rollout failed.
func checkTrained(t *testing.T, metrics string, steps int) {
	t.Helper()
	trained := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(metrics), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		switch m["policy"] {
		case "generator", "critic":
			if n, _ := m["samples"].(float64); n > 0 {
				trained[m["policy"].(string)]++
			}
		case "_run":
			if m["failed"] != 0.0 {
				t.Errorf("step %v: %v rollouts failed", m["step"], m["failed"])
			}
		}
	}
	for _, p := range []string{"generator", "critic"} {
		if trained[p] != steps {
			t.Errorf("policy %s trained at %d of %d steps:\n%s", p, trained[p], steps, metrics)
		}
	}
}

// TestSandboxCLIBadConfig: a sandbox: section that grants training of a frozen policy is a config
// error, exit 2 with its file and line, before anything runs.
func TestSandboxCLIBadConfig(t *testing.T) {
	cfg := writeConfig(t, `policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith}
  - {name: critic, hf_checkpoint: builtin:tiny-arith, trainable: false}
sandbox:
  prompt_bytes: 0
  train: [generator, critic]
`)
	log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg, "--sandbox", "--out", t.TempDir())
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("%v, want exit status 2:\n%s", err, log)
	}
	for _, want := range []string{
		cfg + ":5: sandbox.prompt_bytes: must be at least 1, got 0",
		cfg + `:6: sandbox.train: grants training of policy "critic", which is frozen`,
	} {
		if !strings.Contains(log, want) {
			t.Errorf("output lacks %q:\n%s", want, log)
		}
	}
}
