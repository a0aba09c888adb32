package script

import (
	"context"
	"fmt"
	"runtime/debug"
	"sort"
	"sync"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/tasks"
)

// Task is one unit of work handed to rollout(task).
type Task = tasks.Task

// Rollout is one call of the script's rollout(task): its threads, the samples it queued for
// training and the metrics it logged. Nothing it queued reaches a buffer unless it succeeds. The
// run fills in the fields above Result, runs the call (NewThread, Call) and then reads the rest.
type Rollout struct {
	Host   Host    // the run, in-process or over the sandbox pipe
	Budget *Budget // the sandbox's per-rollout limits; nil: none
	Ctx    context.Context
	Task   Task
	Index  int // position of the task in its step: the first sort key of its samples
	Step   int
	Seed   uint64
	Group  string            // the group of its train() calls that name none (defaultGroup)
	Eval   *engines.Sampling // eval rollouts sample with these settings and do not train
	Agents *AgentEndpoint    // the run's endpoint of agent() programs; nil: one per agent() call

	Result starlark.Value // what the rollout function returned
	Err    error          // why it failed; nil: it succeeded

	slotsOnce sync.Once
	slots     chan struct{} // the rollout's threads running besides its first (Budget.threads)

	mu        sync.Mutex
	queued    []Queued
	generated []*Completion
	logs      map[string][2]float64 // name → (sum, count)
	prints    int
}

// Pass is one pass of rollouts over tasks: a step, or one eval dataset's run.
type Pass struct {
	Host   Host
	Ctx    context.Context
	RunID  string            // the host process's run id: part of every wire id
	Number int               // counts the passes of the process: part of every wire id
	Step   int               // the step the pass belongs to
	Seed   uint64            // the run's seed
	Eval   *engines.Sampling // an eval pass: its sampling settings; nil: a training step
	// Samples is how many times each task runs (n_samples_per_prompt); 0 is 1. The runs of one
	// task share its default group, so GRPO normalises each policy's samples of the task
	// against each other, as slime does with the n samples of a prompt.
	Samples int
	// Agents is the run's endpoint of agent() programs, which the pass's rollouts share.
	Agents *AgentEndpoint
}

// Rollouts makes the rollouts of the pass, one per task in order. Each rollout's seeds derive
// from (run seed, step, task id, occurrence) and its requests' wire ids from (run id, pass,
// index): a task that runs again in the same pass (a data file smaller than the batch) is another
// rollout, not a copy of the first, with seeds and a default group of its own.
func (p Pass) Rollouts(tasks []Task) []*Rollout {
	n := max(p.Samples, 1)
	ros := make([]*Rollout, 0, len(tasks)*n)
	seen := map[string]int{}
	for _, t := range tasks {
		k := occurrence(seen, t.ID)
		for j := range n {
			key := []int{p.Step}
			if k > 0 || n > 1 {
				key = append(key, k)
			}
			if n > 1 {
				key = append(key, j)
			}
			i := len(ros)
			ros = append(ros, &Rollout{Host: p.Host, Ctx: withRequestIDs(p.Ctx, p.RunID, p.Number, i), Task: t, Index: i, Step: p.Step,
				Eval: p.Eval, Seed: KeySeed(p.Seed, t.ID, key), Group: defaultGroup(t.ID, k), Agents: p.Agents})
		}
	}
	return ros
}

// Queued is one train() request.
type Queued struct {
	C         *Completion
	Group     string    // "": the rollout's default group
	Advantage []float64 // len 1 (sequence) or len(tokens) (PerToken)
	HasAdv    bool
	PerToken  bool
	Teacher   string
}

// Queued returns the train() requests of the rollout, in the order they were made.
func (ro *Rollout) Queued() []Queued {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	return ro.queued
}

// Generated returns the completions the rollout's generate calls returned.
func (ro *Rollout) Generated() []*Completion {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	return ro.generated
}

// Logs returns what the rollout's log() calls recorded: name → (sum, count).
func (ro *Rollout) Logs() map[string][2]float64 {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	return ro.logs
}

// CheckQueued verifies, once the rollout is done, that every queued sample can be trained.
func (ro *Rollout) CheckQueued() error {
	for _, q := range ro.Queued() {
		if _, ok := q.C.Reward(); !ok && !q.HasAdv {
			return fmt.Errorf("train: completion %s has no reward", q.C.id)
		}
	}
	return nil
}

// Reset forgets what the rollout did: a sandboxed rollout whose child died runs again.
func (ro *Rollout) Reset() {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	ro.queued, ro.generated, ro.logs, ro.Result, ro.prints = nil, nil, nil, nil, 0
}

// Note records a completion the rollout's generate calls returned in another process (a sandbox
// child), as the host's copy of the rollout sees it.
func (ro *Rollout) Note(c *Completion) { ro.noteCompletion(c) }

// Adopt makes the host's copy of a rollout that ran in another process what that rollout
// reported: the rewards its completions got (by completion id), then its train() requests and
// its logs. check vets each request first (the host does not take a child's word for its
// grants); the first error it returns is the rollout's (a failed rollout trains nothing).
func (ro *Rollout) Adopt(rewards map[string]float64, queued []Queued, logs map[string][2]float64, check func(Queued) error) error {
	ro.mu.Lock()
	defer ro.mu.Unlock()
	for _, c := range ro.generated {
		if r, ok := rewards[c.id]; ok {
			c.mu.Lock()
			c.reward, c.rewSet = r, true
			c.mu.Unlock()
		}
	}
	for _, q := range queued {
		if err := check(q); err != nil {
			return err
		}
		if r, ok := rewards[q.C.id]; ok && q.C.Conversation() {
			q.C.mu.Lock()
			q.C.reward, q.C.rewSet = r, true // a conversation's sample is the host's own, made for the report
			q.C.mu.Unlock()
		}
		q.C.mu.Lock()
		q.C.trained = true
		q.C.mu.Unlock()
		ro.queued = append(ro.queued, q)
	}
	ro.logs = logs
	return nil
}

func (ro *Rollout) queue(q Queued) {
	ro.mu.Lock()
	ro.queued = append(ro.queued, q)
	ro.mu.Unlock()
}

func (ro *Rollout) noteCompletion(c *Completion) {
	ro.mu.Lock()
	ro.generated = append(ro.generated, c)
	ro.mu.Unlock()
}

// maxPrintsPerRollout rate-limits print: a chatty script cannot flood the run log.
const maxPrintsPerRollout = 20

func (ro *Rollout) print(th *starlark.Thread, msg string) {
	ro.mu.Lock()
	ro.prints++
	n := ro.prints
	ro.mu.Unlock()
	if err := ro.Budget.print(len(msg)); err != nil {
		th.Cancel(err.Error())
		return
	}
	switch {
	case n <= maxPrintsPerRollout:
		ro.Host.Event(fmt.Sprintf("step %d task %s: %s", ro.Step, ro.Task.ID, msg))
	case n == maxPrintsPerRollout+1:
		ro.Host.Event(fmt.Sprintf("step %d task %s: more print output dropped (limit %d lines a rollout)", ro.Step, ro.Task.ID, maxPrintsPerRollout))
	}
}

// threadSlots is the semaphore of the rollout's threads: parallel takes a slot for each item it
// runs on a thread of its own.
func (ro *Rollout) threadSlots() chan struct{} {
	ro.slotsOnce.Do(func() { ro.slots = make(chan struct{}, max(ro.Budget.threads()-1, 0)) })
	return ro.slots
}

// NewThread makes a Starlark thread of this rollout at the given call-tree position.
func (ro *Rollout) NewThread(path []int) *starlark.Thread {
	th := &starlark.Thread{Name: ro.Task.ID, Print: ro.print, Load: noLoad}
	th.SetLocal(threadLocal, &threadState{ro: ro, path: path})
	ro.Budget.limitThread(th)
	setThreadRandom(th, KeySeed(ro.Seed^0x5EED, ro.Task.ID, path))
	return th
}

func noLoad(_ *starlark.Thread, module string) (starlark.StringDict, error) {
	return nil, fmt.Errorf("load %q: load statements run when the script is loaded, not inside rollout", module)
}

// Call runs fn on th, turning a cancelled context into a cancelled thread and a Go panic inside a
// built-in into an error of this rollout alone.
func (ro *Rollout) Call(th *starlark.Thread, fn starlark.Callable, args starlark.Tuple) (v starlark.Value, err error) {
	stop := context.AfterFunc(ro.Ctx, func() {
		// A cause of its own (a budget, a time limit, a stopping run) is what the rollout reports.
		if cause := context.Cause(ro.Ctx); cause != nil && cause != context.Canceled && cause != context.DeadlineExceeded {
			th.Cancel(cause.Error())
			return
		}
		th.Cancel("the run was stopped")
	})
	defer stop()
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("internal error (panic) in task %s: %v\n%s", ro.Task.ID, p, debug.Stack())
		}
	}()
	v, err = starlark.Call(th, fn, args, nil)
	// A sandboxed rollout's steps are counted over all its threads: this one's last steps too.
	if berr := ro.Budget.threadDone(th); berr != nil && err == nil {
		v, err = nil, berr
	}
	return v, err
}

// TaskValue is the frozen `task` struct a rollout receives.
func TaskValue(t Task, step int) starlark.Value {
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
