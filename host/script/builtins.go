package script

import (
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
	"strings"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// The built-ins (README.md lists them). Each one converts its Starlark arguments and calls plain Go on the
// rollout it runs in; that rollout is found through the calling thread.

const threadLocal = "slimen.thread"

// threadState is what a Starlark thread of a rollout carries. path and calls give every generate
// call a position that does not depend on goroutine scheduling: the seed of a call and the order
// of samples derive from it, so runs are reproducible however rollouts interleave.
type threadState struct {
	ro    *Rollout
	path  []int
	calls int
}

func stateOf(thread *starlark.Thread, fn string) (*threadState, error) {
	ts, _ := thread.Local(threadLocal).(*threadState)
	if ts == nil {
		return nil, fmt.Errorf("%s: called at the top level of the script; call it inside rollout(task), where the host runs it for each task", fn)
	}
	return ts, nil
}

// blockingOf is stateOf for the built-ins that wait on the model, on other threads or on the
// state store (generate, a chat's .generate, score, parallel, agent, state.get). A state.update
// function runs holding the store's lock, so such a call there would hang the run (state.get
// on the same lock) or stall every rollout's state behind a model call: it is refused instead.
func blockingOf(thread *starlark.Thread, fn string) (*threadState, error) {
	if thread.Local(inUpdateLocal) != nil {
		return nil, fmt.Errorf("%s: called inside a state.update function, which runs holding the state store's lock; "+
			"call it before state.update and pass the result in", fn)
	}
	return stateOf(thread, fn)
}

// next returns the position of this thread's next call.
func (ts *threadState) next() []int {
	k := append(append([]int(nil), ts.path...), ts.calls)
	ts.calls++
	return k
}

// KeySeed is the seed of the call at position key of task taskID's rollout, derived from the
// base seed: the same in every run, and different for every call.
func KeySeed(base uint64, taskID string, key []int) uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d|%s", base, taskID)
	for _, k := range key {
		fmt.Fprintf(h, "|%d", k)
	}
	return h.Sum64()
}

// Request ids. A generate request carries two ids:
//
//   - its id within its rollout, "TASK/CALL" (CALL is the call's position, "1.0.2"): the
//     completion ids derive from it ("TASK/CALL#i"), so they are the same in every run, and a
//     sandboxed rollout's child and host agree on them;
//   - its wire id, the one an engine sees: "RUN/PASS/INDEX/TASK/CALL", where RUN is the host
//     process's run id (the one optimizer step ids carry), PASS counts the rollout passes of the
//     process (each step and each eval dataset run is one) and INDEX is the task's position in
//     its pass. An engine server remembers ids to answer a resent request once, so the wire id
//     must never name two different requests: not the same task twice in one step (a data file
//     smaller than the batch), not the next pass over the data, not an eval of the same tasks,
//     not a resumed run talking to a server that outlived the previous host. The client keeps it
//     through its own retries.
//
// Only the wire id reaches the engine, and nothing is derived from it: seeds and sample order
// come from the call's position (keySeed), so runs stay reproducible.

// requestIDs is the context key of a rollout's wire-id prefix, "RUN/PASS/INDEX/".
type requestIDs struct{}

// withRequestIDs gives the calls of one rollout their wire-id prefix.
func withRequestIDs(ctx context.Context, run string, pass, index int) context.Context {
	return context.WithValue(ctx, requestIDs{}, fmt.Sprintf("%s/%d/%d/", run, pass, index))
}

// WireID turns a request's id within its rollout into the id its engine sees. Outside a run's
// rollouts (scripted tests, traces) the id stays as it is.
func WireID(ctx context.Context, id string) string {
	if prefix, ok := ctx.Value(requestIDs{}).(string); ok {
		return prefix + id
	}
	return id
}

// occurrence counts the tasks of a pass: it returns how many times id was seen before (0 the
// first time). A task that runs twice in a step (a data file smaller than the batch) is two
// rollouts: the second gets seeds of its own and a group of its own.
func occurrence(seen map[string]int, id string) int {
	k := seen[id]
	seen[id] = k + 1
	return k
}

// defaultGroup is the group of train() calls that name none: the task id, as in slime, where a
// group is the n samples of one prompt of the batch. A task that runs again in the same step is
// another prompt of the batch, so its rollout is a group of its own ("ID#2", "ID#3", …): its
// samples are not normalised against those of the first.
func defaultGroup(id string, occurrence int) string {
	if occurrence == 0 {
		return id
	}
	return fmt.Sprintf("%s#%d", id, occurrence+1)
}

// keyFromRequestID recovers a call's position from its request id ("TASK/1.0.2").
func keyFromRequestID(id string) []int {
	pos := id[strings.LastIndex(id, "/")+1:]
	var key []int
	for _, part := range strings.Split(pos, ".") {
		if k, err := strconv.Atoi(part); err == nil {
			key = append(key, k)
		}
	}
	return key
}

func keyString(key []int) string {
	parts := make([]string, len(key))
	for i, k := range key {
		parts[i] = strconv.Itoa(k)
	}
	return strings.Join(parts, ".")
}

// ToMessages converts a prompt (a string: one user turn, or a list of {"role","content"} dicts).
func ToMessages(fn string, v starlark.Value) ([]engines.Message, error) {
	switch v := v.(type) {
	case starlark.String:
		return []engines.Message{{Role: "user", Content: string(v)}}, nil
	case *starlark.List, starlark.Tuple:
		var out []engines.Message
		it := starlark.Iterate(v)
		defer it.Done()
		var x starlark.Value
		for i := 0; it.Next(&x); i++ {
			d, ok := x.(*starlark.Dict)
			if !ok {
				return nil, fmt.Errorf("%s: prompt[%d] is a %s; a message is a dict with \"role\" and \"content\"", fn, i, x.Type())
			}
			var m engines.Message
			for _, k := range []string{"role", "content"} {
				val, found, _ := d.Get(starlark.String(k))
				s, ok := val.(starlark.String)
				if !found || !ok {
					return nil, fmt.Errorf("%s: prompt[%d] needs a string %q", fn, i, k)
				}
				if k == "role" {
					m.Role = string(s)
				} else {
					m.Content = string(s)
				}
			}
			out = append(out, m)
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("%s: prompt is an empty message list", fn)
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s: prompt is a %s; pass a string or a list of {\"role\", \"content\"} dicts", fn, v.Type())
}

func optInt(fn, name string, v starlark.Value, def, lo, hi int) (int, error) {
	if v == starlark.None {
		return def, nil
	}
	var x int
	if err := starlark.AsInt(v, &x); err != nil {
		return 0, fmt.Errorf("%s: %s must be an int, got %s", fn, name, v.Type())
	}
	if x < lo || x > hi {
		return 0, fmt.Errorf("%s: %s=%d is out of range [%d, %d]", fn, name, x, lo, hi)
	}
	return x, nil
}

func optFloat(fn, name string, v starlark.Value, def, lo, hi float64) (float64, error) {
	if v == starlark.None {
		return def, nil
	}
	x, ok := starlark.AsFloat(v)
	if !ok {
		return 0, fmt.Errorf("%s: %s must be a number, got %s", fn, name, v.Type())
	}
	if math.IsNaN(x) || x < lo || x > hi {
		return 0, fmt.Errorf("%s: %s=%v is out of range [%v, %v]", fn, name, x, lo, hi)
	}
	return x, nil
}

func toStrings(fn, name string, v starlark.Value) ([]string, error) {
	if s, ok := v.(starlark.String); ok {
		return []string{string(s)}, nil
	}
	it, ok := v.(starlark.Iterable)
	if !ok {
		return nil, fmt.Errorf("%s: %s must be a string or a list of strings, got %s", fn, name, v.Type())
	}
	var out []string
	iter := it.Iterate()
	defer iter.Done()
	var x starlark.Value
	for iter.Next(&x) {
		s, ok := x.(starlark.String)
		if !ok {
			return nil, fmt.Errorf("%s: %s must hold strings, got %s", fn, name, x.Type())
		}
		out = append(out, string(s))
	}
	return out, nil
}

// completions flattens a reward/train target: a completion or a list/tuple of them.
func completions(fn string, v starlark.Value) ([]*Completion, error) {
	if c, ok := v.(*Completion); ok {
		return []*Completion{c}, nil
	}
	if ch, ok := v.(*Chat); ok {
		c, err := ch.conversation(fn)
		if err != nil {
			return nil, err
		}
		return []*Completion{c}, nil
	}
	it, ok := v.(starlark.Iterable)
	if !ok {
		return nil, fmt.Errorf("%s: target is a %s; pass a completion, a chat or a list of them", fn, v.Type())
	}
	var out []*Completion
	iter := it.Iterate()
	defer iter.Done()
	var x starlark.Value
	for iter.Next(&x) {
		if ch, ok := x.(*Chat); ok {
			c, err := ch.conversation(fn)
			if err != nil {
				return nil, err
			}
			out = append(out, c)
			continue
		}
		c, ok := x.(*Completion)
		if !ok {
			return nil, fmt.Errorf("%s: target holds a %s; pass completions returned by generate, or chats", fn, x.Type())
		}
		out = append(out, c)
	}
	return out, nil
}
