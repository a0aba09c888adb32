package script

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
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

// This file defines an agent() call's session: its program's run and the answer to each of the
// program's chat-completions calls (admit, sample, record).

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
// The endpoint is the rollout's run's (Rollout.Agents); a rollout without one gets an endpoint of
// the call's own.
func (s *agentSession) run(argv []string, input string, extra map[string]string, timeout time.Duration, dir string) (agentResult, error) {
	agents := s.ro.Agents
	if agents == nil {
		agents = new(AgentEndpoint)
		defer agents.Close()
	}
	base, err := agents.URL()
	if err != nil {
		return agentResult{}, fmt.Errorf("%s: %v", s.fn, err)
	}
	var b [24]byte
	rand.Read(b[:])
	apiKey := "sk-slimen-" + hex.EncodeToString(b[:])
	agents.add(apiKey, s)
	defer agents.remove(apiKey)

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
		p, err = startJailed(agents, s.ro.Budget.cfg, prog, argv, env, dir, strings.NewReader(input), stdout, stderr)
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

// value is the session's result as agent() returns it: the program's output, exit code and
// stderr, and the calls it made and the chats they recorded.
func (s *agentSession) value(res agentResult) starlark.Value {
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
	})
}

// failLocked makes the session's rollout fail with err and kills the program.
func (s *agentSession) failLocked(err error) {
	if s.failed == nil {
		s.failed = err
	}
	if s.kill != nil {
		s.kill()
	}
}

// complete answers one chat-completions call of the program: admitted within the session's
// limits against the conversation it continues, sampled on a copy of that conversation, and
// recorded once sampled.
func (s *agentSession) complete(call openai.ChatCall) ([]engines.Completion, error) {
	t, err := s.admit(call)
	if err != nil {
		return nil, err
	}
	defer s.wg.Done()
	return s.record(t, call, s.sample(t, call))
}

// agentTurn is an admitted call: its position, the conversation it continues and the copy of it
// that the turn is sampled on.
type agentTurn struct {
	index   int        // the call's number in the session
	key     []int      // its position: the session's key and index
	room    int        // the tokens the session may still sample
	ac      *agentChat // the recorded conversation it continues (a new one: turn < 0)
	turn    int        // the last turn of ac it continues; -1: none
	forked  bool       // it continues a copy of ac, recorded beside it
	c       *Chat      // the copy the turn is sampled on
	wire    []string   // ac's canonical messages up to the end of turn
	tools   string     // ac's tools
	ends    []int      // ac.ends when admitted
	msgEnds []int      // ac.msgs when admitted
	readTC  bool       // the answer is read for tool calls
}

// admit checks a call against the session (ended, failed, max_calls, max_tokens), finds the
// conversation it continues and copies it, and counts the call as being answered (s.wg). The
// copy is taken under s.mu, which guards what the recorded conversations hold; the turn is
// sampled on it and replaces the recorded one only once it succeeded.
func (s *agentSession) admit(call openai.ChatCall) (agentTurn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return agentTurn{}, &openai.APIError{Status: http.StatusGone, Type: "invalid_request_error", Msg: "the agent() call this key belonged to has ended"}
	}
	if s.failed != nil {
		return agentTurn{}, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: s.failed.Error()}
	}
	t := agentTurn{index: s.calls}
	s.calls++
	if s.calls > s.maxCalls {
		err := fmt.Errorf("%s: the program made more than %d chat-completions calls (max_calls) and was stopped", s.fn, s.maxCalls)
		s.failLocked(err)
		return agentTurn{}, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: err.Error()}
	}
	if t.room = s.maxTokens - s.tokens; t.room <= 0 {
		err := fmt.Errorf("%s: the program's calls sampled %d tokens, its max_tokens (%d), and it called again; it was stopped", s.fn, s.tokens, s.maxTokens)
		s.failLocked(err)
		return agentTurn{}, &openai.APIError{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", Msg: err.Error()}
	}
	var err error
	if t.ac, t.turn, t.forked, err = s.matchLocked(call, t.index); err != nil {
		return agentTurn{}, &openai.APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Msg: err.Error()}
	}
	t.key = append(slices.Clone(s.key), t.index)
	t.c, t.wire = t.ac.copyTurn(t.turn, t.forked, s.ro.Task.ID, t.key)
	t.tools, t.ends, t.msgEnds = t.ac.tools, slices.Clone(t.ac.ends), slices.Clone(t.ac.msgs)
	t.readTC = t.tools != "" && !call.NoToolCalls
	s.wg.Add(1)
	return t, nil
}

// copyTurn is a copy of the chat up to the end of its turn (turn < 0: an empty conversation) and
// its canonical messages up to there.
func (ac *agentChat) copyTurn(turn int, forked bool, task string, key []int) (*Chat, []string) {
	ac.chat.mu.Lock()
	defer ac.chat.mu.Unlock()
	if turn < 0 {
		return ac.chat.truncatedLocked(-1, 0, forked, task, key), nil
	}
	return ac.chat.truncatedLocked(turn, ac.msgs[turn], forked, task, key), slices.Clone(ac.wire[:ac.ends[turn]])
}

// agentSample is what sampling an admitted call gave: its samples, their prompt and loss mask, the
// tokens of samples drawn and thrown away (tool_choice "required"), and why it failed.
type agentSample struct {
	cs       []*Completion
	prompt   []int32
	mask     []float32
	rejected int
	err      error
}

// sample samples an admitted call's turn on t.c, with the call's new messages appended, as a
// running thread of the rollout: the run's sampling settings within the call's and the
// session's token limits, seeded by the call's position.
func (s *agentSession) sample(t agentTurn, call openai.ChatCall) agentSample {
	ro, c := s.ro, t.c
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
	if per := t.room / n; per < samp.MaxTokens {
		samp.MaxTokens = max(per, 1)
	}
	samp.Stop = append(slices.Clone(samp.Stop), call.Request.Stop...)
	samp.Seed = KeySeed(ro.Seed, ro.Task.ID, t.key)
	for _, m := range call.Messages[len(t.wire):] {
		c.msgs = append(c.msgs, openai.EngineMessage(m))
	}
	if t.turn < 0 && s.toolsInSystem && t.tools != "" {
		c.msgs = withToolsInSystem(c.msgs, call.Tools)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ro.Host.Running(1)
	defer ro.Host.Running(-1)
	var r agentSample
	samp.Constraint, r.err = constraintOf(ro, c.policy, call)
	if r.err == nil {
		r.cs, r.prompt, r.mask, r.err = c.sampleLocked(ro, s.fn, n, samp, t.key)
	}
	// tool_choice "required" or a named function on an engine that does not constrain: sampled
	// again, each time at a position of its own (its seed), until every sample makes the call;
	// only those are recorded. Under a constraint every sample is the call, unless max_tokens
	// cut it (answered as it is, finish_reason "length", as the front answers it).
	require := call.RequireCall
	if samp.Constraint != "" {
		require = ""
	}
	for attempt := 1; r.err == nil && !meetsRequired(require, r.cs); attempt++ {
		if len(r.cs) > 0 && len(r.cs[0].tokens) == 0 && r.cs[0].finish == "length" {
			break // the conversation fills the context: answered below, as any call is
		}
		for _, cm := range r.cs {
			r.rejected += len(cm.tokens)
		}
		if attempt == openai.RequiredAttempts {
			r.err = openai.NoRequiredCall(call.RequireCall)
			break
		}
		again := append(slices.Clone(t.key), requiredAttemptKey+attempt)
		samp.Seed = KeySeed(ro.Seed, ro.Task.ID, again)
		r.cs, r.prompt, r.mask, r.err = c.sampleLocked(ro, s.fn, n, samp, again)
	}
	return r
}

// record counts a sampled call's tokens against the session's max_tokens and, when it succeeded,
// records its turn: on the conversation it continued, or, forked or with n > 1, on conversations
// of its own. It returns the call's answer.
func (s *agentSession) record(t agentTurn, call openai.ChatCall, r agentSample) ([]engines.Completion, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !t.forked {
		t.ac.busy = false
	}
	used := r.rejected
	for _, cm := range r.cs {
		used += len(cm.tokens)
	}
	s.tokens += used
	if r.err != nil {
		return nil, r.err
	}
	cs, c := r.cs, t.c
	if full := len(cs) > 0 && used == 0 && cs[0].finish == "length"; full {
		// The conversation fills the policy's context: the call is the client's mistake, as the
		// API answers it, and the conversation ends with it (nothing of it is recorded, so the
		// rollout trains on what came before); the rollout goes on.
		return nil, &openai.APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: "messages", Code: "context_length_exceeded",
			Msg: fmt.Sprintf("This model's maximum context length is %d tokens. However, your messages resulted in %[1]d tokens, "+
				"which leaves no room for a response. Please reduce the length of the messages.", len(cs[0].prompt))}
	}
	wire := t.wire
	for _, m := range call.Messages[len(t.wire):] {
		wire = append(wire, agentCanon(m))
	}
	put := func(rc *agentChat, ch *Chat, cm *Completion) {
		rc.chat = ch
		rc.wire = append(slices.Clone(wire), agentCanon(openai.AssistantMessage(cm.text, t.readTC)))
		rc.ends = append(slices.Clone(t.ends[:t.turn+1]), len(rc.wire))
		rc.msgs = append(slices.Clone(t.msgEnds[:t.turn+1]), len(ch.msgs))
	}
	if max(call.Request.N, 1) == 1 {
		c.appendTurnLocked(r.prompt, r.mask, cs[0])
		rc := t.ac
		if t.forked {
			rc = &agentChat{tools: t.tools}
			s.chats = append(s.chats, rc)
		}
		put(rc, c, cs[0])
	} else {
		for i, f := range c.forksLocked(s.ro, t.key, r.prompt, r.mask, cs) {
			fc := &agentChat{tools: t.tools}
			put(fc, f, cs[i])
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
