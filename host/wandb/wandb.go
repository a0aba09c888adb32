// Package wandb logs a slimen run to Weights & Biases through the official wandb SDK: a sidecar
// process of the project's Python environment (slimen_torch/wandb_sidecar.py, carried in the
// binary) to which a Logger, a host.Observer, hands the run's config, each step's metrics as
// `policy/metric` scalars, reward and advantage histograms, and tables of the rollouts the run
// saves (run.save_rollouts). See docs/observability.md.
//
// A Logger never holds up the run: the host calls it on a goroutine of its own and drops records
// for it when it falls behind, and a sidecar that dies or stops reading is one warning in the
// run's log and events.log, after which the run goes on without W&B.
package wandb

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
)

// PythonEnv names the interpreter of the sidecar when run.wandb.python is not set: the
// variable that names the torch workers' (host/torch.PythonEnv).
const PythonEnv = "SLIMEN_PYTHON"

// Wait bounds: wandb.init (online, it asks the server), and the finish of a run: an offline run
// only closes its file, an online one uploads what it has not sent yet.
const (
	initWait          = 2 * time.Minute
	finishWaitOffline = 30 * time.Second
	finishWaitOnline  = 2 * time.Minute
)

// runIDFile, in the run folder, keeps the W&B run's id, so that a resumed run logs on in the
// same W&B run.
const runIDFile = "wandb-run-id"

// Options are a Logger's settings besides the run's config.
type Options struct {
	// Log takes the sidecar's output, the SDK's own messages (where the run is saved, its URL);
	// nil: os.Stderr.
	Log io.Writer
}

// Logger is a host.Observer that logs the run to W&B. It logs nothing until Open has started
// its sidecar; a run whose config asks for no W&B leaves it so.
type Logger struct {
	opts Options
	mu   sync.Mutex
	sc   *sidecar
	mode string // the mode the SDK chose (online, offline)
	exit int    // the exit code Close finishes the W&B run with: 1 once End got an error
}

var (
	_ host.Observer = (*Logger)(nil)
	_ host.Ender    = (*Logger)(nil)
)

// New returns a Logger to hand to host.Options.Observers; Open starts it once the run's config
// is known (a resumed run's is its checkpoint's).
func New(opts Options) *Logger {
	if opts.Log == nil {
		opts.Log = os.Stderr
	}
	return &Logger{opts: opts}
}

// String names the Logger in the run's messages.
func (l *Logger) String() string { return "W&B" }

// python is the sidecar's interpreter and where that choice came from: run.wandb.python, else
// $SLIMEN_PYTHON, else the first torch policy's engine.python, else python3 from PATH.
func python(c *config.Config) (python, from string) {
	if c.Run.Wandb.Python != "" {
		return c.Run.Wandb.Python, "run.wandb.python"
	}
	if py := os.Getenv(PythonEnv); py != "" {
		return py, "$" + PythonEnv
	}
	for _, p := range c.Policies {
		if p.Engine.Kind == "torch" && p.Engine.Python != "" {
			return p.Engine.Python, fmt.Sprintf("policy %q's engine.python", p.Name)
		}
	}
	return "python3", "the default, python3 from PATH"
}

// Open starts the sidecar for a run of config c and waits until wandb.init has succeeded, so a
// missing package or a refused login stops the run before its first step. A config without
// run.wandb, or with W&B disabled (mode: disabled, or WANDB_MODE=disabled with no mode),
// starts nothing.
func (l *Logger) Open(ctx context.Context, c *config.Config) error {
	w := c.Run.Wandb
	if w == nil || w.Mode == "disabled" || w.Mode == "" && os.Getenv("WANDB_MODE") == "disabled" {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.sc != nil {
		return errors.New("wandb: the Logger is open already")
	}
	py, from := python(c)
	sc, err := startSidecar(py, func(line string) { fmt.Fprintln(l.opts.Log, line) })
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("run.wandb: cannot start the W&B sidecar with %s (from %s): %w; "+
				"set run.wandb.python (or $%s) to the python of an environment with the wandb package", py, from, err, PythonEnv)
		}
		return fmt.Errorf("run.wandb: start the W&B sidecar: %w", err)
	}
	msg, err := initMessage(c)
	if err == nil {
		err = sc.send(msg)
	}
	var r reply
	if err == nil {
		r, err = sc.await(ctx, initWait, "ready")
	}
	if err != nil {
		sc.close(5 * time.Second)
		if r.Missing == "wandb" {
			return fmt.Errorf("run.wandb: %s (from %s) has no wandb package: install it into that environment (%s -m pip install wandb), "+
				"or set run.wandb.python (or $%s) to the python of one that has it (scripts/pyenv.sh makes one)", py, from, py, PythonEnv)
		}
		if strings.Contains(err.Error(), "API key") {
			return fmt.Errorf("run.wandb: %w; set WANDB_API_KEY (or run `%s -m wandb login`), "+
				"or log offline: run.wandb.mode: offline (or WANDB_MODE=offline) and `wandb sync` later", err, py)
		}
		return fmt.Errorf("run.wandb: %w", err)
	}
	if c.Run.Out != "" && r.ID != "" {
		// Where the id cannot be kept, a resume starts a new W&B run; that is all.
		_ = os.WriteFile(filepath.Join(c.Run.Out, runIDFile), []byte(r.ID+"\n"), 0o644)
	}
	l.sc, l.mode = sc, r.Mode
	return nil
}

// initMessage is the sidecar's init: the W&B run's names, where it writes, and the resolved
// config as the run's W&B config.
func initMessage(c *config.Config) (map[string]any, error) {
	w := c.Run.Wandb
	b, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	var cfg map[string]any
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, err
	}
	msg := map[string]any{"type": "init", "project": w.Project, "entity": w.Entity, "name": w.Name, "mode": w.Mode, "config": cfg}
	if c.Run.Out != "" {
		if w.Name == "" && os.Getenv("WANDB_NAME") == "" {
			msg["name"] = filepath.Base(c.Run.Out)
		}
		if os.Getenv("WANDB_DIR") == "" {
			// The SDK's folder goes inside the run folder (out/wandb), not the working directory.
			abs, err := filepath.Abs(c.Run.Out)
			if err != nil {
				return nil, err
			}
			msg["dir"] = abs
		}
		if id, err := os.ReadFile(filepath.Join(c.Run.Out, runIDFile)); err == nil {
			msg["id"] = strings.TrimSpace(string(id))
		}
	}
	return msg, nil
}

// sidecarOf returns the open sidecar, or nil when the Logger logs nothing.
func (l *Logger) sidecarOf() *sidecar {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sc
}

// Start has nothing to do: Open sent the run's config.
func (l *Logger) Start(host.RunInfo) error { return nil }

// Step logs a step's metrics, its reward and advantage histograms and its saved rollouts.
func (l *Logger) Step(rec host.StepRecord) error {
	sc := l.sidecarOf()
	if sc == nil {
		return nil
	}
	scalars := map[string]any{}
	for _, m := range rec.Metrics {
		policy, _ := m["policy"].(string)
		addScalars(scalars, policy+"/", m, "policy", "step")
	}
	hists := map[string][]any{}
	for policy, vs := range rec.Rewards {
		hists[policy+"/reward"] = numbers(vs)
	}
	for policy, vs := range rec.Advantages {
		hists[policy+"/advantage"] = numbers(vs)
	}
	msg := map[string]any{"type": "log", "step": rec.Step, "scalars": scalars, "histograms": hists}
	if len(rec.Rollouts) > 0 {
		msg["tables"] = map[string]any{"rollouts": rolloutTable(rec.Rollouts)}
	}
	return sc.send(msg)
}

// Eval logs an eval's metrics as eval/DATASET/metric, and its saved rollouts, at the step it
// ran after.
func (l *Logger) Eval(rec host.EvalRecord) error {
	sc := l.sidecarOf()
	if sc == nil {
		return nil
	}
	scalars := map[string]any{}
	for _, m := range rec.Metrics {
		ds, _ := m["dataset"].(string)
		addScalars(scalars, "eval/"+ds+"/", m, "policy", "step", "dataset")
	}
	msg := map[string]any{"type": "log", "step": rec.Step, "scalars": scalars}
	if len(rec.Rollouts) > 0 {
		msg["tables"] = map[string]any{"eval/rollouts": rolloutTable(rec.Rollouts)}
	}
	return sc.send(msg)
}

// End tells the Logger how the run ended: a run that ended with an error is finished in W&B with
// exit code 1 (the run shows as failed, as a Python script that raised does), otherwise 0.
func (l *Logger) End(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.exit = 0
	if err != nil {
		l.exit = 1
	}
}

// Close finishes the W&B run, with End's exit code, and waits, a bounded time, for the sidecar to
// exit.
func (l *Logger) Close() error {
	l.mu.Lock()
	sc := l.sc
	l.sc = nil
	mode, exit := l.mode, l.exit
	l.mu.Unlock()
	if sc == nil {
		return nil
	}
	wait := finishWaitOnline
	if mode == "offline" {
		wait = finishWaitOffline
	}
	if sc.hasExited() {
		sc.close(0)
		return nil // its death was said when a record found it
	}
	err := sc.send(map[string]any{"type": "finish", "exit_code": exit})
	if err == nil {
		_, err = sc.await(context.Background(), wait, "finished")
	}
	if cerr := sc.close(exitWait); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("finishing the W&B run: %w", err)
	}
	return nil
}

// addScalars adds a metrics line's numbers to scalars under prefix, leaving out the keys skip.
func addScalars(scalars map[string]any, prefix string, m host.Metrics, skip ...string) {
	for k, v := range m {
		if slices.Contains(skip, k) {
			continue
		}
		if x, ok := number(v); ok {
			scalars[prefix+k] = x
		}
	}
}

// number is a metric's value as JSON can carry it: a finite float, or the sidecar's names of
// the non-finite ones. Booleans count as 0 and 1; strings are no scalars.
func number(v any) (any, bool) {
	var x float64
	switch v := v.(type) {
	case float64:
		x = v
	case float32:
		x = float64(v)
	case int:
		x = float64(v)
	case int64:
		x = float64(v)
	case uint64:
		x = float64(v)
	case bool:
		if v {
			x = 1
		}
	default:
		return nil, false
	}
	switch {
	case math.IsNaN(x):
		return "NaN", true
	case math.IsInf(x, 1):
		return "Infinity", true
	case math.IsInf(x, -1):
		return "-Infinity", true
	}
	return x, true
}

func numbers(vs []float64) []any {
	out := make([]any, len(vs))
	for i, v := range vs {
		out[i], _ = number(v)
	}
	return out
}
