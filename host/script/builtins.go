package script

import (
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
	"strings"
	"sync"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// The built-ins of DESIGN §2. Each one converts its Starlark arguments and calls plain Go on the
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

// next returns the position of this thread's next call.
func (ts *threadState) next() []int {
	k := append(append([]int(nil), ts.path...), ts.calls)
	ts.calls++
	return k
}

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
func WithRequestIDs(ctx context.Context, run string, pass, index int) context.Context {
	return context.WithValue(ctx, requestIDs{}, fmt.Sprintf("%s/%d/%d/", run, pass, index))
}

// wireID turns a request's id within its rollout into the id its engine sees. Outside a run's
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
func Occurrence(seen map[string]int, id string) int {
	k := seen[id]
	seen[id] = k + 1
	return k
}

// defaultGroup is the group of train() calls that name none: the task id, as in slime, where a
// group is the n samples of one prompt of the batch. A task that runs again in the same step is
// another prompt of the batch, so its rollout is a group of its own ("ID#2", "ID#3", …): its
// samples are not normalised against those of the first.
func DefaultGroup(id string, occurrence int) string {
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

func builtinGenerate(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var policy string
	var prompt starlark.Value
	n := 1
	var maxTokens, temperature, topP, stop, seed starlark.Value = starlark.None, starlark.None, starlark.None, starlark.None, starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "policy", &policy, "prompt", &prompt, "n?", &n,
		"max_tokens?", &maxTokens, "temperature?", &temperature, "top_p?", &topP, "stop?", &stop, "seed?", &seed); err != nil {
		return nil, err
	}
	if n < 1 || n > maxSamplesPerCall {
		return nil, fmt.Errorf("%s: n=%d is out of range; ask for 1 to %d samples", b.Name(), n, maxSamplesPerCall)
	}
	msgs, err := ToMessages(b.Name(), prompt)
	if err != nil {
		return nil, err
	}
	ro := ts.ro
	if err := ro.Budget.allowed(b.Name(), policy, false); err != nil {
		return nil, err
	}
	if _, _, err := ro.Host.CheckPolicy(policy); err != nil {
		return nil, fmt.Errorf("%s: %v", b.Name(), err)
	}
	s := ro.Host.Sampling()
	if ro.Eval != nil {
		s = *ro.Eval
	}
	if s.MaxTokens, err = optInt(b.Name(), "max_tokens", maxTokens, s.MaxTokens, 1, math.MaxInt32); err != nil {
		return nil, err
	}
	if s.Temperature, err = optFloat(b.Name(), "temperature", temperature, s.Temperature, 0, 100); err != nil {
		return nil, err
	}
	if s.TopP, err = optFloat(b.Name(), "top_p", topP, s.TopP, 1e-9, 1); err != nil {
		return nil, err
	}
	if stop != starlark.None {
		if s.Stop, err = toStrings(b.Name(), "stop", stop); err != nil {
			return nil, err
		}
	}
	key := ts.next()
	s.Seed = KeySeed(ro.Seed, ro.Task.ID, key)
	if seed != starlark.None {
		v, err := optInt(b.Name(), "seed", seed, 0, 0, math.MaxInt64)
		if err != nil {
			return nil, err
		}
		s.Seed = uint64(v)
	}
	req := engines.GenerateRequest{ID: ro.Task.ID + "/" + keyString(key), Messages: msgs, N: n, Sampling: s}
	if err := ro.Budget.generate(b.Name(), n, s.MaxTokens); err != nil {
		return nil, err
	}
	outs, err := ro.Host.Generate(ro.Ctx, policy, req)
	used := 0
	for _, o := range outs {
		used += len(o.Tokens)
	}
	ro.Budget.settle(n*s.MaxTokens, used)
	if err != nil {
		return nil, fmt.Errorf("%s: policy %q: %v", b.Name(), policy, err)
	}
	res := make([]starlark.Value, len(outs))
	for i, c := range newCompletions(policy, req, key, outs) {
		ro.noteCompletion(c)
		ro.Host.Generated(len(c.tokens))
		res[i] = c
	}
	if n == 1 && len(res) == 1 {
		return res[0], nil
	}
	return starlark.NewList(res), nil
}

// newCompletions wraps an engine's answer to one request. A sandbox host builds the same
// completions (same ids and keys) as its child, so rewards and train requests can name them.
func newCompletions(policy string, req engines.GenerateRequest, key []int, outs []engines.Completion) []*Completion {
	cs := make([]*Completion, len(outs))
	for i, o := range outs {
		cs[i] = &Completion{
			id: req.ID + "#" + strconv.Itoa(i), policy: policy, messages: req.Messages,
			prompt: o.PromptTokens, tokens: o.Tokens, logprobs: o.Logprobs, text: o.Text,
			finish: o.FinishReason, key: append(append([]int(nil), key...), i),
		}
	}
	return cs
}

// CompletionsOf makes the completions of an engine's answer to a generate request of a rollout
// as the rollout's generate call makes them (same ids, same order): the host of a sandboxed
// rollout keeps its own copy of what the child sees, so the child's report can name them.
func CompletionsOf(policy string, req engines.GenerateRequest, outs []engines.Completion) []*Completion {
	return newCompletions(policy, req, keyFromRequestID(req.ID), outs)
}

// maxSamplesPerCall bounds n: a typo like n=10**6 is an error, not an out-of-memory.
const maxSamplesPerCall = 4096

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
	it, ok := v.(starlark.Iterable)
	if !ok {
		return nil, fmt.Errorf("%s: target is a %s; pass a completion or a list of completions", fn, v.Type())
	}
	var out []*Completion
	iter := it.Iterate()
	defer iter.Done()
	var x starlark.Value
	for iter.Next(&x) {
		c, ok := x.(*Completion)
		if !ok {
			return nil, fmt.Errorf("%s: target holds a %s; pass completions returned by generate", fn, x.Type())
		}
		out = append(out, c)
	}
	return out, nil
}

func builtinCompletion(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var policy, text string
	finish := "stop"
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "policy", &policy, "text", &text, "finish_reason?", &finish); err != nil {
		return nil, err
	}
	id := "injected"
	var key []int
	if ts, _ := thread.Local(threadLocal).(*threadState); ts != nil {
		key = ts.next()
		id = ts.ro.Task.ID + "/" + keyString(key) + "#injected"
	}
	return &Completion{id: id, policy: policy, text: text, finish: finish, injected: true, key: key}, nil
}

func builtinReward(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var target, value starlark.Value
	replace := false
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "target", &target, "value", &value, "replace?", &replace); err != nil {
		return nil, err
	}
	cs, err := completions(b.Name(), target)
	if err != nil {
		return nil, err
	}
	r, ok := starlark.AsFloat(value)
	if _, isBool := value.(starlark.Bool); !ok || isBool {
		return nil, fmt.Errorf("%s: value must be an int or float, got %s", b.Name(), value.Type())
	}
	if math.IsNaN(r) || math.IsInf(r, 0) {
		return nil, fmt.Errorf("%s: value is %v; rewards must be finite numbers (check the reward computation for a division by zero)", b.Name(), r)
	}
	for _, c := range cs {
		c.mu.Lock()
		if c.rewSet && !replace {
			c.mu.Unlock()
			return nil, fmt.Errorf("%s: completion %s already has reward %v; pass replace=True to change it", b.Name(), c.id, c.reward)
		}
		c.reward, c.rewSet = r, true
		c.mu.Unlock()
	}
	return starlark.None, nil
}

func builtinTrain(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var target starlark.Value
	var advantage, group, teacher starlark.Value = starlark.None, starlark.None, starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "target", &target, "advantage?", &advantage, "group?", &group, "teacher?", &teacher); err != nil {
		return nil, err
	}
	cs, err := completions(b.Name(), target)
	if err != nil {
		return nil, err
	}
	ro := ts.ro
	if ro.Eval != nil {
		return nil, fmt.Errorf("%s: eval rollouts do not train; return metrics from eval_rollout instead", b.Name())
	}
	// The default group ("") is resolved when the step's samples are gathered: it is the task id,
	// unless the task runs more than once in the step (see defaultGroup).
	var q Queued
	switch g := group.(type) {
	case starlark.NoneType:
	case starlark.String:
		if g == "" {
			return nil, fmt.Errorf("%s: group is an empty string; leave it out for the default group (the task's rollout), or name one", b.Name())
		}
		q.Group = string(g)
	case starlark.Int:
		q.Group = g.String()
	default:
		return nil, fmt.Errorf("%s: group must be a string or int, got %s", b.Name(), group.Type())
	}
	if teacher != starlark.None {
		name, ok := teacher.(starlark.String)
		if !ok {
			return nil, fmt.Errorf("%s: teacher must be a policy name, got %s", b.Name(), teacher.Type())
		}
		if _, _, err := ro.Host.CheckPolicy(string(name)); err != nil {
			return nil, fmt.Errorf("%s: teacher: %v", b.Name(), err)
		}
		q.Teacher = string(name)
	}
	if advantage != starlark.None {
		if x, ok := starlark.AsFloat(advantage); ok {
			if math.IsNaN(x) || math.IsInf(x, 0) {
				return nil, fmt.Errorf("%s: advantage is %v; it must be finite", b.Name(), x)
			}
			q.Advantage, q.HasAdv = []float64{x}, true
		} else if it, ok := advantage.(starlark.Iterable); ok {
			iter := it.Iterate()
			var v starlark.Value
			for iter.Next(&v) {
				x, ok := starlark.AsFloat(v)
				if !ok || math.IsNaN(x) || math.IsInf(x, 0) {
					iter.Done()
					return nil, fmt.Errorf("%s: advantage holds %s; per-token advantages must be finite numbers", b.Name(), v)
				}
				q.Advantage = append(q.Advantage, x)
			}
			iter.Done()
			q.HasAdv, q.PerToken = true, true
		} else {
			return nil, fmt.Errorf("%s: advantage must be a number or a list of per-token numbers, got %s", b.Name(), advantage.Type())
		}
	}
	for _, c := range cs {
		if err := ro.Budget.allowed(b.Name(), c.policy, true); err != nil {
			return nil, err
		}
		trainable, place, err := ro.Host.CheckPolicy(c.policy)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", b.Name(), err)
		}
		if !trainable {
			return nil, fmt.Errorf("%s: policy %q is frozen (trainable: false%s); do not pass its completions to train, or make it trainable", b.Name(), c.policy, place)
		}
		if c.injected {
			return nil, fmt.Errorf("%s: completion %s was made by completion(), not sampled; only generated completions can be trained", b.Name(), c.id)
		}
		if q.PerToken && len(q.Advantage) != len(c.tokens) {
			return nil, fmt.Errorf("%s: advantage has %d values but completion %s has %d tokens", b.Name(), len(q.Advantage), c.id, len(c.tokens))
		}
		c.mu.Lock()
		switch {
		case c.trained:
			c.mu.Unlock()
			return nil, fmt.Errorf("%s: completion %s is already queued for training", b.Name(), c.id)
		case !c.rewSet && !q.HasAdv:
			c.mu.Unlock()
			return nil, fmt.Errorf("%s: completion %s of policy %q has no reward; call reward(c, value) before train(c), or pass advantage=", b.Name(), c.id, c.policy)
		}
		c.trained = true
		c.mu.Unlock()
		qc := q
		qc.C = c
		ro.queue(qc)
	}
	return starlark.None, nil
}

// builtinParallel runs fn(item) for every item, each on its own thread, and returns the results in
// order. The first failing item (in item order) fails the call with its own backtrace. fn (with
// the values it captures) and the items are frozen first.
func builtinParallel(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var fn starlark.Callable
	var items starlark.Iterable
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "fn", &fn, "items", &items); err != nil {
		return nil, err
	}
	// Threads share fn's captured values and the items: freezing them makes the sharing safe
	// (a frozen value cannot change under another thread).
	fn.Freeze()
	var xs []starlark.Value
	iter := items.Iterate()
	var x starlark.Value
	for iter.Next(&x) {
		if err := ts.ro.Budget.parallel(b.Name(), len(xs)+1); err != nil {
			iter.Done()
			return nil, err
		}
		if len(xs) >= maxParallelItems {
			iter.Done()
			return nil, fmt.Errorf("%s: more than %d items; split the work", b.Name(), maxParallelItems)
		}
		x.Freeze()
		xs = append(xs, x)
	}
	iter.Done()
	base := ts.next()
	ro := ts.ro
	results := make([]starlark.Value, len(xs))
	errs := make([]error, len(xs))
	sem := make(chan struct{}, parallelWidth)
	var wg sync.WaitGroup
	ro.Host.Running(len(xs) - 1) // children count as running before the parent stops running
	for i := range xs {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			defer ro.Host.Running(-1)
			child := ro.NewThread(append(append([]int(nil), base...), i))
			results[i], errs[i] = ro.Call(child, fn, starlark.Tuple{xs[i]})
		}(i)
	}
	wg.Wait()
	ro.Host.Running(1)
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("%s: item %d: %s", b.Name(), i, ErrorText(err))
		}
	}
	return starlark.NewList(results), nil
}

const (
	maxParallelItems = 100_000
	parallelWidth    = 4096 // items running at once; more wait their turn
)

func builtinScore(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var policy string
	var prompt starlark.Value
	var c *Completion
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "policy", &policy, "prompt", &prompt, "completion", &c); err != nil {
		return nil, err
	}
	msgs, err := ToMessages(b.Name(), prompt)
	if err != nil {
		return nil, err
	}
	if c.injected {
		return nil, fmt.Errorf("%s: completion %s was made by completion() and has no tokens to score", b.Name(), c.id)
	}
	if err := ts.ro.Budget.allowed(b.Name(), policy, false); err != nil {
		return nil, err
	}
	lp, err := ts.ro.Host.Score(ts.ro.Ctx, policy, engines.ScoreRequest{Messages: msgs, Tokens: c.tokens})
	if err != nil {
		return nil, fmt.Errorf("%s: policy %q: %v", b.Name(), policy, err)
	}
	out := make([]starlark.Value, len(lp))
	for i, v := range lp {
		out[i] = starlark.Float(v)
	}
	return starlark.NewList(out), nil
}

// reservedMetric are names log() may not use: every metrics record has them.
var reservedMetric = map[string]bool{"step": true, "policy": true}

func builtinLog(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	if len(args) > 0 {
		return nil, fmt.Errorf("%s: pass metrics by name, e.g. log(accuracy=1.0)", b.Name())
	}
	vals := map[string]float64{}
	for _, kv := range kwargs {
		name := string(kv[0].(starlark.String))
		x, ok := starlark.AsFloat(kv[1])
		if _, isBool := kv[1].(starlark.Bool); isBool {
			x, ok = 0, true
			if kv[1].Truth() {
				x = 1
			}
		}
		if !ok || math.IsNaN(x) || math.IsInf(x, 0) {
			return nil, fmt.Errorf("%s: %s=%s; metrics must be finite numbers", b.Name(), name, kv[1])
		}
		if reservedMetric[name] {
			return nil, fmt.Errorf("%s: %q is a metric the host writes itself; choose another name", b.Name(), name)
		}
		vals[name] = x
	}
	ts.ro.log(vals)
	return starlark.None, nil
}
