package script

import (
	"fmt"
	"math"
	"slices"
	"sort"

	"go.starlark.net/starlark"
)

// Limits of log(), in and out of the sandbox: every name a script logs becomes a field of the
// step's `_run` metrics line and a curve of the plots, so a script that logs thousands of names
// (one per task, say) would make the host hold, write and plot them all (60,000 names took a host
// to 1 GB and a 47 MB plot).
const (
	// MaxLogNamesPerRollout bounds the distinct names one rollout logs, over all its log() calls.
	MaxLogNamesPerRollout = 64
	// MaxLogNamesPerRun bounds the distinct names the run writes to its _run lines: names past it
	// are dropped from the metrics, with an event naming them (host/run.go).
	MaxLogNamesPerRun = 1024
	// MaxLogNameLen bounds the bytes of one metric name.
	MaxLogNameLen = 64
)

// RunFields are the fields the host itself writes on a step's `_run` metrics line (host/run.go
// runMetrics, host/async.go): log() may not use them, and the host drops them from what a
// rollout reports, so a script cannot overwrite the host's own count of failed rollouts, say.
var RunFields = []string{"step", "policy", "rollouts", "failed", "tokens", "rollout_s", "train_s", "step_s", "tokens_per_s", "rollout_wall_s"}

// CheckLogName is the rule a metric name must meet (also applied by the host to what a sandboxed
// rollout's child reports): not a field the host writes, at most MaxLogNameLen bytes.
func CheckLogName(fn, name string) error {
	if slices.Contains(RunFields, name) {
		return fmt.Errorf("%s: %q is a field the host writes on the _run metrics line itself (%v); choose another name", fn, name, RunFields)
	}
	if len(name) > MaxLogNameLen {
		return fmt.Errorf("%s: metric name %.24q… is %d bytes; names are at most %d", fn, name, len(name), MaxLogNameLen)
	}
	if name == "" {
		return fmt.Errorf("%s: a metric needs a name", fn)
	}
	return nil
}

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
		if err := CheckLogName(b.Name(), name); err != nil {
			return nil, err
		}
		if !ok || math.IsNaN(x) || math.IsInf(x, 0) {
			return nil, fmt.Errorf("%s: %s=%s; metrics must be finite numbers", b.Name(), name, kv[1])
		}
		vals[name] = x
	}
	if err := ts.ro.logNames(b.Name(), vals); err != nil {
		return nil, err
	}
	return starlark.None, nil
}

// logNames adds a log() call's values to the rollout's metrics, unless they would make it log more
// than MaxLogNamesPerRollout distinct names.
func (ro *Rollout) logNames(fn string, vals map[string]float64) error {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	var added []string
	for k := range vals {
		if _, seen := ro.logs[k]; !seen {
			added = append(added, k)
		}
	}
	if len(ro.logs)+len(added) > MaxLogNamesPerRollout {
		sort.Strings(added)
		return fmt.Errorf("%s: a rollout logs at most %d metric names, and this call would add %d (%q, …) to the %d it has; "+
			"log a few aggregates (a mean, a count), not a name per item",
			fn, MaxLogNamesPerRollout, len(added), added[0], len(ro.logs))
	}
	if ro.logs == nil {
		ro.logs = map[string][2]float64{}
	}
	for k, v := range vals {
		a := ro.logs[k]
		ro.logs[k] = [2]float64{a[0] + v, a[1] + 1}
	}
	return nil
}
