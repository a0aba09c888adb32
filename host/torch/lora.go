package torch

import (
	"context"
	"fmt"
	"hash/fnv"
	"path/filepath"
	"sync"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/torchproc"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

// openLoRA opens a LoRA policy on the torch engine: an adapter named after the policy on the
// run's torch worker for its hf_checkpoint and device (one worker, one copy of the base weights,
// for every LoRA policy on that base), new (B = 0: the base's outputs) or, with load:, the PEFT
// folder there. The host's engine of the policy is the worker as the adapter sees it
// (remote.Adapter), as host/lora.go does for the tiny engine.
func openLoRA(ctx context.Context, p config.PolicyConfig, env host.EngineEnv) (engines.Engine, error) {
	if p.RefLoad != "" && p.RefLoad != p.HFCheckpoint {
		return nil, fmt.Errorf("policy %q: ref_load %s: the KL reference of a LoRA policy is its base, hf_checkpoint %s; remove ref_load", p.Name, p.RefLoad, p.HFCheckpoint)
	}
	abs, err := filepath.Abs(p.HFCheckpoint)
	if err != nil {
		return nil, err
	}
	q := p
	q.HFCheckpoint = abs
	key := gpus.LoRABaseKey(q)
	base := p
	base.LoRA, base.Load, base.RefLoad = nil, "", ""
	eng, fresh, release, err := env.SharedBase(key, func() (engines.Engine, error) { return open(ctx, base, env) })
	if err != nil {
		return nil, err
	}
	if !fresh {
		env.Logf("policy %q: a LoRA adapter on the torch worker of %s that another policy of the run started", p.Name, p.HFCheckpoint)
	}
	c := eng.(*torchproc.Engine).Client
	l := p.LoRA
	h := fnv.New64a()
	h.Write([]byte(p.Name))
	a := c.Adapter(p.Name)
	if p.Load != "" {
		err = a.Load(ctx, p.Load)
	} else {
		_, err = c.AddAdapter(ctx, p.Name, remote.LoRA{Rank: l.Rank, Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets}, h.Sum64())
	}
	if err != nil {
		release()
		return nil, fmt.Errorf("policy %q: %w", p.Name, err)
	}
	return &adapterEngine{Adapter: a, release: release}, nil
}

// adapterEngine is a policy's adapter on a shared worker; closing it removes the adapter and lets
// go of the worker (the last policy to close stops it).
type adapterEngine struct {
	*remote.Adapter
	release func() error
	once    sync.Once
}

// Close removes the adapter from the worker and lets go of the worker.
func (a *adapterEngine) Close() error {
	var err error
	a.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30e9)
		defer cancel()
		a.Client().RemoveAdapter(ctx, a.Name()) // the worker may be gone: its adapters with it
		err = a.release()
	})
	return err
}
