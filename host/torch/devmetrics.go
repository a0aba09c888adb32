package torch

import (
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines/torchproc"
	"github.com/slimen/slimen/host/gpus"
)

// gpuWorker is a torch worker placed on GPUs: its engine, and its GPUs' numbers for every step's
// metrics (host.DeviceMetrics).
type gpuWorker struct {
	*torchproc.Engine
	inv  gpus.Inventory
	gpus []string // UUIDs
}

// DeviceMetrics reads the inventory now; nothing when it cannot (then the keys are absent).
func (w *gpuWorker) DeviceMetrics() map[string]float64 {
	list, err := w.inv.GPUs()
	if err != nil {
		return nil
	}
	return deviceMetrics(list, w.gpus, processTree(w.Pid()))
}

// deviceMetrics are a worker's numbers on its GPUs (want: UUIDs or indices) given the processes of
// its tree (pids: the worker, torchrun's ranks, compiler children):
//
//   - gpu_mem_gib: the memory its processes hold on them, when NVML lists any of them (inside some
//     containers NVML sees no processes: then absent);
//   - gpu_used_gib: the memory in use on them, by any process (neighbours sharing a GPU included);
//   - gpu_util: their utilisation (the share of the last sample period in which a kernel ran, %,
//     averaged over its GPUs; a GPU's, so neighbours' kernels count), when NVML gives it.
//
// None of them when none of its GPUs is in the list.
func deviceMetrics(list []gpus.GPU, want []string, pids map[int]bool) map[string]float64 {
	var mine, used uint64
	var util float64
	n, nutil, seen := 0, 0, false
	for _, g := range list {
		if !slices.Contains(want, g.UUID) && !slices.Contains(want, strconv.Itoa(g.Index)) {
			continue
		}
		n++
		used += g.MemUsed
		if g.Util >= 0 {
			util += float64(g.Util)
			nutil++
		}
		for _, p := range g.Processes {
			if pids[p.PID] {
				mine += p.Used
				seen = true
			}
		}
	}
	if n == 0 {
		return nil
	}
	out := map[string]float64{"gpu_used_gib": float64(used) / (1 << 30)}
	if seen {
		out["gpu_mem_gib"] = float64(mine) / (1 << 30)
	}
	if nutil > 0 {
		out["gpu_util"] = util / float64(nutil)
	}
	return out
}

// processTree is root and its descendants, from /proc (only root where there is none).
func processTree(root int) map[int]bool {
	tree := map[int]bool{root: true}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return tree
	}
	parent := map[int]int{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses: read after the last ')'.
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) < 2 {
			continue
		}
		if pp, err := strconv.Atoi(f[1]); err == nil {
			parent[pid] = pp
		}
	}
	for grew := true; grew; {
		grew = false
		for pid, pp := range parent {
			if tree[pp] && !tree[pid] {
				tree[pid] = true
				grew = true
			}
		}
	}
	return tree
}
