// Package torchproc starts the PyTorch policy engine (engines/torch) as a child process on this
// machine and returns it as an engines.Engine.
//
// Start unpacks the worker's Python package (embedded in the binary by engines/torch, so worker
// and host always speak the same protocol version), runs
//
//	PYTHON -m slimen_torch serve --model MODEL --listen 127.0.0.1:0 --address-file F --token-env VAR [--device D] [--root DIR]…
//
// with PYTHONPATH pointing at it, waits until the worker listens and its Health says SERVING (the
// model is loaded), and connects an engines/remote client to it. Close stops the client and the
// worker (SIGTERM, then SIGKILL after a grace period). The Python environment must have the
// worker's requirements (engines/torch/requirements.txt); scripts/pyenv.sh builds one.
package torchproc

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
)

// Defaults for the zero fields of Options.
const (
	DefaultStartTimeout = 10 * time.Minute // loading and compiling a large model takes minutes
	DefaultStopTimeout  = 15 * time.Second
)

// Options say which Python and model to run, and how.
type Options struct {
	// Python is the interpreter of an environment with the worker's requirements; "" is
	// "python3" from PATH.
	Python string
	// Model is the Hugging Face model folder the worker loads.
	Model string
	// Device is "cuda:0", "cpu", …; "" lets the worker choose (the first GPU if there is one).
	Device string
	// Env holds extra KEY=VALUE entries for the worker's environment, on top of this process's
	// (CUDA_VISIBLE_DEVICES, say).
	Env []string
	// Args are extra `serve` flags (--slots, --max-seq-len, --grad-checkpointing, …).
	Args []string
	// PackageDir, when set, is a folder holding slimen_torch (engines/torch of a checkout) used
	// instead of the copy embedded in the binary.
	PackageDir string
	// Roots are the folders the worker lets its clients save into and load from (its --root
	// flags; a relative folder in a Save or Load is taken from the first). Empty: the worker's
	// working directory, which is this process's.
	Roots []string
	// TokenEnv names an environment variable holding a bearer token that the worker will demand
	// and the client will send. "": Start makes a random token for this worker, handed to it in
	// its environment (WorkerTokenEnv), so that no other process on the machine can use it.
	TokenEnv string
	// StartTimeout bounds the start, model loading included; 0 is DefaultStartTimeout.
	StartTimeout time.Duration
	// Log receives the worker's stdout and stderr; nil is os.Stderr.
	Log io.Writer
	// Client holds the settings of the gRPC client; its Address and TokenEnv are set by Start.
	Client remote.Options
}

// WorkerTokenEnv is the variable of a worker's environment that holds the token Start made for it
// (when Options.TokenEnv is empty).
const WorkerTokenEnv = "SLIMEN_WORKER_TOKEN"

// Engine is a running worker: the remote client (every engines.Engine method) plus the process.
type Engine struct {
	*remote.Client
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the process has exited
	waitErr error
	tail    *tailBuffer
	tmp     string
	once    sync.Once
	stopErr error
}

var _ engines.Engine = (*Engine)(nil)

// Start starts a worker and returns it once it serves the model. The worker lives until Close,
// not until ctx ends; ctx bounds the start only.
func Start(ctx context.Context, opts Options) (*Engine, error) {
	if opts.Model == "" {
		return nil, errors.New("torch engine: no model folder (hf_checkpoint) given")
	}
	if opts.Python == "" {
		opts.Python = "python3"
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = DefaultStartTimeout
	}
	if opts.Log == nil {
		opts.Log = os.Stderr
	}
	model, err := filepath.Abs(opts.Model)
	if err != nil {
		return nil, err
	}
	pkg := opts.PackageDir
	if pkg == "" {
		if pkg, err = unpack(); err != nil {
			return nil, fmt.Errorf("torch engine: unpack the worker: %w", err)
		}
	} else if pkg, err = filepath.Abs(pkg); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "slimen-torch-")
	if err != nil {
		return nil, err
	}
	addrFile := filepath.Join(tmp, "address")
	args := []string{"-m", "slimen_torch", "serve", "--model", model, "--listen", "127.0.0.1:0",
		"--address-file", addrFile}
	if opts.Device != "" {
		args = append(args, "--device", opts.Device)
	}
	// The worker listens on loopback, which every process on this machine can reach: a token
	// keeps them out. Its own is passed in its environment, which only its user can read, never
	// on its command line.
	tokenEnv, token := opts.TokenEnv, ""
	if tokenEnv == "" {
		tokenEnv, token = WorkerTokenEnv, rand.Text()
	}
	args = append(args, "--token-env", tokenEnv)
	for _, r := range opts.Roots {
		abs, err := filepath.Abs(r)
		if err != nil {
			os.RemoveAll(tmp)
			return nil, err
		}
		args = append(args, "--root", abs)
	}
	args = append(args, opts.Args...)
	cmd := exec.Command(opts.Python, args...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pythonPath(pkg), "PYTHONUNBUFFERED=1")
	cmd.Env = append(cmd.Env, opts.Env...)
	if token != "" {
		cmd.Env = append(cmd.Env, WorkerTokenEnv+"="+token) // the last value of a name wins
	}
	tail := &tailBuffer{max: 64 << 10}
	out := io.MultiWriter(opts.Log, tail)
	cmd.Stdout, cmd.Stderr = out, out
	setProcAttr(cmd)
	if err := cmd.Start(); err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("torch engine: start %s: %w (set engine.python to an interpreter with engines/torch/requirements.txt)", opts.Python, err)
	}
	e := &Engine{cmd: cmd, exited: make(chan struct{}), tail: tail, tmp: tmp}
	go func() {
		e.waitErr = cmd.Wait()
		close(e.exited)
	}()
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	if err := e.connect(ctx, addrFile, opts, token); err != nil {
		e.stop()
		return nil, err
	}
	return e, nil
}

// connect waits for the address file, dials (with the token Start made, if any), and waits for the
// model to be served.
func (e *Engine) connect(ctx context.Context, addrFile string, opts Options, token string) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var addr string
	for addr == "" {
		if b, err := os.ReadFile(addrFile); err == nil {
			addr = strings.TrimSpace(string(b))
			break
		}
		if err := e.waitTick(ctx, tick, opts.Model); err != nil {
			return err
		}
	}
	copts := opts.Client
	copts.Address = addr
	copts.TokenEnv, copts.Token = opts.TokenEnv, token
	dialCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // a worker that dies while we dial must not leave Dial retrying
		select {
		case <-e.exited:
			cancel()
		case <-dialCtx.Done():
		}
	}()
	c, err := remote.Dial(dialCtx, copts)
	if err != nil {
		if exitErr := e.exitError(opts.Model); exitErr != nil {
			return exitErr
		}
		return fmt.Errorf("torch engine at %s: %w", addr, err)
	}
	e.Client = c
	for {
		h, err := c.Health(dialCtx)
		if err == nil && h.Serving {
			return nil
		}
		if err := e.waitTick(ctx, tick, opts.Model); err != nil {
			c.Close()
			return err
		}
	}
}

func (e *Engine) waitTick(ctx context.Context, tick *time.Ticker, model string) error {
	select {
	case <-e.exited:
		return e.exitError(model)
	case <-ctx.Done():
		return fmt.Errorf("torch engine for %s: not serving after %v: %w; its log ends:\n%s",
			model, ctx.Err(), ctx.Err(), e.tail.String())
	case <-tick.C:
		return nil
	}
}

// exitError describes a worker that exited, with the end of its log; nil while it runs.
func (e *Engine) exitError(model string) error {
	select {
	case <-e.exited:
		return fmt.Errorf("torch engine for %s exited during start-up (%v); its log ends:\n%s",
			model, e.waitErr, e.tail.String())
	default:
		return nil
	}
}

// Close stops the client and the worker.
func (e *Engine) Close() error {
	e.once.Do(func() {
		if e.Client != nil {
			e.Client.Close()
		}
		e.stopErr = e.stop()
	})
	return e.stopErr
}

// stop ends the worker: SIGTERM (it stops serving and exits), SIGKILL after DefaultStopTimeout.
func (e *Engine) stop() error {
	defer os.RemoveAll(e.tmp)
	select {
	case <-e.exited:
		return nil
	default:
	}
	terminate(e.cmd)
	select {
	case <-e.exited:
		return nil
	case <-time.After(DefaultStopTimeout):
		kill(e.cmd)
		<-e.exited
		return fmt.Errorf("torch engine: the worker did not stop within %v and was killed", DefaultStopTimeout)
	}
}

// Log returns the end of the worker's output (for error reports).
func (e *Engine) Log() string { return e.tail.String() }

func pythonPath(pkg string) string {
	if old := os.Getenv("PYTHONPATH"); old != "" {
		return pkg + string(os.PathListSeparator) + old
	}
	return pkg
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
	max int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf.Write(p)
	if extra := t.buf.Len() - t.max; extra > 0 {
		t.buf.Next(extra)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.buf.String()
}
