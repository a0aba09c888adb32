package host

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/host/config"
)

// AdapterServer is an engine server that a run's LoRA policies share, each an adapter named after
// it (remote.Adapter). It is a torch worker the run starts (host/torch), or a server it reaches at
// engine.address (kind remote: `slimen serve`, the torch worker served by hand).
type AdapterServer struct {
	// Key tells the servers apart: the policies with one key share one (EngineEnv.SharedBase).
	Key string
	// Open opens the server's engine, with env's OnRestart given adapters back (it is called
	// for the first policy of the key only).
	Open func(env EngineEnv) (engines.Engine, error)
	// Client is the engine's gRPC client.
	Client func(engines.Engine) *remote.Client
	// Engine names the server in restart messages ("its engine at host:port (shared by …)").
	Engine string
	// Joined is logged when a policy's adapter goes onto a server another policy opened.
	Joined string
}

// adapterServer is a server that LoRA policies share: its adapters, in the order they opened,
// so that a server started again after a crash gets them all back. The run keeps it with the
// server's shared engine (sharedEngine.server): two runs in one process share none.
type adapterServer struct {
	mu      sync.Mutex
	members []*serverAdapter
}

// OpenAdapter opens a LoRA policy as an adapter named after it on the run's server s (one
// server, one copy of the base weights, for every LoRA policy of s.Key). The adapter starts new
// (B = 0: the base's outputs) or, with load:, from the PEFT folder there (a folder on the server's
// machine). The host's
// engine of the policy is the server as the adapter sees it (remote.Adapter), as openTinyLoRA
// does for the tiny engine. A server started again after a crash gets every adapter back, each
// restored by its own policy's restart rule (its last checkpoint and the steps since).
func OpenAdapter(ctx context.Context, p config.PolicyConfig, env EngineEnv, s AdapterServer) (engines.Engine, error) {
	if p.RefLoad != "" && p.RefLoad != p.HFCheckpoint {
		return nil, fmt.Errorf("policy %q: ref_load %s: the KL reference of a LoRA policy is its base, hf_checkpoint %s; remove ref_load", p.Name,
			p.RefLoad, p.HFCheckpoint)
	}
	as := &adapterServer{}
	benv := env
	benv.OnRestart = func(engine string, self func() engines.Engine) func(ctx context.Context, prev, cur string) error {
		return func(ctx context.Context, prev, cur string) error { return as.restarted(ctx, prev, cur) }
	}
	shared, fresh, release, err := env.sharedBase(s.Key, func() (engines.Engine, error) { return s.Open(benv) }, as)
	if err != nil {
		return nil, err
	}
	if !fresh {
		as = shared.server
		env.Logf("policy %q: %s", p.Name, s.Joined)
	}
	c := s.Client(shared.e)
	l := p.LoRA
	h := fnv.New64a()
	h.Write([]byte(p.Name))
	a := &serverAdapter{Adapter: c.Adapter(p.Name), lora: remote.LoRA{Rank: l.Rank, Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets},
		seed: h.Sum64(), load: p.Load, as: as}
	a.release = release
	if env.OnRestart != nil {
		a.restore = env.OnRestart(s.Engine, func() engines.Engine { return a })
	}
	if err := a.install(ctx); err != nil {
		a.release()
		return nil, fmt.Errorf("policy %q: %w", p.Name, err)
	}
	as.mu.Lock()
	as.members = append(as.members, a)
	as.mu.Unlock()
	return a, nil
}

// serverAdapter is a policy's adapter on a shared server; closing it removes the adapter and
// lets go of the server (the last policy to close stops a worker the run started).
type serverAdapter struct {
	*remote.Adapter
	lora    remote.LoRA
	seed    uint64
	load    string // the policy's load: folder ("" a new adapter)
	as      *adapterServer
	restore func(ctx context.Context, prev, cur string) error // the run's restart rule for the policy; nil: none
	release func() error
	once    sync.Once
}

// install puts the adapter into the server as the policy starts: its load: folder, else new. An
// adapter of the policy's name that the server holds already (an earlier run's on a server the
// run does not own) is replaced, so that a run starts where a run on a fresh server does.
func (a *serverAdapter) install(ctx context.Context) error {
	if a.load != "" {
		return a.Load(ctx, a.load)
	}
	if err := a.Client().RemoveAdapter(ctx, a.Name()); err != nil {
		return err
	}
	_, err := a.Client().AddAdapter(ctx, a.Name(), a.lora, a.seed)
	return err
}

// restarted gives a server that started again every adapter back: each as its policy started,
// then restored by the run's rule for that policy.
func (as *adapterServer) restarted(ctx context.Context, prev, cur string) error {
	as.mu.Lock()
	members := append([]*serverAdapter(nil), as.members...)
	as.mu.Unlock()
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

// Close removes the adapter from the server and lets go of the server.
func (a *serverAdapter) Close() error {
	var err error
	a.once.Do(func() {
		a.as.mu.Lock()
		for i, m := range a.as.members {
			if m == a {
				a.as.members = append(a.as.members[:i], a.as.members[i+1:]...)
				break
			}
		}
		a.as.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		a.Client().RemoveAdapter(ctx, a.Name()) // the server may be gone: its adapters with it
		err = a.release()
	})
	return err
}
