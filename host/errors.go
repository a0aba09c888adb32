package host

// This file defines the errors a run returns: the types a caller may tell apart with errors.As.

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/slimen/slimen/host/script"
)

// ScriptError is a problem with the user's script or config: the CLI exits 2 on it.
type ScriptError = script.Error

// EngineError stops a run: a policy's engine failed (after the retries of its client).
type EngineError struct {
	Step   int
	Policy string
	Err    error
	Hint   string // how to go on (the run's resume command); "" gives a general hint
}

// Error names the step, the policy and the engine's failure, and how to go on.
func (e *EngineError) Error() string {
	if e.Hint != "" {
		return fmt.Sprintf("step %d: the engine of policy %q failed: %v; the run stops: %s", e.Step, e.Policy, e.Err, e.Hint)
	}
	return fmt.Sprintf("step %d: the engine of policy %q failed: %v; the run stops (resume from its last checkpoint with "+
		"--resume once the engine is back)", e.Step, e.Policy, e.Err)
}

// Unwrap returns the engine's error.
func (e *EngineError) Unwrap() error { return e.Err }

// RolloutError is a failed rollout: its task and the Starlark backtrace.
type RolloutError struct {
	Step   int
	TaskID string
	Msg    string
}

// Error names the step and the task, and quotes the backtrace indented.
func (e *RolloutError) Error() string {
	return fmt.Sprintf("step %d task %s: rollout failed:\n%s", e.Step, e.TaskID, indent(e.Msg))
}

// indent indents every line of s by two spaces, for a message quoted inside another.
func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ")
}

// tooManyFailed stops a step: more of its rollouts failed than rollout.max_failed_fraction allows.
type tooManyFailed struct{ msg string }

// Error returns the message that counts the failed rollouts.
func (e *tooManyFailed) Error() string { return e.msg }

// RolloutTimeout is a rollout that ran past rollout.timeout_s: it fails alone, its samples dropped.
type RolloutTimeout struct{ Limit float64 }

// Error says the rollout ran past its limit and how to raise or turn off the limit.
func (e *RolloutTimeout) Error() string {
	return fmt.Sprintf("the rollout ran past its wall-time limit of %gs and was cancelled (rollout.timeout_s; "+
		"an endless loop? Raise the limit, or 0 turns it off)", e.Limit)
}

// StopCancelled is a rollout cancelled because the run was stopping: it was still running
// rollout.stop_grace_s after the signal. Such rollouts fail without counting against
// rollout.max_failed_fraction.
type StopCancelled struct{ Grace float64 }

// Error says the rollout was cancelled by the run's stop after the grace.
func (e *StopCancelled) Error() string {
	return fmt.Sprintf("the run is stopping: the rollout was still running %gs after the stop signal (rollout.stop_grace_s) and was cancelled", e.Grace)
}

// RestartError stops a run: a trainable policy's engine restarted as a new process, lost its
// weights and optimizer state, and the host had no checkpoint to give them back from.
type RestartError struct {
	Step   int    // the step in progress
	Policy string // the policy whose engine restarted
	Engine string // "its engine at ADDR"
	Prev   string // instance ids of the server processes
	Cur    string
	Why    string // why the state could not be put back
	Hint   string // how to go on
}

// Error names the step, the policy and the restarted engine's instances, why the state could
// not be put back, and how to go on.
func (e *RestartError) Error() string {
	return fmt.Sprintf("step %d: policy %q: %s restarted as a new process (instance %s → %s) and lost the weights and "+
		"optimizer state it had trained; %s, so the run stops: %s",
		e.Step, e.Policy, e.Engine, e.Prev, e.Cur, e.Why, e.Hint)
}

// StepCut is a step that a stop cut short: some of its rollouts were still running
// rollout.stop_grace_s after the stop and were cancelled. Such a step is neither trained nor
// checkpointed (a step is saved only whole): the run stops after the step before it, whose
// checkpoint a resume continues from, running the cut step again in full — as the uninterrupted
// run would have.
type StepCut struct {
	Step      int
	Cancelled int // rollouts cancelled by the stop
	Total     int // rollouts of the step
	Grace     float64
}

// Error counts the cancelled rollouts of the cut step and says a resume runs it again whole.
func (e *StepCut) Error() string {
	return fmt.Sprintf("step %d was cut by the stop: %d of its %d rollouts were still running %gs after it "+
		"(rollout.stop_grace_s) and were cancelled; the step is neither trained nor saved, "+
		"so a resume runs it again whole",
		e.Step, e.Cancelled, e.Total, e.Grace)
}

// RunFolderError stops a run whose folder was deleted, moved, replaced or made unwritable: what
// it would write next (metrics, events, checkpoints) would be lost.
type RunFolderError struct {
	Dir  string
	Why  string // "it was deleted", "it is not writable: …"
	Step int    // the steps completed
	Hint string // what to do: the resume command, where there is one
}

// Error names the folder, what happened to it, the steps completed and what to do.
func (e *RunFolderError) Error() string {
	return fmt.Sprintf("run folder %s: %s; the run stops after step %d rather than write where nothing is kept: %s", e.Dir, e.Why, e.Step, e.Hint)
}

// RunLockedError refuses a second writer of a run folder: another process holds its lock.
type RunLockedError struct {
	Dir    string
	Holder lockHolder // zero when the file could not be read
}

// Error names the folder, the process that holds its lock and the choices left.
func (e *RunLockedError) Error() string {
	who := "another process"
	if e.Holder.PID != 0 {
		who = e.Holder.String()
	}
	return fmt.Sprintf("run folder %s is in use by %s: a run folder has one writer at a time (%s is locked); "+
		"wait for that run to end or stop it, or choose another --out",
		e.Dir, who, filepath.Join(e.Dir, LockFile))
}
