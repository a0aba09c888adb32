package host

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// The asynchronous loop (rollout.max_staleness, docs/async.md). Version n of a policy is its
// weights after n training steps. With K = rollout.max_staleness, the rollouts of step s generate
// from version genVersion(s, K) of the trainable policies, so once the rollouts of step s are in,
// those of steps s+1…s+K start and run while the policies train on step s. Which version a step
// generates from is a function of the step alone, never of timing, so a run is as deterministic
// for a given K as the synchronous loop (K = 0), and a resume reproduces it: a checkpoint holds
// the versions its next K steps generate from. Engines keep the versions still needed as
// read-only rollout copies of their weights (engines.Versions).

// genVersion is the one place that decides which weights the rollouts of a step generate from:
// version max(0, step−1−K). K = 0 is the synchronous loop: the weights after the last step.
func genVersion(step, k int) int { return max(0, step-1-k) }

// contVersion is the version a partial rollout of step continues its long generations from
// (rollout.partial): the one after genVersion, once the step before has made it; when it has
// not (the first steps), genVersion itself, and nothing is split.
func contVersion(step, k int) int { return min(genVersion(step, k)+1, step-1) }

// staleness is the run's rollout.max_staleness.
func (r *Run) staleness() int { return r.Config().Rollout.MaxStaleness }

type versionKey struct{}

// stepVersions are the weights versions of a step's rollouts: gen, and cont for the rest of
// a long generation (rollout.partial).
type stepVersions struct{ gen, cont int }

// withVersion marks a pass's context: its rollouts generate from version v of the trainable
// policies (and continue from cont). A context without a mark (K = 0, eval passes) generates from
// the current weights.
func withVersion(ctx context.Context, v, cont int) context.Context {
	return context.WithValue(ctx, versionKey{}, stepVersions{v, cont})
}

// versionFor is the weights versions a call of a rollout with context ctx uses on policy p; gen
// -1: the current weights (a frozen policy, which never changes, or an unmarked pass).
func versionFor(ctx context.Context, p *policy) stepVersions {
	if v, ok := ctx.Value(versionKey{}).(stepVersions); ok && p.cfg.Trainable {
		return v
	}
	return stepVersions{-1, -1}
}

// asyncLoop is the asynchronous loop's state between steps: the rollouts launched for steps not
// yet trained, the data position after them, and the weights versions the trainable policies keep
// for them, with the gate partial rollouts wait at. Starting rollouts and keeping versions in the
// engines is the run's (launch, needVersion); this value holds what they did.
type asyncLoop struct {
	events *eventLog   // where discarded rollouts are said
	ahead  []*launched // in step order
	pos    int         // the data position after the steps launched
	kept   map[int]bool
	gate   versionGate // opens when a version is kept, for partial rollouts
}

// take returns the data position of the next n tasks, which a step about to launch runs.
func (a *asyncLoop) take(n int) int {
	pos := a.pos
	a.pos += n
	return pos
}

// next is the launched rollouts of step when they are the first in line, else nil.
func (a *asyncLoop) next(step int) *launched {
	if len(a.ahead) == 0 || a.ahead[0].step != step {
		return nil
	}
	return a.ahead[0]
}

// lastStep is the last step launched, or step when none is.
func (a *asyncLoop) lastStep(step int) int {
	if n := len(a.ahead); n > 0 {
		return a.ahead[n-1].step
	}
	return step
}

// inFlight says which steps' rollouts are launched: lo…hi, ok false when none are.
func (a *asyncLoop) inFlight() (lo, hi int, ok bool) {
	if n := len(a.ahead); n > 0 {
		return a.ahead[0].step, a.ahead[n-1].step, true
	}
	return 0, 0, false
}

// discard cancels the rollouts launched for steps not yet trained and waits for them; why, when
// not "", goes to the events log.
func (a *asyncLoop) discard(why string) {
	if len(a.ahead) == 0 {
		return
	}
	if why != "" {
		a.events.printf("%s: the rollouts of steps %s, launched already, are discarded; they run again", why, span(a.ahead[0].step, a.ahead[len(a.ahead)-1].step))
	}
	for _, l := range a.ahead {
		l.cancel()
	}
	for _, l := range a.ahead {
		<-l.done
	}
	a.ahead = nil
}

// keep notes that the trainable policies keep weights version v, and opens its gate.
func (a *asyncLoop) keep(v int) {
	if a.kept == nil {
		a.kept = map[int]bool{}
	}
	a.kept[v] = true
	a.gate.open(v)
}

// dropBelow forgets the weights versions below v.
func (a *asyncLoop) dropBelow(v int) {
	for k := range a.kept {
		if k < v {
			delete(a.kept, k)
		}
	}
}

// versions lists the weights versions kept, in order.
func (a *asyncLoop) versions() []int {
	var vs []int
	for v := range a.kept {
		vs = append(vs, v)
	}
	sort.Ints(vs)
	return vs
}

// launched is the rollouts of one step, started on their own goroutine: in the synchronous loop
// when the step starts, with K > 0 while the step K before it trains.
type launched struct {
	step, version int
	n             int // tasks taken from the data
	start         time.Time
	done          chan struct{}
	ros           []*script.Rollout
	err           error
	wallS         float64 // from the start to the last rollout's end
	genS          float64 // of wallS, the time an engine was generating (Run.generating)
	genTokens     int64   // the tokens generated in genS, by these rollouts and any beside them
	cancel        context.CancelFunc
}

// launch starts the rollouts of step from version v (-1: the current weights, the synchronous
// loop) on the tasks after those of the steps launched already. Tasks are taken in order from the
// data position, so a batch size changed by a reload neither skips tasks nor repeats them.
func (r *Run) launch(ctx context.Context, step, v int, cfg *config.Config) error {
	if v >= 0 {
		if err := r.needVersion(ctx, v, cfg.Rollout.MaxStaleness); err != nil {
			return err
		}
	}
	n := cfg.Rollout.BatchSize
	pos := r.async.take(n)
	tasks := make([]Task, n)
	for i := range tasks {
		tasks[i] = r.tasks.Task(pos + i)
	}
	lctx, cancel := context.WithCancel(r.ctx)
	l := &launched{step: step, version: v, n: n, start: time.Now(), done: make(chan struct{}), cancel: cancel}
	rf := rolloutFn{fn: r.script.Rollout(), name: "rollout"}
	samples := samplesPerTask(cfg)
	go func() {
		defer close(l.done)
		g0, n0 := r.generating.read()
		l.ros, l.err = r.runRollouts(lctx, step, tasks, samples, rf, nil, v)
		l.wallS = time.Since(l.start).Seconds()
		g1, n1 := r.generating.read()
		l.genS, l.genTokens = (g1 - g0).Seconds(), n1-n0
	}()
	r.async.ahead = append(r.async.ahead, l)
	return nil
}

// awaitStep returns the rollouts of step, launched earlier or now, once they are done. A cancelled
// ctx abandons them and every step launched after them.
func (r *Run) awaitStep(ctx context.Context, step int, cfg *config.Config) (*launched, error) {
	k := cfg.Rollout.MaxStaleness
	l := r.async.next(step)
	if l == nil {
		r.async.discard("") // launched for other steps: none should be
		r.async.pos = r.next
		v := -1
		if k > 0 {
			v = genVersion(step, k)
		}
		if err := r.launch(ctx, step, v, cfg); err != nil {
			return nil, err
		}
		l = r.async.next(step)
	}
	select {
	case <-l.done:
	case <-ctx.Done():
		r.async.discard("")
		return nil, ctx.Err()
	}
	r.async.ahead = r.async.ahead[1:]
	if l.err == nil && ctx.Err() != nil {
		l.err = ctx.Err()
	}
	return l, l.err
}

// launchAhead starts, once the rollouts of step are in, those of steps step+1…step+K that are
// not running yet; the training of step follows. The versions below genVersion(step+1) are
// dropped first: no step to come generates from them, so a policy keeps at most K versions.
// Each new step generates from a kept version or from the current weights (genVersion(step+K)
// = step−1), kept now, before the training changes them.
func (r *Run) launchAhead(ctx context.Context, step int, cfg *config.Config) error {
	k := cfg.Rollout.MaxStaleness
	if k == 0 {
		return nil
	}
	if err := r.dropVersions(ctx, genVersion(step+1, k), k); err != nil {
		return err
	}
	for t := r.async.lastStep(step) + 1; t <= step+k; t++ {
		if err := r.launch(ctx, t, genVersion(t, k), cfg); err != nil {
			return err
		}
	}
	return nil
}

// versioned returns the engines.Versions of every trainable policy: its engine's own, or rollout
// replicas for an engine the run started that keeps none; an error names the first
// policy that can have neither.
func (r *Run) versioned(ctx context.Context, k int) (map[string]engines.Versions, error) {
	out := map[string]engines.Versions{}
	var fresh []*replicas
	for _, p := range r.pols.list() {
		if !p.cfg.Trainable {
			continue
		}
		vs := p.disp.versions() // nil until the first step with rollout.max_staleness > 0
		if vs == nil {
			var err error
			vs, err = r.versionsOf(ctx, p, k)
			if err != nil {
				return nil, err
			}
			if p.replicas == nil {
				// A policy the script created after the run kept its versions (a zero-config
				// name first met by a step's rollouts, which sampled its current weights): it has
				// not trained yet, so each kept version is its current weights. (Replicas load
				// the kept versions when they are prepared.)
				for _, v := range r.async.versions() {
					if err := vs.KeepVersion(ctx, v); err != nil {
						return nil, &EngineError{Step: r.step + 1, Policy: p.name, Err: fmt.Errorf("keeping weights version %d for rollouts: %w", v, err),
							Hint: r.engineErrorHint()}
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
	if r.Config().Rollout.Partial {
		n++ // a step's rollouts continue under the version after theirs
	}
	errs := atOnce(len(fresh), func(i int) error { return fresh[i].prepare(ctx, n) })
	for i, err := range errs {
		if err != nil {
			return nil, &EngineError{Step: r.step + 1, Policy: fresh[i].policy, Err: err, Hint: r.engineErrorHint()}
		}
	}
	return out, nil
}

// versionsOf finds how policy p keeps weights versions.
func (r *Run) versionsOf(ctx context.Context, p *policy, k int) (engines.Versions, error) {
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
			r.events.printf("policy %q: its %s engine keeps rollout copies of its weights itself, "+
				"so rollouts at rollout.max_staleness %d sample from them while it trains (a device "+
				"copy of the weights per kept version, up to %d)", p.name, kind, k, k)
			return vs, nil
		}
	}
	_, given := r.opts.Engines[p.name]
	if given || offHost(p.cfg) || kind == "openai" || r.opts.Out == "" {
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
			p.name, cfgPlace(r.cfg, p.cfg), k, why, kind, server)
	}
	pc := p.cfg
	var opened atomic.Int64 // replicas opened: the next one's number (EngineEnv.Replica)
	rep := &replicas{policy: p.name, trainer: p.eng, dir: filepath.Join(r.opts.Out, ".rollout_push", p.name), logf: r.events.filef,
		open: func(ctx context.Context) (engines.Engine, error) {
			open := r.opts.OpenEngine
			if open == nil {
				open = func(ctx context.Context, pc config.PolicyConfig) (engines.Engine, error) {
					lost := func(ctx context.Context, ev restartEvent) error {
						return fmt.Errorf("policy %q: a rollout replica restarted and lost the weights version it held; resume the run from its last checkpoint", pc.Name)
					}
					return openEngine(ctx, pc, r.opts.Out, engineLogs{printf: r.events.printf, worker: r.events.filef, restarted: lost, cfg: r.cfg,
						replica: int(opened.Add(1))})
				}
			}
			return open(ctx, pc)
		}}
	p.replicas = rep
	r.events.printf("policy %q: its %s engine trains its only copy of the weights in place, "+
		"so rollouts at rollout.max_staleness %d sample from rollout replicas (another engine of the "+
		"policy each, up to %d), which take the trainer's weights after each step (by broadcast "+
		"through a push group when their engines join one, else through a folder)", p.name, kind, k, k)
	return rep, nil
}

// needVersion makes every trainable policy keep weights version v, which a step about to
// launch generates from: kept already, or the current weights (v = r.step), kept now.
func (r *Run) needVersion(ctx context.Context, v, k int) error {
	vs, err := r.versioned(ctx, k)
	if err != nil {
		return err
	}
	if r.async.kept[v] {
		r.async.gate.open(v)
		return nil
	}
	if v != r.step {
		return fmt.Errorf("step %d: weights version %d is needed, but only the current weights (version %d) and versions %v are at hand", r.step+1, v,
			r.step, r.async.versions())
	}
	for _, name := range sortedKeys(vs) {
		if err := vs[name].KeepVersion(ctx, v); err != nil {
			return &EngineError{Step: r.step + 1, Policy: name, Err: fmt.Errorf("keeping weights version %d for rollouts: %w", v, err), Hint: r.engineErrorHint()}
		}
	}
	r.async.keep(v)
	return nil
}

// dropVersions forgets the weights versions below v: no step to come generates from them.
func (r *Run) dropVersions(ctx context.Context, below, k int) error {
	if k == 0 {
		return nil
	}
	vs, err := r.versioned(ctx, k)
	if err != nil {
		return err
	}
	for _, name := range sortedKeys(vs) {
		if err := vs[name].DropVersions(ctx, below); err != nil {
			return &EngineError{Step: r.step + 1, Policy: name, Err: fmt.Errorf("dropping weights versions: %w", err), Hint: r.engineErrorHint()}
		}
	}
	r.async.dropBelow(below)
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

// saveVersions writes into a checkpoint of step the versions that the steps after it generate
// from, besides the current weights (version step): genVersion(step+1)…step−1.
func (r *Run) saveVersions(ctx context.Context, step int, tmp string) error {
	k := r.staleness()
	if k == 0 || step == 0 {
		return nil
	}
	vs, err := r.versioned(ctx, k)
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
		if lo, hi, ok := r.async.inFlight(); ok {
			msg += fmt.Sprintf("; the rollouts of steps %s in flight are not in it: a resume runs them again from those versions",
				span(lo, hi))
		}
		r.events.filef("%s", msg)
	}
	return nil
}

// restoreVersions puts back the weights versions a checkpoint holds for policy p: each is loaded
// and kept, before the checkpoint's current weights are loaded over them.
func (r *Run) restoreVersions(ctx context.Context, dir string, p *policy) error {
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
	if _, err := r.versioned(ctx, max(1, r.staleness())); err != nil {
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
		r.async.keep(v)
	}
	return nil
}

// save has the policy's engine save its state into dir, metered as engine work (a checkpoint's
// save keeps the engine busy like a train call does).
func (p *policy) save(ctx context.Context, dir string) error {
	p.busy.begin()
	defer p.busy.end()
	return p.eng.Save(ctx, dir)
}

// asyncMetrics adds what the overlap did to a step's records. Per policy that is the share of the
// step's wall time its engine was busy (engine_busy, generate, train and save calls; since the end
// of the last step) and, with K > 0, the run's rollout_wall_s (the step's rollouts from launch to
// end).
func (r *Run) asyncMetrics(res *StepResult, l *launched, k int) {
	now := time.Now()
	since := r.lastStepEnd
	if since.IsZero() {
		since = l.start
	}
	wall := now.Sub(since).Seconds()
	byName := map[string]*policy{}
	for _, p := range r.pols.list() {
		byName[p.name] = p
	}
	for _, m := range res.Policies {
		p := byName[m.Policy()]
		if p == nil {
			continue
		}
		b := p.busy.busy()
		if wall > 0 {
			m.set("engine_busy", min(1, (b-p.busyMark).Seconds()/wall))
		}
		p.busyMark = b
	}
	r.lastStepEnd = now
	if k > 0 {
		res.Run.set("rollout_wall_s", l.wallS)
		if l.genS > 0 {
			// tokens_per_s is the engines' rate, as in the synchronous loop: the tokens generated
			// over the time an engine was generating them, both taken over the rollouts' window
			// (other steps' rollouts may generate in it too). Over wallS it counted the
			// rollouts' own work and waits (an agent() program's start-up, a tool).
			res.Run.set("tokens_per_s", float64(l.genTokens)/l.genS)
		}
	}
}

// span writes a range of steps or versions: "4" or "4–6".
func span(lo, hi int) string {
	if lo == hi {
		return strconv.Itoa(lo)
	}
	return fmt.Sprintf("%d–%d", lo, hi)
}

// stalenessMetrics records, with K > 0, the versions a policy's samples of step were generated
// from. They are trained_version (the weights the step trains, version step−1), rollout_version
// (the oldest its samples came from), staleness_mean (trained_version minus the mean version of a
// sample's tokens, averaged over samples) and staleness_max (trained_version minus the oldest
// version of a token); with rollout.partial, partial_samples: the samples whose tokens come from
// two versions.
func stalenessMetrics(m Metrics, step int, ss []trainSample, partial bool) {
	trained := step - 1
	m.set("trained_version", trained)
	if len(ss) == 0 {
		return
	}
	sum, oldest, two := 0.0, ss[0].version, 0
	for _, s := range ss {
		mean := float64(s.version)
		if vs := s.C.Versions(); len(vs) > 0 {
			t, lo, hi := 0, math.MaxInt, math.MinInt
			for _, v := range vs {
				v := int(v)
				if v == script.StepVersion { // a conversation's turn that was not continued
					v = s.version
				}
				t += v
				lo, hi = min(lo, v), max(hi, v)
			}
			mean = float64(t) / float64(len(vs))
			if hi != lo {
				two++
			}
		}
		sum += float64(trained) - mean
		oldest = min(oldest, s.version)
	}
	m.set("rollout_version", oldest)
	m.set("staleness_mean", sum/float64(len(ss)))
	m.set("staleness_max", trained-oldest)
	if partial {
		m.set("partial_samples", two)
	}
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
func (r *Run) generatePartial(ctx context.Context, p *policy, req engines.GenerateRequest, sv stepVersions) ([]engines.Completion, error) {
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
		r.activity.leave()
		err := r.async.gate.wait(ctx, next)
		r.activity.enter()
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

// versionsInEngine says whether policy name's weights versions live in its engine's process (a
// torch worker that keeps them, engines.VersionsProber), which loses them when it restarts.
func (r *Run) versionsInEngine(name string) bool {
	p := r.pols.get(name)
	if p == nil || r.staleness() == 0 {
		return false
	}
	_, probed := p.eng.(engines.VersionsProber)
	return probed && p.disp.versions() != nil && p.replicas == nil
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
