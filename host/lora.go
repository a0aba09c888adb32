package host

import (
	"context"
	"fmt"
	"hash/fnv"
	"sync"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// loraBases are the tiny engines a run's LoRA policies share: one per base model and thread
// count, holding the base weights once, each policy an adapter on it (tiny.Engine.Adapter). The
// last policy to close its adapter closes the base.
type loraBases struct {
	mu     sync.Mutex
	m      map[string]*loraBase
	shared map[string]*sharedEngine // other engine kinds' shared bases (SharedBase)
}

type loraBase struct {
	e    *tiny.Engine
	refs int
}

// openTinyLoRA opens a LoRA policy on the tiny engine: an adapter named after the policy on the
// run's shared base for its hf_checkpoint (its own base when bases is nil), new (B = 0: the base's
// outputs) or, with load:, the PEFT folder there.
func openTinyLoRA(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
	if p.RefLoad != "" && p.RefLoad != p.HFCheckpoint {
		return nil, fmt.Errorf("policy %q: ref_load %s: the KL reference of a LoRA policy is its base, hf_checkpoint %s; remove ref_load", p.Name,
			p.RefLoad, p.HFCheckpoint)
	}
	b := env.bases
	if b == nil {
		b = &loraBases{}
	}
	key := fmt.Sprintf("%s\x00%d", p.HFCheckpoint, p.Engine.Threads)
	b.mu.Lock()
	defer b.mu.Unlock()
	base := b.m[key]
	if base == nil {
		e, err := tiny.Open(p.HFCheckpoint, tiny.Options{Threads: p.Engine.Threads})
		if err != nil {
			return nil, err
		}
		base = &loraBase{e: e}
		if b.m == nil {
			b.m = map[string]*loraBase{}
		}
		b.m[key] = base
	} else {
		env.Logf("policy %q: a LoRA adapter on the base %s that another policy of the run holds", p.Name, p.HFCheckpoint)
	}
	releaseLocked := func() error {
		base.refs--
		if base.refs > 0 {
			return nil
		}
		delete(b.m, key)
		return base.e.Close()
	}
	release := func() error {
		b.mu.Lock()
		defer b.mu.Unlock()
		return releaseLocked()
	}
	base.refs++
	l := p.LoRA
	h := fnv.New64a()
	h.Write([]byte(p.Name))
	v, err := func() (*tiny.AdapterEngine, error) {
		if err := base.e.AddAdapter(p.Name, tiny.LoRAConfig{Rank: l.Rank, Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets}, h.Sum64()); err != nil {
			return nil, err
		}
		v, err := base.e.Adapter(p.Name)
		if err == nil && p.Load != "" {
			if err = v.Load(ctx, p.Load); err != nil {
				err = fmt.Errorf("policy %q: load: %w", p.Name, err)
			}
		}
		return v, err
	}()
	if err != nil {
		base.e.RemoveAdapter(p.Name)
		releaseLocked()
		return nil, err
	}
	return &sharedAdapter{AdapterEngine: v, release: sync.OnceValue(release)}, nil
}

// sharedAdapter is a policy's adapter; closing it lets go of the shared base.
type sharedAdapter struct {
	*tiny.AdapterEngine
	release func() error
}

// Close removes the adapter from the base and lets go of the base.
func (s *sharedAdapter) Close() error {
	s.Base().RemoveAdapter(s.Name())
	return s.release()
}

// sharedEngine is an engine that several LoRA policies of a run use as their base (an engine
// kind's, through EngineEnv.SharedBase), with how many hold it.
type sharedEngine struct {
	e      engines.Engine
	refs   int
	server *adapterServer // the adapters on it, when it is an engine server (OpenAdapter)
}

// SharedBase returns the engine the run's LoRA policies share under key, opening it with open
// when none holds it yet (fresh is then true), and a release function: the last release closes
// it. Outside a run (no shared bases) every call opens its own. Engine kinds that put policies'
// adapters on one base (host/torch) use it.
func (env EngineEnv) SharedBase(key string, open func() (engines.Engine, error)) (e engines.Engine, fresh bool, release func() error, err error) {
	s, fresh, release, err := env.sharedBase(key, open, nil)
	if err != nil {
		return nil, false, nil, err
	}
	return s.e, fresh, release, nil
}

// sharedBase is SharedBase's shared engine; server, when it opens the engine, is the adapter
// server kept with it for the policies that join it (OpenAdapter).
func (env EngineEnv) sharedBase(key string, open func() (engines.Engine, error), server *adapterServer) (s *sharedEngine, fresh bool,
	release func() error, err error) {
	b := env.bases
	if b == nil {
		b = &loraBases{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	s = b.shared[key]
	if s == nil {
		eng, err := open()
		if err != nil {
			return nil, false, nil, err
		}
		s, fresh = &sharedEngine{e: eng, server: server}, true
		if b.shared == nil {
			b.shared = map[string]*sharedEngine{}
		}
		b.shared[key] = s
	}
	s.refs++
	release = sync.OnceValue(func() error {
		b.mu.Lock()
		defer b.mu.Unlock()
		s.refs--
		if s.refs > 0 {
			return nil
		}
		delete(b.shared, key)
		return s.e.Close()
	})
	return s, fresh, release, nil
}
