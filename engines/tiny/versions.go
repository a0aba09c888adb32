package tiny

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/slimen/slimen/engines"
)

// versionStore holds the rollout copies of an engine's weights (engines.Versions), each a frozen
// engine that never trains: generating or scoring from one takes no lock the training takes.
type versionStore struct {
	mu   sync.RWMutex
	kept map[int]engines.Engine
}

func (s *versionStore) keep(v int, snap engines.Engine) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.kept == nil {
		s.kept = map[int]engines.Engine{}
	}
	s.kept[v] = snap
}

func (s *versionStore) get(v int) (engines.Engine, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	snap, ok := s.kept[v]
	if !ok {
		return nil, fmt.Errorf("tiny: no weights version %d is kept (have %v): %w", v, slices.Sorted(maps.Keys(s.kept)), engines.ErrVersionNotKept)
	}
	return snap, nil
}

// GenerateVersion is Generate with the weights (of an adapter engine: the adapter) kept as
// version v.
func (s *versionStore) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	snap, err := s.get(v)
	if err != nil {
		return nil, err
	}
	return snap.Generate(ctx, reqs)
}

// ScoreVersion is Score with the weights kept as version v.
func (s *versionStore) ScoreVersion(ctx context.Context, v int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	snap, err := s.get(v)
	if err != nil {
		return nil, err
	}
	return snap.Score(ctx, reqs)
}

// SaveVersion writes the weights kept as version v without optimizer state: a model folder, an
// adapter engine's a PEFT folder.
func (s *versionStore) SaveVersion(ctx context.Context, v int, dir string) error {
	snap, err := s.get(v)
	if err != nil {
		return err
	}
	return snap.Save(ctx, dir)
}

// DropVersions forgets the kept versions below below.
func (s *versionStore) DropVersions(ctx context.Context, below int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for v := range s.kept {
		if v < below {
			delete(s.kept, v)
		}
	}
	return nil
}

var (
	_ engines.Versions = (*Engine)(nil)
	_ engines.Versions = (*AdapterEngine)(nil)
)

// frozenCopy is an engine over a copy of e's current weights (and adapters), sharing the
// tokenizer and the KL reference, with the weights packed once for the SIMD kernels. The caller
// holds e.mu.
func (e *Engine) frozenCopy(adapters map[string]*adapterState) *Engine {
	m := newModel(e.m.w.clone()).packed(e.threads)
	return &Engine{spec: e.spec, threads: e.threads, tok: e.tok, eos: e.eos, m: m, ref: e.ref, adapters: adapters}
}

// KeepVersion copies the current weights, adapters included, as rollout version v.
func (e *Engine) KeepVersion(ctx context.Context, v int) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return ErrClosed
	}
	ads := map[string]*adapterState{}
	for name, a := range e.adapters {
		ads[name] = &adapterState{name: name, w: a.w.clone()}
	}
	e.keep(v, e.frozenCopy(ads))
	return nil
}

// KeepVersion copies the adapter's current weights as rollout version v; the base, which does
// not train, is shared.
func (v *AdapterEngine) KeepVersion(ctx context.Context, ver int) error {
	v.e.mu.RLock()
	defer v.e.mu.RUnlock()
	if v.e.closed {
		return ErrClosed
	}
	a := &adapterState{name: v.a.name, w: v.a.w.clone(), opt: newAdamStateOf(v.a.w.tensors())}
	base := &Engine{spec: v.e.spec, threads: v.e.threads, tok: v.e.tok, eos: v.e.eos, m: v.e.m, ref: v.e.ref,
		adapters: map[string]*adapterState{a.name: a}}
	v.keep(ver, &AdapterEngine{e: base, a: a})
	return nil
}
