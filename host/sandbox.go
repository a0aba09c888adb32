package host

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/script/sandbox"
	"github.com/slimen/slimen/internal/capbuf"
)

// The host side of the sandbox (`slimen exec --sandbox`, docs/sandbox.md). Rollouts of an
// untrusted script run in child processes (host/script/sandbox) under memory and CPU rlimits;
// their built-ins call back here. A child that dies takes only the rollouts it was running, and each of those
// runs again alone in a fresh child: honest rollouts then complete, and the one that kills its
// child again fails with the limit it broke.

// pool is the host's side of a sandboxed run: its children and what it counts of them.
type pool struct {
	r   *Run
	cmd []string // how to start a child: the slimen binary itself

	mu       sync.Mutex
	children []*sbChild
	next     int
	alone    chan struct{} // turns of the children that run a rollout alone
	warnOnce sync.Once
	createMu sync.Mutex // zero-config policies are created one at a time

	// The size of the run's state store as sandbox.state_total_bytes counts it, by key. It is
	// worked out again from the store at every step (a step that does not complete puts the
	// store back as it was).
	stMu    sync.Mutex
	stSizes map[string]int
	stTotal int
}

type sbChild struct {
	sb     *pool
	cmd    *exec.Cmd
	in     *os.File // the host's ends of the channel (the child's fds 3 and 4)
	out    *os.File
	encMu  sync.Mutex
	enc    *json.Encoder
	stderr *capbuf.Buffer // the child's stdout and stderr: diagnostics, never read as messages

	readDone chan struct{} // the reader of out has stopped

	mu       sync.Mutex
	breach   error                     // why the host stopped the child (a message over message_bytes, a forged one, wall time)
	rollouts map[int64]*script.Rollout // in flight
	results  map[int64]chan sandbox.Done
	accts    map[int64]*account                   // what the host has charged each rollout in flight
	locks    map[int64]func()                     // state locks held, by rollout id
	commits  map[int64]func(starlark.Value) error // the pending state.update of each lock
	nextID   int64
	dead     chan struct{}
	deathErr error
	gone     bool // read has released the locks of a dead child: none may be taken for it now

	calls, peakCalls int // calls being answered, and the most at once (the child bounds them; so does admit)
	callBytes        int // the bytes of the calls being answered
}

// newSandbox starts nothing yet: children start when the first rollouts come.
func newSandbox(r *Run, cmd []string) *pool {
	if len(cmd) == 0 {
		exe, err := os.Executable()
		if err != nil {
			exe = os.Args[0]
		}
		cmd = []string{exe}
	}
	return &pool{r: r, cmd: cmd}
}

func (sb *pool) close() {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	for _, c := range sb.children {
		c.kill()
	}
	// Reap them (their reader waits for each), so that none outlives the run.
	timeout := time.After(5 * time.Second)
	for _, c := range sb.children {
		select {
		case <-c.dead:
		case <-timeout:
		}
	}
	sb.children = nil
}

// start launches a child and sends it the script. The child speaks to the host over two pipes
// of its own, its fds 3 and 4, which it closes on exec at once, so no program it starts holds
// them; its stdout and stderr are only kept for the host's messages. It gets the environment it
// needs, not the host's (childEnv). A goroutine waits on the process itself, so that its death
// is noticed even while something else holds its pipes.
func (sb *pool) start() (*sbChild, error) {
	cfg := sb.r.Config()
	childCfg, err := script.ChildConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("sandbox: the config for the script's process: %v", err)
	}
	cmd := exec.Command(sb.cmd[0], sb.cmd[1:]...)
	cmd.Env = childEnv(cfg.Sandbox)
	c := &sbChild{sb: sb, cmd: cmd, stderr: &capbuf.Buffer{Head: 4096, Tail: 4096}, rollouts: map[int64]*script.Rollout{},
		results: map[int64]chan sandbox.Done{}, accts: map[int64]*account{}, locks: map[int64]func(){},
		commits: map[int64]func(starlark.Value) error{}, dead: make(chan struct{}), readDone: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = c.stderr, c.stderr
	// A program the child started that holds its stdout open does not hold the host up once
	// the child is gone.
	cmd.WaitDelay = time.Second
	toChild, in, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	out, fromChild, err := os.Pipe()
	if err != nil {
		toChild.Close()
		in.Close()
		return nil, err
	}
	cmd.ExtraFiles = []*os.File{toChild, fromChild} // fds 3 and 4: sandbox.HostInFD, HostOutFD
	err = cmd.Start()
	toChild.Close() // the child's ends are the child's alone
	fromChild.Close()
	if err != nil {
		in.Close()
		out.Close()
		return nil, fmt.Errorf("sandbox: start %s: %w", sb.cmd[0], err)
	}
	c.in, c.out, c.enc = in, out, json.NewEncoder(in)
	go c.wait()
	init, _ := json.Marshal(sandbox.Init{Script: sb.r.script.Path, Source: string(sb.r.script.Source), Config: childCfg, Zero: sb.r.zero})
	c.send(sandbox.Msg{T: "init", Args: init})
	sc := bufio.NewScanner(out)
	// The child sends nothing larger than message_bytes (the newline included); a line longer
	// than that ends the scan, and the host stops the child rather than hold more of it.
	sc.Buffer(make([]byte, 64<<10), cfg.Sandbox.MessageBytes)
	if !sc.Scan() {
		c.noteTooLong(sc.Err())
		c.kill()
		close(c.readDone)
		<-c.dead
		return nil, fmt.Errorf("sandbox: the script's process died while running its top level: %v", c.deathErr)
	}
	var first sandbox.Msg
	if err := json.Unmarshal(sc.Bytes(), &first); err != nil || first.T != "ready" {
		c.kill()
		close(c.readDone)
		<-c.dead
		if err != nil || first.T != "fatal" {
			return nil, fmt.Errorf("sandbox: the script's process did not start: it answered %.200q", sc.Bytes())
		}
		return nil, fmt.Errorf("%s", first.Error)
	}
	go c.read(sc)
	return c, nil
}

// childEnv is a child's environment: its limits and what it needs to run (and start an agent()
// program), none of the host's other variables (tokens, keys, loader settings).
func childEnv(cfg config.SandboxConfig) []string {
	env := []string{sandbox.ChildEnv + "=" + strconv.Itoa(cfg.MemoryMB)}
	if cfg.CPUSeconds > 0 {
		env = append(env, sandbox.CPUEnv+"="+strconv.Itoa(cfg.CPUSeconds))
	}
	for _, k := range []string{"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", script.PythonEnv, "GOCOVERDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

func (c *sbChild) send(m sandbox.Msg) {
	c.encMu.Lock()
	defer c.encMu.Unlock()
	c.enc.Encode(m)
}

func (c *sbChild) kill() {
	c.cmd.Process.Kill()
}

// noteTooLong records a message over message_bytes as the reason the child is stopped.
func (c *sbChild) noteTooLong(err error) {
	if !errors.Is(err, bufio.ErrTooLong) {
		return
	}
	mb := c.sb.r.Config().Sandbox.MessageBytes
	c.stop(&script.BudgetError{Budget: "message_bytes", Limit: strconv.Itoa(mb),
		What: fmt.Sprintf("the script's process sent the host a message of more than %d bytes; the host stopped it", mb)})
}

// stop kills the child, giving the reason its rollouts will report.
func (c *sbChild) stop(why error) {
	c.mu.Lock()
	if c.breach == nil {
		c.breach = why
	}
	c.mu.Unlock()
	c.kill()
}

// read handles the child's messages until its channel closes or breaks, or it sends one that
// its honest self never does; then the child is stopped.
func (c *sbChild) read(sc *bufio.Scanner) {
	defer close(c.readDone)
	cfg := c.sb.r.Config().Sandbox
	for sc.Scan() {
		if err := c.handle(sc.Bytes(), cfg); err != nil {
			c.stop(err)
			return
		}
	}
	c.noteTooLong(sc.Err())
	c.kill()
}

// handle acts on one message of the child; an error is a forged one.
func (c *sbChild) handle(line []byte, cfg config.SandboxConfig) error {
	var m sandbox.Msg
	if err := json.Unmarshal(line, &m); err != nil {
		return forgery("a line that is not a message (%v)", err)
	}
	switch m.T {
	case "call":
		p, err := c.admit(m, cfg)
		if err != nil {
			return err
		}
		go c.answer(p)
	case "note":
		return c.note(m, cfg)
	case "done":
		c.mu.Lock()
		ch, a := c.results[m.ID], c.accts[m.ID]
		_, locked := c.locks[m.ID]
		if ch != nil {
			delete(c.results, m.ID)
			delete(c.rollouts, m.ID)
			delete(c.accts, m.ID)
		}
		c.mu.Unlock()
		switch {
		case ch == nil && m.ID > 0 && m.ID <= c.issued():
			return forgery("a second report of rollout %d", m.ID)
		case ch == nil:
			return forgery("a report of rollout %d, which it was never given", m.ID)
		case locked:
			// The child's state.update ends (state_set or state_unlock) before its rollout does.
			return forgery("the report of rollout %d while it holds the state lock", m.ID)
		}
		c.sb.r.activity.add(-a.running)
		var d sandbox.Done
		if err := json.Unmarshal(m.Result, &d); err != nil {
			return forgery("a report it cannot have encoded (%v)", err)
		}
		ch <- d
	default:
		return forgery("a message of an unknown kind %.40q", m.T)
	}
	return nil
}

// issued is the last rollout id the host gave the child.
func (c *sbChild) issued() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nextID
}

// wait notices the child's death from its process: the host stops reading its channel then,
// even if a program the child started still holds it, and fails what the child was running.
func (c *sbChild) wait() {
	err := c.cmd.Wait()
	c.out.Close() // ends the reader's scan
	c.in.Close()
	<-c.readDone
	death := c.describeDeath(err)
	c.mu.Lock()
	c.deathErr = death
	c.gone = true
	for id, release := range c.locks {
		release()
		delete(c.locks, id)
	}
	residual := 0
	for _, a := range c.accts {
		residual += a.running
	}
	c.mu.Unlock()
	c.sb.r.activity.add(-residual)
	close(c.dead)
}

// describeDeath says why a child ended, naming the limit it most likely broke.
func (c *sbChild) describeDeath(err error) error {
	cfg := c.sb.r.Config().Sandbox
	c.mu.Lock()
	breach := c.breach
	c.mu.Unlock()
	if breach != nil {
		return breach
	}
	tail := strings.TrimSpace(c.stderr.String())
	var ee *exec.ExitError
	switch {
	case strings.Contains(tail, sandbox.CPULimitMsg):
		return &script.BudgetError{Budget: "cpu_seconds", Limit: strconv.Itoa(cfg.CPUSeconds), What: "the script's process used up its CPU time"}
	case strings.Contains(tail, "out of memory") || strings.Contains(tail, "cannot allocate memory"):
		return &script.BudgetError{Budget: "memory_mb", Limit: strconv.Itoa(cfg.MemoryMB), What: "the script's process ran out of memory"}
	case strings.Contains(tail, "pthread_create failed") || strings.Contains(tail, "failed to create new OS thread"):
		// A thread's stack is a private mapping, so RLIMIT_DATA refuses it too: a runtime that
		// cannot start a thread under that limit has run out of memory.
		return &script.BudgetError{Budget: "memory_mb", Limit: strconv.Itoa(cfg.MemoryMB), What: "the script's process ran out of memory (the " +
			"runtime could not start a thread)"}
	case strings.Contains(tail, "SIGSEGV"):
		// Starlark cannot fault by itself; under RLIMIT_DATA the Go runtime sometimes dies this
		// way instead of reporting a failed allocation.
		return &script.BudgetError{Budget: "memory_mb", Limit: strconv.Itoa(cfg.MemoryMB),
			What: "the script's process ran out of memory (the runtime crashed: SIGSEGV)"}
	case errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGXCPU,
		errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signal() == syscall.SIGKILL && cfg.CPUSeconds > 0:
		return &script.BudgetError{Budget: "cpu_seconds", Limit: strconv.Itoa(cfg.CPUSeconds),
			What: "the script's process used up its CPU time (killed at the hard limit)"}
	case strings.Contains(tail, "stack exceeds"):
		return &script.BudgetError{Budget: "memory_mb", Limit: strconv.Itoa(cfg.MemoryMB), What: "the script's process overflowed its stack"}
	}
	first, _, _ := strings.Cut(strings.TrimSpace(tail), "\n")
	return fmt.Errorf("sandbox: the script's process died (%v): %s", err, first)
}

// answer serves one call of the child's built-ins with the run's own services.
func (c *sbChild) answer(p *pending) {
	answered := false
	finish := func() { // the call is no longer in flight: before the child can see the reply
		if !answered && p.counted {
			c.mu.Lock()
			c.calls--
			c.callBytes -= p.size
			c.mu.Unlock()
		}
		answered = true
	}
	defer finish()
	m := p.m
	var v any
	err := fmt.Errorf("rollout %d has ended", m.Rollout)
	if p.ro != nil || p.release != nil {
		v, err = c.serve(p)
	}
	if errors.Is(err, errNoReply) {
		return
	}
	r := sandbox.Msg{T: "reply", ID: m.ID}
	if err != nil {
		r.Error = err.Error()
	} else {
		r.Result, _ = json.Marshal(v)
	}
	finish()
	c.send(r)
}

// errNoReply is a call that gets no reply: its child died while it waited.
var errNoReply = errors.New("no reply")

// serve runs one call of the child's built-ins, admitted and charged, and returns the reply's value.
func (c *sbChild) serve(p *pending) (any, error) {
	h := localHost{c.sb.r}
	ro, m := p.ro, p.m
	switch m.Method {
	case "policy":
		var name string
		if err := callArgs(m, &name); err != nil {
			return nil, err
		}
		if err := c.sb.mayCreate(name); err != nil {
			return nil, err
		}
		trainable, place, err := h.CheckPolicy(name)
		return map[string]any{"trainable": trainable, "place": place}, err
	case "generate":
		return c.generate(h, p)
	case "score":
		s := p.score
		if err := c.sb.usable("score", s.Policy, s.Req.Messages); err != nil {
			return nil, err
		}
		return h.Score(ro.Ctx, s.Policy, s.Req)
	case "render":
		rq := p.render
		for _, q := range rq.Reqs {
			if err := c.sb.usable("chat", rq.Policy, q.Messages); err != nil {
				return nil, err
			}
		}
		return h.Render(ro.Ctx, rq.Policy, rq.Reqs)
	case "state_get":
		var k string
		if err := callArgs(m, &k); err != nil {
			return nil, err
		}
		v, ok, _ := h.StateGet(k)
		return stateReply(v, ok)
	case "state_lock":
		var k string
		if err := callArgs(m, &k); err != nil {
			return nil, err
		}
		v, ok, commit, release, _ := h.StateLock(k)
		c.mu.Lock()
		if c.gone || c.rollouts[m.Rollout] == nil {
			// The child died while this call waited for the lock, or reported the rollout:
			// nobody will release it.
			c.mu.Unlock()
			release()
			return nil, errNoReply
		}
		c.locks[m.Rollout], c.commits[m.Rollout] = release, commit
		c.mu.Unlock()
		return stateReply(v, ok)
	case "state_set", "state_unlock":
		return true, c.stateSet(p)
	}
	return nil, fmt.Errorf("unknown call %q", m.Method)
}

// callArgs decodes the arguments of a call of the child into v. The slimen child encodes them
// itself, so arguments that do not decode come from a process that is not it: the call is
// refused with an error that says so.
func callArgs(m sandbox.Msg, v any) error {
	if err := json.Unmarshal(m.Args, v); err != nil {
		return fmt.Errorf("sandbox: the script's process sent a %.40q call whose arguments do not decode (%v), "+
			"which the slimen sandbox child never sends", m.Method, err)
	}
	return nil
}

// generate serves a generate call. The host keeps its own copy of the completions the child will
// see: the child's report names them by id.
func (c *sbChild) generate(h localHost, p *pending) ([]engines.Completion, error) {
	g, ro := p.gen, p.ro
	used := 0
	defer func() { c.settle(p, used) }()
	// The child checks these too; the host does not take its word for it.
	if err := c.sb.usable("generate", g.Policy, g.Req.Messages); err != nil {
		return nil, err
	}
	outs, err := h.Generate(ro.Ctx, g.Policy, g.Req)
	if err == nil {
		for _, o := range outs {
			used += len(o.Tokens)
		}
		for _, cmp := range script.CompletionsOf(g.Policy, g.Req, outs) {
			ro.Note(cmp)
			h.Generated(len(cmp.Tokens()))
		}
	}
	return outs, err
}

// stateSet ends a state.update of the rollout: state_set stores the new value (within the
// sandbox's state budgets), state_unlock leaves the store as it was; both release the lock.
func (c *sbChild) stateSet(p *pending) error {
	m, release, commit := p.m, p.release, p.commit // admit took them out of c.locks
	if release != nil {
		defer release()
	}
	if m.Method != "state_set" {
		return nil
	}
	var a struct {
		Key   string          `json:"key"`
		Value json.RawMessage `json:"value"`
	}
	if err := callArgs(m, &a); err != nil {
		return err
	}
	v, err := script.DecodeValue(a.Value)
	if err != nil {
		return err
	}
	if commit == nil {
		return errors.New("state_set without state_lock")
	}
	size, err := c.sb.stateFits(c.sb.r.Config().Sandbox, a.Key, v)
	if err != nil {
		return err
	}
	if err := commit(v); err != nil {
		return err
	}
	c.sb.stateStored(a.Key, size)
	return nil
}

// maxZeroPolicies bounds the policies a sandboxed zero-config run creates as the script names
// them: each is a model in the host's memory.
const maxZeroPolicies = 8

// mayCreate refuses a policy a sandboxed zero-config run would create past maxZeroPolicies, and
// creates one below it (under createMu: a fan-out of new names must not all pass the count).
func (sb *pool) mayCreate(name string) error {
	if !sb.r.zero {
		return nil
	}
	if known, _ := sb.policies(name); known {
		return nil
	}
	sb.createMu.Lock()
	defer sb.createMu.Unlock()
	known, names := sb.policies(name)
	if known || len(names) < maxZeroPolicies {
		_, err := sb.r.pols.policyFor(name)
		return err
	}
	return fmt.Errorf("policy %q: a sandboxed run without a config creates at most %d policies (it has %s); name the policies in a config", name,
		maxZeroPolicies, config.QuotePolicyNames(names))
}

// policies says whether the run has a policy, and names them all. A zero-config run adds
// policies to its config as the script names them, under the run's config lock.
func (sb *pool) policies(name string) (bool, []string) {
	sb.r.cfgMu.RLock()
	defer sb.r.cfgMu.RUnlock()
	_, ok := sb.r.cfg.Policy(name)
	return ok, sb.r.cfg.PolicyNames()
}

// usable applies the host's own checks to a generate or score call of a child: the policy is
// granted and may be created, and the prompt is within prompt_bytes.
func (sb *pool) usable(fn, policy string, msgs []engines.Message) error {
	cfg := sb.r.Config().Sandbox
	if err := script.GrantCheck(cfg, sb.r.zero, fn, policy, false); err != nil {
		return err
	}
	if err := script.CheckPrompt(cfg, fn, msgs); err != nil {
		return err
	}
	return sb.mayCreate(policy)
}

// stateFits checks a state entry about to be stored against state_bytes and the whole store
// against state_total_bytes; it returns the entry's size for stateStored. The caller holds the
// store's lock, so no other update runs between the check and the store.
func (sb *pool) stateFits(cfg config.SandboxConfig, key string, v starlark.Value) (int, error) {
	size := script.EntrySize(key, v, cfg.StateTotalBytes)
	if size > cfg.StateBytes {
		return 0, &script.BudgetError{Budget: "state_bytes", Limit: strconv.Itoa(cfg.StateBytes),
			What: fmt.Sprintf("state.update(%s) stores an entry of about %d bytes "+
				"or more (key and value)", quoteKey(key), size)}
	}
	sb.stMu.Lock()
	defer sb.stMu.Unlock()
	if sb.stSizes == nil {
		sb.stSizes = map[string]int{} // runSandboxed syncs at every step; it cannot here (the store is locked)
	}
	if total := sb.stTotal - sb.stSizes[key] + size; total > cfg.StateTotalBytes {
		return 0, &script.BudgetError{Budget: "state_total_bytes", Limit: strconv.Itoa(cfg.StateTotalBytes),
			What: fmt.Sprintf("state.update(%s) would make the run's state hold about %d bytes (%d keys); the store is run-wide: "+
				"keep fewer or smaller entries", quoteKey(key), total, len(sb.stSizes)+1)}
	}
	return size, nil
}

// stateStored records an entry that was stored.
func (sb *pool) stateStored(key string, size int) {
	sb.stMu.Lock()
	defer sb.stMu.Unlock()
	sb.stTotal += size - sb.stSizes[key]
	sb.stSizes[key] = size
}

// syncState works the sizes out from the store itself, at every step: a step that does not
// complete puts the store back as it was, and a resumed run starts with the checkpoint's. The
// caller holds stMu, and not the store's lock.
func (sb *pool) syncState() {
	sb.stSizes, sb.stTotal = map[string]int{}, 0
	for _, k := range sb.r.state.Keys() {
		if v, ok := sb.r.state.Get(k); ok {
			n := script.EntrySize(k, v, math.MaxInt/2)
			sb.stSizes[k] = n
			sb.stTotal += n
		}
	}
}

// quoteKey quotes a state key for a message, shortened if long.
func quoteKey(k string) string {
	if len(k) > 40 {
		return strconv.Quote(k[:40]) + "…"
	}
	return strconv.Quote(k)
}

func stateReply(v starlark.Value, ok bool) (any, error) {
	if !ok {
		return map[string]any{"found": false}, nil
	}
	enc, err := script.EncodeValue(v)
	return map[string]any{"found": true, "value": enc}, err
}

// run evaluates one rollout in a child. alone starts a child of its own (after a crash).
func (sb *pool) run(ro *script.Rollout, a sandbox.Rollout, alone bool) error {
	var c *sbChild
	var err error
	if alone {
		// Rollouts run again alone after a crash take turns, sandbox.processes at a time: a child
		// that died with many rollouts must not start as many children (each up to memory_mb).
		sb.mu.Lock()
		if sb.alone == nil {
			sb.alone = make(chan struct{}, sb.r.Config().Sandbox.Processes)
		}
		turn := sb.alone
		sb.mu.Unlock()
		turn <- struct{}{}
		defer func() { <-turn }()
		if c, err = sb.start(); err != nil {
			return err
		}
		defer c.kill()
	} else if c, err = sb.pick(); err != nil {
		return err
	}
	b, _ := json.Marshal(a)
	ch := make(chan sandbox.Done, 1)
	c.mu.Lock()
	c.nextID++
	id := c.nextID
	c.rollouts[id] = ro
	c.results[id] = ch
	c.accts[id] = &account{}
	c.mu.Unlock()
	c.send(sandbox.Msg{T: "rollout", ID: id, Args: b})
	// The child ends a rollout at its wall time itself; a child that does not (stuck where it
	// cannot be interrupted) is stopped by the host a while later.
	limit := sb.r.Config().Sandbox.WallSeconds
	timer := time.NewTimer(time.Duration((limit + wallGrace.Seconds()) * float64(time.Second)))
	defer timer.Stop()
	select {
	case d := <-ch:
		err := sb.r.applyReport(ro, d)
		var forged *forgedError
		if errors.As(err, &forged) {
			// The report names what the host never generated for the rollout: the child is
			// stopped, and its rollouts, this one too, run again alone.
			c.stop(err)
			<-c.dead
			return &childDied{c.deathErr}
		}
		return err
	case <-c.dead:
		return &childDied{c.deathErr}
	case <-ro.Ctx.Done():
		// The pass is cut short (a stopping run's grace is over, an abandoned step): a loop in
		// the child would not notice, so its process goes, with whatever else it was running.
		cause := context.Cause(ro.Ctx)
		c.stop(cause)
		<-c.dead
		return cause
	case <-timer.C:
		c.stop(&script.BudgetError{Budget: "wall_seconds", Limit: fmt.Sprint(limit), What: fmt.Sprintf("the rollout did not finish in time, "+
			"nor stop %v after; the host stopped its process", wallGrace)})
		<-c.dead
		return &childDied{c.deathErr}
	}
}

// wallGrace is how long after a rollout's wall time the host waits for its child to report.
const wallGrace = 30 * time.Second

type childDied struct{ err error }

func (e *childDied) Error() string { return e.err.Error() }

// pick returns a live child, starting children up to sandbox.processes.
func (sb *pool) pick() (*sbChild, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	live := sb.children[:0]
	for _, c := range sb.children {
		select {
		case <-c.dead:
		default:
			live = append(live, c)
		}
	}
	sb.children = live
	if len(sb.children) < sb.r.Config().Sandbox.Processes {
		c, err := sb.start()
		if err != nil {
			return nil, err
		}
		sb.children = append(sb.children, c)
		return c, nil
	}
	sb.next++
	return sb.children[sb.next%len(sb.children)], nil
}

// applyReport fills the host's copy of a rollout from its child's report.
func (r *Run) applyReport(ro *script.Rollout, d sandbox.Done) error {
	// The child checks rewards and advantages as reward() and train() do; the host does not
	// take its word for it (one out of scale would NaN the step's loss).
	for _, x := range d.Rewards {
		if err := script.CheckReward("sandbox: the child's report: reward", x); err != nil {
			return err
		}
	}
	for _, q := range d.Queued {
		for _, x := range q.Advantage {
			if err := script.CheckAdvantage("sandbox: the child's report: train", x); err != nil {
				return err
			}
		}
	}
	byID := map[string]*script.Completion{}
	for _, c := range ro.Generated() {
		byID[c.ID()] = c
	}
	qs := make([]script.Queued, len(d.Queued))
	for i, q := range d.Queued {
		qs[i] = script.Queued{C: byID[q.ID], Group: q.Group, Advantage: q.Advantage, HasAdv: q.HasAdv, PerToken: q.PerToken, Teacher: q.Teacher}
		if len(q.Turns) > 0 {
			// A chat's sample: rebuilt from the host's copies of its turns, never the child's tokens.
			turns := make([]*script.Completion, len(q.Turns))
			for k, id := range q.Turns {
				if turns[k] = byID[id]; turns[k] == nil {
					return forgery("a report that trains a conversation with turn %.80q, which the host never generated for the rollout", id)
				}
			}
			c, err := script.NewConversation(q.ID, q.Key, turns)
			if err != nil {
				return fmt.Errorf("sandbox: %v", err)
			}
			qs[i].C = c
		}
		if qs[i].C == nil {
			return forgery("a report that trains completion %.80q, which the host never generated for the rollout", q.ID)
		}
	}
	cfg := r.Config().Sandbox
	// The child checks the grants; the host does not take its word for it.
	err := ro.Adopt(d.Rewards, qs, d.Logs, func(q script.Queued) error {
		if err := script.GrantCheck(cfg, r.zero, "train", q.C.Policy(), true); err != nil {
			return err
		}
		if q.Teacher != "" {
			return script.GrantCheck(cfg, r.zero, "train: teacher", q.Teacher, false)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if d.Result != nil {
		raw, _ := json.Marshal(d.Result)
		v, err := script.DecodeValue(raw)
		if err != nil {
			return err
		}
		ro.Result = v
	}
	if d.Error != "" {
		return errors.New(d.Error)
	}
	return nil
}

// runSandboxed runs the rollouts in child processes; the counterpart of the in-process loop in
// runRollouts.
func (r *Run) runSandboxed(ctx context.Context, pass int64, ros []*script.Rollout, fn string, policies []string, n int) {
	cfg := r.Config()
	r.sandbox.warnOnce.Do(func() {
		if !r.zero && len(cfg.Sandbox.Train) == 0 {
			r.events.printf("sandbox: sandbox.train lists no policy, so this script may train none; "+
				"grant what it may train with sandbox: {train: [%s]}", strings.Join(cfg.PolicyNames(), ", "))
		}
	})
	r.sandbox.stMu.Lock()
	r.sandbox.syncState()
	r.sandbox.stMu.Unlock()
	var wg sync.WaitGroup
	for _, ro := range ros {
		wg.Add(1)
		go func(ro *script.Rollout) {
			defer wg.Done()
			defer r.live.rolloutDone(pass)
			a := sandbox.Rollout{Fn: fn, Task: ro.Task, Index: ro.Index, Step: ro.Step, Seed: ro.Seed,
				Sampling: r.sampling(), Eval: ro.Eval, Policies: policies, NSamples: n, WallLimit: cfg.Sandbox.WallSeconds}
			err := r.sandbox.run(ro, a, false)
			var died *childDied
			if errors.As(err, &died) && ro.Ctx.Err() != nil {
				err = context.Cause(ro.Ctx) // the pass was cut short: nothing runs again
			} else if errors.As(err, &died) {
				// Its child died with other rollouts in it: run it again alone, from scratch.
				ro.Reset()
				r.events.printf("sandbox: step %d task %s: its process died (%v); running it again alone", ro.Step, ro.Task.ID, died.err)
				r.activity.add(1)
				err = r.sandbox.run(ro, a, true)
				if errors.As(err, &died) {
					err = died.err
				}
			}
			ro.Err = err
			r.activity.leave()
		}(ro)
	}
	wg.Wait()
}
