package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTorchAsyncVersionsInWorker: at rollout.max_staleness 1 a torch worker keeps the weights
// versions itself (a device copy per version; no rollout replica started), and the run writes
// the metrics of the same run whose workers keep none (--no-versions), which samples from rollout
// replicas that load the weights the trainers save (to sameMetrics' tolerance: the CPU worker's
// sums are not bit-reproducible from one process to the next); the replicas take the weights by
// broadcast through a push group (gloo on the CPU), and with --no-push through the folder, with
// the same metrics again. Both workers of the first run are
// SIGKILLed after step 1: a new process has lost the versions it kept, and the host keeps them
// in it again from the checkpoint before the run goes on.
func TestTorchAsyncVersionsInWorker(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	script := parityScript(t) // a reward that moves the weights at every step
	run := func(name, args string, kill bool) ([]map[string]any, string) {
		cfg := filepath.Join(dir, name+".yaml")
		y := fmt.Sprintf(`policies:
  - name: generator
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[3]s]}
    train: {lr: 1.0e-3, global_batch_size: 0}
  - name: critic
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[3]s]}
    train: {lr: 1.0e-3, global_batch_size: 0}
rollout: {batch_size: 4, max_response_len: 8, max_staleness: 1}
run: {steps: 6, seed: 3, save_interval: 1}
`, model, py, args)
		if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, name)
		if kill {
			killed := execKilling(t, env, out, func(slimen int) []int { return torchWorkers(t, slimen) },
				"exec", script, "--config", cfg, "--out", out)
			if len(killed) != 2 {
				t.Fatalf("killed %v, want the two workers' processes", killed)
			}
		} else if log, err := slimen(t, env, "exec", script, "--config", cfg, "--out", out); err != nil {
			t.Fatalf("%s: %v\n%s", name, err, log)
		}
		ev, err := os.ReadFile(filepath.Join(out, "events.log"))
		if err != nil {
			t.Fatal(err)
		}
		return untimed(t, out), string(ev)
	}
	inWorker, ev := run("versions", "", true)
	for _, want := range []string{
		`policy "generator": its torch engine keeps rollout copies of its weights itself`,
		`policy "critic": its torch engine keeps rollout copies of its weights itself`,
		"kept weights version 1: ",
		`policy "generator": its torch worker restarted as a new process`,
		`policy "critic": its torch worker restarted as a new process`,
		"in it again",
	} {
		if !strings.Contains(ev, want) {
			t.Errorf("events.log lacks %q:\n%s", want, ev)
		}
	}
	if strings.Contains(ev, "rollout replica") {
		t.Errorf("a worker that keeps versions got rollout replicas:\n%s", ev)
	}
	for _, m := range inWorker {
		if m["policy"] == "generator" && m["step"] == 3.0 && (m["rollout_version"] != 1.0 || m["staleness_max"] != 1.0) {
			t.Errorf("step 3 of the generator: rollout_version %v, staleness_max %v; want 1 and 1", m["rollout_version"], m["staleness_max"])
		}
	}
	replicas, ev := run("replicas", `, --no-versions`, false)
	for _, want := range []string{
		"sample from rollout replicas",
		`policy "generator": its trainer and 1 rollout replicas joined push group`,
		`policy "critic": weights version 1 pushed to its rollout replica by broadcast in`,
	} {
		if !strings.Contains(ev, want) {
			t.Errorf("with --no-versions events.log lacks %q:\n%s", want, ev)
		}
	}
	if strings.Contains(ev, "weights are pushed to its rollout replicas through a folder") || strings.Contains(ev, "saved and loaded") {
		t.Errorf("replicas that join a push group took weights through a folder:\n%s", ev)
	}
	sameMetrics(t, replicas, inWorker)
	// --no-push: the replicas load the folder the trainer saves, and sample the same.
	folder, ev := run("folder", `, --no-versions, --no-push`, false)
	for _, want := range []string{
		"weights are pushed to its rollout replicas through a folder (the trainer saves, a replica loads): its engine does not join push groups",
		"s/GB saved and loaded",
	} {
		if !strings.Contains(ev, want) {
			t.Errorf("with --no-push events.log lacks %q:\n%s", want, ev)
		}
	}
	if strings.Contains(ev, "pushed to its rollout replica by broadcast") {
		t.Errorf("with --no-push a push went by broadcast:\n%s", ev)
	}
	sameMetrics(t, folder, replicas)
}
