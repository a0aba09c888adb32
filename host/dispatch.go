package host

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
)

// activity counts the Starlark threads of a step that are running (not waiting on an engine).
// When it reaches zero every rollout is blocked, so no more requests can arrive before some are
// answered: the dispatchers flush at once instead of waiting out their window.
type activity struct {
	mu      sync.Mutex
	running int
	kicks   []chan struct{}
}

func (a *activity) subscribe() chan struct{} {
	ch := make(chan struct{}, 1)
	a.mu.Lock()
	a.kicks = append(a.kicks, ch)
	a.mu.Unlock()
	return ch
}

func (a *activity) add(n int) {
	a.mu.Lock()
	a.running += n
	quiet := a.running <= 0
	a.mu.Unlock()
	if quiet && n < 0 {
		a.kickAll()
	}
}

func (a *activity) enter() { a.add(1) }

func (a *activity) leave() { a.add(-1) }

func (a *activity) quiet() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.running <= 0
}

func (a *activity) kickAll() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, ch := range a.kicks {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// dispatcher coalesces the generate calls of all rollouts for one policy into engine batches.
// A batch goes out when every rollout thread is waiting (nothing more can come), when it holds
// maxSamples samples, or when its first request has waited maxWait. Requests arriving while the
// engine works form the next batch. A batch holds requests of one weights version:
// the oldest request's.
type dispatcher struct {
	eng engines.Engine
	// gen sends a batch: eng.Generate, or the batcher of the policies on a shared LoRA base
	// (adapterBatcher).
	gen        func(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error)
	act        *activity
	kick       chan struct{}
	maxSamples int
	maxWait    time.Duration
	busy       *busyMeter       // nil: not measured
	generating *busyMeter       // the run's generate batches, every policy's (Run.generating); nil: not measured
	vers       engines.Versions // the policy's weights versions (its engine's, or replicas; setVersions); nil: none

	mu      sync.Mutex
	pending []*pendingGen
	scores  []*pendingScore // score calls, batched the same way into the engine's Score
	// sending is set while a batch taken from pending is on its way to the engine (an
	// adapterBatcher waits for it rather than send its other batches without it).
	sending bool
	// batches and requests count what reached the engine, for tests and metrics.
	batches, requests int
	// engineErr is the first error the engine returned since the last takeErr.
	engineErr error
}

// takeErr returns and clears the engine error seen since the last call.
func (d *dispatcher) takeErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	err := d.engineErr
	d.engineErr = nil
	return err
}

type pendingGen struct {
	ctx     context.Context
	req     engines.GenerateRequest
	version int // the weights version to sample from; -1: the current weights
	done    chan genResult
}

type genResult struct {
	out []engines.Completion
	err error
}

type pendingScore struct {
	ctx     context.Context
	req     engines.ScoreRequest
	version int // as pendingGen's
	done    chan scoreResult
}

type scoreResult struct {
	lp  []float32
	err error
}

// score queues a score request, as generate does a generate request, and blocks until its
// log-probs are back: the score calls of all rollouts reach the engine in batches too.
func (d *dispatcher) score(ctx context.Context, req engines.ScoreRequest, version int) ([]float32, error) {
	p := &pendingScore{ctx: ctx, req: req, version: version, done: make(chan scoreResult, 1)}
	r, err := await(d, ctx, func() { d.scores = append(d.scores, p) }, p.done)
	if err != nil {
		return nil, err
	}
	return r.lp, r.err
}

// await queues a request (queue runs under d.mu), wakes the loop and blocks until its result is
// back or ctx ends; the calling thread stops counting as running while it waits.
func await[R any](d *dispatcher, ctx context.Context, queue func(), done <-chan R) (R, error) {
	d.mu.Lock()
	queue()
	d.mu.Unlock()
	select {
	case d.kick <- struct{}{}:
	default:
	}
	d.act.leave()
	defer d.act.enter()
	select {
	case r := <-done:
		return r, nil
	case <-ctx.Done():
		var zero R
		return zero, context.Cause(ctx) // a rollout's time limit, say, rather than "context canceled"
	}
}

func newDispatcher(eng engines.Engine, act *activity, maxSamples int) *dispatcher {
	return &dispatcher{eng: eng, gen: eng.Generate, act: act, kick: act.subscribe(), maxSamples: maxSamples, maxWait: 20 * time.Millisecond}
}

// generate queues a request and blocks until its completions are back (await).
func (d *dispatcher) generate(ctx context.Context, req engines.GenerateRequest, version int) ([]engines.Completion, error) {
	p := &pendingGen{ctx: ctx, req: req, version: version, done: make(chan genResult, 1)}
	r, err := await(d, ctx, func() { d.pending = append(d.pending, p) }, p.done)
	if err != nil {
		return nil, err
	}
	return r.out, r.err
}

// loop runs until ctx ends.
func (d *dispatcher) loop(ctx context.Context) {
	var first time.Time
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		d.mu.Lock()
		n, samples := len(d.pending)+len(d.scores), len(d.scores)
		for _, p := range d.pending {
			samples += max(p.req.N, 1)
		}
		d.mu.Unlock()
		if n > 0 {
			if first.IsZero() {
				first = time.Now()
			}
			if d.act.quiet() || samples >= d.maxSamples || time.Since(first) >= d.maxWait {
				d.flush(ctx)
				d.flushScores(ctx)
				first = time.Time{}
				continue
			}
			timer.Reset(d.maxWait - time.Since(first))
		}
		select {
		case <-ctx.Done():
			d.failAll(ctx.Err())
			return
		case <-d.kick:
		case <-timer.C:
		}
	}
}

// flush forms a batch of the pending generate requests (takeBatch), sends it to the engine (send)
// and hands each request its completions, or the batch's error, back (handBack).
func (d *dispatcher) flush(ctx context.Context) {
	batch, samples := d.takeBatch()
	if len(batch) == 0 {
		return
	}
	out, err := d.send(ctx, batch, samples)
	handBack(batch, out, err)
}

// takeBatch takes a batch off the pending generate requests: the oldest one whose rollout is not
// gone, and each later one of its weights version that fits within maxSamples samples; requests
// whose rollout is gone are dropped. A batch taken is counted and marked as on its way to the
// engine (sending) at once. samples is the samples the batch asks for.
func (d *dispatcher) takeBatch() (batch []*pendingGen, samples int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rest := d.pending[:0:0]
	for _, p := range d.pending {
		if p.ctx.Err() != nil {
			continue // its rollout is gone
		}
		if len(batch) > 0 && (samples+max(p.req.N, 1) > d.maxSamples || p.version != batch[0].version) {
			rest = append(rest, p)
			continue
		}
		batch = append(batch, p)
		samples += max(p.req.N, 1)
	}
	d.pending = rest
	if len(batch) > 0 {
		d.batches++
		d.requests += len(batch)
		d.sending = true
	}
	return batch, samples
}

// send sends batch, of samples samples in all, to the engine, timing the engine's work on it
// (busy, generating) and counting the tokens it generated. A batch that comes back short is an
// error; an error while ctx lives is kept for takeErr.
func (d *dispatcher) send(ctx context.Context, batch []*pendingGen, samples int) ([]engines.Completion, error) {
	reqs := make([]engines.GenerateRequest, len(batch))
	for i, p := range batch {
		reqs[i] = p.req
	}
	d.busy.begin()
	d.generating.begin()
	out, err := d.generateVersion(ctx, batch[0].version, reqs)
	d.mu.Lock()
	d.sending = false
	d.mu.Unlock()
	if err == nil {
		n := 0
		for _, c := range out {
			n += len(c.Tokens)
		}
		d.generating.count(n)
	}
	d.generating.end()
	d.busy.end()
	if err == nil && len(out) != samples {
		err = errShortBatch(len(out), samples)
	}
	if err != nil && ctx.Err() == nil {
		d.mu.Lock()
		if d.engineErr == nil {
			d.engineErr = err
		}
		d.mu.Unlock()
	}
	return out, err
}

// generateVersion has the engine generate reqs from weights version v of the policy (-1: its
// current weights).
func (d *dispatcher) generateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	if vs := d.versions(); v >= 0 && vs != nil {
		return vs.GenerateVersion(ctx, v, reqs)
	}
	// The current weights: the synchronous loop, or (vs nil) a policy created by the script
	// after the run set up its versions (a zero-config name first met by these rollouts),
	// which has not trained yet, so every version of it is these weights (Run.versioned).
	return d.gen(ctx, reqs)
}

// handBack hands each request of batch its completions, in order from out, or the batch's err.
func handBack(batch []*pendingGen, out []engines.Completion, err error) {
	k := 0
	for _, p := range batch {
		if err != nil {
			p.done <- genResult{err: err}
			continue
		}
		n := max(p.req.N, 1)
		p.done <- genResult{out: out[k : k+n]}
		k += n
	}
}

// flushScores sends a batch of the pending score requests: up to maxSamples of them, of the
// oldest one's weights version.
func (d *dispatcher) flushScores(ctx context.Context) {
	d.mu.Lock()
	var batch []*pendingScore
	rest := d.scores[:0:0]
	for _, p := range d.scores {
		if p.ctx.Err() != nil {
			continue
		}
		if len(batch) > 0 && (len(batch) >= d.maxSamples || p.version != batch[0].version) {
			rest = append(rest, p)
			continue
		}
		batch = append(batch, p)
	}
	d.scores = rest
	d.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	reqs := make([]engines.ScoreRequest, len(batch))
	for i, p := range batch {
		reqs[i] = p.req
	}
	d.busy.begin()
	var out []engines.Scores
	var err error
	if v, vs := batch[0].version, d.versions(); v >= 0 && vs != nil {
		out, err = vs.ScoreVersion(ctx, v, reqs)
	} else { // the current weights, as generateVersion says
		out, err = d.eng.Score(ctx, reqs)
	}
	d.busy.end()
	if err == nil && len(out) != len(reqs) {
		err = fmt.Errorf("engine returned %d scores for %d requests", len(out), len(reqs))
	}
	for i, p := range batch {
		if err != nil {
			p.done <- scoreResult{err: err}
			continue
		}
		p.done <- scoreResult{lp: out[i].Logprobs}
	}
}

func (d *dispatcher) failAll(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, p := range d.pending {
		p.done <- genResult{err: err}
	}
	d.pending = nil
	for _, p := range d.scores {
		p.done <- scoreResult{err: err}
	}
	d.scores = nil
}

// stats returns how many batches and requests reached the engine so far.
func (d *dispatcher) stats() (batches, requests int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.batches, d.requests
}

func errShortBatch(got, want int) error {
	return fmt.Errorf("engine returned %d completions for %d samples", got, want)
}

// versions returns what setVersions gave, or nil.
func (d *dispatcher) versions() engines.Versions {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.vers
}

// setVersions gives the dispatcher the policy's weights versions.
func (d *dispatcher) setVersions(vs engines.Versions) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.vers = vs
}
