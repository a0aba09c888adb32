package host

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sort"
	"strings"
	"sync"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/tasks"
)

// Task is one unit of work handed to rollout(task).
type Task = tasks.Task

// rollout is one call of the script's rollout(task): its threads, the samples it queued for
// training and the metrics it logged. Nothing it queued reaches a buffer unless it succeeds.
type rollout struct {
	run    *Run     // nil in a sandbox child
	svc    services // the host, in-process or over the sandbox pipe
	budget *budget  // the sandbox's per-rollout limits; nil: none
	ctx    context.Context
	task   Task
	index  int // position of the task in its step: the first sort key of its samples
	step   int
	seed   uint64
	group  string            // the group of its train() calls that name none (defaultGroup)
	eval   *engines.Sampling // eval rollouts sample with these settings and do not train

	result      starlark.Value             // what the rollout function returned
	stateCommit func(starlark.Value) error // sandbox host: the pending state.update of this rollout

	mu        sync.Mutex
	queued    []queued
	generated []*Completion
	logs      map[string][2]float64 // name → (sum, count)
	prints    int
	err       error
}

// queued is one train() request.
type queued struct {
	c         *Completion
	group     string
	advantage []float64 // len 1 (sequence) or len(tokens) (perToken)
	hasAdv    bool
	perToken  bool
	teacher   string
}

func (ro *rollout) queue(q queued) {
	ro.mu.Lock()
	ro.queued = append(ro.queued, q)
	ro.mu.Unlock()
}

func (ro *rollout) noteCompletion(c *Completion) {
	ro.mu.Lock()
	ro.generated = append(ro.generated, c)
	ro.mu.Unlock()
}

func (ro *rollout) log(vals map[string]float64) {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	if ro.logs == nil {
		ro.logs = map[string][2]float64{}
	}
	for k, v := range vals {
		a := ro.logs[k]
		ro.logs[k] = [2]float64{a[0] + v, a[1] + 1}
	}
}

// maxPrintsPerRollout rate-limits print: a chatty script cannot flood the run log.
const maxPrintsPerRollout = 20

func (ro *rollout) print(th *starlark.Thread, msg string) {
	ro.mu.Lock()
	ro.prints++
	n := ro.prints
	ro.mu.Unlock()
	if err := ro.budget.print(len(msg)); err != nil {
		th.Cancel(err.Error())
		return
	}
	switch {
	case n <= maxPrintsPerRollout:
		ro.svc.event(fmt.Sprintf("step %d task %s: %s", ro.step, ro.task.ID, msg))
	case n == maxPrintsPerRollout+1:
		ro.svc.event(fmt.Sprintf("step %d task %s: more print output dropped (limit %d lines a rollout)", ro.step, ro.task.ID, maxPrintsPerRollout))
	}
}

// newThread makes a Starlark thread of this rollout at the given call-tree position.
func (ro *rollout) newThread(path []int) *starlark.Thread {
	th := &starlark.Thread{Name: ro.task.ID, Print: ro.print, Load: noLoad}
	th.SetLocal(threadLocal, &threadState{ro: ro, path: path})
	ro.budget.limitThread(th)
	setThreadRandom(th, keySeed(ro.seed^0x5EED, ro.task.ID, path))
	return th
}

func noLoad(_ *starlark.Thread, module string) (starlark.StringDict, error) {
	return nil, fmt.Errorf("load %q: load statements run when the script is loaded, not inside rollout", module)
}

// call runs fn on th, turning a cancelled context into a cancelled thread and a Go panic inside a
// built-in into an error of this rollout alone.
func (ro *rollout) call(th *starlark.Thread, fn starlark.Callable, args starlark.Tuple) (v starlark.Value, err error) {
	stop := context.AfterFunc(ro.ctx, func() {
		var be *BudgetError
		if cause := context.Cause(ro.ctx); errors.As(cause, &be) {
			th.Cancel(be.Error())
			return
		}
		th.Cancel("the run was stopped")
	})
	defer stop()
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("internal error (panic) in task %s: %v\n%s", ro.task.ID, p, debug.Stack())
		}
	}()
	v, err = starlark.Call(th, fn, args, nil)
	// A sandboxed rollout's steps are counted over all its threads: this one's last steps too.
	if berr := ro.budget.threadDone(th); berr != nil && err == nil {
		v, err = nil, berr
	}
	return v, err
}

// taskValue is the frozen `task` struct a rollout receives.
func taskValue(t Task, step int) starlark.Value {
	var prompt starlark.Value
	switch p := t.Prompt.(type) {
	case string:
		prompt = starlark.String(p)
	case []engines.Message:
		l := make([]starlark.Value, len(p))
		for i, m := range p {
			d := starlark.NewDict(2)
			d.SetKey(starlark.String("role"), starlark.String(m.Role))
			d.SetKey(starlark.String("content"), starlark.String(m.Content))
			l[i] = d
		}
		prompt = starlark.NewList(l)
	default:
		prompt = starlark.String(fmt.Sprint(p))
	}
	var label starlark.Value = starlark.None
	if t.HasLabel {
		label = starlark.String(t.Label)
	}
	v := starlarkstruct.FromStringDict(starlarkstruct.Default, starlark.StringDict{
		"id":       starlark.String(t.ID),
		"prompt":   prompt,
		"label":    label,
		"metadata": toStarlark(t.Metadata),
		"step":     starlark.MakeInt(step),
	})
	v.Freeze()
	return v
}

// toStarlark converts decoded JSON values into Starlark values.
func toStarlark(v any) starlark.Value {
	switch v := v.(type) {
	case nil:
		return starlark.None
	case bool:
		return starlark.Bool(v)
	case float64:
		if v == float64(int64(v)) && v > -1e15 && v < 1e15 {
			return starlark.MakeInt64(int64(v))
		}
		return starlark.Float(v)
	case int:
		return starlark.MakeInt(v)
	case int64:
		return starlark.MakeInt64(v)
	case uint64:
		return starlark.MakeUint64(v)
	case string:
		return starlark.String(v)
	case []any:
		l := make([]starlark.Value, len(v))
		for i, x := range v {
			l[i] = toStarlark(x)
		}
		return starlark.NewList(l)
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		d := starlark.NewDict(len(v))
		for _, k := range keys {
			d.SetKey(starlark.String(k), toStarlark(v[k]))
		}
		return d
	}
	return starlark.String(fmt.Sprint(v))
}

// RolloutError is a failed rollout: its task and the Starlark backtrace.
type RolloutError struct {
	Step   int
	TaskID string
	Msg    string
}

func (e *RolloutError) Error() string {
	return fmt.Sprintf("step %d task %s: rollout failed:\n%s", e.Step, e.TaskID, indent(e.Msg))
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ")
}
