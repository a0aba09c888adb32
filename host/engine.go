package host

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// An EngineKind opens the engines of one engine kind: the engine.kind of a policy's config. The
// host has three, tiny (the embedded pure-Go engine), remote (an engine server over gRPC) and
// openai (an OpenAI-compatible HTTP server, for frozen policies); a package registers another
// with RegisterEngineKind in its init, and a program links the kind by importing that package
// (host/torch registers torch, the CLI imports it).
type EngineKind struct {
	// Open opens the engine of a policy; env is where it reports and how it hears of restarts.
	Open func(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error)
	// OffHost marks engines whose state lives on a server the run does not own: a checkpoint
	// records where that state lives instead of saving it on this machine's disk, and the server
	// writes the policy's save: folder itself.
	OffHost bool
	// PassThrough marks engines that may use the slime-n settings slimen does not interpret
	// (train.KEY, engine.KEY); for the other kinds the run notes that they are ignored.
	PassThrough bool
}

// EngineEnv is what a run gives the engines it opens.
type EngineEnv struct {
	// RunDir is the run's directory ("" when it has none): where the run asks the engine to
	// save and load checkpoints.
	RunDir string
	// Logf reports start-up lines and restarts in the run's events; never nil.
	Logf func(format string, args ...any)
	// Worker, when not nil, takes a worker process's output line by line (the run's events.log
	// only); nil: let the output go to stderr.
	Worker func(format string, args ...any)
	// OnRestart, when not nil, makes the callback an engine client calls when its engine
	// restarted as a new process (remote.Options.OnRestart): it puts the policy's state back or
	// says why it cannot. engine names the engine in messages ("its engine at host:port"), self
	// returns it once it is open. nil: the run does not listen, a restart is only logged.
	OnRestart func(engine string, self func() engines.Engine) func(ctx context.Context, prev, cur string) error
	// Config is the run's config, all its policies (nil when the caller has none): what a kind
	// that places its workers among the run's other policies reads (host/torch, on the GPUs).
	// It is the run's; an engine must not change it.
	Config *config.Config
	// Replica is 0 for a policy's own engine, n ≥ 1 for its n-th rollout replica: a
	// kind that places its workers may put a replica apart from the policy's worker (host/torch:
	// on the GPUs of the policy's rollout slice).
	Replica int

	bases *loraBases // the run's shared LoRA bases; nil: none shared
}

// RegisterEngineKind makes an engine kind available to every run under name (and to config
// validation: the kinds are config's one registry). It panics on a second registration of a name
// or a kind without Open: both are programming errors, found at start-up.
func RegisterEngineKind(name string, k EngineKind) {
	if k.Open == nil {
		panic(fmt.Sprintf("host.RegisterEngineKind(%q): registered twice, or without Open", name))
	}
	config.RegisterEngineKind(name, config.EngineKind{Open: k.Open, OffHost: k.OffHost, PassThrough: k.PassThrough})
}

// engineKind finds a registered kind.
func engineKind(name string) (EngineKind, error) {
	if ck, ok := config.LookupEngineKind(name); ok {
		open, ok := ck.Open.(func(context.Context, config.PolicyConfig, EngineEnv) (engines.Engine, error))
		if !ok {
			return EngineKind{}, fmt.Errorf("engine kind %q was registered with an opener of type %T; register it with host.RegisterEngineKind", name, ck.Open)
		}
		return EngineKind{Open: open, OffHost: ck.OffHost, PassThrough: ck.PassThrough}, nil
	}
	hint := ""
	if name == "torch" {
		hint = "; a program links the torch worker by importing github.com/slimen/slimen/host/torch (the slimen CLI does)"
	}
	return EngineKind{}, fmt.Errorf("engine kind %q is not available in this build (known: %s)%s", name, strings.Join(config.LinkedEngineKinds(), ", "), hint)
}

func init() {
	RegisterEngineKind("tiny", EngineKind{Open: openTiny})
	RegisterEngineKind("remote", EngineKind{Open: openRemote, OffHost: true, PassThrough: true})
	RegisterEngineKind("openai", EngineKind{Open: openOpenAI})
}

// offHost says whether a policy's engine keeps its state on a server the run does not own.
func offHost(p config.PolicyConfig) bool {
	k, err := engineKind(p.Engine.Kind)
	return err == nil && k.OffHost
}

// engineLogs are where openEngine reports; a nil func drops its lines, except worker output,
// which then goes to stderr.
type engineLogs struct {
	printf func(string, ...any) // start-up lines and engine restarts (the run's events)
	worker func(string, ...any) // a worker's output, line by line (events.log only)
	// restarted, when set, is told that a remote engine or torch worker restarted as a new
	// process, before anything that process says is used; it puts the policy's state back or
	// returns why it cannot (then the engine fails every call). Unset, a restart is only logged.
	restarted func(ctx context.Context, ev restartEvent) error
	bases     *loraBases     // where the run's LoRA policies share their base models
	cfg       *config.Config // the run's config, for EngineEnv.Config
	replica   int            // EngineEnv.Replica
}

func (l engineLogs) logf(format string, args ...any) {
	if l.printf != nil {
		l.printf(format, args...)
	}
}

// env is the EngineEnv of a policy's engine in a run with directory runDir.
func (l engineLogs) env(p config.PolicyConfig, runDir string) EngineEnv {
	e := EngineEnv{RunDir: runDir, Logf: l.logf, Worker: l.worker, bases: l.bases, Config: l.cfg, Replica: l.replica}
	if l.printf != nil || l.restarted != nil {
		e.OnRestart = func(engine string, self func() engines.Engine) func(ctx context.Context, prev, cur string) error {
			return func(ctx context.Context, prev, cur string) error {
				if l.restarted == nil {
					l.logf("policy %q: %s restarted as a new process (instance %s → %s) and lost what it learned since it started; "+
						"resume from a checkpoint to restore it", p.Name, engine, prev, cur)
					return nil
				}
				return l.restarted(ctx, restartEvent{policy: p.Name, trainable: p.Trainable, engine: engine, prev: prev, cur: cur, eng: self()})
			}
		}
	}
	return e
}

// openEngine opens the engine a policy's config asks for, of a registered kind, with places to
// report to: a remote engine that restarted (and so lost whatever it had learned since its last
// save), a worker's start and output. runDir is the run's directory ("" if it has none).
func openEngine(ctx context.Context, p config.PolicyConfig, runDir string, logs engineLogs) (engines.Engine, error) {
	k, err := engineKind(p.Engine.Kind)
	if err != nil {
		return nil, err
	}
	return k.Open(ctx, p, logs.env(p, runDir))
}

// openTiny opens the embedded pure-Go engine on hf_checkpoint (a folder or builtin:NAME), or on
// the folder given by load: (a checkpoint this engine saved).
func openTiny(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
	if p.LoRA != nil {
		return openTinyLoRA(ctx, p, env)
	}
	// The engine keeps the model it opens as its KL reference, so it opens the reference and
	// then loads the weights the policy starts from when they are another folder.
	o, ref := tiny.Options{Threads: p.Engine.Threads}, p.KLReference()
	e, err := tiny.Open(ref, o)
	if err != nil || p.Load == "" || p.Load == ref {
		return e, err
	}
	if err := e.Load(ctx, p.Load); err != nil {
		e.Close()
		if !errors.Is(err, tiny.ErrArchitecture) {
			return nil, fmt.Errorf("policy %q: load: %w", p.Name, err)
		}
		// A load: folder of another shape cannot be measured against the reference (an
		// hf_checkpoint left at its builtin default, say): it is its own reference.
		env.Logf("policy %q: load: %s has another architecture than %s, so the KL reference is the load: folder itself; "+
			"set hf_checkpoint (or ref_load) to its base model to measure against that", p.Name, p.Load, ref)
		return tiny.Open(p.Load, o)
	}
	return e, nil
}

// openRemote connects to an engine server at engine.address (slimen serve, python -m
// slimen_torch serve, …). A LoRA policy is an adapter named after it on that server, whose
// connection the run's LoRA policies at one address share (OpenAdapter).
func openRemote(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
	if p.LoRA != nil {
		key := fmt.Sprintf("remote\x00%s\x00%s\x00%v", p.Engine.Address, p.Engine.TokenEnv, p.Engine.Insecure)
		if t := p.Engine.TLS; t != nil {
			key += fmt.Sprintf("\x00%+v", *t)
		}
		base := p
		base.LoRA, base.Load = nil, ""
		return OpenAdapter(ctx, p, env, AdapterServer{
			Key:    key,
			Open:   func(benv EngineEnv) (engines.Engine, error) { return dialRemote(ctx, base, benv) },
			Client: func(e engines.Engine) *remote.Client { return e.(*remote.Client) },
			Engine: "its engine at " + p.Engine.Address + " (shared by the run's LoRA policies there)",
			Joined: "a LoRA adapter on the engine at " + p.Engine.Address + " that another policy of the run reached",
		})
	}
	return dialRemote(ctx, p, env)
}

// dialRemote connects to the engine server of a policy's engine.address.
func dialRemote(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
	o := ClientOptions(p)
	o.Address, o.Insecure, o.TokenEnv = p.Engine.Address, p.Engine.Insecure, p.Engine.TokenEnv
	var self atomic.Value
	if env.OnRestart != nil {
		o.OnRestart = env.OnRestart("its engine at "+p.Engine.Address, func() engines.Engine { e, _ := self.Load().(engines.Engine); return e })
	}
	if t := p.Engine.TLS; t != nil {
		o.TLS = &remote.TLS{CAFile: t.CA, CertFile: t.Cert, KeyFile: t.Key, ServerName: t.ServerName}
	}
	c, err := remote.Dial(ctx, o)
	if err != nil {
		return nil, err
	}
	self.Store(engines.Engine(c))
	return c, nil
}

// checkServerFolders asks the engine server of a trainable policy (kind remote) whether it would
// write the run's checkpoints and the policy's save: folder. A server confined to another folder
// (slimen serve started elsewhere, with its default --root) then stops the run at start-up, not at
// the first checkpoint after the training.
func (r *Run) checkServerFolders(ctx context.Context, pc config.PolicyConfig, eng engines.Engine) error {
	sc, ok := eng.(interface {
		CheckSaveFolder(ctx context.Context, dir string) error
	})
	if !ok || !pc.Trainable {
		return nil
	}
	var dirs []string
	if r.opts.Out != "" {
		root, err := r.ckpt.root()
		if err != nil {
			return err
		}
		dirs = append(dirs, root)
	}
	if pc.Save != "" {
		dirs = append(dirs, pc.Save)
	}
	for _, dir := range dirs {
		if err := sc.CheckSaveFolder(ctx, dir); err != nil {
			what := "the run's checkpoints"
			if dir == pc.Save {
				what = "its save: folder"
			}
			return fmt.Errorf("its engine server at %s would refuse to write %s (%s), so the run would train and then fail at its "+
				"first checkpoint: %w\nstart slimen serve with --root covering %s (or from that "+
				"folder), or write the run where the server may save (--out inside its root)",
				pc.Engine.Address, what, dir, err, filepath.Dir(dir))
		}
	}
	return nil
}

// ClientOptions are the gRPC client settings of a policy's engine, for engine kinds that reach
// their engine over gRPC (remote, torch).
func ClientOptions(p config.PolicyConfig) remote.Options {
	return remote.Options{MaxMessageBytes: p.Engine.MaxMessageMB << 20, Timeout: p.Engine.Timeout,
		ReconnectTimeout: p.Engine.ReconnectTimeout}
}

// instanced is an engine client that knows which server process it talks to (remote.Client:
// the server's random instance id).
type instanced interface{ Instance() string }

// claimServer prepares the engine of a policy on a server the run does not own (kind remote),
// which other policies and earlier runs may share:
//
//   - two trainable policies must not train one server process, whatever addresses reach it
//     (the instance id tells): each would train one model on both policies' samples. A frozen
//     policy on a trained policy's server samples from the weights being trained: said once.
//   - a trainable policy's server is put back to the policy's starting weights — its load:
//     folder, else the model the server was started with (as the server names it, Info.Model) —
//     with a fresh optimizer, so a run on a server an earlier run trained starts where a run on
//     a fresh one does (same seed, same metrics). engine.continue: true trains on from the
//     state it holds instead; a resumed run loads its checkpoint instead. A server that cannot
//     load that model is refused with the ways to go on.
func (r *Run) claimServer(ctx context.Context, pc config.PolicyConfig, eng engines.Engine) error {
	if in, ok := eng.(instanced); ok && in.Instance() != "" {
		// Unlocked: registerPolicy's caller holds the table's lock, or the run is starting.
		for _, name := range r.pols.order {
			q := r.pols.byName[name]
			qi, ok := q.eng.(instanced)
			if !ok || qi.Instance() != in.Instance() {
				continue
			}
			at := "at " + pc.Engine.Address
			if q.cfg.Engine.Address != pc.Engine.Address {
				at = fmt.Sprintf("at %s and at %s", q.cfg.Engine.Address, pc.Engine.Address)
			}
			switch {
			case q.cfg.Trainable && pc.Trainable:
				return fmt.Errorf("policies %q and %q are both trainable, and their engines %s are one server process (instance %s): "+
					"it would train one model on both policies' samples. Give each trainable policy "+
					"an engine server of its own (another slimen serve on its own --listen address), "+
					"or make one of them trainable: false",
					q.name, pc.Name, at, in.Instance())
			case q.cfg.Trainable || pc.Trainable:
				frozen, trained := q.name, pc.Name
				if q.cfg.Trainable {
					frozen, trained = pc.Name, q.name
				}
				r.events.printf("warning: policy %q is frozen, but its engine is policy %q's (%s, instance %s): "+
					"it samples from the weights %q trains; give it an engine server of its own to keep it as it started", frozen, trained, at, in.Instance(), trained)
			}
		}
	}
	if !pc.Trainable || r.opts.resuming || pc.LoRA != nil {
		// A LoRA policy's adapter started new, or from its load: folder, as it opened
		// (OpenAdapter); the server's base weights are frozen under it.
		return nil
	}
	if pc.Engine.Continue {
		r.restart.startedFrom(pc.Name, "", true)
		r.events.printf("policy %q: engine.continue: training on from the state its engine at %s holds (not reset to its starting weights)", pc.Name,
			pc.Engine.Address)
		return nil
	}
	target, what := pc.Load, "its load: folder"
	if target == "" {
		info, err := eng.Info(ctx)
		if err != nil {
			return fmt.Errorf("its engine at %s: info: %w", pc.Engine.Address, err)
		}
		target, what = info.Model, "the model the server was started with"
	}
	if err := eng.Load(ctx, target); err != nil {
		return fmt.Errorf("its engine at %s could not be reset to %s (%s), and without that the run would start from whatever "+
			"the server learned before (an earlier run's training): "+
			"%w\nrestart the server before the run, start it with a --root that covers that folder, "+
			"or set engine: {continue: true} to train on from the state it holds",
			pc.Engine.Address, what, target, err)
	}
	if pc.Load != "" {
		r.restart.startedFrom(pc.Name, pc.Load, false)
	}
	r.events.printf("policy %q: reset its engine at %s to %s (%s) with a fresh optimizer, "+
		"so the run does not start from what the server learned before; engine: {continue: true} keeps that state instead", pc.Name, pc.Engine.Address, target, what)
	return nil
}

// OpenPolicyEngine opens the engine of the policy name of cfg as a run would (any registered
// kind: tiny, torch, remote, openai), outside a run: what `slimen serve --config` serves. logf
// takes its start-up lines; a worker's output goes to stderr.
func OpenPolicyEngine(ctx context.Context, cfg *config.Config, name string, logf func(format string, args ...any)) (engines.Engine, error) {
	for _, p := range cfg.Policies {
		if p.Name == name {
			return openEngine(ctx, p, "", engineLogs{printf: logf, cfg: cfg})
		}
	}
	return nil, fmt.Errorf("%s defines no policy %q; it defines %s", cfg.File, name, config.QuotePolicyNames(cfg.PolicyNames()))
}
