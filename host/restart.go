package host

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
)

// Engines that restart. A remote engine (or a torch worker) can die and come back as a new
// process, which has the weights it was started with and no optimizer state: everything the
// policy learned since is gone. Its client notices before it trusts anything the new process
// says (engines/remote, Options.OnRestart) and calls engineRestarted, which puts the policy's
// state back before any request in flight is resent:
//
//   - a frozen policy lost nothing (its state is what its config says); the restart is logged;
//   - a trainable policy's state is the run's checkpoint of step B plus the optimizer steps
//     applied since, where B is the last step the run checkpointed (0: the model the engine was
//     started with). The host keeps those optimizer steps until the next checkpoint (up to
//     replayLimit bytes of them): it loads the checkpoint into the new process and replays them,
//     step by step. The run then goes on exactly as if nothing had happened: the step in
//     progress is not run again, and no other policy's engine or the script's state is touched.
//   - otherwise (the optimizer steps since B outgrew replayLimit, engine.continue before the
//     first checkpoint, no run directory) the state cannot be put back: the run stops with a
//     *RestartError that says how to go on.

// replayLimit bounds the optimizer steps the host keeps to replay into a restarted engine, in
// bytes of their samples: past it, they are dropped until the next checkpoint (run.save_interval,
// run.save_minutes), and a restart until then stops the run.
const replayLimit = 1 << 30

// restartGuard is what the run knows of the state of its trainable engines, to put it back into
// one that restarted; the run owns it, and gives putBack the checkpoints, weights versions and
// events.log it needs. All fields are guarded by mu, which a restore holds throughout.
type restartGuard struct {
	mu      sync.Mutex
	started bool // stepStarting was called
	known   bool // base is a state the host can restore: engines hold base plus applied
	base    int  // the step of that state: a checkpoint of the run, or 0 (the models as started)
	done    int  // the steps completed, as last told by the step loop
	// applied are the optimizer steps each policy's engine applied since base, in order, with
	// the step each belongs to; bytes is their size, bounded by limit (0: replayLimit).
	applied map[string][]appliedStep
	bytes   int64
	limit   int64
	dropped int           // the step whose optimizer steps outgrew the limit (0: none)
	err     *RestartError // the first restart the run could not recover from
	// start is, for policies on servers the run reset at start-up to a folder of their own
	// (load:), that folder: a process that restarts before the first checkpoint has the model it
	// was started with, not that one. continued are the policies that trained on from the state
	// their server held (engine.continue): the run cannot give that back.
	start     map[string]string
	continued map[string]bool
}

// startedFrom records how a policy's engine on a server started: reset to dir (a load: folder),
// or, with continued, from whatever state the server held.
func (g *restartGuard) startedFrom(policy, dir string, continued bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.start == nil {
		g.start, g.continued = map[string]string{}, map[string]bool{}
	}
	g.start[policy], g.continued[policy] = dir, continued
}

// stepStarting is called when a step begins with done steps completed; haveCheckpoint says
// whether the run has a complete checkpoint of step done (it wrote it, or resumed from it).
func (g *restartGuard) stepStarting(done int, haveCheckpoint bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.started && g.done == done && (g.known || !haveCheckpoint) {
		// The engines hold base plus applied still (this may be a step tried again), or the
		// optimizer steps since base were dropped and no checkpoint was made since.
		return
	}
	// The first step of this process, fresh or resumed; or a checkpoint made between steps
	// (Run.Checkpoint) after the optimizer steps were dropped.
	g.started = true
	g.done, g.applied, g.bytes, g.dropped = done, nil, 0, 0
	g.known, g.base = done == 0 || haveCheckpoint, done
}

// appliedStep is an optimizer step an engine applied in a step of the run.
type appliedStep struct {
	step int
	b    engines.Batch
}

// batchBytes is about what a batch holds in memory.
func batchBytes(b engines.Batch) int64 {
	n := int64(len(b.ID))
	for _, s := range b.Samples {
		n += 4*int64(len(s.Prompt)+len(s.Response)+len(s.LossMask)+len(s.OldLogprobs)+len(s.TrainLogprobs)+
			len(s.Advantages)+len(s.Returns)+len(s.OldValues)) + int64(len(s.Group)) + 200
	}
	return n
}

// trained records an optimizer step a policy's engine applied.
func (g *restartGuard) trained(policy string, b engines.Batch) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.known {
		return
	}
	limit := g.limit
	if limit <= 0 {
		limit = replayLimit
	}
	if g.bytes += batchBytes(b); g.bytes > limit {
		// Kept any longer, they would hold the host's memory hostage until the next checkpoint.
		g.known, g.applied, g.bytes, g.dropped = false, nil, 0, g.done+1
		return
	}
	if g.applied == nil {
		g.applied = map[string][]appliedStep{}
	}
	g.applied[policy] = append(g.applied[policy], appliedStep{step: g.done + 1, b: b})
}

// stepDone is called at the end of a step; checkpointed says whether the run now has a complete
// checkpoint of it. With one, the engines hold that checkpoint's state and the optimizer steps
// are forgotten; without, they are kept, and a restarted engine gets the older checkpoint and
// every optimizer step since.
func (g *restartGuard) stepDone(step int, checkpointed bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.done = step
	if checkpointed {
		g.applied, g.bytes, g.dropped = nil, 0, 0
		g.known, g.base = true, step
	}
}

// failure is the restart the run could not recover from, if any.
func (g *restartGuard) failure() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err == nil {
		return nil // not a typed nil in an interface
	}
	return g.err
}

// cause is what stopped a call that failed with err: the restart the run could not recover from
// (the engine then fails every call), else err.
func (g *restartGuard) cause(err error) error {
	if rerr := g.failure(); rerr != nil {
		return rerr
	}
	return err
}

// restartEvent is an engine's report that it restarted.
type restartEvent struct {
	policy    string
	trainable bool
	engine    string         // "its engine at ADDR", "its torch worker"
	prev, cur string         // the server processes' instance ids
	eng       engines.Engine // the engine's client: calls with the hook's ctx reach the new process
}

// engineRestarted is every engine's OnRestart: it puts the policy's state back into the new
// process, or refuses it (and the run stops).
func (r *Run) engineRestarted(ctx context.Context, ev restartEvent) error {
	if p := r.pols.get(ev.policy); p != nil {
		p.forgetInfo() // the new process renders with what it reports now
	}
	return r.restart.putBack(ctx, ev, restartSources{ckpt: &r.ckpt, vers: &r.vers, pols: r.pols.list(), events: r.events, out: r.opts.Out})
}

// restartSources is what putting a restarted engine's state back takes from the run.
type restartSources struct {
	ckpt   *checkpoints   // the checkpoints to load
	vers   *versionKeeper // the weights versions the rollouts of steps to come sample from
	pols   []*policy      // the run's policies
	events *eventLog      // where the restart is said
	out    string         // the run folder: how to go on after a restart the run cannot recover from
}

// putBack puts the state of ev's policy back into its engine's new process, or refuses it: then
// it returns the *RestartError that stops the run, as it does for every restart after.
func (g *restartGuard) putBack(ctx context.Context, ev restartEvent, from restartSources) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	who := fmt.Sprintf("policy %q: %s restarted as a new process (instance %s → %s)", ev.policy, ev.engine, ev.prev, ev.cur)
	if !ev.trainable {
		from.events.printf("%s; the policy is frozen, so it lost nothing", who)
		return nil
	}
	if g.err != nil {
		return g.err
	}
	what, err := g.restore(ctx, ev, from)
	if err != nil {
		g.err = &RestartError{Step: g.done + 1, Policy: ev.policy, Engine: ev.engine, Prev: ev.prev, Cur: ev.cur,
			Why: err.Error(), Hint: resumeHint(from.out)}
		from.events.filef("%s", g.err.Error()) // the run's error shows it on the terminal
		return g.err
	}
	from.events.printf("%s: %s; the run goes on", who, what)
	return nil
}

// restore gives ev's engine its policy's state: the state of step base, the weights versions its
// rollouts sample from, and the optimizer steps applied since base. what says what it did; err,
// why it could not. The caller holds mu.
func (g *restartGuard) restore(ctx context.Context, ev restartEvent, from restartSources) (what string, err error) {
	if err := g.recoverable(ev); err != nil {
		return "", err
	}
	if what, err = g.loadBase(ctx, ev, from.ckpt); err != nil {
		return "", err
	}
	versions := from.vers.inEngine(from.pols, ev.policy)
	if versions {
		// Its rollouts sample weights versions the process kept: those up to g.base
		// are the state of g.base or in its checkpoint; those of the steps since are kept again
		// by replay, each once its step's optimizer steps are replayed.
		kept, err := from.ckpt.keepAgain(ctx, ev.eng, ev.policy, g.base)
		if err != nil {
			return "", fmt.Errorf("putting back the weights versions its rollouts sample from failed: %v", err)
		}
		what += fmt.Sprintf(", kept weights versions %v in it again", kept)
	}
	replayed, err := g.replay(ctx, ev, versions, from.vers.staleness())
	if err != nil {
		return "", err
	}
	return what + replayed, nil
}

// recoverable says why ev's policy cannot get its state back; nil if it can. The caller holds mu.
func (g *restartGuard) recoverable(ev restartEvent) error {
	switch {
	case ev.eng == nil:
		return errors.New("its engine was not ready to be given its state back")
	case !g.known && g.dropped > 0:
		return fmt.Errorf("the optimizer steps applied since the run's last checkpoint outgrew the %d MiB the host keeps to replay "+
			"into a restarted engine in step %d, and the run has no checkpoint of step %d to load "+
			"into it (a checkpoint more often — run.save_interval, run.save_minutes — keeps them fewer)", replayLimitOf(g)>>20, g.dropped, g.done)
	case !g.known:
		return fmt.Errorf("the run has no checkpoint of step %d to load into it", g.done)
	}
	return nil
}

// loadBase gives ev's engine the state of step base: the run's checkpoint of it, or before the
// first checkpoint the model the policy started from. It says what it did. The caller holds mu.
func (g *restartGuard) loadBase(ctx context.Context, ev restartEvent, ckpt *checkpoints) (string, error) {
	if g.base > 0 {
		dir, err := ckpt.policyDir(g.base, ev.policy)
		if err != nil {
			return "", fmt.Errorf("its checkpoint of step %d cannot be loaded: %v", g.base, err)
		}
		if err := ev.eng.Load(ctx, dir); err != nil {
			return "", fmt.Errorf("loading its checkpoint of step %d (%s) into it failed: %v", g.base, dir, err)
		}
		return fmt.Sprintf("loaded %s (step %d) into it", dir, g.base), nil
	}
	switch {
	case g.continued[ev.policy]:
		return "", errors.New("the run trained on from the state the server held when it started (engine.continue), which no checkpoint of the run holds")
	case g.start[ev.policy] != "":
		dir := g.start[ev.policy]
		if err := ev.eng.Load(ctx, dir); err != nil {
			return "", fmt.Errorf("loading its load: folder %s, which the run started from, into it failed: %v", dir, err)
		}
		return fmt.Sprintf("loaded its load: folder %s, which the run started from, into it", dir), nil
	case len(g.applied[ev.policy]) > 0:
		return "it had been trained from the model it was started with", nil
	}
	return "it had not been trained yet, so it needs no checkpoint", nil
}

// replay applies again in ev's engine the optimizer steps its policy applied since base. With
// versions (the policy's weights versions live in the engine's process) it keeps the weights
// version of each replayed step again that a step to come may still generate from (staleness:
// rollout.max_staleness). It says what it did ("" for nothing). The caller holds mu.
func (g *restartGuard) replay(ctx context.Context, ev restartEvent, versions bool, staleness int) (string, error) {
	replay := g.applied[ev.policy]
	var again []int // weights versions of the replayed steps kept again
	for i, a := range replay {
		if _, err := ev.eng.Train(ctx, a.b); err != nil {
			return "", fmt.Errorf("replaying optimizer step %d of %d since step %d (%s) failed: %v", i+1, len(replay), g.base, a.b.ID, err)
		}
		if last := i+1 == len(replay) || replay[i+1].step != a.step; versions && last && a.step <= g.done && a.step >= g.done-staleness {
			// A version a step to come may still generate from (genVersion of step
			// done+1 is done-K); older ones the run dropped already.
			if err := keepVersion(ctx, ev.eng, a.step); err != nil {
				return "", fmt.Errorf("keeping weights version %d again after replaying its optimizer steps failed: %v", a.step, err)
			}
			again = append(again, a.step)
		}
	}
	var what string
	if len(replay) > 0 {
		steps := span(replay[0].step, replay[len(replay)-1].step)
		what += fmt.Sprintf(" and replayed the %d optimizer steps applied since (step %s)", len(replay), steps)
	}
	if len(again) > 0 {
		what += fmt.Sprintf(", keeping weights versions %v again", again)
	}
	return what, nil
}

// replayLimitOf is the bound on the optimizer steps g keeps to replay.
func replayLimitOf(g *restartGuard) int64 {
	if g.limit > 0 {
		return g.limit
	}
	return replayLimit
}

// keepVersion keeps eng's current weights as weights version v.
func keepVersion(ctx context.Context, eng engines.Engine, v int) error {
	vs, ok := eng.(engines.Versions)
	if !ok {
		return fmt.Errorf("its engine keeps no weights versions")
	}
	return vs.KeepVersion(ctx, v)
}

// outageBounded is an engine client that can be told when to stop waiting for its engine while
// it is unreachable (remote.Client, a torch worker's client).
type outageBounded interface{ GiveUpAt(time.Time) }

// giveUpOnEngines tells the engine client of every policy of pols that reaches a server to stop
// waiting for it at t, should it be unreachable. The run is stopping, and a server that is down
// must not hold up its exit past the stop grace (the rollouts are cancelled then; the final
// checkpoint and what else the run still asks of its engines fail at once instead of waiting
// ReconnectTimeout).
func giveUpOnEngines(pols *policyTable, t time.Time) {
	pols.each(func(p *policy) {
		switch e := p.eng.(type) {
		case outageBounded:
			e.GiveUpAt(t)
		case interface{ Client() *remote.Client }: // a LoRA adapter on a server
			if c := e.Client(); c != nil {
				c.GiveUpAt(t)
			}
		}
	})
}

// resumeHint says how to go on after a run with run folder out ("" for none) stopped for an
// engine: resume from its newest checkpoint once the engine is back, or start again when it has
// none.
func resumeHint(out string) string {
	if out == "" {
		return "start it again once the engine is back (a run without a directory keeps no checkpoints)"
	}
	dir, _, err := FindCheckpoint(out)
	if err != nil {
		return fmt.Sprintf("%s has no checkpoint to resume from (run.save_interval writes them), "+
			"and slimen exec does not write a new run into a folder that holds one: "+
			"start it again once the engine is back, with another --out (or remove %s first)", out, out)
	}
	info, err := readRunInfo(dir)
	step := info.Step
	if err != nil {
		return fmt.Sprintf("resume from its last checkpoint once the engine is back: slimen exec --resume %s", out)
	}
	return fmt.Sprintf("resume from its last checkpoint (step %d) once the engine is back: slimen exec --resume %s", step, out)
}

// engineErrorHint is the EngineError hint of a run with run folder out: the resume command
// (resumeHint), worked out when the error happens; a run without a folder ("") keeps the
// general hint.
func engineErrorHint(out string) string {
	if out == "" {
		return ""
	}
	return resumeHint(out)
}
