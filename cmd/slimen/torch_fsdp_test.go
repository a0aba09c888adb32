//go:build linux

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Issue 18: num_gpus_per_node 2 starts a policy's torch worker under torchrun with 2 ranks (FSDP2,
// gloo on the CPU); a rank SIGKILLed mid-run takes its group down (torchrun stops the other rank),
// torchrun starts the group again itself (the host's supervisor does not: no torchrun of its
// own to wait for), the host puts the policy's state back, and the run completes with the
// metrics of the same run on one rank, never interrupted.
func TestTorchWorkerOverTwoRanks(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	script := parityScript(t)
	one := filepath.Join(dir, "one")
	cfg1 := torchConfig(t, dir, model, py, "", ", save_interval: 1")
	if log, err := slimen(t, env, "exec", script, "--config", cfg1, "--steps", "3", "--out", one); err != nil {
		t.Fatalf("one rank: %v\n%s", err, log)
	}

	sub := filepath.Join(dir, "two")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg2 := torchConfig(t, sub, model, py, "    num_gpus_per_node: 2\n", ", save_interval: 1")
	two := filepath.Join(dir, "run-two")
	// One rank of the generator's torchrun (the worker whose command line runs torch.distributed.run).
	killed := execKilling(t, env, two, func(slimen int) []int {
		for _, w := range torchWorkers(t, slimen) {
			if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", w)); strings.Contains(string(cmd), "torch.distributed.run") {
				if ranks := torchWorkers(t, w); len(ranks) == 2 {
					return ranks[1:]
				}
			}
		}
		return nil
	}, "exec", script, "--config", cfg2, "--steps", "3", "--out", two)
	if len(killed) != 1 {
		t.Fatalf("killed %v, want one rank of the generator's two", killed)
	}
	events := eventsLog(t, two)
	for _, want := range []string{
		`policy "generator": starting a torch worker: ` + py + " -m torch.distributed.run --nproc-per-node 2",
		`policy "generator": its torch worker restarted as a new process`,
	} {
		if !strings.Contains(events, want) {
			t.Errorf("events.log lacks %q:\n%s", want, events)
		}
	}
	if strings.Contains(events, `policy "generator": the torch worker is started again`) {
		t.Errorf("the host started torchrun again, where torchrun restarts its group:\n%s", events)
	}
	sameMetrics(t, untimed(t, one), untimed(t, two))
}
