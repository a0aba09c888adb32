package host

// This file defines the loop of steps (Train, Stop, the grace of the rollouts a Stop cuts) and
// the check that an engine applies use_tis; a step's training is the trainer's.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
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
	r.trainErr.Store(&err)
	return err
}

// train is Train without the events line that says why it ended.
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
		giveUpOnEngines(&r.pols, time.Now().Add(r.StopGrace())) // a server down ends the wait then
	})
}

// StopGrace is how long rollouts may still run after Stop before they are cancelled
// (rollout.stop_grace_s).
func (r *Run) StopGrace() time.Duration { return seconds(r.Config().Rollout.StopGraceS) }

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

// seconds converts a config's seconds to a duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// checkTIS refuses policy pc with use_tis when its engine eng does not apply the correction (no
// "tis" capability): without it the engine would train as if the samples were on-policy. c is the
// running config, whose file the error names. It runs at start-up and on a reloaded config.
func checkTIS(ctx context.Context, c *config.Config, pc config.PolicyConfig, eng engines.Engine) error {
	if !pc.Trainable || !pc.Train.UseTIS || pc.IsCritic() {
		return nil
	}
	info, err := eng.Info(ctx)
	if err != nil {
		return fmt.Errorf("policy %q: info: %w", pc.Name, err)
	}
	if !slices.Contains(info.Capabilities, "tis") {
		return fmt.Errorf("policy %q%s: train.use_tis needs an engine that applies the off-policy correction, "+
			"and its engine (%s) does not (no \"tis\" capability; the tiny and torch engines have it): "+
			"set use_tis: false or use another engine", pc.Name, cfgPlace(c, pc), info.Model)
	}
	return nil
}
