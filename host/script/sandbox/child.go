package sandbox

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"time"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/host/script"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// ChildMain runs the sandbox child on the host's channel (fds HostInFD and HostOutFD); the CLI
// calls it when ChildEnv is set. It returns the process exit code.
func ChildMain() int {
	in, out, err := openChannel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen sandbox child:", err)
		return 2
	}
	if mb, err := strconv.Atoi(os.Getenv(ChildEnv)); err == nil && mb > 0 {
		limit := uint64(mb) << 20
		// The hard limit makes an allocation past it fail (the runtime then dies, taking only
		// this child); the soft one makes the collector work hard before that.
		syscall.Setrlimit(syscall.RLIMIT_DATA, &syscall.Rlimit{Cur: limit, Max: limit})
		debug.SetMemoryLimit(int64(limit) / 2)
	}
	if s, err := strconv.ParseUint(os.Getenv(CPUEnv), 10, 64); err == nil && s > 0 {
		// The Go runtime ignores SIGXCPU, which the soft limit sends: catch it and exit, saying
		// why (the host names cpu_seconds from this line). The hard limit's SIGKILL is the
		// backstop.
		xcpu := make(chan os.Signal, 1)
		signal.Notify(xcpu, syscall.SIGXCPU)
		go func() {
			<-xcpu
			fmt.Fprintln(os.Stderr, CPULimitMsg)
			os.Exit(3)
		}()
		syscall.Setrlimit(syscall.RLIMIT_CPU, &syscall.Rlimit{Cur: s, Max: s + 5})
	}
	c := &childConn{out: out, waiting: map[int64]*waiter{}}
	defer c.agents.Close()
	return c.serve(in)
}

// openChannel takes the host's channel and hides it from every program this process starts
// (agent()): both ends close on exec, at once, before any program can start. The process is
// also made non-dumpable, so that a program of the same (non-root) user can neither open
// /proc/<child>/fd/N nor trace it; a root program can, which only a jail that hides this process
// from it (its own PID namespace) prevents.
func openChannel() (*os.File, *os.File, error) {
	for _, fd := range []int{HostInFD, HostOutFD} {
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil {
			return nil, nil, fmt.Errorf("no channel to the host on fd %d (%v): a sandbox child is started by the host", fd, err)
		}
		syscall.CloseOnExec(fd)
	}
	syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_SET_DUMPABLE, 0, 0)
	return os.NewFile(HostInFD, "host-in"), os.NewFile(HostOutFD, "host-out"), nil
}

// childConn is the child's side of the pipe.
type childConn struct {
	outMu   sync.Mutex
	out     io.Writer
	mu      sync.Mutex
	nextID  int64
	waiting map[int64]*waiter
	script  *script.Script
	cfg     *config.Config
	zero    bool
	calls   *inflight
	// agents is the endpoint of the agent() programs of the child's rollouts.
	agents script.AgentEndpoint
}

// send writes one message to the host. A message over sandbox.message_bytes is not sent: the host
// would stop reading this child (what it is to do with a child that breaks the protocol).
func (c *childConn) send(m Msg) error {
	b, err := Marshal(m)
	if err != nil {
		return err
	}
	if c.cfg != nil && len(b)+1 > c.cfg.Sandbox.MessageBytes {
		what := m.T
		if m.Method != "" {
			what = m.Method
		}
		return &script.BudgetError{Budget: "message_bytes", Limit: fmt.Sprint(c.cfg.Sandbox.MessageBytes),
			What: fmt.Sprintf("a %s message of %d bytes to the host", what, len(b)+1)}
	}
	c.outMu.Lock()
	defer c.outMu.Unlock()
	_, err = c.out.Write(append(b, '\n'))
	return err
}

func (c *childConn) serve(in io.Reader) int {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 1<<30)
	for sc.Scan() {
		var m Msg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			c.send(Msg{T: "fatal", Error: "bad message from the host: " + err.Error()})
			return 2
		}
		switch m.T {
		case "init":
			var in Init
			if err := json.Unmarshal(m.Args, &in); err != nil {
				c.send(Msg{T: "fatal", Error: err.Error()})
				return 2
			}
			c.cfg, c.zero = in.Config, in.Zero
			c.calls = newInflight(MaxCallsInFlight, InflightMessages*c.cfg.Sandbox.MessageBytes)
			s, err := script.LoadSource(in.Script, []byte(in.Source), script.Options{Sandbox: true, Config: script.ConfigValue(func() *config.Config { return c.cfg })})
			if err != nil {
				msg := err.Error()
				if len(msg) > 64<<10 {
					msg = msg[:64<<10] + "…"
				}
				c.send(Msg{T: "fatal", Error: msg})
				return 2
			}
			c.script = s
			c.send(Msg{T: "ready"})
		case "rollout":
			go c.runRollout(m.ID, m.Args)
		case "reply":
			c.mu.Lock()
			w := c.waiting[m.ID]
			delete(c.waiting, m.ID)
			c.mu.Unlock()
			switch {
			case w == nil:
			case w.abandoned:
				// Its caller gave up (the rollout's wall time); the call was still in flight at
				// the host until now.
				c.calls.release(w.size)
			default:
				w.ch <- m
			}
		}
	}
	return 0
}

// The calls a child has in flight at the host are bounded, in number and in bytes, so that no
// script can make the host hold more than a few messages' worth of its calls at once (a parallel
// fan-out of state.get, nested parallel generate calls with large prompts). Calls past the bound
// wait in the child, where memory_mb bounds them.
const (
	MaxCallsInFlight = 256
	InflightMessages = 4 // bytes in flight: this many message_bytes
)

// waiter is a call waiting for the host's reply.
type waiter struct {
	ch        chan Msg
	size      int  // its bytes in flight (c.calls); 0 for state_set and state_unlock
	abandoned bool // its caller gave up: the reply releases its place in flight
}

// call sends a request to the host and waits for its reply, or until ctx ends (the rollout's
// wall time): then the host's late reply is dropped. state_set and state_unlock are never held
// back or abandoned, since they release the host's state lock.
//
// The host charges every call as it comes and counts it in flight until it replies (host/sandbox.go),
// and stops a child whose calls go past what these checks allow. So a call is not sent once its
// rollout's ctx has ended (a call abandoned then gave its tokens back to the rollout's budget,
// which the host still holds), and an abandoned call keeps its place in flight until the host's
// reply comes.
func (c *childConn) call(ctx context.Context, rollout int64, method string, args any) (json.RawMessage, error) {
	b, err := Marshal(args)
	if err != nil {
		return nil, err
	}
	w := &waiter{ch: make(chan Msg, 1)}
	releases := method == "state_set" || method == "state_unlock"
	if releases {
		ctx = context.Background()
	} else {
		if err := c.calls.acquire(ctx, len(b)); err != nil {
			return nil, err
		}
		w.size = len(b)
		if err := ctx.Err(); err != nil {
			c.calls.release(w.size)
			return nil, context.Cause(ctx)
		}
	}
	c.mu.Lock()
	c.nextID++
	id := c.nextID
	c.waiting[id] = w
	c.mu.Unlock()
	if err := c.send(Msg{T: "call", ID: id, Rollout: rollout, Method: method, Args: b}); err != nil {
		c.mu.Lock()
		delete(c.waiting, id)
		c.mu.Unlock()
		if !releases {
			c.calls.release(w.size)
		}
		return nil, err
	}
	select {
	case r := <-w.ch:
		if !releases {
			c.calls.release(w.size)
		}
		if r.Error != "" {
			return nil, errors.New(r.Error)
		}
		return r.Result, nil
	case <-ctx.Done():
		c.mu.Lock()
		if _, waiting := c.waiting[id]; waiting {
			w.abandoned = true // the reply, when it comes, releases its place
		} else {
			c.calls.release(w.size) // the reply came as ctx ended
		}
		c.mu.Unlock()
		return nil, context.Cause(ctx)
	}
}

// inflight is a counting semaphore over calls and their bytes.
type inflight struct {
	mu                 sync.Mutex
	cond               *sync.Cond
	n, bytes           int
	maxCalls, maxBytes int
}

func newInflight(calls, bytes int) *inflight {
	l := &inflight{maxCalls: calls, maxBytes: bytes}
	l.cond = sync.NewCond(&l.mu)
	return l
}

// acquire waits for room for a call of size bytes (a call alone always has room).
func (l *inflight) acquire(ctx context.Context, size int) error {
	stop := context.AfterFunc(ctx, func() {
		l.mu.Lock()
		l.cond.Broadcast()
		l.mu.Unlock()
	})
	defer stop()
	l.mu.Lock()
	defer l.mu.Unlock()
	for l.n > 0 && (l.n >= l.maxCalls || l.bytes+size > l.maxBytes) {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		l.cond.Wait()
	}
	l.n++
	l.bytes += size
	return nil
}

func (l *inflight) release(size int) {
	l.mu.Lock()
	l.n--
	l.bytes -= size
	l.cond.Broadcast()
	l.mu.Unlock()
}

func (c *childConn) runRollout(id int64, raw json.RawMessage) {
	var a Rollout
	done := func(d Done) {
		b, _ := Marshal(d)
		if err := c.send(Msg{T: "done", ID: id, Result: b}); err != nil {
			// The report is too large (a flood of log() names, a huge eval result): the rollout
			// fails, saying so, and nothing of it is trained.
			b, _ = Marshal(Done{Error: fmt.Sprintf("the rollout's report to the host: %v", err)})
			c.send(Msg{T: "done", ID: id, Result: b})
		}
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		done(Done{Error: err.Error()})
		return
	}
	a.Task.Prompt = promptFromJSON(a.Task.Prompt)
	var fn starlark.Callable
	switch a.Fn {
	case "rollout":
		fn = c.script.Rollout()
	case "eval_rollout":
		fn = c.script.EvalRollout()
	case "default_eval":
		var err error
		if fn, err = script.DefaultEval(a.Policies, a.NSamples); err != nil {
			done(Done{Error: err.Error()})
			return
		}
	}
	wall := time.Duration(a.WallLimit * float64(time.Second))
	ctx, cancel := context.WithTimeoutCause(context.Background(), wall,
		&script.BudgetError{Budget: "wall_seconds", Limit: fmt.Sprint(a.WallLimit), What: "the rollout did not finish in time"})
	defer cancel()
	b := script.NewBudget(c.cfg.Sandbox, c.zero)
	ro := &script.Rollout{Host: &pipeHost{c: c, id: id, defaults: a.Sampling, budget: b, ctx: ctx}, Budget: b,
		Ctx: ctx, Task: a.Task, Index: a.Index, Step: a.Step, Seed: a.Seed, Eval: a.Eval, Agents: &c.agents}
	th := ro.NewThread(nil)
	res, err := ro.Call(th, fn, starlark.Tuple{script.TaskValue(a.Task, a.Step)})
	if err == nil {
		err = ro.CheckQueued()
	}
	d := Done{Rewards: map[string]float64{}, Logs: ro.Logs()}
	if err != nil {
		d.Error = script.ErrorText(err)
	}
	for _, q := range ro.Queued() {
		wq := Queued{ID: q.C.ID(), Group: q.Group, Advantage: q.Advantage, HasAdv: q.HasAdv, PerToken: q.PerToken, Teacher: q.Teacher}
		if q.C.Conversation() {
			for _, t := range q.C.Turns() {
				wq.Turns = append(wq.Turns, t.ID())
			}
			wq.Key = q.C.Key()
			if r, ok := q.C.Reward(); ok {
				d.Rewards[q.C.ID()] = r
			}
		}
		d.Queued = append(d.Queued, wq)
	}
	for _, g := range ro.Generated() {
		if r, ok := g.Reward(); ok {
			d.Rewards[g.ID()] = r
		}
	}
	if res != nil && err == nil && a.Fn != "rollout" {
		if d.Result, err = script.EncodeValue(res); err != nil {
			d.Error = "eval_rollout returned " + res.Type() + "; return a dict of numbers"
		}
	}
	done(d)
}

// promptFromJSON turns a decoded JSON prompt back into a string or []engines.Message.
func promptFromJSON(p any) any {
	list, ok := p.([]any)
	if !ok {
		return p
	}
	msgs := make([]engines.Message, 0, len(list))
	for _, x := range list {
		m, _ := x.(map[string]any)
		role, _ := m["role"].(string)
		content, _ := m["content"].(string)
		msgs = append(msgs, engines.Message{Role: role, Content: content})
	}
	return msgs
}

// pipeHost is the script.Host of a rollout in a sandbox child: every method a call to the host.
type pipeHost struct {
	c        *childConn
	id       int64
	defaults engines.Sampling // the host's rollout settings when the rollout started
	budget   *script.Budget
	ctx      context.Context // the rollout's: its wall time ends every call it waits on
}

func (s *pipeHost) CheckPolicy(name string) (bool, string, error) {
	raw, err := s.c.call(s.ctx, s.id, "policy", name)
	if err != nil {
		return false, "", err
	}
	var r struct {
		Trainable bool   `json:"trainable"`
		Place     string `json:"place"`
	}
	err = json.Unmarshal(raw, &r)
	return r.Trainable, r.Place, err
}

func (s *pipeHost) Sampling() engines.Sampling { return s.defaults }

func (s *pipeHost) Generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error) {
	if err := s.budget.Prompt("generate", req.Messages); err != nil {
		return nil, err
	}
	raw, err := s.c.call(ctx, s.id, "generate", Generate{Policy: policy, Req: req})
	if err != nil {
		return nil, err
	}
	var out []engines.Completion
	err = json.Unmarshal(raw, &out)
	return out, err
}

func (s *pipeHost) Score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error) {
	if err := s.budget.Prompt("score", req.Messages); err != nil {
		return nil, err
	}
	raw, err := s.c.call(ctx, s.id, "score", Score{Policy: policy, Req: req})
	if err != nil {
		return nil, err
	}
	var out []float32
	err = json.Unmarshal(raw, &out)
	return out, err
}

func (s *pipeHost) Render(ctx context.Context, policy string, reqs []engines.RenderRequest) (script.Rendered, error) {
	for _, r := range reqs {
		if err := s.budget.Prompt("chat", r.Messages); err != nil {
			return script.Rendered{}, err
		}
	}
	// A conversation's tool schemas are rendered into its prompt: they count as its bytes (the
	// host checks this too).
	if err := script.CheckRender(s.c.cfg.Sandbox, "chat", reqs); err != nil {
		return script.Rendered{}, err
	}
	raw, err := s.c.call(ctx, s.id, "render", Render{Policy: policy, Reqs: reqs})
	if err != nil {
		return script.Rendered{}, err
	}
	var out script.Rendered
	err = json.Unmarshal(raw, &out)
	return out, err
}

func (s *pipeHost) StateGet(key string) (starlark.Value, bool, error) {
	raw, err := s.c.call(s.ctx, s.id, "state_get", key)
	if err != nil {
		return nil, false, err
	}
	return decodeStateReply(raw)
}

// StateLock is not abandoned at the wall time (the host may be granting the lock as the child
// gives up, and would then hold it for nobody); what the holder does next ends, and releases it.
func (s *pipeHost) StateLock(key string) (starlark.Value, bool, func(starlark.Value) error, func(), error) {
	raw, err := s.c.call(context.Background(), s.id, "state_lock", key)
	if err != nil {
		return nil, false, nil, nil, err
	}
	cur, found, err := decodeStateReply(raw)
	if err != nil {
		s.c.call(context.Background(), s.id, "state_unlock", key)
		return nil, false, nil, nil, err
	}
	done := false
	release := func() {
		if !done {
			done = true
			s.c.call(context.Background(), s.id, "state_unlock", key)
		}
	}
	commit := func(v starlark.Value) error {
		enc, err := script.EncodeValue(v)
		if err != nil {
			return err
		}
		done = true
		if _, err = s.c.call(context.Background(), s.id, "state_set", map[string]any{"key": key, "value": enc}); err != nil {
			var be *script.BudgetError
			if errors.As(err, &be) && be.Budget == "message_bytes" {
				// Not sent: the host still holds the lock for this update.
				s.c.call(context.Background(), s.id, "state_unlock", key)
			}
		}
		return err
	}
	return cur, found, commit, release, nil
}

func decodeStateReply(raw json.RawMessage) (starlark.Value, bool, error) {
	var r struct {
		Found bool            `json:"found"`
		Value json.RawMessage `json:"value"`
	}
	if err := json.Unmarshal(raw, &r); err != nil || !r.Found {
		return nil, false, err
	}
	v, err := script.DecodeValue(r.Value)
	return v, err == nil, err
}

func (s *pipeHost) Event(msg string) {
	b, _ := Marshal(msg)
	s.c.send(Msg{T: "note", Rollout: s.id, Method: "event", Args: b})
}

func (s *pipeHost) Running(n int) {
	b, _ := json.Marshal(n)
	s.c.send(Msg{T: "note", Rollout: s.id, Method: "running", Args: b})
}

func (s *pipeHost) Generated(int) {} // the host counts tokens as it answers generate
