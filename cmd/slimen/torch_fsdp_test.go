package main

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Issue 18: num_gpus_per_node 2 starts a policy's torch worker under torchrun with 2 ranks (FSDP2,
// gloo on the CPU), and the run's metrics are those of the same run on one rank.
func TestTorchWorkerOverTwoRanks(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py, dir)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	var runs [][]map[string]any
	for _, ranks := range []string{"1", "2"} {
		out := filepath.Join(dir, "run"+ranks)
		sub := filepath.Join(dir, ranks)
		if err := os.MkdirAll(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		cfg := torchConfig(t, sub, model, py, "    num_gpus_per_node: "+ranks+"\n", "")
		if log, err := slimen(t, env, "exec", debate, "--config", cfg, "--out", out, "--steps", "1"); err != nil {
			t.Fatalf("%s ranks: %v\n%s", ranks, err, log)
		}
		runs = append(runs, untimed(t, out))
		ev, _ := os.ReadFile(filepath.Join(out, "events.log"))
		if ranks == "2" && !strings.Contains(string(ev), `policy "generator": starting a torch worker: `+py+" -m torch.distributed.run --nproc-per-node 2") {
			t.Errorf("events.log does not say the generator runs under torchrun:\n%s", ev)
		}
	}
	if len(runs[0]) != len(runs[1]) {
		t.Fatalf("metrics lines: %d on one rank, %d on two", len(runs[0]), len(runs[1]))
	}
	for i, one := range runs[0] {
		two := runs[1][i]
		for k, v := range one {
			a, isNum := v.(float64)
			b, ok := two[k].(float64)
			if !isNum {
				continue
			}
			if !ok || math.Abs(a-b) > 1e-4*math.Max(1, math.Abs(a)) {
				t.Errorf("line %d (%v %v) %s: one rank %v, two ranks %v", i, one["policy"], one["step"], k, v, two[k])
			}
		}
	}
}
