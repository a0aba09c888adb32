package host

import (
	"context"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
)

// adapterBatcher gathers the generate calls that the LoRA policies on one shared base make at about
// the same time into one engine batch whose rows name their adapters. That is one forward pass per
// step for all the policies (GenerateAdapters) instead of one batch per policy. Each policy's
// dispatcher still forms its own batches (and counts them in its metrics); the batcher sends the
// batches that are waiting together once every adapter of the base has one waiting, or nothing more
// can come (every rollout thread waits and no member's dispatcher holds requests: the dispatchers'
// own rule), or when the first has waited window. Engines compute each row as they would alone
// (batch invariance), so the merge changes no result. A merged batch that fails is sent again call
// by call, so that one policy's bad request fails only that policy's call.
type adapterBatcher struct {
	gen    func(ctx context.Context, reqs []engines.GenerateRequest, adapters []string) ([]engines.Completion, error)
	window time.Duration
	act    *activity
	kick   chan struct{} // act's signal that every rollout thread waits

	mu      sync.Mutex
	members map[string]*dispatcher // the adapters on the base, with their policies' dispatchers
	pending []*adapterCall
	sent    map[string]int // calls per adapter in engine batches not yet answered
	full    chan struct{}  // signalled when every member has a call waiting
	armed   bool           // a flush is scheduled
	// batches counts the engine batches sent, calls the policy batches they carried (tests).
	batches, calls int
}

type adapterCall struct {
	ctx     context.Context
	adapter string
	reqs    []engines.GenerateRequest
	done    chan genResult
}

func newAdapterBatcher(gen func(context.Context, []engines.GenerateRequest, []string) ([]engines.Completion, error), act *activity) *adapterBatcher {
	return &adapterBatcher{gen: gen, window: 20 * time.Millisecond, act: act, kick: act.subscribe(),
		members: map[string]*dispatcher{}, sent: map[string]int{}, full: make(chan struct{}, 1)}
}

func (b *adapterBatcher) join(name string, d *dispatcher) {
	b.mu.Lock()
	b.members[name] = d
	b.mu.Unlock()
}

// ready says whether the waiting batches should go. They go when every member has one, or when
// nothing more can come (every rollout thread waits, and each member without a batch here has
// nothing pending and none on its way, or has one in an engine batch of this batcher already). The
// caller holds b.mu.
func (b *adapterBatcher) ready() bool {
	if len(b.pending) == 0 {
		return false
	}
	have := map[string]bool{}
	for _, c := range b.pending {
		have[c.adapter] = true
	}
	all, idle := true, b.act.quiet()
	for m, d := range b.members {
		if have[m] {
			continue
		}
		all = false
		if idle && b.sent[m] == 0 {
			d.mu.Lock()
			idle = len(d.pending) == 0 && !d.sending
			d.mu.Unlock()
		}
	}
	return all || idle
}

func (b *adapterBatcher) kickIfFull() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.ready() {
		return
	}
	select {
	case b.full <- struct{}{}:
	default:
	}
}

// generate sends reqs with adapter in the next merged batch and waits for its completions.
func (b *adapterBatcher) generate(ctx context.Context, adapter string, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	c := &adapterCall{ctx: ctx, adapter: adapter, reqs: reqs, done: make(chan genResult, 1)}
	b.mu.Lock()
	b.pending = append(b.pending, c)
	if !b.armed {
		b.armed = true
		go b.flushSoon()
	}
	b.mu.Unlock()
	b.kickIfFull()
	select {
	case r := <-c.done:
		return r.out, r.err
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

func (b *adapterBatcher) flushSoon() {
	t := time.NewTimer(b.window)
wait:
	for {
		select {
		case <-b.full:
			break wait
		case <-t.C:
			break wait
		case <-b.kick:
			b.kickIfFull()
		}
	}
	t.Stop()
	b.mu.Lock()
	calls := b.pending
	b.pending, b.armed = nil, false
	select { // a signal for this flush that came late must not cut the next one short
	case <-b.full:
	default:
	}
	b.batches++
	b.calls += len(calls)
	for _, c := range calls {
		b.sent[c.adapter]++
	}
	b.mu.Unlock()
	b.send(calls)
	b.mu.Lock()
	for _, c := range calls {
		b.sent[c.adapter]--
	}
	b.mu.Unlock()
}

// send runs the calls as one batch; request ids get their adapter's name in front, so that two
// policies' ids cannot collide, and get them back in the completions.
func (b *adapterBatcher) send(calls []*adapterCall) {
	var reqs []engines.GenerateRequest
	var names []string
	for _, c := range calls {
		for _, r := range c.reqs {
			if r.ID != "" {
				r.ID = c.adapter + "/" + r.ID
			}
			reqs = append(reqs, r)
			names = append(names, c.adapter)
		}
	}
	ctx := context.WithoutCancel(calls[0].ctx)
	out, err := b.gen(ctx, reqs, names)
	want := 0
	for _, c := range calls {
		for _, r := range c.reqs {
			want += max(r.N, 1)
		}
	}
	if err == nil && len(out) != want {
		err = errShortBatch(len(out), want)
	}
	if err != nil {
		if len(calls) == 1 {
			calls[0].done <- genResult{err: err}
			return
		}
		for _, c := range calls {
			b.send([]*adapterCall{c})
		}
		return
	}
	k := 0
	for _, c := range calls {
		n := 0
		for _, r := range c.reqs {
			n += max(r.N, 1)
		}
		part := out[k : k+n]
		j := 0
		for _, r := range c.reqs {
			for range max(r.N, 1) {
				part[j].RequestID = r.ID
				j++
			}
		}
		c.done <- genResult{out: part}
		k += n
	}
}
