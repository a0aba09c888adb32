package torch

import (
	"testing"

	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/torchproc"
)

// The LoRA policies' shared worker is a gpuWorker when the run placed it on GPUs (engine.gpus or
// the sizing rules): its adapters reach the worker's client all the same (a run with LoRA agents
// on a GPU panicked on the type of its engine).
func TestLoRAWorkerClientOnGPUs(t *testing.T) {
	c := &remote.Client{}
	e := &torchproc.Engine{Client: c}
	if got := workerClient(e); got != c {
		t.Errorf("unplaced worker: client %p, want %p", got, c)
	}
	if got := workerClient(&gpuWorker{Engine: e, gpus: []string{"GPU-0"}}); got != c {
		t.Errorf("worker placed on GPUs: client %p, want %p", got, c)
	}
}
