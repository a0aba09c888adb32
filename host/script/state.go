package script

import (
	"fmt"
	"sort"
	"sync"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// State is the run-wide store scripts reach as `state`: it survives steps, hot reloads and
// checkpoints. It holds plain data only (None, bools, numbers, strings, lists, tuples, dicts), so
// it can be saved and no completion or function leaks from one rollout into another.
//
// A step's writes count only if the step completes: Run.Step snapshots the store before the step
// and restores it when the step does not complete (abandoned on a signal, stopped by an error),
// so a checkpoint never holds the writes of a step whose samples were never trained. Within a
// step, updates apply at once, under the store's lock, so concurrent rollouts see each other's.
type State struct {
	mu     sync.Mutex
	values map[string]starlark.Value
}

// NewState returns an empty store.
func NewState() *State { return &State{values: map[string]starlark.Value{}} }

// Get returns the value stored under k.
func (s *State) Get(k string) (starlark.Value, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.values[k]
	return v, ok
}

// Keys returns the stored keys, sorted.
func (s *State) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys := make([]string, 0, len(s.values))
	for k := range s.values {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Set stores a plain-data value under k.
func (s *State) Set(k string, v starlark.Value) error {
	if err := plainData(v, 0); err != nil {
		return err
	}
	v.Freeze()
	s.mu.Lock()
	s.values[k] = v
	s.mu.Unlock()
	return nil
}

// Snapshot returns the store's contents. Stored values are frozen, so a copy of the map is a
// snapshot: nothing can change what it holds.
func (s *State) Snapshot() map[string]starlark.Value {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[string]starlark.Value, len(s.values))
	for k, v := range s.values {
		m[k] = v
	}
	return m
}

// Restore puts back what Snapshot returned: the writes made since are forgotten.
func (s *State) Restore(m map[string]starlark.Value) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values = make(map[string]starlark.Value, len(m))
	for k, v := range m {
		s.values[k] = v
	}
}

// Lock holds the store for an atomic update of key (state.update): the caller computes the new
// value and calls commit, or release to leave it unchanged. release after commit is a no-op.
func (s *State) Lock(key string) (cur starlark.Value, found bool, commit func(starlark.Value) error, release func()) {
	s.mu.Lock()
	done := false
	release = func() {
		if !done {
			done = true
			s.mu.Unlock()
		}
	}
	commit = func(v starlark.Value) error {
		if err := plainData(v, 0); err != nil {
			return err
		}
		v.Freeze()
		s.values[key] = v
		release()
		return nil
	}
	cur, found = s.values[key]
	return cur, found, commit, release
}

func plainData(v starlark.Value, depth int) error {
	if depth > 32 {
		return fmt.Errorf("value nests deeper than 32 levels")
	}
	switch v := v.(type) {
	case starlark.NoneType, starlark.Bool, starlark.Int, starlark.Float, starlark.String:
		return nil
	case *starlark.List:
		for i := 0; i < v.Len(); i++ {
			if err := plainData(v.Index(i), depth+1); err != nil {
				return err
			}
		}
		return nil
	case starlark.Tuple:
		for _, x := range v {
			if err := plainData(x, depth+1); err != nil {
				return err
			}
		}
		return nil
	case *starlark.Dict:
		for _, kv := range v.Items() {
			if err := plainData(kv[0], depth+1); err != nil {
				return err
			}
			if err := plainData(kv[1], depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("a %s cannot be kept in state; store plain data (numbers, strings, lists, dicts)", v.Type())
}

var stateModule = &starlarkstruct.Module{
	Name: "state",
	Members: starlark.StringDict{
		"get":    starlark.NewBuiltin("state.get", stateGet),
		"update": starlark.NewBuiltin("state.update", stateUpdate),
	},
}

const inUpdateLocal = "slimen.state.update"

func stateGet(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var k string
	var def starlark.Value = starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "key", &k, "default?", &def); err != nil {
		return nil, err
	}
	v, ok, err := ts.ro.Host.StateGet(k)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", b.Name(), err)
	}
	if ok {
		return v, nil
	}
	return def, nil
}

// stateUpdate calls fn(current) and stores its result, atomically with respect to every other
// update: fn runs under the store's lock, so it must not call state itself.
func stateUpdate(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var k string
	var fn starlark.Callable
	var def starlark.Value = starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "key", &k, "fn", &fn, "default?", &def); err != nil {
		return nil, err
	}
	if thread.Local(inUpdateLocal) != nil {
		return nil, fmt.Errorf("%s: called inside another state.update function; compute the value first", b.Name())
	}
	cur, ok, commit, release, err := ts.ro.Host.StateLock(k)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", b.Name(), err)
	}
	defer release()
	if !ok {
		cur = def
	}
	thread.SetLocal(inUpdateLocal, true)
	v, err := starlark.Call(thread, fn, starlark.Tuple{cur}, nil)
	thread.SetLocal(inUpdateLocal, nil)
	if err != nil {
		return nil, err
	}
	if err := ts.ro.Budget.state(b.Name(), v); err != nil {
		return nil, err
	}
	if err := commit(v); err != nil {
		return nil, fmt.Errorf("%s(%q): %v", b.Name(), k, err)
	}
	return v, nil
}
