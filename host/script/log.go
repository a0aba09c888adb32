package script

import (
	"fmt"
	"math"

	"go.starlark.net/starlark"
)

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
