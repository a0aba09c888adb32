// Package gpus reads this machine's NVIDIA GPUs through NVML and places a config's local PyTorch
// workers on them by slime-n's sizing rules, with an estimate of each worker's memory.
//
// Place is a pure function of the config, the models' shapes and the inventory; NVML (the only
// part that needs cgo and the driver's libnvidia-ml) sits behind Inventory. A binary built with
// CGO_ENABLED=0 has an Inventory that always answers ErrNoNVML, so it builds and runs anywhere.
package gpus

import (
	"errors"
	"fmt"
)

// GPU is one device as NVML reports it. Util is the percentage of the last sample period in
// which a kernel ran, -1 when NVML does not say.
type GPU struct {
	Index     int
	UUID      string
	Name      string
	MemTotal  uint64
	MemUsed   uint64
	Util      int
	Processes []Process
}

// Free is the memory no process holds.
func (g GPU) Free() uint64 {
	if g.MemUsed >= g.MemTotal {
		return 0
	}
	return g.MemTotal - g.MemUsed
}

// Process is a compute process on a GPU and the memory it holds there (0 when NVML cannot tell,
// as inside some containers).
type Process struct {
	PID  int
	Used uint64
}

// Inventory lists the GPUs of this machine.
type Inventory interface {
	GPUs() ([]GPU, error)
}

// ErrNoNVML is what an Inventory answers on a machine without an NVIDIA driver, or in a binary
// built without cgo: there are no GPUs to list, which is not a failure of the caller.
var ErrNoNVML = errors.New("no NVIDIA GPUs visible")

// noNVML is ErrNoNVML with the reason.
func noNVML(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrNoNVML, fmt.Sprintf(format, args...))
}

// Fake is an Inventory of fixed GPUs, or of Err when it is set (tests, and the CLI's
// SLIMEN_FAKE_GPUS).
type Fake struct {
	List []GPU
	Err  error
}

// GPUs returns the fixed list.
func (f Fake) GPUs() ([]GPU, error) {
	if f.Err != nil {
		return nil, f.Err
	}
	return append([]GPU(nil), f.List...), nil
}

// GiB formats bytes in GiB with one decimal (MiB below 1 GiB).
func GiB(b uint64) string {
	if b < 1<<30 {
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30))
}
