package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/host"
)

// TestTorchAsyncVersionsInWorker: at rollout.max_staleness 1 a torch worker keeps the weights
// versions itself (a device copy per version; no rollout replica started), and the run writes
// the metrics of the same run whose workers keep none (--no-versions), which samples from rollout
// replicas that load the weights the trainers save.
func TestTorchAsyncVersionsInWorker(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py, dir)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	run := func(name, args string) (string, string) {
		cfg := filepath.Join(dir, name+".yaml")
		y := fmt.Sprintf(`policies:
  - name: generator
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[3]s]}
    train: {lr: 1.0e-2, global_batch_size: 0}
  - name: critic
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[3]s]}
    train: {lr: 1.0e-2, global_batch_size: 0}
rollout: {batch_size: 2, max_response_len: 6, max_staleness: 1}
run: {steps: 3, seed: 3}
`, model, py, args)
		if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, name)
		if log, err := slimen(t, env, "exec", debate, "--config", cfg, "--out", out); err != nil {
			t.Fatalf("%s: %v\n%s", name, err, log)
		}
		m, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
		if err != nil {
			t.Fatal(err)
		}
		ev, err := os.ReadFile(filepath.Join(out, "events.log"))
		if err != nil {
			t.Fatal(err)
		}
		return host.WithoutTimings(string(m)), string(ev)
	}
	inWorker, ev := run("versions", "")
	for _, want := range []string{
		`policy "generator": its torch engine keeps rollout copies of its weights itself`,
		`policy "critic": its torch engine keeps rollout copies of its weights itself`,
		"kept weights version 1: ",
	} {
		if !strings.Contains(ev, want) {
			t.Errorf("events.log lacks %q:\n%s", want, ev)
		}
	}
	if strings.Contains(ev, "rollout replica") {
		t.Errorf("a worker that keeps versions got rollout replicas:\n%s", ev)
	}
	if !strings.Contains(inWorker, `"staleness_max":1`) {
		t.Errorf("no sample of step 3 came from version 1 (staleness 1):\n%s", inWorker)
	}
	replicas, ev := run("replicas", `, --no-versions`)
	if !strings.Contains(ev, "sample from rollout replicas") {
		t.Errorf("with --no-versions events.log has no rollout replicas:\n%s", ev)
	}
	if inWorker != replicas {
		t.Errorf("the run with versions in the worker writes other metrics than with rollout replicas:\n%s\n---\n%s", inWorker, replicas)
	}
}
