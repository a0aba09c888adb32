package server

import (
	"context"
	"fmt"
	"sync"

	"github.com/slimen/slimen/engines"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// trainLog applies each optimizer step id at most once and remembers the recent ones with their
// stats, so that a step resent after a lost answer gets the first answer back.
type trainLog struct {
	mu    sync.Mutex
	steps map[string]*trainStep
	order []*trainStep // in the order they started, for forgetting the oldest
	max   int
}

type trainStep struct {
	id    string
	fp    [32]byte
	done  chan struct{}
	stats engines.TrainStats
	err   error
}

func newTrainLog(max int) *trainLog {
	return &trainLog{steps: map[string]*trainStep{}, max: max}
}

// apply runs train for id unless id was applied (or is being applied) already; dup reports a
// repeat. A step that has started runs to the end even if ctx ends: a resend then finds it and
// waits, instead of an optimizer step being cut off halfway or applied a second time. A failed
// step is forgotten, so that a resend tries again.
func (l *trainLog) apply(ctx context.Context, id string, fp [32]byte,
	train func(context.Context) (engines.TrainStats, error)) (stats engines.TrainStats, dup bool, err error) {
	l.mu.Lock()
	st, seen := l.steps[id]
	if seen && st.fp != fp {
		l.mu.Unlock()
		return engines.TrainStats{}, false, status.Errorf(codes.AlreadyExists,
			"optimizer step id %q was already used for a different batch: every step needs its own id", id)
	}
	if !seen {
		st = &trainStep{id: id, fp: fp, done: make(chan struct{})}
		l.steps[id] = st
		l.order = append(l.order, st)
		l.trim()
		go func() {
			stats, err := train(context.WithoutCancel(ctx))
			l.mu.Lock()
			st.stats, st.err = stats, err
			if err != nil && l.steps[id] == st {
				delete(l.steps, id)
			}
			l.mu.Unlock()
			close(st.done)
		}()
	}
	l.mu.Unlock()
	select {
	case <-st.done:
		return st.stats, seen, st.err
	case <-ctx.Done():
		return engines.TrainStats{}, false, fmt.Errorf("step %q is still running on the engine and will be applied; "+
			"resend it with the same id to get its stats: %w", id, ctx.Err())
	}
}

// trim forgets the oldest finished steps beyond max. l.mu is held.
func (l *trainLog) trim() {
	for len(l.order) > l.max {
		st := l.order[0]
		if !st.finished() {
			return // the oldest is still running; it and the ones after it stay a while longer
		}
		l.order = l.order[1:]
		if l.steps[st.id] == st {
			delete(l.steps, st.id)
		}
	}
}

// forget drops every finished step (Load rewound the weights).
func (l *trainLog) forget() {
	l.mu.Lock()
	defer l.mu.Unlock()
	keep := l.order[:0]
	for _, st := range l.order {
		if !st.finished() {
			keep = append(keep, st)
		} else if l.steps[st.id] == st {
			delete(l.steps, st.id)
		}
	}
	l.order = keep
}

func (st *trainStep) finished() bool {
	select {
	case <-st.done:
		return true
	default:
		return false
	}
}
