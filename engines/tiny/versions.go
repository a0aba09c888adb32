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

func (s *versionStore) generate(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	snap, err := s.get(v)
	if err != nil {
		return nil, err
	}
	return snap.Generate(ctx, reqs)
}

func (s *versionStore) score(ctx context.Context, v int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	snap, err := s.get(v)
	if err != nil {
		return nil, err
	}
	return snap.Score(ctx, reqs)
}

func (s *versionStore) save(ctx context.Context, v int, dir string) error {
	snap, err := s.get(v)
	if err != nil {
		return err
	}
	return snap.Save(ctx, dir)
}

func (s *versionStore) drop(below int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for v := range s.kept {
		if v < below {
			delete(s.kept, v)
		}
	}
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
	e.versions.keep(v, e.frozenCopy(ads))
	return nil
}

// GenerateVersion is Generate with the weights kept as version v.
func (e *Engine) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return e.versions.generate(ctx, v, reqs)
}

// ScoreVersion is Score with the weights kept as version v.
func (e *Engine) ScoreVersion(ctx context.Context, v int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return e.versions.score(ctx, v, reqs)
}

// SaveVersion writes the weights kept as version v as a model folder (no optimizer state).
func (e *Engine) SaveVersion(ctx context.Context, v int, dir string) error {
	return e.versions.save(ctx, v, dir)
}

// DropVersions forgets the kept versions below v.
func (e *Engine) DropVersions(ctx context.Context, below int) error {
	e.versions.drop(below)
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
	v.versions.keep(ver, &AdapterEngine{e: base, a: a})
	return nil
}

// GenerateVersion is Generate with the adapter kept as version ver.
func (v *AdapterEngine) GenerateVersion(ctx context.Context, ver int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return v.versions.generate(ctx, ver, reqs)
}

// ScoreVersion is Score with the adapter kept as version ver.
func (v *AdapterEngine) ScoreVersion(ctx context.Context, ver int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return v.versions.score(ctx, ver, reqs)
}

// SaveVersion writes the adapter kept as version ver as a PEFT folder (no optimizer state).
func (v *AdapterEngine) SaveVersion(ctx context.Context, ver int, dir string) error {
	return v.versions.save(ctx, ver, dir)
}

// DropVersions forgets the kept versions below ver.
func (v *AdapterEngine) DropVersions(ctx context.Context, below int) error {
	v.versions.drop(below)
	return nil
}
