package host

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/slimen/slimen/host/config"
)

// Train runs the run's remaining steps, up to run.steps (read again at every step boundary, so a
// config reloaded by Watch may lengthen or shorten the run), then checkpoints it when it has an
// output folder and a step is done. Options.BeforeStep and AfterStep are called around each step.
//
// Stop ends Train after the step in progress. Cancelling ctx abandons the step in progress: the
// run (its `state` included) stays as it was after the last step, and Train still checkpoints
// that. Train returns nil when it ran every step or was stopped by Stop, ctx's error when ctx ended
// it without Stop, and any other error of a step or of the final checkpoint.
func (r *Run) Train(ctx context.Context) error {
	err := r.train(ctx)
	r.sayWhyStopped(err)
	return err
}

func (r *Run) train(ctx context.Context) error {
	var cut *StepCut
	for r.step < r.Config().Run.Steps && !r.stopping.Load() {
		if f := r.opts.BeforeStep; f != nil {
			f(r)
		}
		res, err := r.Step(ctx)
		if err != nil {
			if ctx.Err() != nil && errors.Is(err, context.Canceled) {
				break // the abandoned step left the run as it was after the last one
			}
			if errors.As(err, &cut) {
				r.events.printf("stop: %v", cut)
				break // the cut step left the run as it was after the last one
			}
			return err
		}
		if f := r.opts.AfterStep; f != nil {
			f(r, res)
		}
	}
	if r.step > 0 && r.opts.Out != "" {
		if _, err := r.Checkpoint(context.WithoutCancel(ctx)); err != nil {
			return fmt.Errorf("final checkpoint: %w", err)
		}
		if cut != nil {
			r.events.printf("stop: the checkpoint holds step %d, the last whole step; step %d runs again on resume", r.step, cut.Step)
		}
	}
	if r.stopping.Load() {
		return nil
	}
	return ctx.Err()
}

// sayWhyStopped writes into events.log why Train ended, with the way on where there is one.
func (r *Run) sayWhyStopped(err error) {
	hint := r.StopHint()
	switch {
	case err != nil:
		msg := err.Error()
		if !strings.Contains(msg, "the run stops") { // a message that says it already (too many failed rollouts)
			msg = "the run stops: " + msg
		}
		var fe *RunFolderError
		if errors.As(err, &fe) || hint == "" || strings.Contains(msg, "--resume") {
			r.events.filef("stop: %s", msg)
		} else {
			r.events.filef("stop: %s; %s", msg, hint)
		}
	case r.stopping.Load():
		if hint == "" {
			hint = "no checkpoint (no step completed)"
		}
		r.events.filef("stop: stopped (a signal or Run.Stop) after step %d; %s", r.step, hint)
	case r.step < r.Config().Run.Steps:
		r.events.filef("stop: abandoned after step %d; %s", r.step, hint)
	default:
		r.events.filef("done: %d steps (run.steps)", r.step)
	}
}

// Stop asks Train to stop after the step in progress. It may be called from any goroutine (a
// signal handler's). Rollouts still running rollout.stop_grace_s after the first Stop are
// cancelled: they fail with StopCancelled, and the step, no longer whole, is neither trained nor
// checkpointed (StepCut): the run stops after the step before it. An engine server that is
// unreachable is waited for until the grace ends, no longer: what the run still asks of it then
// (the final checkpoint) fails at once, and the run stops with the resume command of its last
// checkpoint.
func (r *Run) Stop() {
	r.stopping.Store(true)
	r.stopOnce.Do(func() {
		close(r.stopped)
		r.giveUpOnEngines(time.Now().Add(r.StopGrace())) // restart.go: a server down ends the wait then
	})
}

// StopGrace is how long rollouts may still run after Stop before they are cancelled
// (rollout.stop_grace_s).
func (r *Run) StopGrace() time.Duration { return seconds(r.Config().Rollout.StopGraceS) }

// LastCheckpoint is the folder of the newest complete checkpoint this run wrote or resumed from;
// "" when there is none.
func (r *Run) LastCheckpoint() string {
	if !r.ckpt.have || r.opts.Out == "" {
		return ""
	}
	return filepath.Join(r.opts.Out, "checkpoints", stepName(r.ckpt.step))
}

// cancelOnStop cancels a pass's rollouts once Stop was called and rollout.stop_grace_s has
// passed; it returns when the pass ends.
func (r *Run) cancelOnStop(pass context.Context, cancel context.CancelCauseFunc) {
	select {
	case <-r.stopped:
	case <-pass.Done():
		return
	}
	grace := r.Config().Rollout.StopGraceS
	t := time.NewTimer(seconds(grace))
	defer t.Stop()
	select {
	case <-t.C:
		cancel(&StopCancelled{Grace: grace})
	case <-pass.Done():
	}
}

// RolloutTimeout is a rollout that ran past rollout.timeout_s: it fails alone, its samples dropped.
type RolloutTimeout struct{ Limit float64 }

func (e *RolloutTimeout) Error() string {
	return fmt.Sprintf("the rollout ran past its wall-time limit of %gs and was cancelled (rollout.timeout_s; an endless loop? Raise the limit, or 0 turns it off)", e.Limit)
}

// StopCancelled is a rollout cancelled because the run was stopping: it was still running
// rollout.stop_grace_s after the signal. Such rollouts fail without counting against
// rollout.max_failed_fraction.
type StopCancelled struct{ Grace float64 }

func (e *StopCancelled) Error() string {
	return fmt.Sprintf("the run is stopping: the rollout was still running %gs after the stop signal (rollout.stop_grace_s) and was cancelled", e.Grace)
}

// seconds converts a config's seconds to a duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// afterEval runs Options.AfterEval once eval metrics are written; its error is reported, not
// fatal.
func (r *Run) afterEval() {
	if r.opts.AfterEval == nil {
		return
	}
	if err := r.opts.AfterEval(r); err != nil {
		r.events.printf("%v", err)
	}
}

// Resume loads a stopped run again and restores it: from is its run directory (its newest valid
// checkpoint is taken; newer ones that fail verification are reported in the run's log and
// removed as the run goes on) or one of its checkpoints/step_N folders. script "" is the script
// the checkpoint recorded, found from any working directory (resumeScript). opts.Config nil is the
// checkpoint's own config, its relative paths taken from the directory the run started in (which
// run.json records), then opts.ConfigOverride applied to it; opts.Out "" is the run directory the
// checkpoint belongs to. The run then goes on at the step after the checkpoint's. A checkpoint
// that cannot be found or read, and a config or script that does not load, are ScriptErrors.
func Resume(ctx context.Context, from, script string, opts Options) (*Run, error) {
	ckpt, skipped, err := FindCheckpoint(from)
	if err != nil {
		return nil, &ScriptError{Msg: err.Error()}
	}
	info, err := readRunInfo(ckpt)
	if err != nil {
		return nil, &ScriptError{Msg: err.Error()}
	}
	var scriptNote string
	var moved []string // what Options.Relocate changed
	if script == "" {
		script, scriptNote = resumeScript(ckpt, info, opts.FS != nil)
	}
	if opts.Out == "" {
		opts.Out = runDirOf(ckpt)
	}
	opts.workDir, opts.resuming = info.Dir, true
	if opts.Config == nil {
		ckptConfig := filepath.Join(ckpt, "config.yaml")
		if opts.Config, err = config.Load(ckptConfig); err != nil {
			return nil, &ScriptError{Msg: err.Error()}
		}
		if opts.Relocate != nil {
			if moved, err = relocate(opts.Config, opts.Relocate); err != nil { // reliability.go
				return nil, &ScriptError{Msg: "resume: " + err.Error()}
			}
		}
		if opts.FS == nil {
			// Before the command line's changes, which are relative to here; and so for every
			// version of the checkpoint's config a reload reads (--watch on a resumed run).
			rebasePaths(opts.Config, info.Dir)
			override := opts.ConfigOverride
			opts.ConfigOverride = func(c *config.Config) error {
				if c.File == ckptConfig {
					rebasePaths(c, info.Dir)
				}
				if override != nil {
					return override(c)
				}
				return nil
			}
		}
		if opts.ConfigOverride != nil {
			if err := opts.ConfigOverride(opts.Config); err != nil {
				return nil, &ScriptError{Msg: err.Error()}
			}
		}
		opts.Config.Run.Out = opts.Out
	}
	r, err := Load(ctx, script, opts)
	if err != nil {
		var se *ScriptError
		if !errors.As(err, &se) {
			err = &ScriptError{Msg: err.Error()}
		}
		return nil, err
	}
	if scriptNote != "" {
		r.events.printf("resume: %s", scriptNote)
	}
	if opts.Relocate != nil && len(moved) == 0 {
		r.events.printf("resume: --config %s: the engines live where the checkpoint's config says; nothing changed", opts.Relocate.File)
	}
	for _, c := range moved {
		r.events.printf("resume: --config %s: %s", opts.Relocate.File, c)
	}
	for _, bad := range skipped {
		r.events.printf("warning: %v", bad)
	}
	if len(skipped) > 0 {
		r.events.printf("warning: resuming from %s, the newest valid checkpoint; the newer ones above are removed when the run goes on", ckpt)
	}
	if err := r.restore(ctx, ckpt); err != nil {
		r.events.filef("stop: the resume from %s failed: %v", ckpt, err)
		r.Close()
		return nil, err
	}
	r.opts.resuming = false // the engines hold the checkpoint's state now
	return r, nil
}
