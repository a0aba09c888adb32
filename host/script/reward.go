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
