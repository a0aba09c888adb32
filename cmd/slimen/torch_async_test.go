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
// broadcast through a push group (gloo on the CPU), and with --no-push through the folder: one
// run of both, the generator's replica by broadcast and the critic's with --no-push (a run costs
// its workers' starts, and one policy's pushes do not depend on the other's). Both workers of the
// first run are SIGKILLed after step 1: a new process has lost the versions it kept, and the host
// keeps them in it again from the checkpoint before the run goes on.
func TestTorchAsyncVersionsInWorker(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	script := parityScript(t) // a reward that moves the weights at every step
	run := func(name, genArgs, criticArgs string, kill bool) ([]map[string]any, string) {
		cfg := filepath.Join(dir, name+".yaml")
		y := fmt.Sprintf(`policies:
  - name: generator
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[3]s]}
    train: {lr: 1.0e-3, global_batch_size: 0}
  - name: critic
    hf_checkpoint: %[1]s
    engine: {kind: torch, python: %[2]q, device: cpu, args: [--max-seq-len, "512"%[4]s]}
    train: {lr: 1.0e-3, global_batch_size: 0}
rollout: {batch_size: 4, max_response_len: 8, max_staleness: 1}
run: {steps: 6, seed: 3, save_interval: 1}
`, model, py, genArgs, criticArgs)
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
	inWorker, ev := run("versions", "", "", true)
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
	replicas, ev := run("replicas", `, --no-versions`, `, --no-versions, --no-push`, false)
	for _, want := range []string{
		"sample from rollout replicas",
		`policy "generator": its trainer and 1 rollout replicas joined push group`,
		`policy "generator": weights version 1 pushed to its rollout replica by broadcast in`,
		`policy "critic": weights are pushed to its rollout replicas through a folder (the trainer saves, a replica loads): its engine does not join push groups`,
		"s/GB saved and loaded",
	} {
		if !strings.Contains(ev, want) {
			t.Errorf("with --no-versions (and the critic's --no-push) events.log lacks %q:\n%s", want, ev)
		}
	}
	for _, line := range strings.Split(ev, "\n") {
		if strings.Contains(line, `policy "generator": `) && (strings.Contains(line, "weights are pushed to its rollout replicas through a folder") || strings.Contains(line, "saved and loaded")) {
			t.Errorf("a replica that joins a push group took weights through a folder: %s", line)
		}
		if strings.Contains(line, `policy "critic": `) && (strings.Contains(line, "joined push group") || strings.Contains(line, "pushed to its rollout replica by broadcast")) {
			t.Errorf("with --no-push a push went by broadcast: %s", line)
		}
	}
	sameMetrics(t, replicas, inWorker)
}
