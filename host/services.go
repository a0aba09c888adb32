package host

import (
	"context"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// services is what a rollout's built-ins need from the host. In-process it is the Run itself;
// in a sandbox child it is the pipe to the host process (sandbox.go). Keeping the built-ins on
// this interface is what lets untrusted Starlark run in another process unchanged.
type services interface {
	// checkPolicy says whether a policy exists and can be trained; place names where it was
	// configured, for messages (" in config.yaml:7").
	checkPolicy(name string) (trainable bool, place string, err error)
	sampling() engines.Sampling
	generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error)
	score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error)
	stateGet(key string) (starlark.Value, bool, error)
	// stateLock holds the state store for an atomic update of key: the caller computes the new
	// value and calls commit, or release to leave it unchanged. release after commit is a no-op.
	stateLock(key string) (cur starlark.Value, found bool, commit func(starlark.Value) error, release func(), err error)
	event(msg string)
	// running adds n (or removes, n < 0) threads to the count of running Starlark threads.
	running(n int)
	generated(tokens int)
}

// local services: the run itself.
type localServices struct{ r *Run }

func (s localServices) checkPolicy(name string) (bool, string, error) {
	p, err := s.r.policyFor(name)
	if err != nil {
		return false, "", err
	}
	return p.cfg.Trainable, s.r.cfgPlace(p), nil
}

func (s localServices) sampling() engines.Sampling { return s.r.sampling() }

func (s localServices) generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error) {
	p, err := s.r.policyFor(policy)
	if err != nil {
		return nil, err
	}
	req.ID = wireID(ctx, req.ID) // a sandboxed rollout's requests come this way too
	return p.disp.generate(ctx, req)
}

func (s localServices) score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error) {
	p, err := s.r.policyFor(policy)
	if err != nil {
		return nil, err
	}
	return s.r.score(ctx, p, req)
}

func (s localServices) stateGet(key string) (starlark.Value, bool, error) {
	v, ok := s.r.state.Get(key)
	return v, ok, nil
}

func (s localServices) stateLock(key string) (starlark.Value, bool, func(starlark.Value) error, func(), error) {
	st := s.r.state
	st.mu.Lock()
	done := false
	release := func() {
		if !done {
			done = true
			st.mu.Unlock()
		}
	}
	commit := func(v starlark.Value) error {
		if err := plainData(v, 0); err != nil {
			return err
		}
		v.Freeze()
		st.values[key] = v
		release()
		return nil
	}
	cur, ok := st.values[key]
	return cur, ok, commit, release, nil
}

func (s localServices) event(msg string) { s.r.events.printf("%s", msg) }

func (s localServices) running(n int) { s.r.activity.add(n) }

func (s localServices) generated(tokens int) { s.r.live.tokens.Add(int64(tokens)) }
