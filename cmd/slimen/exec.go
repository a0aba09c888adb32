package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/plot"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/tasks"
	"github.com/slimen/slimen/host/wandb"
)

func init() {
	commands["exec"] = command{"run a rollout script and train its policies", cmdExec}
}

// parseInterleaved parses flags that may come before or after positional arguments
// (`slimen exec script.star --steps 3` as well as `slimen exec --steps 3 script.star`).
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: -"); ok {
				if near := nearFlag(fs, strings.TrimLeft(name, "-")); near != "" {
					fmt.Fprintf(fs.Output(), "slimen %s: unknown flag -%s; did you mean --%s?\n", fs.Name(), name, near)
				}
			}
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// nearFlag is the flag of fs a letter or two from name ("stpes": "steps"), "" if none is.
func nearFlag(fs *flag.FlagSet, name string) string {
	limit := 2
	if len(name) <= 4 {
		limit = 1
	}
	best, dist := "", limit+1
	fs.VisitAll(func(f *flag.Flag) {
		if d := config.EditDistance(name, f.Name); d < dist {
			best, dist = f.Name, d
		}
	})
	return best
}

// execFlags are the flags of `slimen exec`.
type execFlags struct {
	fs                         *flag.FlagSet
	cfgPath, data, out, resume *string
	wandb, tensorboard         *string
	steps, batch, staleness    *int
	seed                       *uint64
	sandbox, watch             *bool
	deterministic              *bool
	set                        map[string]bool // the flags given on the command line
}

func newExecFlags() *execFlags {
	fs := flag.NewFlagSet("exec", flag.ContinueOnError)
	f := &execFlags{fs: fs,
		cfgPath: fs.String("config", "", "YAML config (slime-n's policies: schema); default: "+
			"every policy the script names on builtin:tiny-arith. With --resume: "+
			"only where engines live (engine.address, tls, token_env, insecure, base_url, "+
			"api_key_env) may differ from the checkpoint's"),
		data:  fs.String("data", "", "task source: a JSONL file or synthetic:arith[?difficulty=N] (overrides data.path)"),
		steps: fs.Int("steps", 0, "steps to run (overrides run.steps)"),
		seed:  fs.Uint64("seed", 0, "run seed (overrides run.seed)"),
		out:   fs.String("out", "", "run directory (overrides run.out; default runs/SCRIPT_NAME)"),
		batch: fs.Int("batch-size", 0, "tasks per step (overrides rollout.batch_size)"),
		staleness: fs.Int("max-staleness", 0, "K of the asynchronous loop: the rollouts of the next K steps run while a step "+
			"trains, from weights at most K steps old (overrides rollout.max_staleness; 0: synchronous)"),
		resume: fs.String("resume", "", "continue a run: its directory (its newest valid checkpoint; "+
			"newer invalid ones are reported and skipped) or a checkpoints/step_N folder"),
		sandbox: fs.Bool("sandbox", false, "run the script's rollouts in child processes under the config's sandbox budgets (for contributed workflows)"),
		watch:   fs.Bool("watch", false, "reload the script, the files it loads and the config when they change (at step boundaries)"),
		wandb:   fs.String("wandb", "", "log the run to this Weights & Biases project (sets run.wandb.project; docs/observability.md)"),
		set:     map[string]bool{},
	}
	f.deterministic = fs.Bool("deterministic", false, "batch-invariant kernels on every torch worker: "+
		"a sample does not depend on its batch and the trainer's log-probs equal the rollout's "+
		"bit for bit (sets engine.deterministic; docs/torch.md)")
	f.tensorboard = fs.String("tensorboard", "", "write TensorBoard event files into this folder, "+
		"relative to the working directory (sets run.tensorboard; docs/observability.md)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen exec SCRIPT [--config Y] [--data D] [--steps N] [--seed S] [--out DIR] "+
			"[--batch-size B] [--max-staleness K] [--wandb PROJECT] [--tensorboard DIR] "+
			"[--deterministic] [--watch] [--sandbox] [--resume RUN_DIR|RUN_DIR/checkpoints/step_N]")
		fs.PrintDefaults()
	}
	return f
}

// override applies the command line's overrides of the config file: to it now, and by the run
// to every version of it that --watch reloads (run.out is the run's for good: the run keeps it).
func (f *execFlags) override(c *config.Config) error {
	var o config.Overrides
	if f.set["data"] {
		o.Data = f.data
	}
	if f.set["steps"] {
		o.Steps = f.steps
	}
	if f.set["seed"] {
		o.Seed = f.seed
	}
	if err := c.Override(o); err != nil {
		return err
	}
	if f.set["wandb"] {
		if *f.wandb == "" {
			return errors.New("--wandb: give the W&B project to log to")
		}
		if c.Run.Wandb == nil {
			c.Run.Wandb = &config.WandbConfig{}
		}
		c.Run.Wandb.Project = *f.wandb
	}
	if f.set["tensorboard"] {
		if *f.tensorboard == "" {
			return errors.New("--tensorboard: give the folder to write TensorBoard's event files into")
		}
		c.Run.TensorBoard = *f.tensorboard
	}
	if f.set["batch-size"] {
		if *f.batch < 1 {
			return errors.New("--batch-size must be at least 1")
		}
		c.Rollout.BatchSize = *f.batch
	}
	if f.set["max-staleness"] {
		if *f.staleness < 0 {
			return errors.New("--max-staleness must be ≥ 0")
		}
		c.Rollout.MaxStaleness = *f.staleness
	}
	if f.set["deterministic"] && *f.deterministic {
		torch := 0
		for i := range c.Policies {
			p := &c.Policies[i]
			if p.Engine.Kind != "torch" {
				continue
			}
			if p.NumGPUsPerNode > 1 {
				return fmt.Errorf("--deterministic: policy %q runs on %d GPUs a worker (num_gpus_per_node), "+
					"and the batch-invariant kernels on one", p.Name, p.NumGPUsPerNode)
			}
			p.Engine.Deterministic = true
			torch++
		}
		if torch == 0 {
			return errors.New("--deterministic: no policy runs on a torch worker (the embedded engine computes exactly already; docs/torch.md)")
		}
	}
	return nil
}

func cmdExec(args []string) int {
	f := newExecFlags()
	pos, err := parseInterleaved(f.fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(pos) > 1 || len(pos) == 0 && *f.resume == "" {
		f.fs.Usage()
		return 2
	}
	f.fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	var script string
	if len(pos) == 1 {
		script = pos[0]
	}
	prog := newProgress(os.Stderr, 0)
	r, code := loadRun(f, script, prog)
	if r == nil {
		return code
	}
	defer r.Close()
	return train(r, prog, args)
}

// loadRun loads the run the flags ask for, a new one or a resumed one, and its progress display.
// A nil run comes with the exit code.
func loadRun(f *execFlags, script string, prog *progress) (*host.Run, int) {
	ctx := context.Background()
	opts := host.Options{Log: prog.logWriter(), Sandbox: *f.sandbox, ConfigOverride: f.override,
		BeforeStep: func(r *host.Run) {
			prog.total = r.Config().Run.Steps // a reloaded config may change it
			prog.begin(r)
		},
		AfterStep: func(_ *host.Run, res *host.StepResult) { prog.step(res) },
		AfterEval: func(r *host.Run) error {
			if err := writePlots(r.Config().Run.Out); err != nil {
				return fmt.Errorf("plots: %w", err)
			}
			return nil
		}}
	wb := wandb.New(wandb.Options{Log: prog.logWriter()}) // opened below, once the config is known
	opts.Observers = append(opts.Observers, wb)
	var r *host.Run
	var err error
	if *f.resume != "" {
		// The checkpoint's resolved config and run directory; the script as given, or as recorded.
		// --config may move the engines (addresses, TLS, tokens), nothing else.
		if *f.cfgPath != "" {
			if opts.Relocate, err = config.Load(*f.cfgPath); err != nil {
				fmt.Fprintln(os.Stderr, "slimen:", err)
				return nil, 2
			}
		}
		r, err = host.Resume(ctx, *f.resume, script, opts)
	} else {
		r, err = loadNew(ctx, f, script, opts)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen:", err)
		var se *host.ScriptError
		var de *tasks.SourceError
		if errors.As(err, &se) || errors.As(err, &de) || *f.cfgPath != "" {
			return nil, 2
		}
		return nil, 1
	}
	if done, steps := r.StepsDone(), r.Config().Run.Steps; *f.resume != "" && done >= steps {
		// Nothing to run: said, not a run of no steps that exits 0.
		r.Close()
		fmt.Fprintf(os.Stderr, "slimen: %s is finished: it ran %d of its %d steps (run.steps); to run more, resume with --steps N, N > %d\n",
			*f.resume, done, steps, done)
		return nil, 2
	}
	if err := wb.Open(ctx, r.Config()); err != nil {
		r.Close()
		fmt.Fprintln(os.Stderr, "slimen:", err)
		return nil, 2
	}
	if *f.watch {
		cfgPath := *f.cfgPath
		if *f.resume != "" {
			cfgPath = r.Config().File // the checkpoint's config.yaml
		}
		if err := r.Watch(cfgPath); err != nil {
			r.Close()
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return nil, 1
		}
	}
	cfg := r.Config()
	prog.total = cfg.Run.Steps
	fmt.Fprintf(os.Stderr, "slimen: %s → %s (steps %d to %d, %d tasks each)\n",
		r.Script().Path, cfg.Run.Out, r.StepsDone()+1, cfg.Run.Steps, cfg.Rollout.BatchSize)
	return r, 0
}

// loadNew loads a new run: its config (or zero-config), the command line's overrides, and a run
// directory of its own.
func loadNew(ctx context.Context, f *execFlags, scriptPath string, opts host.Options) (*host.Run, error) {
	var cfg *config.Config
	var err error
	if *f.cfgPath != "" {
		cfg, err = config.Load(*f.cfgPath)
	} else {
		cfg, err = zeroConfig(!f.set["data"]) // policies appear as the script names them
	}
	if err != nil {
		return nil, err
	}
	if err := f.override(cfg); err != nil {
		return nil, script.Errorf("%w", err)
	}
	dir, err := runDir(scriptPath, cfg.Run.Out, *f.out)
	if err != nil {
		return nil, script.Errorf("%w", err)
	}
	cfg.Run.Out = dir
	opts.Config, opts.Zero, opts.Out = cfg, *f.cfgPath == "", dir
	return host.Load(ctx, scriptPath, opts)
}

// zeroConfigEval is what a zero-config run on the synthetic source adds to config.Default: 200
// held-out problems of synthetic:arith (opened with the eval seed, so none is trained on),
// evaluated before the first step and every 10 steps (the eval defaults of docs/config.md), so
// the first run a user makes shows whether training helps.
const zeroConfigEval = "eval: {datasets: [{path: synthetic:arith, limit: 200}]}\n"

// zeroConfig is the config of `slimen exec SCRIPT` without --config: config.Default, plus the
// held-out eval when the tasks come from the synthetic source (no --data).
func zeroConfig(eval bool) (*config.Config, error) {
	if !eval {
		return config.Default(nil), nil
	}
	c, err := config.Parse([]byte(zeroConfigEval), "zero-config eval")
	if err != nil {
		return nil, fmt.Errorf("zero-config eval: %w", err)
	}
	c.File = "" // still the zero-config defaults, as the resolved config.yaml says
	return c, nil
}

// train runs the loaded run to its end. SIGINT/SIGTERM: finish (or, with run.on_signal: abandon,
// cut short) the step in progress, checkpoint and exit 0; rollouts still running
// rollout.stop_grace_s after the signal are cancelled. A second signal exits at once; checkpoints
// are renamed into place when complete, so the last good one survives it.
func train(r *host.Run, prog *progress, args []string) int {
	ctx, abandon := context.WithCancel(context.Background())
	defer abandon()
	var stopping atomic.Bool
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		<-sigs
		stopping.Store(true)
		r.Stop()
		if r.Config().Run.OnSignal == "abandon" {
			// The run's step count belongs to Train's goroutine: the last line says what was saved.
			fmt.Fprintln(prog.logWriter(), "slimen: stopping: abandoning the step in progress, then checkpointing the last "+
				"completed step, if any (a second signal exits at once)")
			abandon()
		} else {
			fmt.Fprintf(prog.logWriter(), "slimen: stopping: finishing the step in progress (rollouts still running in %v are "+
				"cancelled: rollout.stop_grace_s), then checkpointing (a second signal exits at once)\n",
				r.StopGrace())
		}
		<-sigs
		fmt.Fprintln(os.Stderr, "\nslimen: second signal: exiting now")
		os.Exit(130)
	}()
	err := r.Train(ctx)
	prog.end()
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen:", err)
		if hint := r.StopHint(); hint != "" && !strings.Contains(err.Error(), "--resume") {
			fmt.Fprintln(os.Stderr, "slimen:", hint)
		} else if dir := r.Config().Run.Out; hint == "" && wroteRun(dir) {
			// No checkpoint to resume from, and a folder --out no longer takes: a new one.
			if again := againCommand(args, dir); again != "" {
				fmt.Fprintf(os.Stderr, "slimen: %s has no checkpoint to resume from; start the run again (once what stopped it is fixed) with: %s\n", dir, again)
			}
		}
		return 1
	}
	dir := r.Config().Run.Out
	if err := writePlots(dir); err != nil {
		fmt.Fprintln(os.Stderr, "slimen: plots:", err)
	}
	verb := "done"
	if stopping.Load() {
		verb = "stopped"
	}
	saved := "no checkpoint (no step completed)"
	if ck := r.LastCheckpoint(); ck != "" {
		saved = "checkpoint in " + ck
	}
	fmt.Fprintf(os.Stderr, "slimen: %s after %d steps; metrics in %s, %s\n", verb, r.StepsDone(),
		filepath.Join(dir, "metrics.jsonl"), saved)
	return 0
}

// runDir picks the run directory: --out, else run.out, else runs/<script name>. A default
// directory that already holds a run gets a numbered sibling; an explicit one is refused.
func runDir(script, fromConfig, flagOut string) (string, error) {
	explicit := flagOut
	if explicit == "" {
		explicit = fromConfig
	}
	if explicit != "" {
		if holder, ok := host.RunFolderHolder(explicit); ok {
			return "", fmt.Errorf("%s is in use by %s: a run folder has one writer at a time; choose another --out", explicit, holder)
		}
		if holdsRun(explicit) {
			return "", fmt.Errorf("%s already holds a run (metrics.jsonl); choose another --out or remove it", explicit)
		}
		return explicit, nil
	}
	base := filepath.Join("runs", strings.TrimSuffix(filepath.Base(script), filepath.Ext(script)))
	dir := base
	for i := 2; holdsRun(dir); i++ {
		dir = fmt.Sprintf("%s-%d", base, i)
	}
	return dir, nil
}

// holdsRun reports whether dir holds a run that trained (metrics or checkpoints) or one that a
// live process is writing (its lock, even before its first step). A run that stopped before its
// first step (a typo in a data path, say) leaves an empty metrics.jsonl; the corrected command
// may use its folder.
func holdsRun(dir string) bool {
	if _, ok := host.RunFolderHolder(dir); ok {
		return true
	}
	return wroteRun(dir)
}

// wroteRun reports whether dir holds a run that trained: metrics or checkpoints.
func wroteRun(dir string) bool {
	if fi, err := os.Stat(filepath.Join(dir, "metrics.jsonl")); err == nil && fi.Size() > 0 {
		return true
	}
	_, err := os.Stat(filepath.Join(dir, "checkpoints"))
	return err == nil
}

// writePlots redraws the run's curves; a run with nothing to plot yet is not an error.
func writePlots(dir string) error {
	if _, err := plot.Write(dir); err != nil && !errors.Is(err, plot.ErrNothingToPlot) {
		return err
	}
	return nil
}
