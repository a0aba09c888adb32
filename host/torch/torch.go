// Package torch registers the engine kind torch with the host: a PyTorch worker
// (python -m slimen_torch serve, embedded in the binary by engines/torch) started on this machine
// for each policy of that kind, on hf_checkpoint or the folder given by load:, and stopped with
// the engine's Close. A program links it by importing this package; the slimen CLI does:
//
//	import _ "github.com/slimen/slimen/host/torch"
//
// A worker's output goes to the run's events.log (to stderr when the run keeps none).
package torch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/torchproc"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

func init() { host.RegisterEngineKind("torch", host.EngineKind{Open: open}) }

// PythonEnv is the environment variable naming the interpreter of torch workers whose policy
// gives no engine.python.
const PythonEnv = "SLIMEN_PYTHON"

// torchPython is the interpreter of a policy's torch worker and where that choice came from.
func torchPython(p config.PolicyConfig) (python, from string) {
	if p.Engine.Python != "" {
		return p.Engine.Python, "engine.python"
	}
	if py := os.Getenv(PythonEnv); py != "" {
		return py, "$" + PythonEnv
	}
	return "python3", "the default: engine.python, else $" + PythonEnv + ", else python3 from PATH"
}

// Supervision defaults (engine.max_restarts, engine.hang_timeout): a worker that dies or hangs is
// started again up to 3 times; one whose Health goes unanswered for 2 minutes is hung.
const (
	defaultMaxRestarts = 3
	defaultHangTimeout = 2 * time.Minute
)

// open starts a policy's torch worker and connects to it.
func open(ctx context.Context, p config.PolicyConfig, env host.EngineEnv) (engines.Engine, error) {
	if p.LoRA != nil {
		return openLoRA(ctx, p, env)
	}
	python, from := torchPython(p)
	model, key := p.HFCheckpoint, "hf_checkpoint"
	args := slices.Clone(p.Engine.Args)
	if p.Engine.Deterministic {
		args = append(args, "--deterministic")
	}
	if p.Load != "" {
		model, key = p.Load, "load"
	}
	if err := checkModelFolder(key, model); err != nil {
		return nil, err
	}
	if ref := p.KLReference(); ref != model {
		if err := checkModelFolder("the KL reference (ref_load, else hf_checkpoint)", ref); err != nil {
			return nil, err
		}
	}
	if err := checkTorchPython(ctx, python, from); err != nil {
		return nil, err
	}
	w, err := placement(p, env)
	if err != nil {
		return nil, err
	}
	if err := checkRanks(p, w); err != nil {
		return nil, err
	}
	placeEnv, placeArgs := placed(p, w)
	if env.Replica == 0 && replicasOnRolloutSlice(p, w, env.Config) {
		// The rollout slice would stay idle while the worker kept the versions on its actor GPU.
		placeArgs = append(placeArgs, "--no-versions")
		env.Logf("policy %q: rollout.max_staleness %d with a rollout slice of its own (GPU %s): "+
			"its rollout replicas run there and take the weights after each step, "+
			"so its worker keeps no versions (--no-versions); colocate it to keep them in the worker", p.Name, env.Config.Rollout.MaxStaleness, joinInts(w.Replicas))
	}
	replicaOn := ""
	if env.Replica > 0 && w != nil {
		placeArgs = nil // its cache was not sized with the worker's neighbours
		if on := replicaPlace(p, w, env.Replica); on != nil {
			w = on
			placeEnv = []string{"CUDA_VISIBLE_DEVICES=" + on.UUIDs[0]}
			replicaOn = fmt.Sprintf("rollout replica %d on GPU %d of its rollout slice", env.Replica, on.GPUs[0])
		}
	}
	args = append(args, placeArgs...)
	// The KL reference stays the base model, not the checkpoint the policy resumes from.
	refSet := slices.ContainsFunc(args, func(a string) bool { return a == "--ref-model" || strings.HasPrefix(a, "--ref-model=") })
	if ref := p.KLReference(); ref != model && !refSet {
		ref, err := filepath.Abs(ref)
		if err != nil {
			return nil, err
		}
		args = append(args, "--ref-model", ref)
	}
	o := torchproc.Options{Python: python, Model: model, Device: p.Engine.Device, Args: args, Ranks: p.NumGPUsPerNode,
		Roots: torchRoots(p, env.RunDir), TokenEnv: p.Engine.TokenEnv, StartTimeout: p.Engine.StartTimeout,
		Client: host.ClientOptions(p), MaxRestarts: defaultMaxRestarts, HangTimeout: p.Engine.HangTimeout,
		Logf: func(format string, args ...any) { env.Logf("policy %q: %s", p.Name, fmt.Sprintf(format, args...)) }}
	if p.Engine.MaxRestarts != nil {
		o.MaxRestarts = *p.Engine.MaxRestarts
	}
	if o.HangTimeout == 0 {
		o.HangTimeout = defaultHangTimeout
	}
	where := "device " + p.Engine.Device
	if p.Engine.Device == "" {
		where = "the worker's default device (the first GPU it sees, else the CPU)"
	}
	if len(p.Engine.GPUs) > 0 {
		o.Env = []string{"CUDA_VISIBLE_DEVICES=" + strings.Join(p.Engine.GPUs, ",")}
		where += ", " + o.Env[0]
	}
	if len(placeEnv) > 0 {
		o.Env = placeEnv
		where += fmt.Sprintf(" of GPU %s (placed: %s)", joinInts(w.GPUs), o.Env[0])
	}
	if replicaOn != "" {
		where += "; " + replicaOn
	}
	var self atomic.Value
	if env.OnRestart != nil {
		o.Client.OnRestart = env.OnRestart("its torch worker", func() engines.Engine { e, _ := self.Load().(engines.Engine); return e })
	}
	var lines *lineWriter
	if env.Worker != nil {
		lines = &lineWriter{emit: func(line string) { env.Worker("policy %q: worker: %s", p.Name, line) }}
		o.Log = lines
	}
	launch := python + " -m slimen_torch serve"
	if o.Ranks > 1 {
		launch = fmt.Sprintf("%s -m torch.distributed.run --nproc-per-node %d -m slimen_torch serve (FSDP2 over %d ranks)", python, o.Ranks, o.Ranks)
	}
	env.Logf("policy %q: starting a torch worker: %s --model %s, on %s", p.Name, launch, model, where)
	start := time.Now()
	e, err := torchproc.Start(ctx, o)
	if err != nil {
		if lines != nil {
			lines.flush()
		}
		return nil, torchStartError(err, python, from)
	}
	var eng engines.Engine = e
	if w != nil {
		eng = &gpuWorker{Engine: e, inv: inventory, gpus: w.UUIDs}
	}
	self.Store(eng)
	env.Logf("policy %q: torch worker ready in %.1fs (pid %d)", p.Name, time.Since(start).Seconds(), e.Pid())
	return eng, nil
}

// torchRoots are the folders a policy's torch worker lets its clients save into and load from:
// the run's directory (its checkpoints) and the folder that holds the policy's save: folder (which
// is written beside it and swapped in). With neither, the worker's default: this process's
// working directory.
func torchRoots(p config.PolicyConfig, runDir string) []string {
	var roots []string
	if runDir != "" {
		roots = append(roots, runDir)
	}
	if p.Save != "" && p.Trainable {
		roots = append(roots, filepath.Dir(p.Save))
	}
	return roots
}

// checkModelFolder checks, before a worker starts, that a policy's model path (named by key) is a
// Hugging Face model folder, so a typo is reported in the config's words, not as the worker's
// Python traceback.
func checkModelFolder(key, dir string) error {
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s %s does not exist; give a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)", key, dir)
	case err != nil:
		return fmt.Errorf("%s %s: %w", key, dir, err)
	case !fi.IsDir():
		return fmt.Errorf("%s %s is a file; give the Hugging Face model folder that holds config.json and the *.safetensors weights", key, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "config.json")); err != nil {
		return fmt.Errorf("%s %s has no config.json, so it is not a Hugging Face model folder "+
			"(make one with `python -m slimen_torch make-model`, or save one with transformers' save_pretrained)", key, dir)
	}
	return nil
}

// torchRequirements are the modules a torch worker imports; checkTorchPython finds them without
// importing them (which takes seconds for torch).
const torchRequirements = "torch transformers safetensors tokenizers grpc google.protobuf"

// checkTorchPython checks that the worker's interpreter runs and has the worker's requirements.
func checkTorchPython(ctx context.Context, python, from string) error {
	const probe = `import importlib.util as u, sys
missing = []
for m in sys.argv[1:]:
    try:
        found = u.find_spec(m) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        missing.append(m)
print(" ".join(missing))`
	cmd := exec.CommandContext(ctx, python, append([]string{"-c", probe}, strings.Fields(torchRequirements)...)...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return torchStartError(fmt.Errorf("torch engine: start %s: %w", python, err), python, from)
	}
	if missing := strings.TrimSpace(string(out)); missing != "" {
		return &startError{msg: fmt.Sprintf("the torch worker cannot start: %s (from %s) lacks %s; "+
			"install engines/torch/requirements.txt into its environment, "+
			"or set engine.python (or $%s) to one that has them (scripts/pyenv.sh makes one)",
			python, from, missing, PythonEnv)}
	}
	return nil
}

// workerTailLines is how many lines of a torch worker's output a start-up error quotes.
const workerTailLines = 30

// startError is a torch worker that did not start: torchproc's error with the worker's output
// cut to its last lines, and a hint where one applies.
type startError struct {
	msg string
	err error
}

func (e *startError) Error() string { return e.msg }
func (e *startError) Unwrap() error { return e.err }

func torchStartError(err error, python, from string) error {
	msg := "the torch worker did not start: " + lastLines(err.Error(), workerTailLines)
	switch {
	case errors.Is(err, exec.ErrNotFound) || errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission):
		msg += fmt.Sprintf("\nthe interpreter %s comes from %s; set engine.python (or $%s) to the python of an environment "+
			"with engines/torch/requirements.txt (scripts/pyenv.sh makes one)",
			python, from, PythonEnv)
	case strings.Contains(err.Error(), "No module named"):
		msg += fmt.Sprintf("\n%s (from %s) lacks the worker's requirements: install engines/torch/requirements.txt into its "+
			"environment, or set engine.python (or $%s) to one that has them (scripts/pyenv.sh makes one)",
			python, from, PythonEnv)
	}
	return &startError{msg: msg, err: err}
}

// lastLines keeps the first line of s (the summary) and its last n lines.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) <= n+1 {
		return strings.Join(lines, "\n")
	}
	cut := len(lines) - n
	return lines[0] + fmt.Sprintf("\n  … (%d earlier lines left out)\n", cut-1) + strings.Join(lines[cut:], "\n")
}

// lineWriter hands each complete line written to it to emit; a line longer than maxLine is
// emitted in pieces.
type lineWriter struct {
	mu   sync.Mutex
	buf  []byte
	emit func(string)
}

const maxLine = 8 << 10

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			if len(w.buf) >= maxLine {
				w.emit(string(w.buf))
				w.buf = w.buf[:0]
			}
			return len(p), nil
		}
		w.emit(strings.TrimRight(string(w.buf[:i]), "\r"))
		w.buf = w.buf[i+1:]
	}
}

// flush emits a last line that has no newline yet.
func (w *lineWriter) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) > 0 {
		w.emit(string(w.buf))
		w.buf = nil
	}
}

// checkRanks refuses a worker of several ranks (num_gpus_per_node > 1, one GPU each, cuda:0… of
// those it sees) that would see fewer GPUs than ranks, or that names one GPU with engine.device.
func checkRanks(p config.PolicyConfig, w *gpus.Worker) error {
	n := p.NumGPUsPerNode
	if n <= 1 || p.Engine.Device == "cpu" || strings.HasPrefix(p.Engine.Device, "cpu:") {
		return nil
	}
	if strings.HasPrefix(p.Engine.Device, "cuda:") {
		return fmt.Errorf("policy %q: engine.device %s names one GPU, but num_gpus_per_node %d runs %d ranks on cuda:0…%d of "+
			"the GPUs the worker sees: leave engine.device out (or say cuda) and give the GPUs with engine.gpus", p.Name, p.Engine.Device, n, n, n-1)
	}
	seen, from := 0, ""
	switch {
	case len(p.Engine.GPUs) > 0:
		seen, from = len(p.Engine.GPUs), "engine.gpus"
	case w != nil:
		seen, from = len(w.GPUs), "its placement"
	}
	if from != "" && seen < n {
		return fmt.Errorf("policy %q: num_gpus_per_node %d runs %d ranks, one GPU each, but %s gives the worker %d GPU(s)", p.Name, n, n, from, seen)
	}
	return nil
}
