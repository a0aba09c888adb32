package script

import (
	"fmt"
	"math"
	"strconv"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

func builtinGenerate(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
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
	if err := ro.mayGenerate(b.Name(), policy); err != nil {
		return nil, err
	}
	s, key, err := samplingArgs(b.Name(), ts, maxTokens, temperature, topP, stop, seed)
	if err != nil {
		return nil, err
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

// mayGenerate checks that a rollout may sample policy (the sandbox's grants) and that the run
// has it, for generate and chat.
func (ro *Rollout) mayGenerate(fn, policy string) error {
	if err := ro.Budget.allowed(fn, policy, false); err != nil {
		return err
	}
	if _, _, err := ro.Host.CheckPolicy(policy); err != nil {
		return fmt.Errorf("%s: %v", fn, err)
	}
	return nil
}

// samplingArgs reads the sampling arguments of a generate call (or a chat turn) over the run's
// defaults, and takes the call's position in the call tree, from which its seed derives.
func samplingArgs(fn string, ts *threadState, maxTokens, temperature, topP, stop, seed starlark.Value) (engines.Sampling, []int, error) {
	ro := ts.ro
	var err error
	s := ro.Host.Sampling()
	if ro.Eval != nil {
		s = *ro.Eval
	}
	if s.MaxTokens, err = optInt(fn, "max_tokens", maxTokens, s.MaxTokens, 1, math.MaxInt32); err != nil {
		return s, nil, err
	}
	if s.Temperature, err = optFloat(fn, "temperature", temperature, s.Temperature, 0, 100); err != nil {
		return s, nil, err
	}
	if s.TopP, err = optFloat(fn, "top_p", topP, s.TopP, 1e-9, 1); err != nil {
		return s, nil, err
	}
	if stop != starlark.None {
		if s.Stop, err = toStrings(fn, "stop", stop); err != nil {
			return s, nil, err
		}
	}
	key := ts.next()
	s.Seed = KeySeed(ro.Seed, ro.Task.ID, key)
	if seed != starlark.None {
		v, err := optInt(fn, "seed", seed, 0, 0, math.MaxInt64)
		if err != nil {
			return s, nil, err
		}
		s.Seed = uint64(v)
	}
	return s, key, nil
}

// newCompletions wraps an engine's answer to one request. A sandbox host builds the same
// completions (same ids and keys) as its child, so rewards and train requests can name them.
func newCompletions(policy string, req engines.GenerateRequest, key []int, outs []engines.Completion) []*Completion {
	cs := make([]*Completion, len(outs))
	for i, o := range outs {
		cs[i] = &Completion{
			id: req.ID + "#" + strconv.Itoa(i), policy: policy, messages: req.Messages,
			prompt: o.PromptTokens, tokens: o.Tokens, logprobs: o.Logprobs, text: o.Text,
			finish: o.FinishReason, key: append(append([]int(nil), key...), i), versions: o.Versions,
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
