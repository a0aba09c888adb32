//go:build !cgo || !linux

package gpus

// NVML is the Inventory of a binary built without cgo (or off Linux): NVML cannot be loaded, so
// it answers ErrNoNVML.
func NVML() Inventory { return noInventory{} }

type noInventory struct{}

func (noInventory) GPUs() ([]GPU, error) {
	return nil, noNVML("this slimen was built without cgo, so it cannot read NVML (build it with CGO_ENABLED=1 on Linux)")
}
