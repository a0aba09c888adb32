package script

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/internal/capbuf"
	"github.com/slimen/slimen/starlib"
)

// agent(argv, task_input, policy, timeout=300, env=None, max_calls=64, max_tokens=65536,
// call_max_tokens=None, tools_prompt="template", check=True) runs an external program for one rollout: an agent
// written against the OpenAI chat-completions API, in any language or framework. The program
// gets OPENAI_BASE_URL (a loopback endpoint this process serves while it runs) and an
// OPENAI_API_KEY of its own that routes its calls to this rollout; task_input goes to its stdin
// and to $SLIMEN_TASK_INPUT. Each chat-completions call it makes is a turn of a chat (chat.go)
// with the policy: sampled through the run's batching like generate, with seeds from the call's
// position, and recorded token-exactly: a call whose history continues a recorded conversation
// continues its token ids, rendering only the messages appended since (Chat.sampleLocked); any
// other history starts a new chat. agent() returns a struct: output (the program's stdout),
// exit_code, stderr (its tail), calls and chats (the recorded conversations, for reward and
// train).
//
// A program that runs past timeout is killed (its process group) and fails the rollout; so does
// one that makes more than max_calls calls or samples more than max_tokens tokens (its calls
// are answered 429 from then on), and, with check=True, one that exits non-zero.
func builtinAgent(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var argvV, input, env, timeoutV, callMaxV starlark.Value = nil, nil, starlark.None, starlark.None, starlark.None
	var policy string
	maxCalls, maxTokens := 64, 65536
	toolsPrompt := "template"
	check := true
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "argv", &argvV, "task_input", &input, "policy", &policy,
		"timeout?", &timeoutV, "env?", &env, "max_calls?", &maxCalls, "max_tokens?", &maxTokens, "call_max_tokens?", &callMaxV,
		"tools_prompt?", &toolsPrompt, "check?", &check); err != nil {
		return nil, err
	}
	timeout, err := optFloat(b.Name(), "timeout", timeoutV, 300, 0, 7*24*3600)
	if err != nil {
		return nil, err
	}
	callMax, err := optInt(b.Name(), "call_max_tokens", callMaxV, 0, 1, math.MaxInt32)
	if err != nil {
		return nil, err
	}
	where := callerPos(thread)
	argv, err := toStrings(b.Name(), "argv", argvV)
	if _, isStr := argvV.(starlark.String); err == nil && (isStr || len(argv) == 0 || argv[0] == "") {
		err = fmt.Errorf("%s: argv must be a non-empty list of strings (the program and its arguments), got %s", b.Name(), argvV.String())
	}
	if err != nil {
		return nil, err
	}
	text, ok := input.(starlark.String)
	if !ok {
		if input == starlark.None {
			text = ""
		} else if text, ok = jsonOf(input); !ok {
			return nil, fmt.Errorf("%s: task_input must be a string or a JSON-encodable value, got %s", b.Name(), input.Type())
		}
	}
	extra := map[string]string{}
	if env != starlark.None {
		d, ok := env.(*starlark.Dict)
		if !ok {
			return nil, fmt.Errorf("%s: env must be a dict of strings, got %s", b.Name(), env.Type())
		}
		for _, kv := range d.Items() {
			k, ok1 := kv[0].(starlark.String)
			v, ok2 := kv[1].(starlark.String)
			if !ok1 || !ok2 {
				return nil, fmt.Errorf("%s: env must map strings to strings, got %s: %s", b.Name(), kv[0].Type(), kv[1].Type())
			}
			extra[string(k)] = string(v)
		}
	}
	switch {
	case timeout <= 0:
		return nil, fmt.Errorf("%s: timeout=%g; give the program more than 0 seconds", b.Name(), timeout)
	case maxCalls < 1:
		return nil, fmt.Errorf("%s: max_calls=%d; allow at least 1 call", b.Name(), maxCalls)
	case maxTokens < 1:
		return nil, fmt.Errorf("%s: max_tokens=%d; allow at least 1 token", b.Name(), maxTokens)
	case toolsPrompt != "template" && toolsPrompt != "system":
		return nil, fmt.Errorf("%s: tools_prompt=%q; want \"template\" (the chat template's tools variable) or \"system\" (a Hermes description in the system message)", b.Name(), toolsPrompt)
	}
	ro := ts.ro
	if err := ro.Budget.mayStart(b.Name(), where, argv); err != nil {
		return nil, err
	}
	if err := ro.Budget.mayEnv(b.Name(), where, extra); err != nil {
		return nil, err
	}
	if err := ro.mayGenerate(b.Name(), policy); err != nil {
		return nil, err
	}
	s := &agentSession{ro: ro, fn: b.Name(), policy: policy, key: ts.next(), toolsInSystem: toolsPrompt == "system",
		maxCalls: maxCalls, maxTokens: maxTokens, callMax: callMax}
	res, err := s.run(argv, string(text), extra, time.Duration(timeout*float64(time.Second)), scriptDir(where))
	if err != nil {
		return nil, err
	}
	if check && res.exit != 0 {
		return nil, fmt.Errorf("%s: %s exited with status %d%s", b.Name(), argv[0], res.exit, stderrTail(res.stderr))
	}
	chats := make([]starlark.Value, len(s.chats))
	for i, ac := range s.chats {
		chats[i] = ac.chat
	}
	return starlarkstruct.FromStringDict(starlark.String("agent_result"), starlark.StringDict{
		"output":    starlark.String(res.stdout),
		"stderr":    starlark.String(res.stderr),
		"exit_code": starlark.MakeInt(res.exit),
		"calls":     starlark.MakeInt(s.calls),
		"chats":     starlark.NewList(chats),
	}), nil
}

// callerPos is where the script called the built-in: "file.star:12:5".
func callerPos(thread *starlark.Thread) string {
	if thread.CallStackDepth() < 2 {
		return ""
	}
	return thread.CallFrame(1).Pos.String()
}

// scriptDir is the folder of the script file at pos, where the program runs; "" (the host's
// working directory) when it is not a folder of this machine.
func scriptDir(pos string) string {
	file, _, _ := strings.Cut(pos, ":")
	dir, err := filepath.Abs(filepath.Dir(file))
	if st, serr := os.Stat(dir); err != nil || serr != nil || !st.IsDir() {
		return ""
	}
	return dir
}

func jsonOf(v starlark.Value) (starlark.String, bool) {
	s, err := jsonEncode(v)
	return starlark.String(s), err == nil
}

func stderrTail(s string) string {
	s = strings.TrimSpace(s)
	if s == "" {
		return " (its stderr is empty)"
	}
	if len(s) > 2000 {
		s = "…" + s[len(s)-2000:]
	}
	return "; its stderr ends:\n" + s
}

// PythonEnv names the interpreter that argv "python" or "python3" of agent() runs, as it names
// the torch worker's (docs/agents.md).
const PythonEnv = "SLIMEN_PYTHON"

// agentSession is one agent() call: the program's calls, routed to it by its API key, and the
// chats they recorded.
type agentSession struct {
	ro            *Rollout
	fn            string
	policy        string
	key           []int // the agent() call's position; its i-th call is at key+[i]
	toolsInSystem bool
	maxCalls      int
	maxTokens     int
	callMax       int // the most tokens one call samples; 0: the run's max_response_len

	mu     sync.Mutex
	calls  int
	tokens int // sampled so far, all calls together
	chats  []*agentChat
	failed error // why the rollout fails (a flood); the program is killed
	kill   func()
	closed bool
	wg     sync.WaitGroup // calls being answered
}

// agentChat is a recorded conversation and its messages as the program sends them back.
type agentChat struct {
	chat  *Chat
	tools string   // the request's tools, as JSON lines: another set of tools is another chat
	wire  []string // canonical form of each message the program sent or was answered (agentCanon)
	ends  []int    // len(wire) after each sampled turn
	msgs  []int    // len(chat.msgs) after each sampled turn
	busy  bool     // a call is extending it
}

type agentResult struct {
	stdout, stderr string
	exit           int
}

// run starts the program, waits for it (or its timeout) and for the calls being answered.
func (s *agentSession) run(argv []string, input string, extra map[string]string, timeout time.Duration, dir string) (agentResult, error) {
	base, err := agentEndpoint()
	if err != nil {
		return agentResult{}, fmt.Errorf("%s: %v", s.fn, err)
	}
	var b [24]byte
	rand.Read(b[:])
	apiKey := "sk-slimen-" + hex.EncodeToString(b[:])
	agentSrv.add(apiKey, s)
	defer agentSrv.remove(apiKey)

	prog := argv[0]
	if (prog == "python" || prog == "python3") && os.Getenv(PythonEnv) != "" {
		prog = os.Getenv(PythonEnv)
	}
	ctx, cancel := context.WithTimeout(s.ro.Ctx, timeout)
	defer cancel()
	env := []string{"OPENAI_BASE_URL=" + base + "/v1", "OPENAI_API_KEY=" + apiKey, "OPENAI_MODEL=" + s.policy, "SLIMEN_TASK_INPUT=" + input}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	stdout, stderr := &capbuf.Buffer{Head: 1 << 20}, &capbuf.Buffer{Tail: 64 << 10}
	var p agentProc
	if s.ro.Budget != nil {
		// A sandboxed script's program runs in a jail, or not at all.
		env[0] = "OPENAI_BASE_URL=" + jailBaseURL + "/v1"
		p, err = startJailed(s.ro.Budget.cfg, prog, argv, env, dir, strings.NewReader(input), stdout, stderr)
	} else {
		p, err = startBare(prog, argv, env, dir, strings.NewReader(input), stdout, stderr)
	}
	if err != nil {
		return agentResult{}, fmt.Errorf("%s: cannot start %s: %v", s.fn, strings.Join(argv, " "), err)
	}
	stop := context.AfterFunc(ctx, p.kill)
	defer stop()
	s.mu.Lock()
	s.kill = cancel
	s.mu.Unlock()
	// While the program runs, this thread only waits: the dispatchers need not wait for it to
	// send batches out. Each call the program makes runs (complete) as a thread of the rollout.
	s.ro.Host.Running(-1)
	exit, werr := p.wait()
	s.mu.Lock()
	s.closed = true
	failed := s.failed
	s.mu.Unlock()
	s.wg.Wait()
	s.ro.Host.Running(1)
	res := agentResult{stdout: stdout.String(), stderr: stderr.String(), exit: exit}
	switch {
	case failed != nil:
		return res, failed
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return res, fmt.Errorf("%s: %s ran past its timeout of %s and was killed (with every process it started)%s", s.fn, argv[0], timeout, stderrTail(res.stderr))
	case s.ro.Ctx.Err() != nil:
		return res, fmt.Errorf("%s: %v", s.fn, s.ro.Ctx.Err())
	case werr != nil && res.exit < 0:
		return res, fmt.Errorf("%s: %s: %v%s", s.fn, argv[0], werr, stderrTail(res.stderr))
	}
	return res, nil
}

// fail makes the session's rollout fail with err and kills the program.
func (s *agentSession) failLocked(err error) {
	if s.failed == nil {
		s.failed = err
	}
	if s.kill != nil {
		s.kill()
	}
}

// complete answers one chat-completions call of the program.
func (s *agentSession) complete(call openai.ChatCall) ([]engines.Completion, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, &openai.APIError{Status: http.StatusGone, Type: "invalid_request_error", Msg: "the agent() call this key belonged to has ended"}
	}
	if s.failed != nil {
		s.mu.Unlock()
		return nil, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: s.failed.Error()}
	}
	index := s.calls
	s.calls++
	if s.calls > s.maxCalls {
		err := fmt.Errorf("%s: the program made more than %d chat-completions calls (max_calls) and was stopped", s.fn, s.maxCalls)
		s.failLocked(err)
		s.mu.Unlock()
		return nil, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: err.Error()}
	}
	room := s.maxTokens - s.tokens
	if room <= 0 {
		err := fmt.Errorf("%s: the program's calls sampled %d tokens, its max_tokens (%d), and it called again; it was stopped", s.fn, s.tokens, s.maxTokens)
		s.failLocked(err)
		s.mu.Unlock()
		return nil, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: err.Error()}
	}
	ac, turn, forked, err := s.matchLocked(call, index)
	if err != nil {
		s.mu.Unlock()
		return nil, &openai.APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Msg: err.Error()}
	}
	// The turn is sampled on a copy of the conversation (with the new messages), which replaces
	// the recorded one only once it succeeded; the copy is taken under s.mu, which guards what
	// the recorded conversations hold.
	ro := s.ro
	key := append(slices.Clone(s.key), index)
	var wire []string
	ac.chat.mu.Lock()
	c := ac.chat.truncatedLocked(-1, 0, forked, ro.Task.ID, key)
	if turn >= 0 {
		c = ac.chat.truncatedLocked(turn, ac.msgs[turn], forked, ro.Task.ID, key)
		wire = slices.Clone(ac.wire[:ac.ends[turn]])
	}
	ac.chat.mu.Unlock()
	tools, ends, msgEnds := ac.tools, slices.Clone(ac.ends), slices.Clone(ac.msgs)
	readCalls := tools != "" && !call.NoToolCalls
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	samp := ro.Host.Sampling()
	if ro.Eval != nil {
		samp = *ro.Eval
	}
	if s.callMax > 0 {
		samp.MaxTokens = s.callMax
	}
	if call.MaxTokens > 0 && call.MaxTokens < samp.MaxTokens {
		samp.MaxTokens = call.MaxTokens
	}
	n := max(call.Request.N, 1)
	if per := room / n; per < samp.MaxTokens {
		samp.MaxTokens = max(per, 1)
	}
	samp.Stop = append(slices.Clone(samp.Stop), call.Request.Stop...)
	samp.Seed = KeySeed(ro.Seed, ro.Task.ID, key)
	for _, m := range call.Messages[len(wire):] {
		c.msgs = append(c.msgs, openai.EngineMessage(m))
		wire = append(wire, agentCanon(m))
	}
	if turn < 0 && s.toolsInSystem && tools != "" {
		c.msgs = withToolsInSystem(c.msgs, call.Tools)
	}
	c.mu.Lock()
	ro.Host.Running(1)
	var (
		cs     []*Completion
		prompt []int32
		mask   []float32
	)
	samp.Constraint, err = constraintOf(ro, c.policy, call)
	if err == nil {
		cs, prompt, mask, err = c.sampleLocked(ro, s.fn, n, samp, key)
	}
	// tool_choice "required" or a named function on an engine that does not constrain: sampled
	// again, each time at a position of its own (its seed), until every sample makes the call;
	// only those are recorded. Under a constraint every sample is the call, unless max_tokens
	// cut it (answered as it is, finish_reason "length", as the front answers it).
	require := call.RequireCall
	if samp.Constraint != "" {
		require = ""
	}
	rejected := 0
	for attempt := 1; err == nil && !meetsRequired(require, cs); attempt++ {
		if len(cs) > 0 && len(cs[0].tokens) == 0 && cs[0].finish == "length" {
			break // the conversation fills the context: answered below, as any call is
		}
		for _, cm := range cs {
			rejected += len(cm.tokens)
		}
		if attempt == openai.RequiredAttempts {
			err = openai.NoRequiredCall(call.RequireCall)
			break
		}
		again := append(slices.Clone(key), requiredAttemptKey+attempt)
		samp.Seed = KeySeed(ro.Seed, ro.Task.ID, again)
		cs, prompt, mask, err = c.sampleLocked(ro, s.fn, n, samp, again)
	}
	ro.Host.Running(-1)
	c.mu.Unlock()

	s.mu.Lock()
	defer s.mu.Unlock()
	if !forked {
		ac.busy = false
	}
	used := rejected
	for _, cm := range cs {
		used += len(cm.tokens)
	}
	s.tokens += used
	if err != nil {
		return nil, err
	}
	if full := len(cs) > 0 && used == 0 && cs[0].finish == "length"; full {
		// The conversation fills the policy's context: the call is the client's mistake, as the
		// API answers it, and the conversation ends with it (nothing of it is recorded, so the
		// rollout trains on what came before); the rollout goes on.
		return nil, &openai.APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: "messages", Code: "context_length_exceeded",
			Msg: fmt.Sprintf("This model's maximum context length is %d tokens. However, your messages resulted in %[1]d tokens, which leaves no room for a response. Please reduce the length of the messages.", len(cs[0].prompt))}
	}
	record := func(rc *agentChat, ch *Chat, cm *Completion) {
		rc.chat = ch
		rc.wire = append(slices.Clone(wire), agentCanon(openai.AssistantMessage(cm.text, readCalls)))
		rc.ends = append(slices.Clone(ends[:turn+1]), len(rc.wire))
		rc.msgs = append(slices.Clone(msgEnds[:turn+1]), len(ch.msgs))
	}
	if n == 1 {
		c.appendTurnLocked(prompt, mask, cs[0])
		rc := ac
		if forked {
			rc = &agentChat{tools: tools}
			s.chats = append(s.chats, rc)
		}
		record(rc, c, cs[0])
	} else {
		for i, f := range c.forksLocked(ro, key, prompt, mask, cs) {
			fc := &agentChat{tools: tools}
			record(fc, f, cs[i])
			s.chats = append(s.chats, fc)
		}
	}
	out := make([]engines.Completion, len(cs))
	for i, cm := range cs {
		out[i] = engines.Completion{RequestID: call.Request.ID, Index: i, PromptTokens: cm.prompt, Tokens: cm.tokens,
			Logprobs: cm.logprobs, Text: cm.text, FinishReason: cm.finish}
	}
	return out, nil
}

// constraintOf is the decoding constraint of a call's tool_choice, parallel_tool_calls and
// response_format where the policy's engine constrains decoding; where it does not, none, and a
// call whose fields need it (response_format, parallel_tool_calls false) is refused with a 400
// naming them (tool_choice "required" alone is met by sampling again).
func constraintOf(ro *Rollout, policy string, call openai.ChatCall) (string, error) {
	if call.Constraint == "" {
		return "", nil
	}
	r, err := ro.Host.Render(ro.Ctx, policy, nil)
	switch {
	case err != nil:
		return "", err
	case r.Constrain:
		return call.Constraint, nil
	case call.Strict != "":
		return "", openai.NoConstraint(call.Strict)
	}
	return "", nil
}

// requiredAttemptKey marks, in a call's position, the samples drawn again for tool_choice
// "required" (requiredAttemptKey+1, +2, …): positions no call of the program reaches.
const requiredAttemptKey = 1 << 20

// meetsRequired says whether every sample of a call makes the call its tool_choice requires.
func meetsRequired(require string, cs []*Completion) bool {
	for _, cm := range cs {
		if !openai.RequiredCall(require, cm.text) {
			return false
		}
	}
	return true
}

// matchLocked finds the recorded conversation a call's history continues: the longest one whose
// messages up to the end of one of its sampled turns are the call's first messages (and whose
// tools are the call's). It returns the chat, the turn (-1: none, a new chat) and whether the
// turn is not the chat's last or the chat is busy, so the call continues a copy of it.
func (s *agentSession) matchLocked(call openai.ChatCall, index int) (*agentChat, int, bool, error) {
	if len(call.Messages) == 0 {
		return nil, 0, false, fmt.Errorf("messages is empty")
	}
	tools := strings.Join(call.Tools, "\n")
	canon := make([]string, len(call.Messages))
	for i, m := range call.Messages {
		canon[i] = agentCanon(m)
	}
	var best *agentChat
	bestTurn, bestLen := -1, 0
	for _, ac := range s.chats {
		if ac.tools != tools {
			continue
		}
		for t := len(ac.ends) - 1; t >= 0; t-- {
			e := ac.ends[t]
			if e > bestLen && e < len(canon) && slices.Equal(ac.wire[:e], canon[:e]) {
				best, bestTurn, bestLen = ac, t, e
				break
			}
		}
	}
	if best == nil {
		c := &Chat{policy: s.policy}
		if tools != "" && !s.toolsInSystem {
			c.tools = call.Tools
		}
		return &agentChat{chat: c, tools: tools}, -1, true, nil
	}
	forked := best.busy || bestTurn != len(best.ends)-1
	if !forked {
		best.busy = true
	}
	return best, bestTurn, forked, nil
}

// truncatedLocked is a copy of the chat up to the end of its turn t, its first n messages (t <
// 0: an empty conversation), under the id of the agent call at key when it is a new
// conversation.
func (c *Chat) truncatedLocked(t, n int, newChat bool, task string, key []int) *Chat {
	cp := c.copyLocked(task, key)
	if !newChat {
		cp.id, cp.key = c.id, c.key
	}
	if t < 0 {
		cp.msgs, cp.rendered, cp.tokens, cp.mask, cp.logprobs, cp.turns = nil, 0, nil, nil, nil, nil
		return cp
	}
	last := c.turns[t]
	end := len(last.prompt) + len(last.tokens)
	cp.msgs, cp.rendered = cp.msgs[:n], n
	cp.tokens, cp.mask, cp.logprobs, cp.turns = cp.tokens[:end], cp.mask[:end], cp.logprobs[:end], cp.turns[:t+1]
	return cp
}

// withToolsInSystem describes the tools in the system message (tools_prompt="system"), for a
// template without a tools variable (the tiny engine's).
func withToolsInSystem(msgs []engines.Message, tools []string) []engines.Message {
	return openai.ToolsInSystem(msgs, starlib.ToolsSystemPrompt(tools))
}

// agentCanon is a message as the matching of histories compares it: its role, its content
// without surrounding space, and its tool calls' names and arguments (re-encoded, so that a
// client that re-serialises them still matches); call ids are the client's business.
func agentCanon(m openai.ChatMessage) string {
	var b strings.Builder
	b.WriteString(m.Role)
	b.WriteByte(0)
	b.WriteString(strings.TrimSpace(m.Content))
	for _, c := range m.ToolCalls {
		b.WriteByte(0)
		b.WriteString(c.Name)
		b.WriteByte(0)
		var v any
		if json.Unmarshal([]byte(c.Arguments), &v) == nil {
			enc, _ := json.Marshal(v)
			b.Write(enc)
		} else {
			b.WriteString(c.Arguments)
		}
	}
	return b.String()
}

// agentSrv is the process's endpoint for agent programs: one loopback HTTP server, started at
// the first agent() call, that routes each call by its API key to its session.
var agentSrv = &agentServer{sessions: map[string]*agentSession{}}

type agentServer struct {
	once    sync.Once
	url     string
	err     error
	handler http.Handler

	sockOnce sync.Once // the Unix socket jails lead to (agentSocket)
	sock     string
	sockErr  error

	mu       sync.Mutex
	sessions map[string]*agentSession
}

func (a *agentServer) add(key string, s *agentSession) {
	a.mu.Lock()
	a.sessions[key] = s
	a.mu.Unlock()
}

func (a *agentServer) remove(key string) {
	a.mu.Lock()
	delete(a.sessions, key)
	a.mu.Unlock()
}

type agentSessionKey struct{}

// agentEndpoint returns the root of the endpoint ("http://127.0.0.1:PORT"), starting it.
func agentEndpoint() (string, error) {
	a := agentSrv
	a.once.Do(func() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			a.err = fmt.Errorf("cannot listen on loopback for the agent endpoint: %v", err)
			return
		}
		a.url = "http://" + ln.Addr().String()
		// Each program's /v1/models lists the name it was given ($OPENAI_MODEL): its policy's.
		modelFor := func(r *http.Request) string { return r.Context().Value(agentSessionKey{}).(*agentSession).policy }
		front := openai.NewChatHandler(openai.HandlerOptions{Model: "slimen-policy", ModelFor: modelFor}, func(ctx context.Context, call openai.ChatCall) ([]engines.Completion, error) {
			return ctx.Value(agentSessionKey{}).(*agentSession).complete(call)
		})
		srv := openai.NewServer(nil)
		a.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// The key is checked before anything of the body is read.
			key, _ := openai.BearerToken(r)
			a.mu.Lock()
			s := a.sessions[key]
			a.mu.Unlock()
			if s == nil {
				openai.Unauthorized(w, "this endpoint answers the programs agent() runs, each with the OPENAI_API_KEY it was given; the request carried none, or the key of an agent() call that has ended")
				return
			}
			front.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), agentSessionKey{}, s)))
		})
		srv.Handler = a.handler
		go srv.Serve(ln)
	})
	return a.url, a.err
}
