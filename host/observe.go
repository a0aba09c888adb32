package host

import (
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/slimen/slimen/host/config"
)

// Observer receives what a run records, as it records it: a sink such as TensorBoard's event
// files or a Weights & Biases sidecar (docs/observability.md). Each observer is called from a
// goroutine of its own, in order (Start, then Step and Eval as the run writes them, then Close),
// so a slow one does not hold up the run's steps. The first error an observer returns goes to
// events.log and the run's log, and the run calls it no more, except for Close; the run goes on.
type Observer interface {
	// Start is called once, before the run's first record (the eval before step 1 or step 1; on
	// resume, the first step after the checkpoint).
	Start(RunInfo) error
	// Step is called after each completed step, once its lines are in metrics.jsonl.
	Step(StepRecord) error
	// Eval is called after each eval, once its lines are in metrics.jsonl.
	Eval(EvalRecord) error
	// Close is called once, when the run closes, after every record was handed over (also when
	// the run recorded nothing and Start was never called).
	Close() error
}

// An Ender is an Observer that learns how the run ended: End is called once, before Close, with
// the error Train returned (nil when the run ran its steps, was stopped, or never trained), so a
// tracker can mark a failed run as failed (W&B's exit code).
type Ender interface {
	End(err error)
}

// closeObserver ends (an Ender) and closes o, saying in the run's log when closing fails.
func closeObserver(events *eventLog, o Observer, name string, ended error) {
	if e, ok := o.(Ender); ok {
		e.End(ended)
	}
	if err := o.Close(); err != nil {
		events.printf("observer %s: closing: %v", name, err)
	}
}

// RunInfo is what an Observer learns of the run when it starts.
type RunInfo struct {
	ID      string         // the process's run id (a resumed run has a new one)
	Out     string         // the run folder; "" when the run writes no files
	WorkDir string         // the working directory the run started in (relative paths are from it)
	Config  *config.Config // the resolved config (read-only)
	Step    int            // the steps done before this process: > 0 on resume
	Resumed bool           // the run goes on from a checkpoint (Step > 0)
}

// StepRecord is what a completed step hands to observers.
type StepRecord struct {
	Step int
	// Metrics are the step's lines of metrics.jsonl: each policy's, sorted by name, then "_run".
	Metrics []Metrics
	// Rewards are, per policy, the rewards of the step's samples: the values its reward_mean is
	// the mean of (a conversation counts once, with its conversation's reward).
	Rewards map[string][]float64
	// Advantages are, per trainable policy, one value per trained sample: the mean advantage
	// over its trained tokens (loss mask 1).
	Advantages map[string][]float64
	// Rollouts are the step's rollouts saved to rollouts.jsonl (run.save_rollouts).
	Rollouts []RolloutRecord
}

// EvalRecord is what an eval hands to observers.
type EvalRecord struct {
	Step     int       // the steps done when the eval ran (0: before training)
	Metrics  []Metrics // the "_eval" lines, one per dataset
	Rollouts []RolloutRecord
}

// observerQueue is how many records an observer may fall behind before the run drops records for
// it (and says so once) instead of waiting.
const observerQueue = 256

// observerCloseWait bounds how long closing the run waits for an observer to finish.
const observerCloseWait = 2 * time.Minute

// observers hands a run's records to its Observers, each on its own goroutine.
type observers struct {
	events  *eventLog
	list    []*observed
	started bool
}

// observed is one observer with its queue.
type observed struct {
	o       Observer
	name    string
	queue   chan func(Observer) error
	done    chan struct{}
	mu      sync.Mutex
	failed  bool
	dropped int
	events  *eventLog
}

func newObservers(events *eventLog, os []Observer) *observers {
	obs := &observers{events: events}
	for _, o := range os {
		if o == nil {
			continue
		}
		ob := &observed{o: o, name: observerName(o), queue: make(chan func(Observer) error, observerQueue), done: make(chan struct{}), events: events}
		go ob.loop()
		obs.list = append(obs.list, ob)
	}
	return obs
}

// observerName names an observer in the run's log: its String, else its type.
func observerName(o Observer) string {
	if s, ok := o.(fmt.Stringer); ok {
		return s.String()
	}
	return fmt.Sprintf("%T", o)
}

// loop calls the observer with each record in turn; after its first error it only drains.
func (ob *observed) loop() {
	defer close(ob.done)
	for call := range ob.queue {
		ob.mu.Lock()
		failed := ob.failed
		ob.mu.Unlock()
		if failed {
			continue
		}
		if err := call(ob.o); err != nil {
			ob.mu.Lock()
			ob.failed = true
			ob.mu.Unlock()
			ob.events.printf("observer %s: %v; the run goes on without it", ob.name, err)
		}
	}
}

// send queues a call, or drops it when the observer is too far behind.
func (ob *observed) send(call func(Observer) error) {
	select {
	case ob.queue <- call:
	default:
		ob.mu.Lock()
		ob.dropped++
		first := ob.dropped == 1
		ob.mu.Unlock()
		if first {
			ob.events.printf("observer %s is %d records behind; records are dropped for it until it catches up", ob.name, observerQueue)
		}
	}
}

// start calls Start on every observer once, before their first record.
func (obs *observers) start(info RunInfo) {
	if obs == nil || obs.started {
		return
	}
	obs.started = true
	for _, ob := range obs.list {
		ob.send(func(o Observer) error { return o.Start(info) })
	}
}

func (obs *observers) step(rec StepRecord) {
	if obs == nil {
		return
	}
	for _, ob := range obs.list {
		ob.send(func(o Observer) error { return o.Step(rec) })
	}
}

func (obs *observers) eval(rec EvalRecord) {
	if obs == nil {
		return
	}
	for _, ob := range obs.list {
		ob.send(func(o Observer) error { return o.Eval(rec) })
	}
}

// close hands over what is queued, then ends and closes every observer (waiting at most
// observerCloseWait for each); ended is the error Train returned.
func (obs *observers) close(ended error) {
	if obs == nil {
		return
	}
	for _, ob := range obs.list {
		close(ob.queue)
	}
	for _, ob := range obs.list {
		select {
		case <-ob.done:
		case <-time.After(observerCloseWait):
			ob.events.printf("observer %s did not finish its records within %s; the run closes without it", ob.name, observerCloseWait)
			continue
		}
		closeObserver(ob.events, ob.o, ob.name, ended)
	}
	obs.list = nil
}

// copyLines copies metrics lines, so an observer's goroutine never shares a map the run's caller
// may change.
func copyLines(ms []Metrics) []Metrics {
	out := make([]Metrics, len(ms))
	for i, m := range ms {
		out[i] = maps.Clone(m)
	}
	return out
}
