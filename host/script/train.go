package script

import (
	"fmt"
	"math"

	"go.starlark.net/starlark"
)

// builtinTrain is train(target, advantage=None, group=None, teacher=None): it queues the target's
// completions on their policies' buffers, with the settings of the call.
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
	q, err := trainRequest(b.Name(), ro.Host, advantage, group, teacher)
	if err != nil {
		return nil, err
	}
	for _, c := range cs {
		if err := ro.trainable(b.Name(), c, q); err != nil {
			return nil, err
		}
		qc := q
		qc.C = c
		ro.queue(qc)
	}
	return starlark.None, nil
}

// trainRequest reads the settings of a train() call: its group, teacher and advantages.
func trainRequest(fn string, host Host, advantage, group, teacher starlark.Value) (Queued, error) {
	// The default group ("") is resolved when the step's samples are gathered: it is the task id,
	// unless the task runs more than once in the step (see defaultGroup).
	var q Queued
	switch g := group.(type) {
	case starlark.NoneType:
	case starlark.String:
		if g == "" {
			return q, fmt.Errorf("%s: group is an empty string; leave it out for the default group (the task's rollout), or name one", fn)
		}
		q.Group = string(g)
	case starlark.Int:
		q.Group = g.String()
	default:
		return q, fmt.Errorf("%s: group must be a string or int, got %s", fn, group.Type())
	}
	if teacher != starlark.None {
		name, ok := teacher.(starlark.String)
		if !ok {
			return q, fmt.Errorf("%s: teacher must be a policy name, got %s", fn, teacher.Type())
		}
		if _, _, err := host.CheckPolicy(string(name)); err != nil {
			return q, fmt.Errorf("%s: teacher: %v", fn, err)
		}
		q.Teacher = string(name)
	}
	var err error
	q.Advantage, q.HasAdv, q.PerToken, err = advantageArg(fn, advantage)
	return q, err
}

// advantageArg reads train()'s advantage=: None, one number for the whole sequence, or a list of
// per-token numbers, every one finite.
func advantageArg(fn string, advantage starlark.Value) (adv []float64, has, perToken bool, err error) {
	if advantage == starlark.None {
		return nil, false, false, nil
	}
	if x, ok := starlark.AsFloat(advantage); ok {
		if err := CheckAdvantage(fn, x); err != nil {
			return nil, false, false, err
		}
		return []float64{x}, true, false, nil
	}
	it, ok := advantage.(starlark.Iterable)
	if !ok {
		return nil, false, false, fmt.Errorf("%s: advantage must be a number or a list of per-token numbers, got %s", fn, advantage.Type())
	}
	iter := it.Iterate()
	defer iter.Done()
	var v starlark.Value
	for iter.Next(&v) {
		x, ok := starlark.AsFloat(v)
		if !ok || math.IsNaN(x) || math.IsInf(x, 0) {
			return nil, false, false, fmt.Errorf("%s: advantage holds %s; per-token advantages must be finite numbers", fn, v)
		}
		if err := CheckAdvantage(fn, x); err != nil {
			return nil, false, false, fmt.Errorf("%s (at token %d)", err, len(adv))
		}
		adv = append(adv, x)
	}
	return adv, true, true, nil
}

// trainable checks that completion c may be queued with the settings of q, and marks it queued.
func (ro *Rollout) trainable(fn string, c *Completion, q Queued) error {
	if err := ro.Budget.allowed(fn, c.policy, true); err != nil {
		return err
	}
	trainable, place, err := ro.Host.CheckPolicy(c.policy)
	if err != nil {
		return fmt.Errorf("%s: %v", fn, err)
	}
	if !trainable {
		return fmt.Errorf("%s: policy %q is frozen (trainable: false%s); do not pass its completions to train, or make it trainable", fn, c.policy, place)
	}
	if c.injected {
		return fmt.Errorf("%s: completion %s was made by completion(), not sampled; only generated completions can be trained", fn, c.id)
	}
	if q.PerToken && len(q.Advantage) != len(c.tokens) {
		return fmt.Errorf("%s: advantage has %d values but completion %s has %d tokens", fn, len(q.Advantage), c.id, len(c.tokens))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.trained:
		return fmt.Errorf("%s: completion %s is already queued for training", fn, c.id)
	case !c.rewSet && !q.HasAdv:
		return fmt.Errorf("%s: completion %s of policy %q has no reward; call reward(c, value) before train(c), or pass advantage=", fn, c.id, c.policy)
	}
	c.trained = true
	return nil
}
