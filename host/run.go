package host

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/advantage"
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
	// rollouts, and each eval's, as the run records them (observe.go); their errors are logged,
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
}

// Task is one unit of work handed to rollout(task).
type Task = tasks.Task

// ScriptError is a problem with the user's script or config: the CLI exits 2 on it.
type ScriptError = script.Error

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
	rec      recorder   // rollouts.jsonl and what a step's record needs (rollout_record.go)
	obs      *observers // Options.Observers and run.tensorboard's, once started (observe.go)
	lock     *runLock   // the run folder's lock (runlock.go); nil without a folder
	// logNames are the log() names the run has written to its _run lines (at most
	// script.MaxLogNamesPerRun; runMetrics).
	logNames map[string]bool

	ctx    context.Context // lives as long as the run; dispatchers stop with it
	cancel context.CancelFunc

	polMu sync.Mutex
	bases loraBases // the base models the LoRA policies share
	// adapterBatchers send the generate batches of the LoRA policies on one base together.
	adapterBatchers map[engines.AdapterGenerator]*adapterBatcher
	policies        map[string]*policy
	openErrs        map[string]error // zero-config policies whose engine failed to open: not retried
	order           []string         // policy names in config order, then first use

	id      string    // random per process: part of optimizer step ids
	wd      string    // the absolute working directory the run started in (run.json's dir)
	step    int       // steps completed
	next    int       // index of the first task of the next step: the data position
	reload  *reloader // nil unless Watch was called
	sandbox *pool     // nil unless the run is sandboxed

	ckpt checkpoints // what the run remembers of its checkpoints (checkpoint.go)

	// ahead are the rollouts launched for steps not yet trained, in step order (async.go).
	ahead     []*launched
	launchPos int          // the data position after the steps launched (async.go)
	kept      map[int]bool // the weights versions the trainable policies keep
	gate      versionGate  // opens when a version is kept, for partial rollouts
	// lastStepEnd is when the last step ended, for engine_busy.
	lastStepEnd time.Time

	warned sync.Map // warnings given once per run, by key

	stopping atomic.Bool   // Stop was called: Train ends after the step in progress
	stopped  chan struct{} // closed by the first Stop: rollouts get rollout.stop_grace_s more
	stopOnce sync.Once

	passes  atomic.Int64 // rollout passes so far (steps, eval datasets): part of generate request ids
	restart restartGuard // what puts a restarted engine's state back (restart.go)

	// live is the rollout pass in progress (a step's or an eval's), for progress displays; genMark
	// is generating's total when it began.
	live struct {
		done, total, tokens, genMark atomic.Int64
		eval                         atomic.Bool
		// pass is the number of the pass shown, the newest: rollout.max_staleness > 1 runs
		// several at once, and only the shown one's rollouts count in done.
		pass atomic.Int64
	}
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
func (r *Run) Live() LivePass {
	return LivePass{Done: int(r.live.done.Load()), Total: int(r.live.total.Load()), Tokens: int(r.live.tokens.Load()),
		Eval: r.live.eval.Load(), Generating: r.generating.busy() - time.Duration(r.live.genMark.Load())}
}

// policy is one policy's engine and its dispatcher.
type policy struct {
	name     string
	cfg      config.PolicyConfig
	eng      engines.Engine
	disp     *dispatcher
	busy     *busyMeter // the engine's generate, train and save calls
	replicas *replicas  // the rollout replicas the run opened for it (replica.go); nil: none
	// busyMark is busy's total at the end of the last step.
	busyMark time.Duration

	infoMu sync.Mutex
	info   *engines.Info // the engine's Info as chat turns render with it; nil: ask again
}

// chatInfo is the engine's Info for rendering chat turns (template, EOS, context), asked once and
// kept until forgetInfo: a chat renders at every turn, and a remote or torch engine's Info is a
// round trip.
func (p *policy) chatInfo(ctx context.Context) (engines.Info, error) {
	p.infoMu.Lock()
	defer p.infoMu.Unlock()
	if p.info != nil {
		return *p.info, nil
	}
	info, err := p.eng.Info(ctx)
	if err != nil {
		return engines.Info{}, err
	}
	p.info = &info
	return info, nil
}

// forgetInfo drops the kept Info: the engine restarted as a new process, or the run's
// configuration was reloaded, and the next render asks the engine again.
func (p *policy) forgetInfo() {
	p.infoMu.Lock()
	p.info = nil
	p.infoMu.Unlock()
}

// Load reads the script, resolves the configuration and opens the engines.
func Load(ctx context.Context, scriptPath string, opts Options) (*Run, error) {
	r := newRun(opts)
	sandboxed := opts.Sandbox || r.cfg.Sandbox.Enabled
	if sandboxed && (len(opts.Builtins) > 0 || len(opts.Modules) > 0) {
		r.cancel()
		return nil, &ScriptError{Msg: "a sandboxed run cannot have Options.Builtins or Options.Modules: they are Go values of this process, and the script runs in child processes"}
	}
	s, err := script.Load(scriptPath, r.scriptOptions(sandboxed))
	if err != nil {
		r.cancel()
		return nil, err
	}
	r.script = s
	if sandboxed {
		r.cfg.Sandbox.Enabled = true
		r.sandbox = newSandbox(r, opts.SandboxCommand)
		// The first child runs the script's top level under the sandbox's limits: a script that
		// does not load fails here, with the child's message.
		if _, err := r.sandbox.pick(); err != nil {
			r.Close()
			return nil, &ScriptError{Msg: err.Error()}
		}
	}
	if err := r.openOutputs(); err != nil {
		r.Close()
		return nil, err
	}
	if r.tasks == nil {
		if err := r.openTasks(); err != nil {
			return nil, r.notStarted(err)
		}
	}
	if err := r.checkEvalData(); err != nil { // eval.go
		return nil, r.notStarted(err)
	}
	if err := r.checkScript(); err != nil { // scriptcheck.go
		return nil, r.notStarted(err)
	}
	if err := r.openPolicies(ctx); err != nil {
		return nil, r.notStarted(err)
	}
	if err := r.checkSaveFolders(); err != nil { // policies' save: folders (checkpoint.go)
		return nil, r.notStarted(err)
	}
	r.events.printf("loaded %s (sha256 %s); %s", s.Path, s.Hash[:12], policiesLoaded(r.cfg.Policies))
	for _, w := range r.cfg.Warnings {
		r.events.printf("config: %s", w)
	}
	for _, p := range r.cfg.Policies {
		// The engines the host runs read none of slime-n's parallelism and server settings: say
		// so once (a torch worker takes its own flags from engine.args).
		k, err := engineKind(p.Engine.Kind)
		if keys := p.PassThrough(); err == nil && !k.PassThrough && len(keys) > 0 {
			r.events.printf("config: policy %q: the %s engine ignores %s", p.Name, p.Engine.Kind, strings.Join(keys, ", "))
		}
	}
	if err := r.refuseScoringWithoutScore(); err != nil {
		return nil, r.notStarted(err)
	}
	if r.zero {
		if err := r.openScriptPolicies(); err != nil {
			return nil, r.notStarted(err)
		}
	}
	if r.opts.Out != "" {
		r.events.printf("checkpoints: %s", checkpointPlan(r.cfg.Run))
	}
	r.ckpt.since = time.Now()
	return r, nil
}

// notStarted says in events.log (where the run folder has one) why the run does not start, and
// closes the run: a folder read later says why it holds no step.
func (r *Run) notStarted(err error) error {
	r.events.filef("stop: the run does not start: %v", err)
	r.Close()
	return err
}

// checkpointPlan says when a run checkpoints and how many it keeps, for its start-up line.
func checkpointPlan(c config.RunConfig) string {
	var when []string
	if c.SaveInterval > 0 {
		when = append(when, fmt.Sprintf("every %d steps (run.save_interval)", c.SaveInterval))
	}
	if c.SaveMinutes > 0 {
		when = append(when, fmt.Sprintf("after the first step past %g minutes since the last (run.save_minutes)", c.SaveMinutes))
	}
	when = append(when, "at the end or on a signal")
	keep := "all kept"
	if c.KeepCheckpoints > 0 {
		keep = fmt.Sprintf("the newest %d kept (run.keep_checkpoints)", c.KeepCheckpoints)
	}
	return strings.Join(when, ", ") + "; " + keep
}

// refuseScoringWithoutScore stops a run at start-up, not at its first score call, when its
// script scores with a policy whose engine only generates (kind openai: the OpenAI API returns
// no log-probabilities of given tokens): score("judge", …) or train(…, teacher="judge") with the
// name written literally. (Training such a policy is refused by the config check.)
func (r *Run) refuseScoringWithoutScore() error {
	for _, u := range script.ScoringUses(r.script) {
		for _, p := range r.cfg.Policies {
			if p.Name != u.Name || p.Engine.Kind != "openai" {
				continue
			}
			call := fmt.Sprintf("score(%q, …)", u.Name)
			if u.Fn == "train" {
				call = fmt.Sprintf("train(…, teacher=%q)", u.Name)
			}
			return fmt.Errorf("%s: %s scores with policy %q, whose engine (kind openai, %s:%d) only generates: the OpenAI API returns no log-probabilities of given tokens; score with a tiny, torch or remote policy",
				u.Pos, call, u.Name, r.cfgName(), p.Line)
		}
	}
	return nil
}

// openScriptPolicies starts, in a zero-config run, the policies the script names literally, so
// that they are listed at start-up and in config.yaml before the first step (names a script
// computes are still created when first used), and warns about names a typo apart.
func (r *Run) openScriptPolicies() error {
	uses := script.PolicyNames(r.script)
	for _, w := range script.NearPolicyNames(uses) {
		r.events.printf("warning: %s", w)
	}
	chat := map[string]bool{} // names a chat() with tool schemas uses: on the embedded chat model
	for _, u := range uses {
		chat[u.Name] = chat[u.Name] || u.Tools
	}
	for _, u := range uses {
		checkpoint := config.BuiltinCheckpoint
		if chat[u.Name] {
			checkpoint = config.BuiltinChatCheckpoint
		}
		if _, err := r.policyOn(u.Name, checkpoint); err != nil {
			return fmt.Errorf("%s: %w", u.Pos, err)
		}
	}
	return r.writeConfig()
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
	r := &Run{opts: opts, state: script.NewState(), policies: map[string]*policy{}, tasks: opts.Tasks, id: newRunID(),
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
	return r
}

// atOnce runs fn(0), …, fn(n−1) at the same time and returns their errors, by index.
func atOnce(n int, fn func(i int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	return errs
}

// openPolicies opens the config's policies. Their engines start at the same time (eight torch
// workers, each with its start-up of several seconds, started one after another before), except
// those that share an engine (addToLane: LoRA policies join their shared bases one at a time, in
// config order); then the policies are registered in config order.
func (r *Run) openPolicies(ctx context.Context) error {
	pcs := r.cfg.Policies
	at := map[string]int{} // a policy's index in pcs
	var lanes [][]*policy
	for i, pc := range pcs {
		at[pc.Name] = i
		lanes = addToLane(lanes, &policy{name: pc.Name, cfg: pc, eng: r.opts.Engines[pc.Name]})
	}
	engs, errs := make([]engines.Engine, len(pcs)), make([]error, len(pcs))
	atOnce(len(lanes), func(l int) error {
		for _, p := range lanes[l] {
			i := at[p.name]
			engs[i], errs[i] = r.openPolicyEngine(ctx, pcs[i])
		}
		return nil
	})
	for i, pc := range pcs {
		if errs[i] == nil {
			_, errs[i] = r.registerPolicy(ctx, pc, engs[i])
		}
		if errs[i] != nil {
			for j := i + 1; j < len(pcs); j++ { // opened, never registered
				if _, given := r.opts.Engines[pcs[j].Name]; !given && engs[j] != nil {
					engs[j].Close()
				}
			}
			return errs[i]
		}
	}
	return nil
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
	var errs []error
	r.polMu.Lock()
	for _, name := range r.order {
		p := r.policies[name]
		if _, given := r.opts.Engines[name]; !given && p.eng != nil {
			errs = append(errs, p.eng.Close())
		}
		if p.replicas != nil {
			errs = append(errs, p.replicas.Close())
		}
	}
	r.polMu.Unlock()
	errs = append(errs, r.closeRecord(), r.events.close(), r.metrics.close(), r.lock.release())
	return errors.Join(errs...)
}

func (r *Run) addPolicy(ctx context.Context, pc config.PolicyConfig) (*policy, error) {
	eng, err := r.openPolicyEngine(ctx, pc)
	if err != nil {
		return nil, err
	}
	return r.registerPolicy(ctx, pc, eng)
}

// openPolicyEngine returns the engine of policy pc: the one Options.Engines gives, or a new one.
func (r *Run) openPolicyEngine(ctx context.Context, pc config.PolicyConfig) (engines.Engine, error) {
	eng := r.opts.Engines[pc.Name]
	if eng == nil {
		open := r.opts.OpenEngine
		if open == nil {
			open = func(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
				return openEngine(ctx, p, r.opts.Out, engineLogs{printf: r.events.printf, worker: r.events.filef, restarted: r.engineRestarted, bases: &r.bases, cfg: r.cfg})
			}
		}
		var err error
		if eng, err = open(ctx, pc); err != nil {
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, r.cfgPlace(&policy{cfg: pc}), err)
		}
	}
	return eng, nil
}

// registerPolicy makes policy pc of its engine eng (closed on an error unless Options.Engines
// gave it) and starts its dispatcher.
func (r *Run) registerPolicy(ctx context.Context, pc config.PolicyConfig, eng engines.Engine) (*policy, error) {
	_, given := r.opts.Engines[pc.Name]
	if !given && r.opts.OpenEngine == nil && offHost(pc) { // a server this run reached itself
		// After the policies before it are registered: it checks that no two trainable
		// policies share one server process.
		// The folders first: a run refused for them leaves the server's state as it was.
		if err := r.checkServerFolders(ctx, pc, eng); err != nil { // engine.go
			eng.Close()
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, r.cfgPlace(&policy{cfg: pc}), err)
		}
		if err := r.claimServer(ctx, pc, eng); err != nil { // engine.go
			eng.Close()
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, r.cfgPlace(&policy{cfg: pc}), err)
		}
	}
	if err := r.checkTIS(ctx, pc.Name, pc, eng); err != nil {
		if !given {
			eng.Close()
		}
		return nil, err
	}
	p := &policy{name: pc.Name, cfg: pc, eng: eng, busy: &busyMeter{}}
	p.disp = newDispatcher(eng, &r.activity, maxBatchSamples(r.cfg))
	p.disp.busy, p.disp.generating = p.busy, &r.generating
	if v, ok := eng.(engines.AdapterView); ok && crossPolicyBatching {
		// A LoRA policy on a shared base: its batches go out with the other adapters' batches.
		base := v.AdapterBase()
		bt := r.adapterBatchers[base]
		if bt == nil {
			bt = newAdapterBatcher(base.GenerateAdapters, &r.activity)
			if r.adapterBatchers == nil {
				r.adapterBatchers = map[engines.AdapterGenerator]*adapterBatcher{}
			}
			r.adapterBatchers[base] = bt
		}
		name := v.AdapterName()
		bt.join(name, p.disp)
		p.disp.gen = func(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
			return bt.generate(ctx, name, reqs)
		}
	}
	go p.disp.loop(r.ctx)
	r.policies[pc.Name] = p
	r.order = append(r.order, pc.Name)
	return p, nil
}

func maxBatchSamples(c *config.Config) int {
	if c.Rollout.MaxBatchTokens > 0 {
		return max(1, c.Rollout.MaxBatchTokens/max(1, c.Rollout.MaxResponseLen))
	}
	return 1024
}

// policyFor returns a policy by name. Zero-config runs create it on first use, on
// config.BuiltinCheckpoint.
func (r *Run) policyFor(name string) (*policy, error) {
	return r.policyOn(name, config.BuiltinCheckpoint)
}

// policyOn is policyFor with the checkpoint a zero-config run creates the policy on.
func (r *Run) policyOn(name, checkpoint string) (*policy, error) {
	r.polMu.Lock()
	defer r.polMu.Unlock()
	if p, ok := r.policies[name]; ok {
		return p, nil
	}
	if !r.zero {
		hint := ""
		if best := script.ClosestName(name, r.order); best != "" {
			hint = fmt.Sprintf(" (did you mean %q?)", best)
		}
		return nil, fmt.Errorf("unknown policy %q%s; %s defines %s — add it under policies: or fix the name", name, hint, r.cfgName(), config.QuotePolicyNames(r.order))
	}
	if err := config.CheckPolicyName(name); err != nil {
		return nil, fmt.Errorf("%v (a zero-config run creates each policy under the name the script passes, which must be a name a config may give it)", err)
	}
	if err := r.openErrs[name]; err != nil {
		return nil, err
	}
	pc := config.DefaultPolicy(name)
	pc.HFCheckpoint, pc.Engine.ModelPath = checkpoint, checkpoint
	p, err := r.addPolicy(r.ctx, pc)
	if err != nil {
		if r.openErrs == nil {
			r.openErrs = map[string]error{}
		}
		r.openErrs[name] = err
		return nil, err
	}
	r.cfgMu.Lock()
	r.cfg.Policies = append(r.cfg.Policies, pc)
	r.cfgMu.Unlock()
	r.events.printf("zero-config: policy %q on %s (%s engine)", name, pc.HFCheckpoint, pc.Engine.Kind)
	if r.step > 0 || r.live.total.Load() > 0 {
		// A name the script computed, created mid-run: config.yaml lists it too.
		if err := r.writeConfig(); err != nil {
			r.events.printf("config.yaml: %v", err)
		}
	}
	return p, nil
}

func (r *Run) cfgName() string {
	if r.cfg.File != "" {
		return r.cfg.File
	}
	return "the config"
}

// cfgPlace names where a policy was configured, for messages: " in policies.yaml:7".
func (r *Run) cfgPlace(p *policy) string {
	if r.cfg.File != "" && p.cfg.Line > 0 {
		return fmt.Sprintf(" in %s:%d", r.cfg.File, p.cfg.Line)
	}
	return ""
}

// sampling returns the rollout defaults of the current config.
func (r *Run) sampling() engines.Sampling {
	c := r.Config()
	return engines.Sampling{
		MaxTokens: c.Rollout.MaxResponseLen, Temperature: c.Rollout.Temperature,
		TopP: c.Rollout.TopP, Stop: c.Rollout.Stop,
	}
}

// score scores one request of a rollout: through the policy's dispatcher, which batches the score
// calls of all rollouts as it does their generate calls, at the weights version the rollout
// samples from.
func (r *Run) score(ctx context.Context, p *policy, req engines.ScoreRequest) ([]float32, error) {
	return p.disp.score(ctx, req, versionFor(ctx, p).gen)
}

// StepResult is what one step did: one metrics record per policy plus the run-wide record.
type StepResult struct {
	Step     int
	Policies []Metrics // sorted by policy name
	Run      Metrics   // policy "_run"
	Eval     []Metrics // policy "_eval", one per dataset, on eval steps
	Failed   []*RolloutError
}

// EngineError stops a run: a policy's engine failed (after the retries of its client).
type EngineError struct {
	Step   int
	Policy string
	Err    error
	Hint   string // how to go on (the run's resume command); "" gives a general hint
}

func (e *EngineError) Error() string {
	if e.Hint != "" {
		return fmt.Sprintf("step %d: the engine of policy %q failed: %v; the run stops: %s", e.Step, e.Policy, e.Err, e.Hint)
	}
	return fmt.Sprintf("step %d: the engine of policy %q failed: %v; the run stops (resume from its last checkpoint with --resume once the engine is back)", e.Step, e.Policy, e.Err)
}

func (e *EngineError) Unwrap() error { return e.Err }

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

// shownFailures is how many failed rollouts a step shows in full on the run's log.
const shownFailures = 3

// evalDue says whether the eval datasets run after the given step (step 0: before training).
func (r *Run) evalDue(step int) bool {
	c := r.Config()
	return len(c.Eval.Datasets) > 0 && c.Run.EvalInterval > 0 && step%c.Run.EvalInterval == 0
}

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
		r.discardAhead("reload: rollback")
		res, err = r.runStep(ctx)
		if r.step == before {
			r.state.Restore(snap)
		}
	}
	return res, err
}

// runStep is Step without the rollback of the state store.
func (r *Run) runStep(ctx context.Context) (*StepResult, error) {
	step := r.step + 1
	if err := r.checkFolder(); err != nil { // reliability.go
		return nil, err
	}
	r.restart.stepStarting(r.step, r.ckpt.have && r.ckpt.step == r.step)
	if err := r.applyReload(ctx, step); err != nil {
		return nil, err
	}
	cfg := r.Config()
	if step == 1 && r.evalDue(0) {
		if _, err := r.evalAndLog(ctx); err != nil {
			return nil, err
		}
	}
	t0 := time.Now()
	k := cfg.Rollout.MaxStaleness
	if cfg.Rollout.Partial && k > 0 {
		// The rollouts running continue their long generations from the weights just trained.
		if err := r.needVersion(ctx, r.step, k); err != nil {
			return nil, err
		}
	}
	l, err := r.awaitStep(ctx, step, cfg)
	if err != nil {
		return nil, err
	}
	ros, n := l.ros, l.n
	rolloutS := time.Since(t0).Seconds()
	if err := stepCut(step, ros, cfg.Rollout.StopGraceS); err != nil { // saved only whole
		r.discardAhead("")
		return nil, err
	}
	res := &StepResult{Step: step}
	if err := r.rolloutFailures(ctx, cfg, res, ros); err != nil {
		return nil, err
	}
	if err := r.launchAhead(ctx, step, cfg); err != nil { // with K > 0, the next steps' rollouts run while this one trains
		return nil, err
	}
	t1 := time.Now()
	// Training is not cut short by a cancelled context: an abandoned step stops in its rollouts,
	// never between two optimizer steps of a policy.
	pm, err := r.trainPolicies(context.WithoutCancel(ctx), step, cfg, ros, rolloutS, l.version)
	if err != nil {
		return nil, r.restart.cause(err)
	}
	r.warnNothingTrained(step, ros, pm) // advantage.go
	trainS := time.Since(t1).Seconds()
	if err := r.checkFolder(); err != nil {
		return nil, err
	}
	res.Policies = pm
	res.Run = r.runMetrics(step, ros, res, rolloutS, l.genS, trainS, time.Since(t0).Seconds())
	r.asyncMetrics(res, l, k)
	r.step, r.next = step, r.next+n
	if err := r.metrics.writeLines(append(append([]Metrics(nil), res.Policies...), res.Run)); err != nil {
		return nil, err
	}
	r.recordStep(step, ros, res) // rollout_record.go
	if r.evalDue(step) {
		if res.Eval, err = r.evalAndLog(ctx); err != nil {
			return nil, err
		}
	}
	checkpointed := false
	if r.opts.Out != "" && (cfg.Run.SaveInterval > 0 && step%cfg.Run.SaveInterval == 0 || r.ckpt.due(cfg.Run.SaveMinutes)) {
		if _, err := r.Checkpoint(ctx); err != nil {
			return nil, r.restart.cause(err)
		}
		checkpointed = true
	}
	r.restart.stepDone(step, checkpointed)
	return res, nil
}

// evalAndLog runs the eval datasets, writes their metrics and calls Options.AfterEval.
func (r *Run) evalAndLog(ctx context.Context) ([]Metrics, error) {
	evs, err := r.Eval(ctx)
	if err != nil {
		return nil, err
	}
	if err := r.metrics.writeLines(evs); err != nil {
		return nil, err
	}
	r.recordEval(evs)
	r.afterEval()
	return evs, nil
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
	for _, p := range r.policyList() {
		if err := p.disp.takeErr(); err != nil && ctx.Err() == nil {
			return &EngineError{Step: res.Step, Policy: p.name, Err: err, Hint: r.engineErrorHint()}
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
// train. version ≥ 0 is the weights version the trainable policies generate from (async.go); -1:
// their current weights.
func (r *Run) runRollouts(ctx context.Context, step int, tasks []Task, samples int, rf rolloutFn, eval *engines.Sampling, version int) ([]*script.Rollout, error) {
	if version >= 0 {
		ctx = withVersion(ctx, version, contVersion(step, r.Config().Rollout.MaxStaleness))
	}
	stepCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go r.cancelOnStop(stepCtx, cancel)
	pass := script.Pass{Host: localHost{r}, Ctx: stepCtx, RunID: r.id, Number: int(r.passes.Add(1)), Step: step,
		Seed: r.Config().Run.Seed, Eval: eval, Samples: samples}
	ros := pass.Rollouts(tasks)
	n := len(ros)
	r.live.pass.Store(int64(pass.Number))
	r.live.done.Store(0)
	r.live.total.Store(int64(n))
	r.live.tokens.Store(0)
	r.live.eval.Store(eval != nil)
	r.live.genMark.Store(int64(r.generating.busy()))
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
			defer r.rolloutDone(int64(pass.Number))
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

// rolloutDone counts a finished rollout of pass on the live line, if that pass is the one shown.
func (r *Run) rolloutDone(pass int64) {
	if r.live.pass.Load() == pass {
		r.live.done.Add(1)
	}
}

// trainSample is a queued sample of a successful rollout, in deterministic order.
type trainSample struct {
	script.Queued
	task    int
	reward  float64
	version int // the weights version it was generated from; -1: the current one (K = 0)
}

// trainPolicies computes advantages and trains every trainable policy on its samples.
func (r *Run) trainPolicies(ctx context.Context, step int, cfg *config.Config, ros []*script.Rollout, rolloutS float64, version int) ([]Metrics, error) {
	byPolicy, gens := gather(ros, version)
	pols := r.policyList()
	advs, targets, err := r.advantages(ctx, pols, byPolicy)
	if err != nil {
		return nil, err
	}
	r.rec.keepAdvantages(byPolicy, advs)
	var out []Metrics
	crit := r.critic()
	var lanes [][]*policy // policies whose training shares an engine, in config order
	for _, p := range pols {
		if p == crit {
			continue // trained below, on the targets of the ppo actors' samples
		}
		m := newMetrics(step, p.name)
		ss := byPolicy[p.name]
		fillRewardMetrics(m, gens[p.name], ss)
		m.set("rollout_s", rolloutS)
		if cfg.Rollout.MaxStaleness > 0 && p.cfg.Trainable {
			stalenessMetrics(m, step, ss, cfg.Rollout.Partial)
		}
		if p.cfg.Trainable && len(ss) > 0 {
			lanes = addToLane(lanes, p)
		} else {
			m.set("train_s", 0.0) // no loss: a policy that did not train has none, not 0
		}
		out = append(out, m)
	}
	// Policies on different engines (workers, GPUs) train at the same time; those that share an
	// engine (LoRA adapters on one base, or one engine given for several policies) one after
	// another. Each policy's optimizer steps depend only on its own samples, so the metrics do
	// not depend on the order.
	byName := map[string]Metrics{}
	for _, m := range out {
		byName[m.Policy()] = m
	}
	errs := atOnce(len(lanes), func(i int) error {
		for _, p := range lanes[i] {
			m, t := byName[p.name], time.Now()
			ss, adv := r.withinContext(ctx, step, p, byPolicy[p.name], advs[p.name], m)
			if len(ss) == 0 {
				m.set("train_s", 0.0)
				continue
			}
			if err := r.trainOne(ctx, step, p, ss, adv, m); err != nil {
				return err
			}
			m.set("train_s", time.Since(t).Seconds())
		}
		return nil
	})
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	for _, p := range pols {
		if m := byName[p.name]; m != nil { // the critic's come below
			addDeviceMetrics(m, p.eng)
		}
	}
	if crit != nil {
		m := newMetrics(step, crit.name)
		fillRewardMetrics(m, nil, nil)
		m.set("rollout_s", rolloutS)
		var samples []engines.Sample
		for _, p := range pols {
			for i, t := range targets[p.name] {
				c := byPolicy[p.name][i].C
				samples = append(samples, engines.Sample{Prompt: c.PromptTokens(), Response: c.Tokens(), LossMask: c.LossMask(),
					Returns: t.returns, OldValues: t.values, Group: byPolicy[p.name][i].Group})
			}
		}
		if len(samples) > 0 && crit.cfg.Trainable {
			if err := r.trainCritic(ctx, step, crit, samples, m); err != nil {
				return nil, err
			}
		}
		addDeviceMetrics(m, crit.eng)
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Policy() < out[j].Policy() })
	return out, nil
}

// withinContext leaves out of training the samples longer than the policy's model takes (a chat
// whose history outgrew the context: its last turn sampled nothing): the engine would refuse the
// whole batch, and the run would stop as if the engine had failed. They keep their rewards and
// their part in their groups' advantages; overflow counts them, and the run says
// so once a policy.
func (r *Run) withinContext(ctx context.Context, step int, p *policy, ss []trainSample, adv [][]float32, m Metrics) ([]trainSample, [][]float32) {
	info, err := p.chatInfo(ctx)
	if err != nil || info.MaxSeqLen <= 0 {
		return ss, adv // the engine checks, as before
	}
	var keep []trainSample
	var keepAdv [][]float32
	dropped, longest := 0, 0
	for i, s := range ss {
		if n := len(s.C.PromptTokens()) + len(s.C.Tokens()); n > info.MaxSeqLen {
			dropped++
			longest = max(longest, n)
			continue
		}
		keep, keepAdv = append(keep, s), append(keepAdv, adv[i])
	}
	if dropped == 0 {
		return ss, adv
	}
	m.set("overflow", float64(dropped))
	if _, seen := r.warned.LoadOrStore("past-context/"+p.name, true); !seen {
		r.events.printf("warning: step %d: policy %q: %d of %d samples (up to %d tokens) are longer than its model's context of %d tokens and are not trained (overflow counts them each step); keep conversations shorter (fewer turns, a smaller max_tokens, shorter tool results) or use a model with more positions",
			step, p.name, dropped, len(ss), longest, info.MaxSeqLen)
	}
	return keep, keepAdv
}

// addToLane puts p into the lane of the policies whose training shares its engine, or a new one:
// LoRA policies share one lane (their adapters usually sit on one base, which trains one adapter
// at a time), and so do policies given the same engine.
func addToLane(lanes [][]*policy, p *policy) [][]*policy {
	for i, lane := range lanes {
		q := lane[0]
		if (p.cfg.LoRA != nil && q.cfg.LoRA != nil) || sameEngine(p.eng, q.eng) {
			lanes[i] = append(lane, p)
			return lanes
		}
	}
	return append(lanes, []*policy{p})
}

// sameEngine says whether a and b are one engine (false where the engines' type cannot be
// compared).
func sameEngine(a, b engines.Engine) bool {
	ta, tb := reflect.TypeOf(a), reflect.TypeOf(b)
	return ta == tb && ta != nil && ta.Comparable() && a == b
}

// policyList returns the policies in config order (then order of first use).
func (r *Run) policyList() []*policy {
	r.polMu.Lock()
	defer r.polMu.Unlock()
	pols := make([]*policy, len(r.order))
	for i, n := range r.order {
		pols[i] = r.policies[n]
	}
	return pols
}

// gather collects the samples and completions of the successful rollouts, per policy, in an order
// that does not depend on scheduling: task, then position in the rollout's call tree.
func gather(ros []*script.Rollout, version int) (map[string][]trainSample, map[string][]*script.Completion) {
	byPolicy := map[string][]trainSample{}
	gens := map[string][]*script.Completion{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		for _, q := range ro.Queued() {
			if q.Group == "" {
				q.Group = ro.Group
			}
			rw, _ := q.C.Reward()
			byPolicy[q.C.Policy()] = append(byPolicy[q.C.Policy()], trainSample{Queued: q, task: ro.Index, reward: rw, version: version})
		}
		for _, c := range ro.Generated() {
			gens[c.Policy()] = append(gens[c.Policy()], c)
		}
	}
	for _, ss := range byPolicy {
		sort.SliceStable(ss, func(i, j int) bool {
			if ss[i].task != ss[j].task {
				return ss[i].task < ss[j].task
			}
			return ss[i].C.Before(ss[j].C)
		})
	}
	for _, cs := range gens {
		sort.SliceStable(cs, func(i, j int) bool { return cs[i].Before(cs[j]) })
	}
	return byPolicy, gens
}

// trainOne splits a policy's samples into optimizer steps of global_batch_size and trains.
func (r *Run) trainOne(ctx context.Context, step int, p *policy, ss []trainSample, adv [][]float32, m Metrics) error {
	tc := p.cfg.Train
	lc := lossConfig(tc)
	size := tc.GlobalBatchSize
	if size <= 0 || size > len(ss) {
		size = len(ss)
	}
	var sums struct{ loss, pg, kl, clip, ent, gn, tisClip, tisW float64 }
	steps, skipped, tokens := 0, 0, 0
	trainLogp, err := r.trainLogprobs(ctx, step, p, ss, size)
	if err != nil {
		return err
	}
	for k := 0; k < len(ss); k += size {
		end := min(k+size, len(ss))
		// The run id keeps a server that outlived a crashed host from taking a resumed run's
		// steps for ones it has already applied.
		b := engines.Batch{ID: fmt.Sprintf("%s/%s/step%d/%d", r.id, p.name, step, k/size), Loss: lc}
		for i := k; i < end; i++ {
			c := ss[i].C
			b.Samples = append(b.Samples, engines.Sample{
				Prompt: c.PromptTokens(), Response: c.Tokens(), LossMask: c.LossMask(), OldLogprobs: c.Logprobs(),
				Advantages: adv[i], Group: ss[i].Group,
			})
			if trainLogp != nil {
				b.Samples[len(b.Samples)-1].TrainLogprobs = trainLogp[i]
			}
		}
		p.busy.begin()
		st, err := p.eng.Train(ctx, b)
		p.busy.end()
		if err != nil {
			return &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("train: %w", err), Hint: r.engineErrorHint()}
		}
		r.restart.trained(p.name, b)
		if st.Skipped {
			skipped++
			r.events.printf("step %d: policy %q: optimizer step %s skipped: %s", step, p.name, b.ID, st.Reason)
			continue
		}
		steps++
		tokens += st.Tokens
		sums.loss += st.Loss
		sums.pg += st.PGLoss
		sums.kl += st.KL
		sums.clip += st.ClipFrac
		sums.ent += st.Entropy
		sums.gn += st.GradNorm
		sums.tisClip += st.TISClipFrac
		sums.tisW += st.TISWeight
	}
	// The means of the optimizer steps taken; none taken (every one skipped): no loss, not 0.
	if d := float64(steps); steps > 0 {
		m.set("loss", sums.loss/d)
		m.set("pg_loss", sums.pg/d)
		m.set("kl", sums.kl/d)
		m.set("clip_frac", sums.clip/d)
		m.set("entropy", sums.ent/d)
		m.set("grad_norm", sums.gn/d)
		if lc.UseTIS {
			m.set("tis_clip_frac", sums.tisClip/d)
			m.set("tis_weight", sums.tisW/d)
		}
	}
	m.set("optimizer_steps", steps)
	m.set("skipped_steps", skipped)
	m.set("trained_tokens", tokens)
	return nil
}

func lossConfig(tc config.TrainConfig) engines.LossConfig {
	kl := tc.KLLossCoef
	if !tc.UseKLLoss {
		kl = 0
	}
	pl := "ppo"
	if tc.AdvantageEstimator == "gspo" {
		pl = "gspo"
	}
	return engines.LossConfig{
		LR: tc.LR, Beta1: tc.AdamBeta1, Beta2: tc.AdamBeta2, WeightDecay: tc.WeightDecay,
		MaxGradNorm: tc.ClipGrad, EpsClip: tc.EpsClip, EpsClipHigh: tc.EpsClipHigh,
		KLLossCoef: kl, KLLossType: tc.KLLossType, EntropyCoef: tc.EntropyCoef,
		Aggregation: tc.LossAggregation, PolicyLoss: pl,
		UseTIS: tc.UseTIS, TISMode: tc.TISMode, TISClip: tc.TISClip, TISClipLow: tc.TISClipLow,
	}
}

// trainLogprobs returns, when use_tis is on and a policy's step is cut into several optimizer
// steps of size samples, the trainer's log-probs of every sample before the first of them, as
// slime recomputes its old log_probs once per rollout: the later optimizer steps then measure
// their PPO ratio from the same weights as the first. nil otherwise: with one optimizer step the
// engine's own log-probs before the step are those.
func (r *Run) trainLogprobs(ctx context.Context, step int, p *policy, ss []trainSample, size int) ([][]float32, error) {
	if !p.cfg.Train.UseTIS || size >= len(ss) {
		return nil, nil
	}
	reqs := make([]engines.ScoreRequest, len(ss))
	for i, s := range ss {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.C.PromptTokens(), Tokens: s.C.Tokens()}
	}
	scores, err := p.eng.Score(ctx, reqs)
	if err != nil {
		return nil, &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("scoring %d samples for use_tis's old log-probs: %w", len(ss), err), Hint: r.engineErrorHint()}
	}
	out := make([][]float32, len(ss))
	for i, s := range ss {
		if len(scores[i].Logprobs) != len(s.C.Tokens()) {
			return nil, fmt.Errorf("policy %q: scoring for use_tis returned %d log-probs for %d tokens", p.name, len(scores[i].Logprobs), len(s.C.Tokens()))
		}
		out[i] = scores[i].Logprobs
	}
	return out, nil
}

// checkTIS refuses a policy with use_tis whose engine does not apply the correction (no "tis"
// capability): without it the engine would train as if the samples were on-policy.
func (r *Run) checkTIS(ctx context.Context, name string, pc config.PolicyConfig, eng engines.Engine) error {
	if !pc.Trainable || !pc.Train.UseTIS || pc.IsCritic() {
		return nil
	}
	info, err := eng.Info(ctx)
	if err != nil {
		return fmt.Errorf("policy %q: info: %w", name, err)
	}
	if !slices.Contains(info.Capabilities, "tis") {
		return fmt.Errorf("policy %q%s: train.use_tis needs an engine that applies the off-policy correction, and its engine (%s) does not (no \"tis\" capability; the tiny and torch engines have it): set use_tis: false or use another engine", name, r.cfgPlace(&policy{cfg: pc}), info.Model)
	}
	return nil
}

// advantages computes the per-token advantages of every policy's samples. Shared-buffer policies
// are normalised together; split ones alone. Teacher terms (on-policy distillation) come last.
func (r *Run) advantages(ctx context.Context, pols []*policy, byPolicy map[string][]trainSample) (map[string][][]float32, map[string][]ppoTargets, error) {
	out := map[string][][]float32{}
	targets := map[string][]ppoTargets{}
	type pool struct {
		names []string
		tc    config.TrainConfig
	}
	var pools []pool
	var shared *pool
	kls := map[string][][]float64{} // the reward-side KL of each policy's samples (kl_coef)
	for _, p := range pols {
		if !p.cfg.Trainable || p.cfg.IsCritic() {
			continue
		}
		kl, err := r.rewardKL(ctx, p, byPolicy[p.name])
		if err != nil {
			return nil, nil, err
		}
		kls[p.name] = kl
		if p.cfg.Train.AdvantageEstimator == "ppo" {
			adv, t, err := r.ppoAdvantages(ctx, p, byPolicy[p.name], kl)
			if err != nil {
				return nil, nil, err
			}
			out[p.name], targets[p.name] = adv, t
			continue
		}
		if p.cfg.BufferMode == "shared" {
			if shared == nil {
				pools = append(pools, pool{tc: p.cfg.Train})
				shared = &pools[len(pools)-1]
			}
			shared.names = append(shared.names, p.name)
			continue
		}
		pools = append(pools, pool{names: []string{p.name}, tc: p.cfg.Train})
	}
	for _, pl := range pools {
		var in []advantage.Input
		for _, n := range pl.names {
			for i, s := range byPolicy[n] {
				a := advantage.Input{Reward: s.reward, Group: s.Group, Tokens: len(s.C.Tokens()), Mask: maskOf(s.C)}
				if kls[n] != nil {
					a.KL = kls[n][i]
				}
				if s.HasAdv {
					a.Override = s.Advantage
				}
				in = append(in, a)
			}
		}
		r.warnSingletons(pl.names, pl.tc, in)
		adv, err := advantage.Compute(estimatorOf(pl.tc), in)
		if err != nil {
			return nil, nil, err
		}
		k := 0
		for _, n := range pl.names {
			m := len(byPolicy[n])
			out[n] = adv[k : k+m]
			k += m
		}
	}
	for _, p := range pols {
		if err := r.applyTeacher(ctx, p, byPolicy[p.name], out[p.name]); err != nil {
			return nil, nil, err
		}
	}
	return out, targets, nil
}

// applyTeacher subtracts opd_kl_coef·(logp_student − logp_teacher) per token for samples trained
// with teacher=.
func (r *Run) applyTeacher(ctx context.Context, p *policy, ss []trainSample, adv [][]float32) error {
	byTeacher := map[string][]int{}
	for i, s := range ss {
		if s.Teacher != "" {
			byTeacher[s.Teacher] = append(byTeacher[s.Teacher], i)
		}
	}
	teachers := make([]string, 0, len(byTeacher))
	for t := range byTeacher {
		teachers = append(teachers, t)
	}
	sort.Strings(teachers)
	coef := p.cfg.Train.OPDKLCoef
	for _, t := range teachers {
		tp, err := r.policyFor(t)
		if err != nil {
			return err
		}
		idx := byTeacher[t]
		reqs := make([]engines.ScoreRequest, len(idx))
		for k, i := range idx {
			c := ss[i].C
			reqs[k] = engines.ScoreRequest{Messages: c.Messages(), Tokens: c.Tokens()}
		}
		scores, err := tp.eng.Score(ctx, reqs)
		if err != nil {
			return &EngineError{Step: r.step + 1, Policy: t, Err: fmt.Errorf("scoring %d samples of policy %q as their teacher: %w", len(idx), p.name, err), Hint: r.engineErrorHint()}
		}
		for k, i := range idx {
			c := ss[i].C
			lp := scores[k].Logprobs
			if len(lp) != len(c.Tokens()) {
				return fmt.Errorf("teacher %q returned %d log-probs for %d tokens", t, len(lp), len(c.Tokens()))
			}
			for j := range adv[i] {
				adv[i][j] -= float32(coef * float64(c.Logprobs()[j]-lp[j]))
			}
		}
	}
	return nil
}

func fillRewardMetrics(m Metrics, gens []*script.Completion, ss []trainSample) {
	var rs []float64
	tokens, truncated := 0, 0
	for _, c := range gens {
		if rw, ok := c.Reward(); ok {
			rs = append(rs, rw)
		}
		tokens += len(c.Tokens())
		if c.FinishReason() == "length" {
			truncated++
		}
	}
	for _, s := range ss {
		if s.C.Conversation() {
			rs = append(rs, s.reward) // a chat's reward is its conversation's, not a turn's
		}
	}
	if len(rs) > 0 {
		// No reward is no number: a policy that generated nothing this step, or whose
		// completions nobody rewarded (a frozen judge), has no reward_mean, not a mean of 0.
		mean, std := meanStd(rs)
		m.set("reward_mean", mean)
		m.set("reward_std", std)
	}
	m.set("samples", len(ss))
	m.set("completions", len(gens))
	m.set("tokens", tokens)
	rl := 0.0
	if len(gens) > 0 {
		rl = float64(tokens) / float64(len(gens))
		m.set("truncated", float64(truncated)/float64(len(gens)))
	} else {
		m.set("truncated", 0.0)
	}
	m.set("response_len", rl)
}

// meanStd returns the mean and the population standard deviation (0, 0 for no values).
func meanStd(xs []float64) (float64, float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	mean := s / float64(len(xs))
	var v float64
	for _, x := range xs {
		v += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(v / float64(len(xs)))
}

// tokens_per_s is the tokens generated over genS, the time an engine was generating them (an
// agent() run's rollouts also start programs and run tools, which rolloutS counts).
func (r *Run) runMetrics(step int, ros []*script.Rollout, res *StepResult, rolloutS, genS, trainS, stepS float64) Metrics {
	m := newMetrics(step, "_run")
	m.set("rollouts", len(ros))
	m.set("failed", len(res.Failed))
	tokens := 0
	for _, p := range res.Policies {
		tokens += p.int("tokens")
	}
	m.set("tokens", tokens)
	m.set("rollout_s", rolloutS)
	m.set("train_s", trainS)
	m.set("step_s", stepS)
	switch {
	case genS > 0:
		m.set("tokens_per_s", float64(tokens)/genS)
	case rolloutS > 0: // nothing generated
		m.set("tokens_per_s", 0.0)
	}
	for k, v := range r.logSums(step, ros) {
		m.set(k, v[0]/v[1])
	}
	return m
}

// logSums adds up the log() values of the step's successful rollouts. It applies log()'s rules
// again, since a sandboxed rollout's values come from its child: a rollout that reports a name
// the host writes itself (script.RunFields), a name too long or not finite, or more than
// script.MaxLogNamesPerRollout names, counts with none of its values. Names new to the run past
// script.MaxLogNamesPerRun are dropped, with an event that names them.
func (r *Run) logSums(step int, ros []*script.Rollout) map[string][2]float64 {
	sums := map[string][2]float64{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		logs := ro.Logs()
		if err := checkLogs(logs); err != nil {
			r.events.printf("step %d task %s: its log() values are left out of the metrics: %v", step, ro.Task.ID, err)
			continue
		}
		for k, v := range logs {
			a := sums[k]
			sums[k] = [2]float64{a[0] + v[0], a[1] + v[1]}
		}
	}
	var dropped []string
	for k := range sums {
		if !r.logNames[k] && len(r.logNames) >= script.MaxLogNamesPerRun {
			dropped = append(dropped, k)
			continue
		}
		if r.logNames == nil {
			r.logNames = map[string]bool{}
		}
		r.logNames[k] = true
	}
	if len(dropped) > 0 {
		sort.Strings(dropped)
		for _, k := range dropped {
			delete(sums, k)
		}
		names := strings.Join(dropped[:min(len(dropped), 5)], ", ")
		if len(dropped) > 5 {
			names += ", …"
		}
		r.events.printf("step %d: log(): the run has written %d metric names, the most a run writes; %d new names are left out of its metrics: %s",
			step, len(r.logNames), len(dropped), names)
	}
	return sums
}

// checkLogs applies log()'s rules to a rollout's logged values.
func checkLogs(logs map[string][2]float64) error {
	if len(logs) > script.MaxLogNamesPerRollout {
		return fmt.Errorf("%d metric names, more than the %d a rollout logs", len(logs), script.MaxLogNamesPerRollout)
	}
	for k, v := range logs {
		if err := script.CheckLogName("log", k); err != nil {
			return err
		}
		if math.IsNaN(v[0]) || math.IsInf(v[0], 0) || !(v[1] >= 1) {
			return fmt.Errorf("log: %s is not a finite number", k)
		}
	}
	return nil
}

func (r *Run) openOutputs() error {
	out := r.opts.Out
	r.events = &eventLog{w: r.opts.Log}
	r.metrics = &metricsWriter{}
	if out == "" {
		return nil
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		// Bad input (--out or run.out), not a failed run.
		return &ScriptError{Msg: fmt.Sprintf("run directory %s cannot be made: %v; choose another --out (or run.out)", out, err)}
	}
	// One writer per run folder, before anything is written there (runlock.go).
	lock, err := lockRunDir(out)
	if err != nil {
		return err
	}
	r.lock = lock
	if err := r.events.open(filepath.Join(out, "events.log")); err != nil {
		return err
	}
	if h := lock.stale; h != nil {
		r.events.printf("lock: %s was left locked by %s, which ended without releasing it (a crash or a kill); this run (pid %d) holds it now", lock.path, h, os.Getpid())
	}
	if err := r.metrics.open(filepath.Join(out, "metrics.jsonl"), r.events); err != nil {
		return err
	}
	if err := r.saveScriptVersion(1); err != nil {
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

// tooManyFailed stops a step: more of its rollouts failed than rollout.max_failed_fraction allows.
type tooManyFailed struct{ msg string }

func (e *tooManyFailed) Error() string { return e.msg }

// maskOf is a sample's loss mask for the advantage estimators: nil when every token is trained
// (a generate call's completion), else the conversation's mask (chat).
func maskOf(c *script.Completion) []float64 {
	m := c.LossMask()
	out := make([]float64, len(m))
	all := true
	for i, x := range m {
		out[i] = float64(x)
		all = all && x == 1
	}
	if all {
		return nil
	}
	return out
}
