package host

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// The weights versions of the asynchronous loop (docs/async.md): with rollout.max_staleness
// K > 0 the trainable policies keep, as read-only rollout copies of their weights, the versions
// the rollouts of the steps not yet trained generate from, in their engines (engines.Versions) or
// in rollout replicas; a checkpoint holds them, and a resume puts them back.

// versionKeeper is the weights versions the trainable policies keep for the rollouts of steps
// not yet trained: which versions are kept, the gate partial rollouts wait at, and how each
// policy keeps them (its engine's engines.Versions, or rollout replicas the keeper opens). The run
// owns one (Run.vers) and sets it up with its outputs; the policies and the steps done come as
// arguments.
type versionKeeper struct {
	cfg    func() *config.Config // the run's config, as a reload leaves it
	events *eventLog             // the run's events.log
	// out is the run directory, through which rollout replicas take the weights and which an
	// EngineError's hint resumes from; "" without one.
	out string
	// given and open are Options.Engines and Options.OpenEngine: a given engine has no replicas,
	// and open (nil: openEngine) opens a replica.
	given map[string]engines.Engine
	open  func(context.Context, config.PolicyConfig) (engines.Engine, error)
	act   *activity // the run's running rollouts, which a partial rollout leaves while it waits
	kept  map[int]bool
	gate  versionGate // opens when a version is kept, for partial rollouts
}

// staleness is the run's rollout.max_staleness.
func (vk *versionKeeper) staleness() int { return vk.cfg().Rollout.MaxStaleness }

// keep notes that the trainable policies keep weights version v, and opens its gate.
func (vk *versionKeeper) keep(v int) {
	if vk.kept == nil {
		vk.kept = map[int]bool{}
	}
	vk.kept[v] = true
	vk.gate.open(v)
}

// dropBelow forgets the weights versions below v.
func (vk *versionKeeper) dropBelow(v int) {
	for k := range vk.kept {
		if k < v {
			delete(vk.kept, k)
		}
	}
}

// list lists the weights versions kept, in order.
func (vk *versionKeeper) list() []int {
	var vs []int
	for v := range vk.kept {
		vs = append(vs, v)
	}
	sort.Ints(vs)
	return vs
}

// versioned returns the engines.Versions of every trainable policy of pols: its engine's own,
// or rollout replicas for an engine the run started that keeps none; an error names the first
// policy that can have neither. done is the steps the run has completed.
func (vk *versionKeeper) versioned(ctx context.Context, pols []*policy, done, k int) (map[string]engines.Versions, error) {
	out := map[string]engines.Versions{}
	var fresh []*replicas
	for _, p := range pols {
		if !p.cfg.Trainable {
			continue
		}
		vs := p.disp.versions() // nil until the first step with rollout.max_staleness > 0
		if vs == nil {
			var err error
			vs, err = vk.versionsOf(ctx, p, k)
			if err != nil {
				return nil, err
			}
			if p.replicas == nil {
				// A policy the script created after the run kept its versions (a zero-config
				// name first met by a step's rollouts, which sampled its current weights): it has
				// not trained yet, so each kept version is its current weights. (Replicas load
				// the kept versions when they are prepared.)
				for _, v := range vk.list() {
					if err := vs.KeepVersion(ctx, v); err != nil {
						return nil, &EngineError{Step: done + 1, Policy: p.name, Err: fmt.Errorf("keeping weights version %d for rollouts: %w", v, err),
							Hint: engineErrorHint(vk.out)}
					}
				}
			}
			p.disp.setVersions(vs)
			if p.replicas != nil {
				fresh = append(fresh, p.replicas)
			}
		}
		out[p.name] = vs
	}
	// The replicas of all policies start at once: worker processes, each seconds to start.
	n := k
	if vk.cfg().Rollout.Partial {
		n++ // a step's rollouts continue under the version after theirs
	}
	errs := atOnce(len(fresh), func(i int) error { return fresh[i].prepare(ctx, n) })
	for i, err := range errs {
		if err != nil {
			return nil, &EngineError{Step: done + 1, Policy: fresh[i].policy, Err: err, Hint: engineErrorHint(vk.out)}
		}
	}
	return out, nil
}

// versionsOf finds how policy p keeps weights versions.
func (vk *versionKeeper) versionsOf(ctx context.Context, p *policy, k int) (engines.Versions, error) {
	kind := p.cfg.Engine.Kind
	if vs, ok := p.eng.(engines.Versions); ok {
		probe, asks := p.eng.(engines.VersionsProber)
		if !asks {
			return vs, nil
		}
		keeps, err := probe.KeepsVersions(ctx)
		if err != nil {
			return nil, fmt.Errorf("policy %q: asking its engine whether it keeps weights versions (rollout.max_staleness %d): %w", p.name, k, err)
		}
		if keeps {
			vk.events.printf("policy %q: its %s engine keeps rollout copies of its weights itself, "+
				"so rollouts at rollout.max_staleness %d sample from them while it trains (a device "+
				"copy of the weights per kept version, up to %d)", p.name, kind, k, k)
			return vs, nil
		}
	}
	_, given := vk.given[p.name]
	if given || offHost(p.cfg) || kind == "openai" || vk.out == "" {
		why := "an engine the run opens itself and a run directory, through which its rollout replicas take the weights"
		if offHost(p.cfg) {
			why = "an engine the run starts itself: a replica of a server the run does not own would be the same server"
		}
		server := ""
		if p.cfg.LoRA != nil && offHost(p.cfg) {
			// An adapter on a server keeps no versions of its own (the tiny engine's adapters
			// in the run's process do; a torch policy's adapters get rollout replicas).
			server = " (a LoRA adapter on a server keeps no weights versions: run the policy on kind: tiny or kind: torch to train it asynchronously)"
		} else if _, asks := p.eng.(engines.VersionsProber); asks {
			// A server reached over the protocol keeps them when it lists "versions".
			server = " (its server lists no \"versions\" capability; `slimen serve` of an engine that keeps versions and the torch worker without --no-versions list it)"
		}
		return nil, fmt.Errorf("policy %q%s: rollout.max_staleness is %d, which needs an engine that keeps rollout copies of "+
			"its weights while it trains (the tiny engine does) or %s; "+
			"its %s engine has neither%s — set rollout.max_staleness: 0 (docs/async.md)",
			p.name, cfgPlace(vk.cfg(), p.cfg), k, why, kind, server)
	}
	pc := p.cfg
	var opened atomic.Int64 // replicas opened: the next one's number (EngineEnv.Replica)
	rep := &replicas{policy: p.name, trainer: p.eng, dir: filepath.Join(vk.out, ".rollout_push", p.name), logf: vk.events.filef,
		open: func(ctx context.Context) (engines.Engine, error) {
			open := vk.open
			if open == nil {
				open = func(ctx context.Context, pc config.PolicyConfig) (engines.Engine, error) {
					lost := func(ctx context.Context, ev restartEvent) error {
						return fmt.Errorf("policy %q: a rollout replica restarted and lost the weights version it held; resume the run from its last checkpoint", pc.Name)
					}
					return openEngine(ctx, pc, vk.out, engineLogs{printf: vk.events.printf, worker: vk.events.filef, restarted: lost, cfg: vk.cfg(),
						replica: int(opened.Add(1))})
				}
			}
			return open(ctx, pc)
		}}
	p.replicas = rep
	vk.events.printf("policy %q: its %s engine trains its only copy of the weights in place, "+
		"so rollouts at rollout.max_staleness %d sample from rollout replicas (another engine of the "+
		"policy each, up to %d), which take the trainer's weights after each step (by broadcast "+
		"through a push group when their engines join one, else through a folder)", p.name, kind, k, k)
	return rep, nil
}

// need makes every trainable policy of pols keep weights version v, which a step about to
// launch generates from: kept already, or the current weights (v = done, the steps completed),
// kept now.
func (vk *versionKeeper) need(ctx context.Context, pols []*policy, done, v, k int) error {
	vs, err := vk.versioned(ctx, pols, done, k)
	if err != nil {
		return err
	}
	if vk.kept[v] {
		vk.gate.open(v)
		return nil
	}
	if v != done {
		return fmt.Errorf("step %d: weights version %d is needed, but only the current weights (version %d) and versions %v are at hand", done+1, v,
			done, vk.list())
	}
	for _, name := range sortedKeys(vs) {
		if err := vs[name].KeepVersion(ctx, v); err != nil {
			return &EngineError{Step: done + 1, Policy: name, Err: fmt.Errorf("keeping weights version %d for rollouts: %w", v, err), Hint: engineErrorHint(vk.out)}
		}
	}
	vk.keep(v)
	return nil
}

// drop forgets the weights versions below v: no step to come generates from them.
func (vk *versionKeeper) drop(ctx context.Context, pols []*policy, done, below, k int) error {
	if k == 0 {
		return nil
	}
	vs, err := vk.versioned(ctx, pols, done, k)
	if err != nil {
		return err
	}
	for _, name := range sortedKeys(vs) {
		if err := vs[name].DropVersions(ctx, below); err != nil {
			return &EngineError{Step: done + 1, Policy: name, Err: fmt.Errorf("dropping weights versions: %w", err), Hint: engineErrorHint(vk.out)}
		}
	}
	vk.dropBelow(below)
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// versionsDir is where a checkpoint holds the weights versions its next steps generate from:
// rollout_versions/<policy>/<version>.
const versionsDir = "rollout_versions"

// save writes into a checkpoint of step (the steps the run has completed) the versions that the
// steps after it generate from, besides the current weights (version step): genVersion(step+1)…
// step−1. inFlight says which steps' rollouts are launched (asyncLoop.inFlight), for events.log.
func (vk *versionKeeper) save(ctx context.Context, pols []*policy, step int, tmp string, inFlight func() (lo, hi int, ok bool)) error {
	k := vk.staleness()
	if k == 0 || step == 0 {
		return nil
	}
	vs, err := vk.versioned(ctx, pols, step, k)
	if err != nil {
		return err
	}
	lo := genVersion(step+1, k)
	for name, v := range vs {
		for ver := lo; ver < step; ver++ {
			dir := filepath.Join(tmp, versionsDir, name, strconv.Itoa(ver))
			if err := v.SaveVersion(ctx, ver, dir); err != nil {
				return fmt.Errorf("checkpoint: policy %q: its engine could not save weights version %d: %w", name, ver, err)
			}
		}
	}
	if lo < step {
		msg := fmt.Sprintf("checkpoint: step %d holds weights versions %s, which steps %s generate from (rollout.max_staleness %d)", step, span(lo, step-1),
			span(step+1, step+k), k)
		if lo, hi, ok := inFlight(); ok {
			msg += fmt.Sprintf("; the rollouts of steps %s in flight are not in it: a resume runs them again from those versions",
				span(lo, hi))
		}
		vk.events.filef("%s", msg)
	}
	return nil
}

// restore puts back the weights versions a checkpoint holds for policy p, one of pols: each is
// loaded and kept, before the checkpoint's current weights are loaded over them. done is the
// steps the run has completed.
func (vk *versionKeeper) restore(ctx context.Context, pols []*policy, done int, dir string, p *policy) error {
	root := filepath.Join(dir, versionsDir, p.name)
	entries, _ := filepath.Glob(filepath.Join(root, "*"))
	var vers []int
	for _, e := range entries {
		if v, err := strconv.Atoi(filepath.Base(e)); err == nil {
			vers = append(vers, v)
		}
	}
	if len(vers) == 0 {
		return nil
	}
	if _, err := vk.versioned(ctx, pols, done, max(1, vk.staleness())); err != nil {
		return fmt.Errorf("resume: %w", err)
	}
	vs := p.disp.versions()
	sort.Ints(vers)
	for _, v := range vers {
		if err := p.eng.Load(ctx, filepath.Join(root, strconv.Itoa(v))); err != nil {
			return fmt.Errorf("resume: policy %q: weights version %d: %w", p.name, v, err)
		}
		if err := vs.KeepVersion(ctx, v); err != nil {
			return fmt.Errorf("resume: policy %q: weights version %d: %w", p.name, v, err)
		}
		vk.keep(v)
	}
	return nil
}

// inEngine says whether the weights versions of policy name, one of pols, live in its engine's
// process (a torch worker that keeps them, engines.VersionsProber), which loses them when it
// restarts.
func (vk *versionKeeper) inEngine(pols []*policy, name string) bool {
	var p *policy
	for _, q := range pols {
		if q.name == name {
			p = q
			break
		}
	}
	if p == nil || vk.staleness() == 0 {
		return false
	}
	_, probed := p.eng.(engines.VersionsProber)
	return probed && p.disp.versions() != nil && p.replicas == nil
}

// Partial rollouts (rollout.partial). A generation of a step that generates from version v and
// has not ended after partialSplit(max_tokens) tokens is continued from version v+1, the weights
// the policies finish training while it runs: its first tokens are v's, the rest v+1's, and the
// completion says so per token (engines.Completion.Versions). The split is a rule on the token
// count, not on timing, so a run stays deterministic; the continuation waits for version v+1.

// partialSplit is how many tokens of a generation with max_tokens come from its step's version.
func partialSplit(maxTokens int) int { return (maxTokens + 1) / 2 }

// generatePartial is a generate call of a rollout that samples from version v under
// rollout.partial.
func (vk *versionKeeper) generatePartial(ctx context.Context, p *policy, req engines.GenerateRequest, sv stepVersions) ([]engines.Completion, error) {
	v, next := sv.gen, sv.cont
	if next == v {
		return p.disp.generate(ctx, req, v)
	}
	first := req
	first.MaxTokens = partialSplit(req.MaxTokens)
	outs, err := p.disp.generate(ctx, first, v)
	if err != nil || first.MaxTokens >= req.MaxTokens {
		return outs, err
	}
	for i := range outs {
		o := &outs[i]
		if o.FinishReason != "length" || len(o.Tokens) < first.MaxTokens {
			continue // ended, or at the model's length limit
		}
		vk.act.leave()
		err := vk.gate.wait(ctx, next)
		vk.act.enter()
		if err != nil {
			return nil, err
		}
		cont := engines.GenerateRequest{ID: fmt.Sprintf("%s+%d", req.ID, o.Index), PromptTokens: append(slices.Clone(o.PromptTokens), o.Tokens...),
			N: 1, Sampling: req.Sampling}
		cont.MaxTokens = req.MaxTokens - len(o.Tokens)
		cs, err := p.disp.generate(ctx, cont, next)
		if err != nil {
			return nil, err
		}
		c := cs[0]
		vs := make([]int32, len(o.Tokens)+len(c.Tokens))
		for j := range vs {
			vs[j] = int32(v)
			if j >= len(o.Tokens) {
				vs[j] = int32(next)
			}
		}
		o.Tokens = append(o.Tokens, c.Tokens...)
		o.Logprobs = append(o.Logprobs, c.Logprobs...)
		o.Text += c.Text
		o.FinishReason = c.FinishReason
		o.Versions = vs
	}
	return outs, nil
}

// versionGate tells partial rollouts when a weights version is kept.
type versionGate struct {
	mu sync.Mutex
	ch map[int]chan struct{}
}

func (g *versionGate) chanOf(v int) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ch == nil {
		g.ch = map[int]chan struct{}{}
	}
	c := g.ch[v]
	if c == nil {
		c = make(chan struct{})
		g.ch[v] = c
	}
	return c
}

// open says that version v is kept.
func (g *versionGate) open(v int) {
	c := g.chanOf(v)
	select {
	case <-c:
	default:
		close(c)
	}
}

// wait returns once version v is kept, or with ctx's cause.
func (g *versionGate) wait(ctx context.Context, v int) error {
	select {
	case <-g.chanOf(v):
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// keepAgain puts the weights versions the steps from base on generate from back into eng, a
// restarted process of policy name that keeps its weights versions itself. It is for an engine
// that holds the state of step base (before any optimizer step replayed); the versions are those
// the checkpoint of base holds (rollout_versions, docs/async.md) and base itself. It returns
// the versions kept.
func (c *checkpoints) keepAgain(ctx context.Context, eng engines.Engine, name string, base int) ([]int, error) {
	vs, ok := eng.(engines.Versions)
	if !ok {
		return nil, fmt.Errorf("its engine keeps no weights versions")
	}
	var kept []int
	if base > 0 {
		root, err := c.root()
		if err != nil {
			return nil, err
		}
		dir := filepath.Join(root, stepName(base), versionsDir, name)
		entries, _ := filepath.Glob(filepath.Join(dir, "*"))
		for _, e := range entries {
			if v, err := strconv.Atoi(filepath.Base(e)); err == nil && v < base {
				kept = append(kept, v)
			}
		}
		sort.Ints(kept)
		for _, v := range kept {
			if err := eng.Load(ctx, filepath.Join(dir, strconv.Itoa(v))); err != nil {
				return nil, fmt.Errorf("weights version %d: %w", v, err)
			}
			if err := vs.KeepVersion(ctx, v); err != nil {
				return nil, fmt.Errorf("weights version %d: %w", v, err)
			}
		}
		if len(kept) > 0 { // the state of step base again
			cur, err := c.policyDir(base, name)
			if err != nil {
				return nil, err
			}
			if err := eng.Load(ctx, cur); err != nil {
				return nil, fmt.Errorf("loading the checkpoint of step %d again: %w", base, err)
			}
		}
	}
	if err := vs.KeepVersion(ctx, base); err != nil {
		return nil, fmt.Errorf("weights version %d: %w", base, err)
	}
	return append(kept, base), nil
}
