package torch

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"path/filepath"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/torchproc"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

// loraWorker is a torch worker that LoRA policies share: its adapters, in the order they opened,
// so that a worker started again after a crash gets them all back.
type loraWorker struct {
	mu      sync.Mutex
	members []*adapterEngine
}

// loraWorkers finds the loraWorker of a shared worker's engine.
var loraWorkers = struct {
	sync.Mutex
	m map[engines.Engine]*loraWorker
}{m: map[engines.Engine]*loraWorker{}}

// openLoRA opens a LoRA policy on the torch engine: an adapter named after the policy on the
// run's torch worker for its hf_checkpoint and engine settings (one worker, one copy of the base
// weights, for every LoRA policy on that base: gpus.LoRABaseKey), new (B = 0: the base's outputs)
// or, with load:, the PEFT folder there. The host's engine of the policy is the worker as the
// adapter sees it (remote.Adapter), as host/lora.go does for the tiny engine. A worker started
// again after a crash gets every adapter back, each restored by its own policy's restart rule
// (its last checkpoint and the steps since).
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
	lw := &loraWorker{}
	benv := env
	benv.OnRestart = func(engine string, self func() engines.Engine) func(ctx context.Context, prev, cur string) error {
		return func(ctx context.Context, prev, cur string) error { return lw.restarted(ctx, prev, cur) }
	}
	eng, fresh, release, err := env.SharedBase(key, func() (engines.Engine, error) { return open(ctx, base, benv) })
	if err != nil {
		return nil, err
	}
	loraWorkers.Lock()
	if fresh {
		loraWorkers.m[eng] = lw
	} else {
		lw = loraWorkers.m[eng]
		env.Logf("policy %q: a LoRA adapter on the torch worker of %s that another policy of the run started", p.Name, p.HFCheckpoint)
	}
	loraWorkers.Unlock()
	c := eng.(*torchproc.Engine).Client
	l := p.LoRA
	h := fnv.New64a()
	h.Write([]byte(p.Name))
	a := &adapterEngine{Adapter: c.Adapter(p.Name), lora: remote.LoRA{Rank: l.Rank, Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets},
		seed: h.Sum64(), load: p.Load, lw: lw}
	a.release = func() error {
		err := release()
		loraWorkers.Lock()
		if loraWorkers.m[eng] == lw && len(lw.members) == 0 {
			delete(loraWorkers.m, eng)
		}
		loraWorkers.Unlock()
		return err
	}
	if env.OnRestart != nil {
		a.restore = env.OnRestart("its torch worker (shared by the run's LoRA policies on "+p.HFCheckpoint+")", func() engines.Engine { return a })
	}
	if err := a.install(ctx); err != nil {
		release()
		return nil, fmt.Errorf("policy %q: %w", p.Name, err)
	}
	lw.mu.Lock()
	lw.members = append(lw.members, a)
	lw.mu.Unlock()
	return a, nil
}

// adapterEngine is a policy's adapter on a shared worker; closing it removes the adapter and lets
// go of the worker (the last policy to close stops it).
type adapterEngine struct {
	*remote.Adapter
	lora    remote.LoRA
	seed    uint64
	load    string // the policy's load: folder ("" a new adapter)
	lw      *loraWorker
	restore func(ctx context.Context, prev, cur string) error // the run's restart rule for the policy; nil: none
	release func() error
	once    sync.Once
}

// install puts the adapter into the worker as the policy starts: its load: folder, else new.
func (a *adapterEngine) install(ctx context.Context) error {
	if a.load != "" {
		return a.Load(ctx, a.load)
	}
	_, err := a.Client().AddAdapter(ctx, a.Name(), a.lora, a.seed)
	return err
}

// restarted gives a worker that started again every adapter back: each as its policy started,
// then restored by the run's rule for that policy.
func (lw *loraWorker) restarted(ctx context.Context, prev, cur string) error {
	lw.mu.Lock()
	members := append([]*adapterEngine(nil), lw.members...)
	lw.mu.Unlock()
	var errs []error
	for _, a := range members {
		if err := a.install(ctx); err != nil {
			errs = append(errs, fmt.Errorf("adapter %q: %w", a.Name(), err))
			continue
		}
		if a.restore != nil {
			if err := a.restore(ctx, prev, cur); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Close removes the adapter from the worker and lets go of the worker.
func (a *adapterEngine) Close() error {
	var err error
	a.once.Do(func() {
		a.lw.mu.Lock()
		for i, m := range a.lw.members {
			if m == a {
				a.lw.members = append(a.lw.members[:i], a.lw.members[i+1:]...)
				break
			}
		}
		a.lw.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		a.Client().RemoveAdapter(ctx, a.Name()) // the worker may be gone: its adapters with it
		err = a.release()
	})
	return err
}
