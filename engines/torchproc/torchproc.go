// Package torchproc starts the PyTorch policy engine (engines/torch) as a child process on this
// machine and returns it as an engines.Engine.
//
// Start unpacks the worker's Python package (embedded in the binary by engines/torch, so worker
// and host always speak the same protocol version), runs
//
//	PYTHON -m slimen_torch serve --model MODEL --listen 127.0.0.1:PORT --address-file F --token-env VAR [--device D] [--root DIR]…
//
// (under torchrun, `PYTHON -m slimen_torch.launch torch.distributed.run --standalone
// --nproc-per-node N --max-restarts R -m slimen_torch serve …`, when Options.Ranks is above 1:
// one policy over N GPUs, docs/gpus.md; torchrun itself restarts a group whose rank failed)
// with PYTHONPATH pointing at it, waits until the worker listens and its Health says SERVING (the
// model is loaded), and connects an engines/remote client to it. Close stops the client and the
// worker (SIGTERM, then SIGKILL after a grace period). The Python environment must have the
// worker's requirements (engines/torch/requirements.txt); scripts/pyenv.sh builds one.
package torchproc

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/internal/capbuf"
	"github.com/slimen/slimen/internal/loopback"
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
	// Ranks above 1 starts the worker under torchrun with that many ranks on this machine (one
	// GPU each, cuda:0… of those it sees; on the CPU, gloo): rank 0 serves, FSDP2 shards the
	// training (engines/torch/slimen_torch/dist.py).
	Ranks int
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

	// MaxRestarts is how many times a worker that exits after its start, or hangs, is started
	// again, on the same address with the same arguments, so that its client reconnects and
	// finds a new server process (remote.Options.OnRestart puts the state back); 0: never, a
	// dead worker stays dead. Client.ReconnectTimeout must cover the new worker's start. A
	// worker of several ranks (Ranks) is restarted by its torchrun, as often (launcher): the
	// supervisor starts it again only after killing it for a hang, and leaves it dead when
	// torchrun exits.
	MaxRestarts int
	// HangTimeout: a worker whose Health has not answered for this long (it is probed every
	// HangTimeout/5) is killed with SIGKILL, and restarted when MaxRestarts allows; a worker
	// started again has StartTimeout until it first answers; 0: not watched.
	HangTimeout time.Duration
	// Logf, when set, receives a line for each exit, hang and restart of the worker after its start.
	Logf func(format string, args ...any)
}

// WorkerTokenEnv is the variable of a worker's environment that holds the token Start made for it
// (when Options.TokenEnv is empty).
const WorkerTokenEnv = "SLIMEN_WORKER_TOKEN"

// Engine is a running worker: the remote client (every engines.Engine method) plus the process,
// and the supervisor that restarts it (Options.MaxRestarts, Options.HangTimeout).
type Engine struct {
	*remote.Client
	mu       sync.Mutex
	proc     *proc // the current process; guarded by mu
	closing  bool  // Close began: nothing restarts the worker any more; guarded by mu
	restarts int   // guarded by mu
	closed   chan struct{}
	tail     *capbuf.Buffer
	tmp      string
	once     sync.Once
	stopErr  error
	spawn    func(listen string) (*proc, error)
}

// proc is one process of the worker.
type proc struct {
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the process has exited
	waitErr error
	// before is the server process the client knew when this one was started again (its
	// predecessor's instance): once the client knows another, it has met this one.
	before string
}

// Restarts is how many times the worker has been started again after its start.
func (e *Engine) Restarts() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.restarts
}

// Pid is the process id of the worker's current process.
func (e *Engine) Pid() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.proc.cmd.Process.Pid
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
	args := []string{"--address-file", addrFile}
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
	tail := &capbuf.Buffer{Tail: 64 << 10}
	out := io.MultiWriter(opts.Log, tail)
	e := &Engine{tail: tail, tmp: tmp, closed: make(chan struct{})}
	// The first process listens on a free port; one started again listens where it did.
	e.spawn = func(listen string) (*proc, error) {
		argv := append(launcher(opts.Ranks, opts.MaxRestarts), "-m", "slimen_torch", "serve", "--model", model, "--listen", listen)
		argv = append(argv, args...)
		cmd := exec.Command(opts.Python, argv...)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+pythonPath(pkg), "PYTHONUNBUFFERED=1")
		cmd.Env = append(cmd.Env, opts.Env...)
		if token != "" {
			cmd.Env = append(cmd.Env, WorkerTokenEnv+"="+token) // the last value of a name wins
		}
		cmd.Stdout, cmd.Stderr = out, out
		setProcAttr(cmd)
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("torch engine: start %s: %w (set engine.python to an interpreter with engines/torch/requirements.txt)", opts.Python, err)
		}
		p := &proc{cmd: cmd, exited: make(chan struct{})}
		go func() {
			p.waitErr = cmd.Wait()
			close(p.exited)
		}()
		return p, nil
	}
	// A worker that crashes is started again on the same address: one below the ephemeral range,
	// which no client's source port can hold meanwhile (loopback.Addr).
	listen, err := loopback.Addr()
	if err != nil {
		listen = "127.0.0.1:0"
	}
	p, err := e.spawn(listen)
	if err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	e.proc = p
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	if err := e.connect(ctx, addrFile, opts, token); err != nil {
		e.stop()
		return nil, err
	}
	if opts.MaxRestarts > 0 || opts.HangTimeout > 0 {
		go e.supervise(opts)
	}
	return e, nil
}

// supervise waits for the worker to exit, or to stop answering Health for opts.HangTimeout (then
// kills it), and starts it again on its address while opts.MaxRestarts allows.
func (e *Engine) supervise(opts Options) {
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	hung := make(chan *proc, 1)
	if opts.HangTimeout > 0 {
		go e.heartbeat(opts.HangTimeout, opts.StartTimeout, hung)
	}
	addr := e.Client.Address()
	for {
		e.mu.Lock()
		p := e.proc
		e.mu.Unlock()
		select {
		case <-e.closed:
			return
		case <-p.exited:
			logf("the torch worker (pid %d) exited: %v", p.cmd.Process.Pid, p.waitErr)
			if opts.Ranks > 1 {
				// torchrun started its group again itself as often as MaxRestarts allows
				// (launcher) and gave up: a rank that fails on every start (a dead GPU) ends the
				// worker here, not after MaxRestarts more groups.
				logf("the torch worker is not started again: torchrun restarted its group as often as it may (%d times) and gave up; "+
					"calls fail once the client's reconnect timeout has passed", opts.MaxRestarts)
				return
			}
		case h := <-hung:
			if h != p {
				continue
			}
			logf("the torch worker (pid %d) has not answered Health for %v: killing it", p.cmd.Process.Pid, opts.HangTimeout)
			kill(p.cmd)
			<-p.exited
		}
		e.mu.Lock()
		if e.closing {
			e.mu.Unlock()
			return
		}
		if e.restarts >= opts.MaxRestarts {
			e.mu.Unlock()
			logf("the torch worker is not started again: it was restarted %d times already (the limit); "+
				"calls fail once the client's reconnect timeout has passed", e.restarts)
			return
		}
		e.restarts++
		n := e.restarts
		before := e.Client.Instance() // the old process's: the new one has not answered anyone yet
		np, err := e.spawn(addr)
		if err != nil {
			e.mu.Unlock()
			logf("the torch worker could not be started again: %v", err)
			return
		}
		np.before = before
		e.proc = np
		e.mu.Unlock()
		logf("the torch worker is started again on %s (restart %d of at most %d, pid %d)", addr, n, opts.MaxRestarts, np.cmd.Process.Pid)
	}
}

// heartbeat probes Health every timeout/5 and hands the current process to hung when no probe
// has succeeded for timeout; a process started again that has not answered yet has start (its
// start-up: importing torch and loading the model) instead.
func (e *Engine) heartbeat(timeout, start time.Duration, hung chan<- *proc) {
	every := timeout / 5
	tick := time.NewTicker(every)
	defer tick.Stop()
	e.mu.Lock()
	watched, answered := e.proc, true // Start saw the first process serve
	e.mu.Unlock()
	alive := time.Now()
	for {
		select {
		case <-e.closed:
			return
		case <-tick.C:
		}
		e.mu.Lock()
		p := e.proc
		e.mu.Unlock()
		if p != watched {
			watched, answered, alive = p, false, time.Now()
		}
		if !answered && e.Client.Instance() != p.before {
			// The client has met the new process (a call of the run reached it, maybe before
			// this loop saw the restart): it has started, so from now on it has timeout, not
			// start, to answer.
			answered, alive = true, time.Now()
		}
		ctx, cancel := context.WithTimeout(context.Background(), every)
		_, err := e.Client.Health(ctx)
		cancel()
		if err == nil {
			answered, alive = true, time.Now()
			continue
		}
		limit := timeout
		if !answered {
			limit = start
		}
		if time.Since(alive) >= limit {
			select {
			case hung <- p:
			default:
			}
			alive = time.Now()
		}
	}
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
	copts := clientOptions(opts, addr, token)
	dialCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // a worker that dies while we dial must not leave Dial retrying
		select {
		case <-e.proc.exited:
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
	case <-e.proc.exited:
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
	case <-e.proc.exited:
		return fmt.Errorf("torch engine for %s exited during start-up (%v); its log ends:\n%s",
			model, e.proc.waitErr, e.tail.String())
	default:
		return nil
	}
}

// Close stops the client and the worker.
func (e *Engine) Close() error {
	e.once.Do(func() {
		e.mu.Lock()
		e.closing = true
		e.mu.Unlock()
		close(e.closed)
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
	e.mu.Lock()
	p := e.proc
	e.mu.Unlock()
	select {
	case <-p.exited:
		return nil
	default:
	}
	terminate(p.cmd)
	select {
	case <-p.exited:
		return nil
	case <-time.After(DefaultStopTimeout):
		kill(p.cmd)
		<-p.exited
		return fmt.Errorf("torch engine: the worker did not stop within %v and was killed", DefaultStopTimeout)
	}
}

// Log returns the end of the worker's output (for error reports).
func (e *Engine) Log() string { return e.tail.String() }

// LocalMaxBackoff is the client's longest wait between attempts to reach its worker when
// Options.Client leaves MaxBackoff zero. The worker is on this machine, where an attempt that
// finds no server costs microseconds, so a restarted worker is met within this of its readiness;
// remote's default (2 s, give or take a fifth) kept the run waiting for a restarted worker group
// that was ready already, up to 2.4 s (2.75 s seen on the CPU run).
const LocalMaxBackoff = 100 * time.Millisecond

// clientOptions are the worker's client's: opts.Client with the worker's address and token, and
// LocalMaxBackoff unless it sets a MaxBackoff.
func clientOptions(opts Options, addr, token string) remote.Options {
	copts := opts.Client
	copts.Address = addr
	copts.TokenEnv, copts.Token = opts.TokenEnv, token
	if copts.MaxBackoff <= 0 {
		copts.MaxBackoff = LocalMaxBackoff
	}
	return copts
}

// launcher is what runs before `-m slimen_torch` on the interpreter's command line: torchrun
// (torch.distributed.run, the interpreter's own) for a worker of several ranks, with a rendezvous
// on a free port of this machine (--standalone), run by slimen_torch.launch, which exits as soon
// as torchrun returns (torch's teardown in torchrun's exit took seconds of a group's restart).
// torchrun restarts a group whose rank failed itself, restarts times (--max-restarts): its new
// rank 0 listens where the old one did (slimen_torch.dist.relisten) and the client meets it as
// it would a worker the supervisor started again, without the seconds of torchrun's own exit
// and start (a Python process importing torch) that a restart through the supervisor costs.
func launcher(ranks, restarts int) []string {
	if ranks <= 1 {
		return nil
	}
	argv := []string{"-m", "slimen_torch.launch", "torch.distributed.run", "--standalone",
		"--nproc-per-node", strconv.Itoa(ranks)}
	if restarts > 0 {
		argv = append(argv, "--max-restarts", strconv.Itoa(restarts))
	}
	return argv
}

func pythonPath(pkg string) string {
	if old := os.Getenv("PYTHONPATH"); old != "" {
		return pkg + string(os.PathListSeparator) + old
	}
	return pkg
}
