package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/slimen/slimen/host/script"
)

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

func (e *StepCut) Error() string {
	return fmt.Sprintf("step %d was cut by the stop: %d of its %d rollouts were still running %gs after it (rollout.stop_grace_s) and were cancelled; the step is neither trained nor saved, so a resume runs it again whole",
		e.Step, e.Cancelled, e.Total, e.Grace)
}

// stepCut returns a *StepCut when a stop cancelled any of the step's rollouts, else nil.
func stepCut(step int, ros []*script.Rollout, grace float64) error {
	cancelled := 0
	for _, ro := range ros {
		var sc *StopCancelled
		if ro.Err != nil && errors.As(context.Cause(ro.Ctx), &sc) {
			cancelled++
		}
	}
	if cancelled == 0 {
		return nil
	}
	return &StepCut{Step: step, Cancelled: cancelled, Total: len(ros), Grace: grace}
}

// RunFolderError stops a run whose folder was deleted, moved, replaced or made unwritable: what
// it would write next (metrics, events, checkpoints) would be lost.
type RunFolderError struct {
	Dir  string
	Why  string // "it was deleted", "it is not writable: …"
	Step int    // the steps completed
	Hint string // what to do: the resume command, where there is one
}

func (e *RunFolderError) Error() string {
	return fmt.Sprintf("run folder %s: %s; the run stops after step %d rather than write where nothing is kept: %s", e.Dir, e.Why, e.Step, e.Hint)
}

// checkFolder makes sure the run folder is still this run's and writable: its lock file is the
// one this run holds (not deleted, moved or replaced), and a file can be created in it. Called at
// each step's start and before its results are written.
func (r *Run) checkFolder() error {
	if r.lock == nil {
		return nil
	}
	dir := r.opts.Out
	if why := r.lock.gone(); why != "" {
		return &RunFolderError{Dir: dir, Why: why, Step: r.step,
			Hint: fmt.Sprintf("its metrics and checkpoints went with it; if it was moved, move it back to %s and resume with: slimen exec --resume %s", dir, dir)}
	}
	f, err := os.CreateTemp(dir, ".write-check-")
	if err == nil {
		_, err = f.Write([]byte{'\n'})
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		os.Remove(f.Name())
	}
	if err != nil {
		return &RunFolderError{Dir: dir, Why: fmt.Sprintf("it is not writable: %v", err), Step: r.step, Hint: r.folderHint()}
	}
	return nil
}

// folderHint is the way on once the folder is writable again.
func (r *Run) folderHint() string {
	if ck := r.LastCheckpoint(); ck != "" {
		return fmt.Sprintf("once it is writable again, resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(ck), r.opts.Out)
	}
	if dir, _, err := FindCheckpoint(r.opts.Out); err == nil {
		return fmt.Sprintf("once it is writable again, resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(dir), r.opts.Out)
	}
	return fmt.Sprintf("it holds no checkpoint yet: once it is writable again, start the run again with another --out (or remove %s)", r.opts.Out)
}

// StopHint is how a run that stopped goes on: the resume command of its newest valid checkpoint,
// or "" when it has no folder or no checkpoint.
func (r *Run) StopHint() string {
	if r.opts.Out == "" {
		return ""
	}
	dir, _, err := FindCheckpoint(r.opts.Out)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(dir), r.opts.Out)
}
