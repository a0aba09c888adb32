package host

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
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

// staleness is the run's rollout.max_staleness.
func (r *Run) staleness() int { return r.Config().Rollout.MaxStaleness }

type versionKey struct{}

// withVersion marks a pass's context: its rollouts generate from version v of the trainable
// policies. A context without a mark (K = 0, eval passes) generates from the current weights.
func withVersion(ctx context.Context, v int) context.Context {
	return context.WithValue(ctx, versionKey{}, v)
}

// versionFor is the weights version a call of a rollout with context ctx uses on policy p; -1:
// the current weights (a frozen policy, which never changes, or an unmarked pass).
func versionFor(ctx context.Context, p *policy) int {
	if v, ok := ctx.Value(versionKey{}).(int); ok && p.cfg.Trainable {
		return v
	}
	return -1
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
	cancel        context.CancelFunc
}

// launch starts the rollouts of step from version v (-1: the current weights, the synchronous
// loop) on the tasks after those of the steps launched already.
func (r *Run) launch(step, v int, cfg *config.Config) *launched {
	pos, n := r.launchPos, cfg.Rollout.BatchSize
	r.launchPos += n
	tasks := make([]Task, n)
	for i := range tasks {
		tasks[i] = r.tasks.Task(pos + i)
	}
	ctx, cancel := context.WithCancel(r.ctx)
	l := &launched{step: step, version: v, n: n, start: time.Now(), done: make(chan struct{}), cancel: cancel}
	rf := rolloutFn{fn: r.script.Rollout(), name: "rollout"}
	samples := samplesPerTask(cfg)
	go func() {
		defer close(l.done)
		l.ros, l.err = r.runRollouts(ctx, step, tasks, samples, rf, nil, v)
		l.wallS = time.Since(l.start).Seconds()
	}()
	r.ahead = append(r.ahead, l)
	return l
}

// awaitStep returns the rollouts of step, launched earlier or now, once they are done. A cancelled
// ctx abandons them and every step launched after them.
func (r *Run) awaitStep(ctx context.Context, step int, cfg *config.Config) (*launched, error) {
	k := cfg.Rollout.MaxStaleness
	if len(r.ahead) == 0 || r.ahead[0].step != step {
		r.discardAhead("") // launched for other steps: none should be
		r.launchPos = r.next
		v := -1
		if k > 0 {
			v = genVersion(step, k)
		}
		r.launch(step, v, cfg)
	}
	l := r.ahead[0]
	select {
	case <-l.done:
	case <-ctx.Done():
		r.discardAhead("")
		return nil, ctx.Err()
	}
	r.ahead = r.ahead[1:]
	if l.err == nil && ctx.Err() != nil {
		l.err = ctx.Err()
	}
	return l, l.err
}

// launchAhead starts the rollouts of steps step+1…step+K that are not running yet; the training
// of step follows. Each generates from its genVersion, kept already: genVersion(step+K) = step−1.
func (r *Run) launchAhead(step int, cfg *config.Config) {
	k := cfg.Rollout.MaxStaleness
	last := step
	if n := len(r.ahead); n > 0 {
		last = r.ahead[n-1].step
	}
	for t := last + 1; t <= step+k; t++ {
		r.launch(t, genVersion(t, k), cfg)
	}
}

// discardAhead cancels the rollouts launched for steps not yet trained and waits for them; why,
// when not "", goes to the events log.
func (r *Run) discardAhead(why string) {
	if len(r.ahead) == 0 {
		return
	}
	if why != "" {
		r.events.printf("%s: the rollouts of steps %s, launched already, are discarded; they run again", why, span(r.ahead[0].step, r.ahead[len(r.ahead)-1].step))
	}
	for _, l := range r.ahead {
		l.cancel()
	}
	for _, l := range r.ahead {
		<-l.done
	}
	r.ahead = nil
}

// versioned returns the engines.Versions of every trainable policy, or an error naming the first
// whose engine keeps no rollout copies.
func (r *Run) versioned(k int) (map[string]engines.Versions, error) {
	out := map[string]engines.Versions{}
	for _, p := range r.policyList() {
		if !p.cfg.Trainable {
			continue
		}
		vs, ok := p.eng.(engines.Versions)
		if !ok {
			return nil, fmt.Errorf("policy %q%s: rollout.max_staleness is %d, which needs an engine that keeps rollout copies of its weights while it trains (the tiny engine does); its %s engine does not — set rollout.max_staleness: 0 (docs/async.md)",
				p.name, r.cfgPlace(p), k, p.cfg.Engine.Kind)
		}
		out[p.name] = vs
	}
	return out, nil
}

// keepVersions has every trainable policy keep its current weights as version r.step (the
// launches of the step need them) and forget the versions no step to come generates from.
func (r *Run) keepVersions(ctx context.Context, k int) error {
	if k == 0 {
		return nil
	}
	vs, err := r.versioned(k)
	if err != nil {
		return err
	}
	for name, v := range vs {
		if r.kept[name] == r.step+1 {
			continue
		}
		if err := v.KeepVersion(ctx, r.step); err != nil {
			return &EngineError{Step: r.step + 1, Policy: name, Err: fmt.Errorf("keeping weights version %d for rollouts: %w", r.step, err), Hint: r.engineErrorHint()}
		}
		if err := v.DropVersions(ctx, genVersion(r.step+1, k)); err != nil {
			return &EngineError{Step: r.step + 1, Policy: name, Err: fmt.Errorf("dropping old weights versions: %w", err), Hint: r.engineErrorHint()}
		}
		if r.kept == nil {
			r.kept = map[string]int{}
		}
		r.kept[name] = r.step + 1 // one more than the version, so that the zero value is none
	}
	return nil
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
	vs, err := r.versioned(k)
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
		msg := fmt.Sprintf("checkpoint: step %d holds weights versions %s, which steps %s generate from (rollout.max_staleness %d)", step, span(lo, step-1), span(step+1, step+k), k)
		if n := len(r.ahead); n > 0 {
			msg += fmt.Sprintf("; the rollouts of steps %s in flight are not in it: a resume runs them again from those versions", span(r.ahead[0].step, r.ahead[n-1].step))
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
	vs, ok := p.eng.(engines.Versions)
	if !ok {
		return fmt.Errorf("resume: policy %q: the checkpoint holds weights versions for rollouts, but its %s engine keeps none (rollout.max_staleness needs the tiny engine)", p.name, p.cfg.Engine.Kind)
	}
	sort.Ints(vers)
	for _, v := range vers {
		if err := p.eng.Load(ctx, filepath.Join(root, strconv.Itoa(v))); err != nil {
			return fmt.Errorf("resume: policy %q: weights version %d: %w", p.name, v, err)
		}
		if err := vs.KeepVersion(ctx, v); err != nil {
			return fmt.Errorf("resume: policy %q: weights version %d: %w", p.name, v, err)
		}
	}
	return nil
}

// busyMeter measures the time an engine has at least one call running.
type busyMeter struct {
	mu      sync.Mutex
	running int
	since   time.Time
	total   time.Duration
}

// begin and end bracket one engine call.
func (b *busyMeter) begin() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.running == 0 {
		b.since = time.Now()
	}
	b.running++
}

func (b *busyMeter) end() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.running--
	if b.running == 0 {
		b.total += time.Since(b.since)
	}
}

// busy returns the busy time so far, the call running now included.
func (b *busyMeter) busy() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	t := b.total
	if b.running > 0 {
		t += time.Since(b.since)
	}
	return t
}

// asyncMetrics adds what the overlap did to a step's records: per policy the share of the step's
// wall time its engine was busy (engine_busy, generate and train calls; since the end of the last
// step) and, with K > 0, the run's rollout_wall_s (the step's rollouts from launch to end).
func (r *Run) asyncMetrics(res *StepResult, l *launched, k int) {
	now := time.Now()
	since := r.lastStepEnd
	if since.IsZero() {
		since = l.start
	}
	wall := now.Sub(since).Seconds()
	byName := map[string]*policy{}
	for _, p := range r.policyList() {
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
		if l.wallS > 0 {
			// tokens_per_s is the rollouts' rate: over their own wall time, not the step's wait.
			res.Run.set("tokens_per_s", float64(res.Run.int("tokens"))/l.wallS)
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
// from: trained_version (the weights the step trains, version step−1), rollout_version (the
// oldest its samples came from) and staleness_mean and staleness_max (trained_version minus a
// sample's version).
func stalenessMetrics(m Metrics, step int, ss []trainSample) {
	trained := step - 1
	m.set("trained_version", trained)
	if len(ss) == 0 {
		return
	}
	sum, most, oldest := 0, 0, ss[0].version
	for _, s := range ss {
		st := trained - s.version
		sum += st
		most = max(most, st)
		oldest = min(oldest, s.version)
	}
	m.set("rollout_version", oldest)
	m.set("staleness_mean", float64(sum)/float64(len(ss)))
	m.set("staleness_max", most)
}
