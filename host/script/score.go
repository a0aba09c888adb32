package script

import (
	"fmt"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

func builtinScore(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
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
	if err := ts.ro.Budget.Prompt(b.Name(), msgs); err != nil {
		return nil, err
	}
	// A score call costs the engine what a generate call of its tokens would: under the sandbox it
	// is a generate call of the budget, and the tokens it scores count against tokens.
	if err := ts.ro.Budget.generate(b.Name(), 1, len(c.tokens)); err != nil {
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
