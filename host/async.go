package host

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

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
// yet trained, the data position after them and when the last step ended. Starting rollouts is
// the run's (launch); this value holds what it did. The weights versions kept for them are the
// run's versionKeeper's.
type asyncLoop struct {
	events *eventLog   // where discarded rollouts are said
	ahead  []*launched // in step order
	pos    int         // the data position after the steps launched
	// lastStepEnd is when the last step ended, for engine_busy.
	lastStepEnd time.Time
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
		if err := r.vers.need(ctx, r.pols.list(), r.step, v, cfg.Rollout.MaxStaleness); err != nil {
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
	if err := r.vers.drop(ctx, r.pols.list(), r.step, genVersion(step+1, k), k); err != nil {
		return err
	}
	for t := r.async.lastStep(step) + 1; t <= step+k; t++ {
		if err := r.launch(ctx, t, genVersion(t, k), cfg); err != nil {
			return err
		}
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

// metrics adds what the overlap did to a step's records, l its launched rollouts and pols the
// run's policies. Per policy that is the share of the step's wall time its engine was busy
// (engine_busy, generate, train and save calls; since the end of the last step) and, with K > 0,
// the run's rollout_wall_s (the step's rollouts from launch to end).
func (a *asyncLoop) metrics(res *StepResult, l *launched, k int, pols []*policy) {
	now := time.Now()
	since := a.lastStepEnd
	if since.IsZero() {
		since = l.start
	}
	wall := now.Sub(since).Seconds()
	byName := map[string]*policy{}
	for _, p := range pols {
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
	a.lastStepEnd = now
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
