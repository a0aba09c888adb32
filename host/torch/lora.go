package torch

import (
	"context"
	"path/filepath"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/torchproc"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

// openLoRA opens a LoRA policy on the torch engine: an adapter named after the policy on the
// run's torch worker for its hf_checkpoint and engine settings (one worker, one copy of the base
// weights, for every LoRA policy on that base: gpus.LoRABaseKey), through host.OpenAdapter,
// which gives a worker started again after a crash every adapter back.
func openLoRA(ctx context.Context, p config.PolicyConfig, env host.EngineEnv) (engines.Engine, error) {
	abs, err := filepath.Abs(p.HFCheckpoint)
	if err != nil {
		return nil, err
	}
	q := p
	q.HFCheckpoint = abs
	base := p
	base.LoRA, base.Load, base.RefLoad = nil, "", ""
	return host.OpenAdapter(ctx, p, env, host.AdapterServer{
		Key:    gpus.LoRABaseKey(q),
		Open:   func(benv host.EngineEnv) (engines.Engine, error) { return open(ctx, base, benv) },
		Client: workerClient,
		Engine: "its torch worker (shared by the run's LoRA policies on " + p.HFCheckpoint + ")",
		Joined: "a LoRA adapter on the torch worker of " + p.HFCheckpoint + " that another policy of the run started",
	})
}

// workerClient is the gRPC client of a torch worker's engine, placed on GPUs (gpuWorker) or not.
func workerClient(e engines.Engine) *remote.Client {
	if w, ok := e.(*gpuWorker); ok {
		return w.Client
	}
	return e.(*torchproc.Engine).Client
}
