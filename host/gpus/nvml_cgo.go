//go:build cgo && linux

package gpus

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// NVML is the Inventory of this machine, read through libnvidia-ml (loaded at run time: a
// machine without the driver gets ErrNoNVML, not a failure to start).
func NVML() Inventory { return nvmlInventory{} }

type nvmlInventory struct{}

func (nvmlInventory) GPUs() ([]GPU, error) {
	switch ret := nvml.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return nil, noNVML("libnvidia-ml.so.1 is not installed (no NVIDIA driver on this machine)")
	case nvml.ERROR_DRIVER_NOT_LOADED, nvml.ERROR_NO_PERMISSION:
		return nil, noNVML("NVML: %v", ret)
	default:
		return nil, fmt.Errorf("NVML: init: %v", ret)
	}
	defer nvml.Shutdown()
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("NVML: count the devices: %v", ret)
	}
	var list []GPU
	for i := range n {
		d, ret := nvml.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML: GPU %d: %v", i, ret)
		}
		g := GPU{Index: i, Util: -1}
		if g.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML: GPU %d: UUID: %v", i, ret)
		}
		g.Name, _ = d.GetName()
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("NVML: GPU %d: memory: %v", i, ret)
		}
		g.MemTotal, g.MemUsed = mem.Total, mem.Used
		if u, ret := d.GetUtilizationRates(); ret == nvml.SUCCESS {
			g.Util = int(u.Gpu)
		}
		if procs, ret := d.GetComputeRunningProcesses(); ret == nvml.SUCCESS {
			for _, p := range procs {
				g.Processes = append(g.Processes, Process{PID: int(p.Pid), Used: p.UsedGpuMemory})
			}
		}
		list = append(list, g)
	}
	return list, nil
}
