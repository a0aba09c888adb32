package torch

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/slimen/slimen/host/gpus"
)

// A worker's numbers come from its own GPUs and its own processes (torchrun's ranks are children of
// the process slimen started); a neighbour on the same GPU counts in gpu_used_gib only.
func TestDeviceMetricsFromTheInventory(t *testing.T) {
	const gib = 1 << 30
	list := []gpus.GPU{
		{Index: 0, UUID: "GPU-a", MemTotal: 80 * gib, MemUsed: 30 * gib, Util: 60,
			Processes: []gpus.Process{{PID: 11, Used: 8 * gib}, {PID: 99, Used: 20 * gib}}},
		{Index: 1, UUID: "GPU-b", MemTotal: 80 * gib, MemUsed: 9 * gib, Util: 20,
			Processes: []gpus.Process{{PID: 12, Used: 9 * gib}}},
		{Index: 2, UUID: "GPU-c", MemTotal: 80 * gib, MemUsed: 70 * gib, Util: 100,
			Processes: []gpus.Process{{PID: 13, Used: 70 * gib}}},
	}
	tree := map[int]bool{10: true, 11: true, 12: true}
	got := deviceMetrics(list, []string{"GPU-a", "GPU-b"}, tree)
	want := map[string]float64{"gpu_mem_gib": 17, "gpu_used_gib": 39, "gpu_util": 40}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v (all: %v)", k, got[k], v, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("keys %v, want %v", got, want)
	}
	// No process of its own visible (NVML inside a container) and no utilisation: those keys are
	// absent; a worker whose GPUs are not in the list has none.
	list[2].Util = -1
	if got := deviceMetrics(list, []string{"2"}, tree); len(got) != 1 || got["gpu_used_gib"] != 70 {
		t.Errorf("GPU 2 by index, no own process, no utilisation: %v", got)
	}
	if got := deviceMetrics(list, []string{"GPU-z"}, tree); got != nil {
		t.Errorf("a GPU not in the inventory: %v, want nothing", got)
	}
	// Without NVML there is nothing, so the keys stay out of the metrics.
	w := &gpuWorker{inv: gpus.Fake{Err: errors.New("no NVIDIA GPUs visible")}, gpus: []string{"GPU-a"}}
	if got := w.DeviceMetrics(); got != nil {
		t.Errorf("without NVML: %v, want nothing", got)
	}
}

func TestProcessTreeHasChildren(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	cmd := exec.Command("sleep", "5")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	tree := processTree(os.Getpid())
	if !tree[os.Getpid()] || !tree[cmd.Process.Pid] {
		t.Errorf("the tree of %d lacks itself or its child %d: %v", os.Getpid(), cmd.Process.Pid, tree)
	}
	if tree[1] {
		t.Error("the tree has pid 1, an ancestor")
	}
}

// A worker of several ranks needs as many GPUs as ranks, and cannot be pinned to one by device.
func TestCheckRanks(t *testing.T) {
	p := policy("solver", 2, 1, 0)
	if err := checkRanks(p, &gpus.Worker{GPUs: []int{0, 1}}); err != nil {
		t.Errorf("2 ranks on 2 placed GPUs: %v", err)
	}
	p.Engine.GPUs = []string{"3"}
	if err := checkRanks(p, nil); err == nil || !strings.Contains(err.Error(), `policy "solver": num_gpus_per_node 2 runs 2 ranks, one GPU each, but engine.gpus gives the worker 1 GPU(s)`) {
		t.Errorf("2 ranks on engine.gpus [3]: %v", err)
	}
	p.Engine.GPUs, p.Engine.Device = nil, "cuda:1"
	if err := checkRanks(p, nil); err == nil || !strings.Contains(err.Error(), "engine.device cuda:1 names one GPU") {
		t.Errorf("2 ranks on cuda:1: %v", err)
	}
	p.Engine.Device = "cpu"
	if err := checkRanks(p, nil); err != nil {
		t.Errorf("2 CPU ranks: %v", err)
	}
}
