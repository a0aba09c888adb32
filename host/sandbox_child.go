package host

import (
	"bufio"
	"bytes"
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

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// The sandbox child: a copy of the slimen binary started with SandboxChildEnv set, which
// evaluates rollouts of an untrusted script under memory and CPU rlimits and reaches the host for
// everything else (generate, score, state, print) over its stdin/stdout. If the script exhausts
// the child's memory, the child dies and the host loses nothing but the rollouts it ran.

// SandboxChildEnv marks a process as a sandbox child; its value is the memory limit in MiB, and
// SandboxCPUEnv (if set) the CPU limit in seconds.
const (
	SandboxChildEnv = "SLIMEN_SANDBOX_CHILD"
	SandboxCPUEnv   = "SLIMEN_SANDBOX_CPU"
)

// sbMsg is one line of the host–child protocol (JSON lines in both directions).
//
//	host → child:  init {script, source, config}, rollout {id, args}, reply {id, result|error}
//	child → host:  ready | fatal {error}, call {id, rollout, method, args}, note {rollout, method, args},
//	               done {id, result}
type sbMsg struct {
	T       string          `json:"t"`
	ID      int64           `json:"id,omitempty"`
	Rollout int64           `json:"rollout,omitempty"`
	Method  string          `json:"method,omitempty"`
	Args    json.RawMessage `json:"args,omitempty"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   string          `json:"error,omitempty"`
}

type sbInit struct {
	Script string         `json:"script"`
	Source string         `json:"source"`
	Config *config.Config `json:"config"`
	Zero   bool           `json:"zero,omitempty"` // zero-config run: train may use any policy
}

// sbRollout is a rollout to run. Fn is "rollout", "eval_rollout" or "default_eval".
type sbRollout struct {
	Fn        string            `json:"fn"`
	Task      Task              `json:"task"`
	Index     int               `json:"index"`
	Step      int               `json:"step"`
	Seed      uint64            `json:"seed"`
	Sampling  engines.Sampling  `json:"sampling"`
	Eval      *engines.Sampling `json:"eval,omitempty"`
	Policies  []string          `json:"policies,omitempty"` // default_eval
	NSamples  int               `json:"n_samples,omitempty"`
	WallLimit float64           `json:"wall_limit"`
}

// sbDone is a finished rollout's report.
type sbDone struct {
	Error   string                `json:"error,omitempty"`
	Queued  []sbQueued            `json:"queued,omitempty"`
	Rewards map[string]float64    `json:"rewards,omitempty"` // completion id → reward
	Logs    map[string][2]float64 `json:"logs,omitempty"`
	Result  any                   `json:"result,omitempty"` // eval_rollout's dict, encoded
}

type sbQueued struct {
	ID        string    `json:"id"`
	Group     string    `json:"group"`
	Advantage []float64 `json:"advantage,omitempty"`
	HasAdv    bool      `json:"has_adv,omitempty"`
	PerToken  bool      `json:"per_token,omitempty"`
	Teacher   string    `json:"teacher,omitempty"`
}

type sbGenerate struct {
	Policy string                  `json:"policy"`
	Req    engines.GenerateRequest `json:"req"`
}

type sbScore struct {
	Policy string               `json:"policy"`
	Req    engines.ScoreRequest `json:"req"`
}

// SandboxChildMain runs the sandbox child on stdin/stdout; the CLI calls it when SandboxChildEnv
// is set. It returns the process exit code.
func SandboxChildMain() int {
	if mb, err := strconv.Atoi(os.Getenv(SandboxChildEnv)); err == nil && mb > 0 {
		limit := uint64(mb) << 20
		// The hard limit makes an allocation past it fail (the runtime then dies, taking only
		// this child); the soft one makes the collector work hard before that.
		syscall.Setrlimit(syscall.RLIMIT_DATA, &syscall.Rlimit{Cur: limit, Max: limit})
		debug.SetMemoryLimit(int64(limit) / 2)
	}
	if s, err := strconv.ParseUint(os.Getenv(SandboxCPUEnv), 10, 64); err == nil && s > 0 {
		// The Go runtime ignores SIGXCPU, which the soft limit sends: catch it and exit, saying
		// why (the host names cpu_seconds from this line). The hard limit's SIGKILL is the
		// backstop.
		xcpu := make(chan os.Signal, 1)
		signal.Notify(xcpu, syscall.SIGXCPU)
		go func() {
			<-xcpu
			fmt.Fprintln(os.Stderr, cpuLimitMsg)
			os.Exit(3)
		}()
		syscall.Setrlimit(syscall.RLIMIT_CPU, &syscall.Rlimit{Cur: s, Max: s + 5})
	}
	c := &childConn{out: os.Stdout, waiting: map[int64]chan sbMsg{}}
	return c.serve(os.Stdin)
}

// cpuLimitMsg is what a child that used up its CPU time (sandbox.cpu_seconds) writes to stderr.
const cpuLimitMsg = "slimen sandbox child: CPU time limit reached (RLIMIT_CPU)"

// childConn is the child's side of the pipe.
type childConn struct {
	outMu   sync.Mutex
	out     io.Writer
	mu      sync.Mutex
	nextID  int64
	waiting map[int64]chan sbMsg
	script  *Script
	cfg     *config.Config
	zero    bool
	calls   *inflight
}

// marshal encodes a value as JSON without HTML escaping (which would turn every < of a prompt
// into six bytes).
func marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// send writes one message to the host. A message over sandbox.message_bytes is not sent: the host
// would stop reading this child (what it is to do with a child that breaks the protocol).
func (c *childConn) send(m sbMsg) error {
	b, err := marshal(m)
	if err != nil {
		return err
	}
	if c.cfg != nil && len(b)+1 > c.cfg.Sandbox.MessageBytes {
		what := m.T
		if m.Method != "" {
			what = m.Method
		}
		return &BudgetError{"message_bytes", fmt.Sprint(c.cfg.Sandbox.MessageBytes),
			fmt.Sprintf("a %s message of %d bytes to the host", what, len(b)+1)}
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
		var m sbMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			c.send(sbMsg{T: "fatal", Error: "bad message from the host: " + err.Error()})
			return 2
		}
		switch m.T {
		case "init":
			var in sbInit
			if err := json.Unmarshal(m.Args, &in); err != nil {
				c.send(sbMsg{T: "fatal", Error: err.Error()})
				return 2
			}
			c.cfg, c.zero = in.Config, in.Zero
			c.calls = newInflight(maxCallsInFlight, inflightMessages*c.cfg.Sandbox.MessageBytes)
			s, err := LoadScriptSource(in.Script, []byte(in.Source), ScriptOptions{Sandbox: true, Config: configValue{get: func() *config.Config { return c.cfg }}})
			if err != nil {
				msg := err.Error()
				if len(msg) > 64<<10 {
					msg = msg[:64<<10] + "…"
				}
				c.send(sbMsg{T: "fatal", Error: msg})
				return 2
			}
			c.script = s
			c.send(sbMsg{T: "ready"})
		case "rollout":
			go c.runRollout(m.ID, m.Args)
		case "reply":
			c.mu.Lock()
			ch := c.waiting[m.ID]
			delete(c.waiting, m.ID)
			c.mu.Unlock()
			if ch != nil {
				ch <- m
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
	maxCallsInFlight = 256
	inflightMessages = 4 // bytes in flight: this many message_bytes
)

// call sends a request to the host and waits for its reply, or until ctx ends (the rollout's
// wall time): then the host's late reply is dropped. state_set and state_unlock are never held
// back or abandoned, since they release the host's state lock.
func (c *childConn) call(ctx context.Context, rollout int64, method string, args any) (json.RawMessage, error) {
	b, err := marshal(args)
	if err != nil {
		return nil, err
	}
	releases := method == "state_set" || method == "state_unlock"
	if releases {
		ctx = context.Background()
	} else {
		if err := c.calls.acquire(ctx, len(b)); err != nil {
			return nil, err
		}
		defer c.calls.release(len(b))
	}
	ch := make(chan sbMsg, 1)
	c.mu.Lock()
	c.nextID++
	id := c.nextID
	c.waiting[id] = ch
	c.mu.Unlock()
	forget := func() {
		c.mu.Lock()
		delete(c.waiting, id)
		c.mu.Unlock()
	}
	if err := c.send(sbMsg{T: "call", ID: id, Rollout: rollout, Method: method, Args: b}); err != nil {
		forget()
		return nil, err
	}
	select {
	case r := <-ch:
		if r.Error != "" {
			return nil, errors.New(r.Error)
		}
		return r.Result, nil
	case <-ctx.Done():
		forget()
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
	var a sbRollout
	done := func(d sbDone) {
		b, _ := marshal(d)
		if err := c.send(sbMsg{T: "done", ID: id, Result: b}); err != nil {
			// The report is too large (a flood of log() names, a huge eval result): the rollout
			// fails, saying so, and nothing of it is trained.
			b, _ = marshal(sbDone{Error: fmt.Sprintf("the rollout's report to the host: %v", err)})
			c.send(sbMsg{T: "done", ID: id, Result: b})
		}
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		done(sbDone{Error: err.Error()})
		return
	}
	a.Task.Prompt = promptFromJSON(a.Task.Prompt)
	var fn starlark.Callable
	switch a.Fn {
	case "rollout":
		fn = c.script.rollout
	case "eval_rollout":
		fn = c.script.evalRollout
	case "default_eval":
		var err error
		if fn, err = defaultEval(a.Policies, a.NSamples); err != nil {
			done(sbDone{Error: err.Error()})
			return
		}
	}
	wall := time.Duration(a.WallLimit * float64(time.Second))
	ctx, cancel := context.WithTimeoutCause(context.Background(), wall,
		&BudgetError{"wall_seconds", fmt.Sprint(a.WallLimit), "the rollout did not finish in time"})
	defer cancel()
	b := newBudget(c.cfg.Sandbox, c.zero)
	ro := &rollout{svc: &pipeServices{c: c, id: id, defaults: a.Sampling, budget: b, ctx: ctx}, budget: b,
		ctx: ctx, task: a.Task, index: a.Index, step: a.Step, seed: a.Seed, eval: a.Eval}
	th := ro.newThread(nil)
	res, err := ro.call(th, fn, starlark.Tuple{taskValue(a.Task, a.Step)})
	if err == nil {
		err = ro.checkQueued()
	}
	d := sbDone{Rewards: map[string]float64{}, Logs: ro.logs}
	if err != nil {
		d.Error = scriptErrorText(err)
	}
	for _, q := range ro.queued {
		d.Queued = append(d.Queued, sbQueued{ID: q.c.id, Group: q.group, Advantage: q.advantage, HasAdv: q.hasAdv, PerToken: q.perToken, Teacher: q.teacher})
	}
	for _, g := range ro.generated {
		if r, ok := g.Reward(); ok {
			d.Rewards[g.id] = r
		}
	}
	if res != nil && err == nil && a.Fn != "rollout" {
		if d.Result, err = encodeValue(res); err != nil {
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

// pipeServices are the services of a rollout in a sandbox child: every one a call to the host.
type pipeServices struct {
	c        *childConn
	id       int64
	defaults engines.Sampling // the host's rollout settings when the rollout started
	budget   *budget
	ctx      context.Context // the rollout's: its wall time ends every call it waits on
}

func (s *pipeServices) checkPolicy(name string) (bool, string, error) {
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

func (s *pipeServices) sampling() engines.Sampling { return s.defaults }

func (s *pipeServices) generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error) {
	if err := s.budget.prompt("generate", req.Messages); err != nil {
		return nil, err
	}
	raw, err := s.c.call(ctx, s.id, "generate", sbGenerate{Policy: policy, Req: req})
	if err != nil {
		return nil, err
	}
	var out []engines.Completion
	err = json.Unmarshal(raw, &out)
	return out, err
}

func (s *pipeServices) score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error) {
	if err := s.budget.prompt("score", req.Messages); err != nil {
		return nil, err
	}
	raw, err := s.c.call(ctx, s.id, "score", sbScore{Policy: policy, Req: req})
	if err != nil {
		return nil, err
	}
	var out []float32
	err = json.Unmarshal(raw, &out)
	return out, err
}

func (s *pipeServices) stateGet(key string) (starlark.Value, bool, error) {
	raw, err := s.c.call(s.ctx, s.id, "state_get", key)
	if err != nil {
		return nil, false, err
	}
	return decodeStateReply(raw)
}

// stateLock is not abandoned at the wall time (the host may be granting the lock as the child
// gives up, and would then hold it for nobody); what the holder does next ends, and releases it.
func (s *pipeServices) stateLock(key string) (starlark.Value, bool, func(starlark.Value) error, func(), error) {
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
		enc, err := encodeValue(v)
		if err != nil {
			return err
		}
		done = true
		if _, err = s.c.call(context.Background(), s.id, "state_set", map[string]any{"key": key, "value": enc}); err != nil {
			var be *BudgetError
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
	v, err := decodeJSONValue(r.Value)
	return v, err == nil, err
}

func (s *pipeServices) event(msg string) {
	b, _ := marshal(msg)
	s.c.send(sbMsg{T: "note", Rollout: s.id, Method: "event", Args: b})
}

func (s *pipeServices) running(n int) {
	b, _ := json.Marshal(n)
	s.c.send(sbMsg{T: "note", Rollout: s.id, Method: "running", Args: b})
}

func (s *pipeServices) generated(int) {} // the host counts tokens as it answers generate
