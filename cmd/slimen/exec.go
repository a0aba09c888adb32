package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/plot"
	"github.com/slimen/slimen/host/tasks"
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

func cmdExec(args []string) int {
	fs := flag.NewFlagSet("exec", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "YAML config (slime-n's policies: schema); default: every policy the script names on builtin:tiny-arith")
	data := fs.String("data", "", "task source: a JSONL file or synthetic:arith[?difficulty=N] (overrides data.path)")
	steps := fs.Int("steps", 0, "steps to run (overrides run.steps)")
	seed := fs.Uint64("seed", 0, "run seed (overrides run.seed)")
	out := fs.String("out", "", "run directory (overrides run.out; default runs/SCRIPT_NAME)")
	batch := fs.Int("batch-size", 0, "tasks per step (overrides rollout.batch_size)")
	resume := fs.String("resume", "", "continue a run: its directory (its newest valid checkpoint; newer invalid ones are reported and skipped) or a checkpoints/step_N folder")
	sandbox := fs.Bool("sandbox", false, "run the script's rollouts in child processes under the config's sandbox budgets (for contributed workflows)")
	watch := fs.Bool("watch", false, "reload the script, the files it loads and the config when they change (at step boundaries)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen exec SCRIPT [--config Y] [--data D] [--steps N] [--seed S] [--out DIR] [--batch-size B] [--watch] [--sandbox] [--resume RUN_DIR|RUN_DIR/checkpoints/step_N]")
		fs.PrintDefaults()
	}
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(pos) > 1 || len(pos) == 0 && *resume == "" {
		fs.Usage()
		return 2
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	var cfg *config.Config
	var script, ckpt string
	if len(pos) == 1 {
		script = pos[0]
	}
	if *resume != "" {
		// The checkpoint's resolved config and run directory; the script as given, or as recorded.
		var skipped []error
		if ckpt, skipped, err = host.FindCheckpoint(*resume); err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 2
		}
		for _, bad := range skipped {
			fmt.Fprintf(os.Stderr, "slimen: warning: %v\n", bad)
		}
		if len(skipped) > 0 {
			fmt.Fprintf(os.Stderr, "slimen: warning: resuming from %s, the newest valid checkpoint; the newer ones above are removed when the run goes on\n", ckpt)
		}
		_, recorded, err := host.CheckpointInfo(ckpt)
		if err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 2
		}
		if script == "" {
			script = recorded
		}
		*cfgPath = filepath.Join(ckpt, "config.yaml")
		*out = host.RunDirOf(ckpt)
	}
	if *cfgPath != "" {
		if cfg, err = config.Load(*cfgPath); err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 2
		}
	}
	if cfg == nil {
		cfg = config.Default(nil) // zero-config: policies appear as the script names them
	}
	// The command line's overrides of the config file: applied to it now, and by the run to every
	// version of it that --watch reloads (run.out is the run's for good: the run keeps it).
	override := func(c *config.Config) error {
		var o config.Overrides
		if set["data"] {
			o.Data = data
		}
		if set["steps"] {
			o.Steps = steps
		}
		if set["seed"] {
			o.Seed = seed
		}
		if err := c.Override(o); err != nil {
			return err
		}
		if set["batch-size"] {
			if *batch < 1 {
				return errors.New("--batch-size must be at least 1")
			}
			c.Rollout.BatchSize = *batch
		}
		return nil
	}
	if err := override(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "slimen:", err)
		return 2
	}
	dir := *out
	if ckpt == "" {
		if dir, err = runDir(script, cfg.Run.Out, *out); err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 2
		}
	}
	cfg.Run.Out = dir

	ctx := context.Background()
	prog := newProgress(os.Stderr, cfg.Run.Steps)
	r, err := host.Load(ctx, script, host.Options{Config: cfg, Zero: *cfgPath == "", Out: dir, Log: prog.logWriter(), Sandbox: *sandbox, ConfigOverride: override})
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen:", err)
		var se *host.ScriptError
		var de *tasks.SourceError
		if errors.As(err, &se) || errors.As(err, &de) || *cfgPath != "" {
			return 2
		}
		return 1
	}
	defer r.Close()
	if ckpt != "" {
		if err := r.Resume(ctx, ckpt); err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 1
		}
	}
	if *watch {
		if err := r.Watch(*cfgPath); err != nil {
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "slimen: %s → %s (steps %d to %d, %d tasks each)\n", script, dir, r.StepsDone()+1, cfg.Run.Steps, cfg.Rollout.BatchSize)

	// SIGINT/SIGTERM: finish (or, with run.on_signal: abandon, cut short) the step in progress,
	// checkpoint and exit 0. A second signal exits at once; checkpoints are renamed into place
	// when complete, so the last good one survives it.
	stepCtx, abandon := context.WithCancel(ctx)
	defer abandon()
	var stopping atomic.Bool
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		<-sigs
		stopping.Store(true)
		if cfg.Run.OnSignal == "abandon" {
			fmt.Fprintln(prog.logWriter(), "slimen: stopping: abandoning the step in progress, then checkpointing (a second signal exits at once)")
			abandon()
		} else {
			fmt.Fprintln(prog.logWriter(), "slimen: stopping: finishing the step in progress, then checkpointing (a second signal exits at once)")
		}
		<-sigs
		fmt.Fprintln(os.Stderr, "\nslimen: second signal: exiting now")
		os.Exit(130)
	}()
	// run.steps is read at every step boundary: a reloaded config (--watch) may lengthen or
	// shorten the run; --steps, an override, still wins.
	for r.StepsDone() < r.Config().Run.Steps && !stopping.Load() {
		prog.total = r.Config().Run.Steps
		prog.begin(r)
		res, err := r.Step(stepCtx)
		if err != nil {
			prog.end()
			if stopping.Load() && errors.Is(err, context.Canceled) {
				break // the abandoned step left the run (and its state store) as it was after the last one
			}
			fmt.Fprintln(os.Stderr, "slimen:", err)
			return 1
		}
		prog.step(res) // the run redraws the plots after each eval itself
	}
	prog.end()
	if r.StepsDone() > 0 {
		if _, err := r.Checkpoint(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "slimen: final checkpoint:", err)
			return 1
		}
	}
	if err := writePlots(dir); err != nil {
		fmt.Fprintln(os.Stderr, "slimen: plots:", err)
	}
	verb := "done"
	if stopping.Load() {
		verb = "stopped"
	}
	fmt.Fprintf(os.Stderr, "slimen: %s after %d steps; metrics in %s, checkpoint in %s\n", verb, r.StepsDone(),
		filepath.Join(dir, "metrics.jsonl"), filepath.Join(dir, "checkpoints"))
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

// holdsRun reports whether dir holds a run that trained: metrics or checkpoints. A run that
// stopped before its first step (a typo in a data path, say) leaves an empty metrics.jsonl; the
// corrected command may use its folder.
func holdsRun(dir string) bool {
	if fi, err := os.Stat(filepath.Join(dir, "metrics.jsonl")); err == nil && fi.Size() > 0 {
		return true
	}
	_, err := os.Stat(filepath.Join(dir, "checkpoints"))
	return err == nil
}

var _ io.Writer = (*os.File)(nil)

// writePlots redraws the run's curves; a run with nothing to plot yet is not an error.
func writePlots(dir string) error {
	if _, err := plot.Write(dir); err != nil && !errors.Is(err, plot.ErrNothingToPlot) {
		return err
	}
	return nil
}
