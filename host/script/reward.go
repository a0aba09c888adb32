package script

import (
	"fmt"
	"math"

	"go.starlark.net/starlark"
)

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
	if err := CheckReward(b.Name(), r); err != nil {
		return nil, err
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

// MaxTrainMagnitude bounds the magnitude of a reward or an advantage, in and out of the sandbox.
// A finite value far past it (1e300) passes a finite check, yet its square, its group's standard
// deviation or the loss it scales is Inf or NaN, and a NaN loss skips the optimizer step of every
// sample trained with it: one rollout would discard the step's honest samples. No reward scale
// in use comes near it.
const MaxTrainMagnitude = 1e6

// CheckReward is reward()'s rule for a value, which the host also applies to what a sandboxed
// rollout's child reports: a finite number of magnitude at most MaxTrainMagnitude.
func CheckReward(fn string, r float64) error {
	if math.IsNaN(r) || math.IsInf(r, 0) {
		return fmt.Errorf("%s: value is %v; rewards must be finite numbers (check the reward computation for a division by zero)", fn, r)
	}
	if math.Abs(r) > MaxTrainMagnitude {
		return fmt.Errorf("%s: value is %v; rewards are at most %g in magnitude (one out of scale would make the step's loss "+
			"NaN and skip every sample trained with it): scale the reward", fn, r, MaxTrainMagnitude)
	}
	return nil
}

// CheckAdvantage is train()'s rule for an advantage (each per-token one): finite, of magnitude
// at most MaxTrainMagnitude. The host applies it to a sandboxed rollout's report too.
func CheckAdvantage(fn string, x float64) error {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return fmt.Errorf("%s: advantage is %v; it must be finite", fn, x)
	}
	if math.Abs(x) > MaxTrainMagnitude {
		return fmt.Errorf("%s: advantage is %v; advantages are at most %g in magnitude (one out of scale would make the step's "+
			"loss NaN and skip every sample trained with it)", fn, x, MaxTrainMagnitude)
	}
	return nil
}
