package host

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/tasks"
)

// Options configure a run.
type Options struct {
	// Config is the run's configuration. nil means zero-config: every policy the script names gets
	// a trainable default engine on the bundled base checkpoint, created when first used.
	Config *config.Config
	// Engines, keyed by policy name, replace the engines the config would open (tests, embedding).
	Engines map[string]engines.Engine
	// OpenEngine opens the engine of a policy that Engines does not give. nil: OpenEngine. A
	// run's start calls it for several policies at once (LoRA policies one at a time).
	OpenEngine func(ctx context.Context, p config.PolicyConfig) (engines.Engine, error)
	// Zero marks a zero-config run even when Config is given (the CLI fills --steps and friends
	// into a default config): policies are created as the script names them.
	Zero bool
	// ConfigOverride, when set, is applied to every config a reload reads (--watch): the command
	// line's changes to the config file (--steps, --seed, --data, --batch-size, --out), which the
	// caller has already applied to Config.
	ConfigOverride func(*config.Config) error
	// Tasks replaces the config's data source.
	Tasks TaskSource
	// Out is the run directory; "" writes no files (metrics are still returned by Step).
	Out string
	// Log receives progress lines and rollout failures; nil discards them.
	Log io.Writer
	// Sandbox runs the script's rollouts in child processes under the config's sandbox budgets
	// (also set by sandbox.enabled in the config). SandboxCommand starts a child; nil: this
	// executable, which must call sandbox.ChildMain (host/script/sandbox) when sandbox.ChildEnv
	// is set (the CLI does).
	Sandbox        bool
	SandboxCommand []string
	// Builtins are Go values (starlark.NewBuiltin functions, constants) added to the script's
	// predeclared names, beside generate, reward, train…; Modules are packages of Starlark files
	// a script may load as @NAME//path.star. Neither reaches a sandboxed run's children.
	Builtins starlark.StringDict
	Modules  map[string]fs.FS
	// FS, when set, is where the script (scriptPath, a slash-separated path in it) and the
	// files it loads are read; nil: the operating system's files. Watch needs real files.
	FS fs.FS
	// BeforeStep and AfterStep are called by Train around each step it runs, on its goroutine
	// (the CLI draws its progress with them). AfterStep is called only for a step that completed.
	BeforeStep func(r *Run)
	AfterStep  func(r *Run, res *StepResult)
	// AfterEval is called once the metrics of an eval are written, the one before training
	// included (the CLI redraws its charts with host/plot). An error it returns goes to the
	// run's log; the run goes on.
	AfterEval func(r *Run) error
	// Observers receive the run's config, each step's metrics, rewards, advantages and saved
	// rollouts, and each eval's, as the run records them; their errors are logged,
	// never fatal.
	Observers []Observer

	// Relocate, for Resume, is a config whose policies' engines live elsewhere than the
	// checkpoint's say (engine.address, tls, token_env, insecure, base_url, api_key_env): those
	// replace the checkpoint's, and the run's log says what changed. Any other difference is
	// refused (it would change what the run computes). nil: the checkpoint's config as it is.
	Relocate *config.Config

	// workDir is the working directory the run started in, when Resume knows it ("": this
	// process's); resuming says that Resume loads the run, which puts the engines' state back
	// from the checkpoint (so remote engines need no reset to their starting weights).
	workDir  string
	resuming bool
	// perPolicyBatches sends the generate batches of the LoRA policies on one base policy by
	// policy instead of together (adapterBatcher): the baseline of the benchmark that measures
	// the merge.
	perPolicyBatches bool
}

// Task is one unit of work handed to rollout(task).
type Task = tasks.Task

// TaskSource yields the tasks of a run by index (tasks.Source is one).
type TaskSource interface {
	// Task returns task i; a finite source wraps around.
	Task(i int) Task
}

// openTasks opens the config's data source; skipped lines are reported in the events log.
func (r *Run) openTasks() error {
	c := r.cfg
	src, err := tasks.Open(c.Data.Path, tasks.Options{InputKey: c.Data.InputKey, LabelKey: c.Data.LabelKey, Seed: c.Run.Seed, Shuffle: c.Data.Shuffle})
	if err != nil {
		return err
	}
	for _, w := range src.Warnings() {
		r.events.printf("data: %s", w)
	}
	r.tasks = src
	return nil
}

// Run is a training run: a script, its policies and their engines, buffers and the step loop.
// Load one with Load, then call Step (or Steps) from one goroutine.
type Run struct {
	opts     Options
	cfg      *config.Config
	cfgMu    sync.RWMutex
	zero     bool // zero-config: policies are created on first use
	script   *script.Script
	tasks    TaskSource
	state    *script.State
	activity activity
	events   *eventLog
	metrics  *metricsWriter
	rec      recorder // rollouts.jsonl, the observers and what a step's record needs
	lock     *runLock // the run folder's lock; nil without a folder
	// logNames are the log() names the run has written to its _run lines (at most
	// script.MaxLogNamesPerRun; runMetrics).
	logNames logNameSet
	// agents is the endpoint of its rollouts' agent() programs: the run's own.
	agents script.AgentEndpoint

	ctx    context.Context // lives as long as the run; dispatchers stop with it
	cancel context.CancelFunc

	pols policyTable // the policies by name, in order, and the LoRA bases they share

	id      string    // random per process: part of optimizer step ids
	wd      string    // the absolute working directory the run started in (run.json's dir)
	step    int       // steps completed
	next    int       // index of the first task of the next step: the data position
	reload  *reloader // nil unless Watch was called
	sandbox *pool     // nil unless the run is sandboxed

	ckpt  checkpoints // the run's checkpoints folder and what the run wrote there
	async asyncLoop   // the rollouts launched for steps not yet trained

	vers versionKeeper // the weights versions kept for the rollouts of steps not yet trained

	trainer trainer // a step's training: advantages, optimizer steps, their metrics

	stopping atomic.Bool           // Stop was called: Train ends after the step in progress
	trainErr atomic.Pointer[error] // the error Train last returned: what Enders learn at Close
	stopped  chan struct{}         // closed by the first Stop: rollouts get rollout.stop_grace_s more
	stopOnce sync.Once

	passes  atomic.Int64 // rollout passes so far (steps, eval datasets): part of generate request ids
	restart restartGuard // what puts a restarted engine's state back

	live liveLine // the rollout pass in progress, for progress displays
	// generating measures the time any policy's engine has a generate batch in hand: the time
	// the run generates, not the time its rollouts run (an agent() program's start-up, tools,
	// the script's own work), which tokens_per_s is over.
	generating busyMeter
}

// LivePass is the rollout pass in progress, as a progress display shows it.
type LivePass struct {
	Done, Total int  // rollouts done, rollouts in the pass
	Tokens      int  // tokens generated so far
	Eval        bool // an evaluation's pass (eval_rollout on the eval data), not a step's
	// Generating is how long an engine had a generate batch in hand since the pass began.
	Generating time.Duration
}

// Live reports the rollout pass in progress.
func (r *Run) Live() LivePass { return r.live.show(r.generating.busy()) }

// liveLine is the rollout pass in progress (a step's or an eval's), as Live reports it.
type liveLine struct {
	done, total, tokens atomic.Int64
	genMark             atomic.Int64 // the run's generating time when the pass began
	eval                atomic.Bool
	// pass is the number of the pass shown, the newest: rollout.max_staleness > 1 runs several
	// at once, and only the shown one's rollouts count in done.
	pass atomic.Int64
}

// begin shows pass number pass, of n rollouts, from now on; generating is the run's generating
// time so far.
func (l *liveLine) begin(pass int64, n int, eval bool, generating time.Duration) {
	l.pass.Store(pass)
	l.done.Store(0)
	l.total.Store(int64(n))
	l.tokens.Store(0)
	l.eval.Store(eval)
	l.genMark.Store(int64(generating))
}

// rolloutDone counts a finished rollout of pass, if that pass is the one shown.
func (l *liveLine) rolloutDone(pass int64) {
	if l.pass.Load() == pass {
		l.done.Add(1)
	}
}

// show is the pass as a display shows it; generating is the run's generating time so far.
func (l *liveLine) show(generating time.Duration) LivePass {
	return LivePass{Done: int(l.done.Load()), Total: int(l.total.Load()), Tokens: int(l.tokens.Load()),
		Eval: l.eval.Load(), Generating: generating - time.Duration(l.genMark.Load())}
}

// Load reads the script, resolves the configuration and opens the engines. Its phases: the
// script is loaded (in a sandbox child too, for a sandboxed run), the run folder opened, the
// run's inputs checked, and the run started: its engines opened and what it loaded said.
func Load(ctx context.Context, scriptPath string, opts Options) (_ *Run, err error) {
	r := newRun(opts)
	// undo is what a failure undoes, more as the run opens more: its context; then everything
	// Close closes; then, once its outputs are open, also a line in events.log saying why.
	undo := func() { r.cancel() }
	defer func() {
		if err != nil {
			undo()
		}
	}()
	sandboxed := opts.Sandbox || r.cfg.Sandbox.Enabled
	if r.script, err = loadScript(scriptPath, r.scriptOptions(sandboxed)); err != nil {
		return nil, err
	}
	undo = func() { r.Close() }
	if sandboxed {
		if err := r.openSandbox(); err != nil {
			return nil, err
		}
	}
	if err := r.openOutputs(); err != nil {
		return nil, err
	}
	undo = func() { r.notStarted(err) }
	if err := r.checkInputs(); err != nil {
		return nil, err
	}
	if err := r.start(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// loadScript loads the script at path with so, the run's script options. A sandboxed run takes
// no Go values of this process (Options.Builtins, Options.Modules): its script runs in child
// processes.
func loadScript(path string, so script.Options) (*script.Script, error) {
	if so.Sandbox && (len(so.Builtins) > 0 || len(so.Modules) > 0) {
		return nil, &ScriptError{Msg: "a sandboxed run cannot have Options.Builtins or Options.Modules: " +
			"they are Go values of this process, and the script runs in child processes"}
	}
	return script.Load(path, so)
}

// openSandbox starts the sandbox of a sandboxed run. The first child runs the script's top level
// under the sandbox's limits: a script that does not load fails here, with the child's message.
func (r *Run) openSandbox() error {
	r.cfg.Sandbox.Enabled = true
	r.sandbox = newSandbox(r, r.opts.SandboxCommand)
	if _, err := r.sandbox.pick(); err != nil {
		return script.Errorf("%w", err)
	}
	return nil
}

// checkInputs checks what the run reads before any engine opens: its data (opened unless
// Options.Tasks gives it), its eval datasets and its script.
func (r *Run) checkInputs() error {
	if r.tasks == nil {
		if err := r.openTasks(); err != nil {
			return err
		}
	}
	if err := r.checkEvalData(); err != nil {
		return err
	}
	return r.checkScript()
}

// start opens the engines of the run's policies and readies the run for its first step: the
// policies' save: folders checked, what loaded said in events.log, scoring that a policy's
// engine cannot do refused, a zero-config script's policies created, and when the run
// checkpoints said.
func (r *Run) start(ctx context.Context) error {
	if err := r.openPolicies(ctx); err != nil {
		return err
	}
	if err := r.ckpt.checkSaveFolders(r.pols.list()); err != nil { // policies' save: folders
		return err
	}
	tellLoaded(r.events, r.script, r.cfg)
	if err := r.refuseScoringWithoutScore(); err != nil {
		return err
	}
	if r.zero {
		if err := r.openScriptPolicies(); err != nil {
			return err
		}
	}
	if r.opts.Out != "" {
		r.events.printf("checkpoints: %s", checkpointPlan(r.cfg.Run))
	}
	r.ckpt.since = time.Now()
	return nil
}

// tellLoaded says in events what a run loaded: the script s, its policies, the warnings of its
// config c, and the settings of slime-n that the engines the host runs ignore.
func tellLoaded(events *eventLog, s *script.Script, c *config.Config) {
	events.printf("loaded %s (sha256 %s); %s", s.Path, s.Hash[:12], policiesLoaded(c.Policies))
	for _, w := range c.Warnings {
		events.printf("config: %s", w)
	}
	for _, p := range c.Policies {
		// The engines the host runs read none of slime-n's parallelism and server settings: say
		// so once (a torch worker takes its own flags from engine.args).
		k, err := engineKind(p.Engine.Kind)
		if keys := p.PassThrough(); err == nil && !k.PassThrough && len(keys) > 0 {
			events.printf("config: policy %q: the %s engine ignores %s", p.Name, p.Engine.Kind, strings.Join(keys, ", "))
		}
	}
}

// notStarted says in events.log (where the run folder has one) why the run does not start, and
// closes the run: a folder read later says why it holds no step.
func (r *Run) notStarted(err error) {
	r.events.filef("stop: the run does not start: %v", err)
	r.Close()
}

// policiesLoaded says which policies a run starts with, for its first events.log line.
func policiesLoaded(ps []config.PolicyConfig) string {
	if len(ps) == 0 {
		return "policies: created as the script names them"
	}
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return "policies: " + strings.Join(names, ", ")
}

// scriptOptions are how the run loads (and reloads) its script.
func (r *Run) scriptOptions(sandboxed bool) script.Options {
	return script.Options{Config: script.ConfigValue(r.Config), Sandbox: sandboxed, ParseOnly: sandboxed,
		Builtins: r.opts.Builtins, Modules: r.opts.Modules, FS: r.opts.FS}
}

// newRun makes a run with no script, outputs or engines yet.
func newRun(opts Options) *Run {
	r := &Run{opts: opts, state: script.NewState(), tasks: opts.Tasks, id: newRunID(),
		events: &eventLog{w: opts.Log}, metrics: &metricsWriter{}, stopped: make(chan struct{})}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.cfg, r.zero = opts.Config, opts.Zero
	if r.wd = opts.workDir; r.wd == "" {
		r.wd, _ = os.Getwd()
	}
	if r.cfg == nil {
		r.cfg, r.zero = config.Default(nil), true
	}
	if len(r.cfg.Policies) == 0 {
		r.zero = true // a config that lists no policies leaves them to the script, as zero-config does
	}
	var create func(name, checkpoint string) (*policy, error)
	if r.zero {
		create = r.createPolicy
	}
	r.pols = newPolicyTable(r.Config, create)
	r.rec = recorder{events: r.events, config: r.Config, observers: opts.Observers, id: r.id, wd: r.wd}
	r.rec.engineOf = func(name string) engines.Engine {
		p := r.pols.get(name)
		if p == nil {
			return nil
		}
		return p.eng
	}
	r.trainer = trainer{id: r.id, pols: &r.pols, events: r.events, rec: &r.rec, restart: &r.restart, out: opts.Out}
	return r
}

// Config returns the resolved configuration.
func (r *Run) Config() *config.Config {
	r.cfgMu.RLock()
	defer r.cfgMu.RUnlock()
	return r.cfg
}

// StepsDone is the number of completed steps.
func (r *Run) StepsDone() int { return r.step }

// Script returns the script version the run executes.
func (r *Run) Script() *script.Script { return r.script }

// State returns the run-wide store of `state`.
func (r *Run) State() *script.State { return r.state }

// Close stops the dispatchers and closes every engine the run opened.
func (r *Run) Close() error {
	r.cancel()
	if r.sandbox != nil {
		r.sandbox.close()
	}
	errs := []error{r.agents.Close()}
	r.pols.each(func(p *policy) {
		if _, given := r.opts.Engines[p.name]; !given && p.eng != nil {
			errs = append(errs, p.eng.Close())
		}
		if p.replicas != nil {
			errs = append(errs, p.replicas.Close())
		}
	})
	errs = append(errs, r.rec.close(r.trainErr.Load()), r.events.close(), r.metrics.close(), r.lock.release())
	return errors.Join(errs...)
}

// sampling returns the rollout defaults of the current config.
func (r *Run) sampling() engines.Sampling {
	c := r.Config()
	return engines.Sampling{
		MaxTokens: c.Rollout.MaxResponseLen, Temperature: c.Rollout.Temperature,
		TopP: c.Rollout.TopP, Stop: c.Rollout.Stop,
	}
}

// StepResult is what one step did: one metrics record per policy plus the run-wide record.
type StepResult struct {
	Step     int
	Policies []Metrics // sorted by policy name
	Run      Metrics   // policy "_run"
	Eval     []Metrics // policy "_eval", one per dataset, on eval steps
	Failed   []*RolloutError
}

// shownFailures is how many failed rollouts a step shows in full on the run's log.
const shownFailures = 3

// Steps runs n steps (or, for n ≤ 0, the config's run.steps minus those done).
func (r *Run) Steps(ctx context.Context, n int) error {
	if n <= 0 {
		n = r.Config().Run.Steps - r.step
	}
	for i := 0; i < n; i++ {
		if _, err := r.Step(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Step runs one step (docs/architecture.md, "One step"): rollouts, advantages, training, metrics. A step that does not
// complete (abandoned on a signal, stopped by an error before its training and metrics) leaves
// the `state` store as it was after the last step that did.
func (r *Run) Step(ctx context.Context) (*StepResult, error) {
	before, snap := r.step, r.state.Snapshot()
	res, err := r.runStep(ctx)
	if r.step == before {
		r.state.Restore(snap)
	}
	var tf *tooManyFailed
	if errors.As(err, &tf) && r.rollBack(before+1, err) {
		// A new version's first step failed: the last good version runs the step again.
		r.async.discard("reload: rollback")
		res, err = r.runStep(ctx)
		if r.step == before {
			r.state.Restore(snap)
		}
	}
	return res, err
}

// runStep is Step without the rollback of the state store. Its phases: the step begins (the run
// folder checked, a reload swapped in, the eval before training when due), its rollouts come in,
// the policies train on them, the step's metrics and record are written, and the step ends with
// eval and a checkpoint when due.
func (r *Run) runStep(ctx context.Context) (*StepResult, error) {
	step := r.step + 1
	cfg, err := r.beginStep(ctx, step)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	l, res, rolloutS, err := r.stepRollouts(ctx, step, cfg)
	if err != nil {
		return nil, err
	}
	t1 := time.Now()
	pm, err := r.trainer.train(ctx, step, cfg, l.ros, rolloutS, l.version)
	if err != nil {
		return nil, err
	}
	trainS := time.Since(t1).Seconds()
	if err := r.lock.checkFolder(r.opts.Out, r.step, r.LastCheckpoint); err != nil {
		return nil, err
	}
	res.Policies = pm
	res.Run = runMetrics(step, l.ros, res, rolloutS, l.genS, trainS, time.Since(t0).Seconds(), r.logNames.sums(step, l.ros, r.events))
	if err := r.recordStep(res, l, cfg.Rollout.MaxStaleness); err != nil {
		return nil, err
	}
	if err := r.endStep(ctx, step, cfg, res); err != nil {
		return nil, err
	}
	return res, nil
}

// beginStep begins step: it checks the run folder, readies the restart guard, swaps in a
// reloaded script or config, and runs the eval before training (before step 1, when due). It
// returns the config the step runs under.
func (r *Run) beginStep(ctx context.Context, step int) (*config.Config, error) {
	if err := r.lock.checkFolder(r.opts.Out, r.step, r.LastCheckpoint); err != nil {
		return nil, err
	}
	r.restart.stepStarting(r.step, r.ckpt.have && r.ckpt.step == r.step)
	if err := r.applyReload(ctx, step); err != nil {
		return nil, err
	}
	cfg := r.Config()
	if step == 1 && evalDue(r.Config(), 0) {
		if _, err := r.evalAndLog(ctx); err != nil {
			return nil, err
		}
	}
	return cfg, nil
}

// stepRollouts waits for the rollouts of step (launched now, or earlier by the asynchronous
// loop) and sorts out what failed in them into res; then, with rollout.max_staleness K > 0, it
// launches the next steps' rollouts, which run while this one trains. rolloutS is the seconds it
// waited for the rollouts. A step whose rollouts a stop cut short ends here (StepCut): a step is
// saved only whole.
func (r *Run) stepRollouts(ctx context.Context, step int, cfg *config.Config) (l *launched, res *StepResult, rolloutS float64, err error) {
	t0 := time.Now()
	k := cfg.Rollout.MaxStaleness
	if cfg.Rollout.Partial && k > 0 {
		// The rollouts running continue their long generations from the weights just trained.
		if err := r.vers.need(ctx, r.pols.list(), r.step, r.step, k); err != nil {
			return nil, nil, 0, err
		}
	}
	if l, err = r.awaitStep(ctx, step, cfg); err != nil {
		return nil, nil, 0, err
	}
	rolloutS = time.Since(t0).Seconds()
	if err := stepCut(step, l.ros, cfg.Rollout.StopGraceS); err != nil { // saved only whole
		r.async.discard("")
		return nil, nil, 0, err
	}
	res = &StepResult{Step: step}
	if err := r.rolloutFailures(ctx, cfg, res, l.ros); err != nil {
		return nil, nil, 0, err
	}
	if err := r.launchAhead(ctx, step, cfg); err != nil { // with K > 0, the next steps' rollouts run while this one trains
		return nil, nil, 0, err
	}
	return l, res, rolloutS, nil
}

// recordStep records the step of res, whose rollouts l ran under rollout.max_staleness k: the
// asynchronous loop's metrics, the step counter and the data position, the metrics lines of
// metrics.jsonl, and rollouts.jsonl and the observers.
func (r *Run) recordStep(res *StepResult, l *launched, k int) error {
	r.async.metrics(res, l, k, r.pols.list())
	r.step, r.next = res.Step, r.next+l.n
	if err := r.metrics.writeLines(append(append([]Metrics(nil), res.Policies...), res.Run)); err != nil {
		return err
	}
	r.rec.step(res.Step, l.ros, res)
	return nil
}

// endStep ends step, recorded in res: the eval when due, into res.Eval, then a checkpoint when
// run.save_interval or run.save_minutes say so; the restart guard learns whether it checkpointed.
func (r *Run) endStep(ctx context.Context, step int, cfg *config.Config, res *StepResult) (err error) {
	if evalDue(r.Config(), step) {
		if res.Eval, err = r.evalAndLog(ctx); err != nil {
			return err
		}
	}
	checkpointed := false
	if r.opts.Out != "" && (cfg.Run.SaveInterval > 0 && step%cfg.Run.SaveInterval == 0 || r.ckpt.due(cfg.Run.SaveMinutes)) {
		if _, err := r.Checkpoint(ctx); err != nil {
			return r.restart.cause(err)
		}
		checkpointed = true
	}
	r.restart.stepDone(step, checkpointed)
	return nil
}

// rolloutFailures sorts out what failed in a step's rollouts. An engine that failed after its own
// retries is not the script's fault: dropping the rollouts that met it would bias the step, so
// the run stops and can resume later; so does one that restarted and could not be given its
// state back. Failed rollouts are reported in res and logged; more than
// rollout.max_failed_fraction of them stop the run.
func (r *Run) rolloutFailures(ctx context.Context, cfg *config.Config, res *StepResult, ros []*script.Rollout) error {
	if err := r.restart.failure(); err != nil {
		return err
	}
	for _, p := range r.pols.list() {
		if err := p.disp.takeErr(); err != nil && ctx.Err() == nil {
			return &EngineError{Step: res.Step, Policy: p.name, Err: err, Hint: engineErrorHint(r.opts.Out)}
		}
	}
	var first *RolloutError
	cancelled := 0 // cancelled by a stopping run: not the script's failures
	for _, ro := range ros {
		var sc *StopCancelled
		if ro.Err != nil && errors.As(context.Cause(ro.Ctx), &sc) {
			cancelled++
		}
		if ro.Err != nil {
			re := &RolloutError{Step: res.Step, TaskID: ro.Task.ID, Msg: script.ErrorText(ro.Err)}
			res.Failed = append(res.Failed, re)
			if len(res.Failed) <= shownFailures {
				r.events.printf("%s", re.Error())
			} else {
				r.events.filef("%s", re.Error())
			}
			if first == nil {
				first = re
			}
		}
	}
	if len(res.Failed) > shownFailures {
		r.events.split(fmt.Sprintf("step %d: %d more rollouts failed (all in events.log)", res.Step, len(res.Failed)-shownFailures),
			fmt.Sprintf("step %d: %d rollouts failed in all, %d of them shown on the terminal", res.Step, len(res.Failed), shownFailures))
	}
	if first != nil && len(ros) > 0 && float64(len(res.Failed)-cancelled)/float64(len(ros)) > cfg.Rollout.MaxFailedFraction {
		return &tooManyFailed{fmt.Sprintf("step %d: %d of %d rollouts failed, more than rollout.max_failed_fraction (%g); the run stops. First failure:\n%s",
			res.Step, len(res.Failed), len(ros), cfg.Rollout.MaxFailedFraction, first.Error())}
	}
	return nil
}

// rolloutFn is the function rollouts call: its value in-process, its name in a sandbox child
// (where default_eval is compiled for policies and n samples).
type rolloutFn struct {
	fn       starlark.Callable
	name     string // rollout | eval_rollout | default_eval
	policies []string
	n        int
}

// runRollouts calls fn(task) for every task, each on its own goroutine (or, sandboxed, in child
// processes). eval, when not nil, marks eval rollouts: they sample with its settings and may not
// train. version ≥ 0 is the weights version the trainable policies generate from; -1:
// their current weights.
func (r *Run) runRollouts(ctx context.Context, step int, tasks []Task, samples int, rf rolloutFn, eval *engines.Sampling,
	version int) ([]*script.Rollout, error) {
	if version >= 0 {
		ctx = withVersion(ctx, version, contVersion(step, r.Config().Rollout.MaxStaleness))
	}
	stepCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go r.cancelOnStop(stepCtx, cancel)
	pass := script.Pass{Host: localHost{r}, Ctx: stepCtx, RunID: r.id, Number: int(r.passes.Add(1)), Step: step,
		Seed: r.Config().Run.Seed, Eval: eval, Samples: samples, Agents: &r.agents}
	ros := pass.Rollouts(tasks)
	n := len(ros)
	r.live.begin(int64(pass.Number), n, eval != nil, r.generating.busy())
	r.activity.add(n)
	if r.sandbox != nil {
		r.runSandboxed(stepCtx, int64(pass.Number), ros, rf.name, rf.policies, rf.n)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return ros, nil
	}
	fn := rf.fn
	var wg sync.WaitGroup
	for _, ro := range ros {
		wg.Add(1)
		go func(ro *script.Rollout) {
			defer wg.Done()
			defer r.live.rolloutDone(int64(pass.Number))
			defer r.activity.leave()
			if limit := r.Config().Rollout.TimeoutS; limit > 0 {
				var stop context.CancelFunc
				ro.Ctx, stop = context.WithTimeoutCause(ro.Ctx, seconds(limit), &RolloutTimeout{Limit: limit})
				defer stop()
			}
			th := ro.NewThread(nil)
			ro.Result, ro.Err = ro.Call(th, fn, starlark.Tuple{script.TaskValue(ro.Task, step)})
			if ro.Err == nil {
				ro.Err = ro.CheckQueued()
			}
		}(ro)
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return ros, nil
}

// openOutputs opens the run directory: its lock, events.log, metrics.jsonl, the script's copy
// and config.yaml. A run without a directory writes only to its Log writer.
func (r *Run) openOutputs() error {
	out := r.opts.Out
	r.events = &eventLog{w: r.opts.Log}
	r.metrics = &metricsWriter{}
	r.rec.out, r.rec.events = out, r.events
	r.ckpt.out, r.ckpt.events = out, r.events
	r.async.events = r.events
	r.trainer.events = r.events
	r.vers = versionKeeper{cfg: r.Config, events: r.events, out: out, given: r.opts.Engines,
		open: r.opts.OpenEngine, act: &r.activity}
	if out == "" {
		return nil
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		// Bad input (--out or run.out), not a failed run.
		return script.Errorf("run directory %s cannot be made: %w; choose another --out (or run.out)", out, err)
	}
	// One writer per run folder, before anything is written there.
	lock, err := lockRunDir(out)
	if err != nil {
		return err
	}
	r.lock = lock
	if err := r.events.open(filepath.Join(out, "events.log")); err != nil {
		return err
	}
	if h := lock.stale; h != nil {
		r.events.printf("lock: %s was left locked by %s, which ended without releasing it (a crash or a kill); this run (pid %d) holds it now", lock.path,
			h, os.Getpid())
	}
	if err := r.metrics.open(filepath.Join(out, "metrics.jsonl"), r.events); err != nil {
		return err
	}
	if err := saveScriptVersion(out, r.script, 1); err != nil {
		return err
	}
	return r.writeConfig()
}

// writeConfig writes the resolved config into the run directory.
func (r *Run) writeConfig() error {
	if r.opts.Out == "" {
		return nil
	}
	y, err := r.Config().Marshal()
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(r.opts.Out, "config.yaml"), y, 0o644)
}

// newRunID is a random id of this process's run, part of its optimizer step ids.
func newRunID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// samplesPerTask is how many times each task of a step runs: the largest n_samples_per_prompt of
// the trainable policies (slime's n samples of a prompt). A rollout samples every policy it calls,
// so the policies of one script cannot run a task a different number of times each.
func samplesPerTask(cfg *config.Config) int {
	n := 1
	for _, p := range cfg.Policies {
		if p.Trainable {
			n = max(n, p.Train.NSamplesPerPrompt)
		}
	}
	return n
}
