package script

import (
	"fmt"
	"slices"
	"strconv"
	"sync"

	starlarkjson "go.starlark.net/lib/json"
	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// Chat is what chat(policy, system=None, tools=None) returns: a multi-turn conversation with one
// policy, kept as token ids. Each .generate samples from the conversation's own tokens
// (GenerateRequest.PromptTokens) and keeps the sampled ids as they are; only the messages
// appended after a sampled turn are rendered, by the policy's engine, as the difference between
// the chat template applied to the conversation with them and without them. So the tokens a
// conversation trains on are exactly the ones the model sampled, whatever the template does to
// earlier turns when it renders them again (Qwen3 drops their <think> blocks).
//
// reward(chat, v) and train(chat) make one sample of the conversation: the prompt is the tokens
// before its first sampled turn, the response everything after, with loss mask 1 exactly at the
// sampled tokens and their rollout log-probs (0 elsewhere).
type Chat struct {
	policy string
	tools  []string // JSON schemas, for the template's tools variable
	id     string   // TASK/CALL of the chat() or fork that made it
	key    []int

	mu       sync.Mutex
	frozen   bool
	msgs     []engines.Message
	rendered int       // messages already in tokens
	tokens   []int32   // the conversation so far: prompt, sampled turns and rendered injections
	mask     []float32 // 1 at sampled tokens
	logprobs []float32 // rollout log-probs at sampled tokens, 0 elsewhere
	turns    []*Completion
	closing  []int32 // the template's tokens after an assistant message's content; nil: not known yet
	sample   *Completion
}

var (
	_ starlark.HasAttrs = (*Chat)(nil)
	_ starlark.Value    = (*Chat)(nil)
)

func builtinChat(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var policy string
	var system, tools starlark.Value = starlark.None, starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "policy", &policy, "system?", &system, "tools?", &tools); err != nil {
		return nil, err
	}
	ro := ts.ro
	if err := ro.mayGenerate(b.Name(), policy); err != nil {
		return nil, err
	}
	key := ts.next()
	c := &Chat{policy: policy, id: ro.Task.ID + "/" + keyString(key), key: key}
	if system != starlark.None {
		s, ok := system.(starlark.String)
		if !ok {
			return nil, fmt.Errorf("%s: system must be a string, got %s", b.Name(), system.Type())
		}
		c.msgs = append(c.msgs, engines.Message{Role: "system", Content: string(s)})
	}
	if tools != starlark.None {
		if c.tools, err = toolSchemas(b.Name(), tools); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// toolSchemas reads tools=: a list of JSON schemas, each a dict (encoded here) or a JSON string.
func toolSchemas(fn string, v starlark.Value) ([]string, error) {
	it, ok := v.(starlark.Iterable)
	if !ok {
		return nil, fmt.Errorf("%s: tools must be a list of tool schemas (dicts), got %s", fn, v.Type())
	}
	var out []string
	iter := it.Iterate()
	defer iter.Done()
	var x starlark.Value
	for i := 0; iter.Next(&x); i++ {
		switch x := x.(type) {
		case starlark.String:
			out = append(out, string(x))
		case *starlark.Dict:
			s, err := jsonEncode(x)
			if err != nil {
				return nil, fmt.Errorf("%s: tools[%d]: %v", fn, i, err)
			}
			out = append(out, s)
		default:
			return nil, fmt.Errorf("%s: tools[%d] is a %s; a tool schema is a dict ({\"type\": \"function\", \"function\": {…}})", fn, i, x.Type())
		}
	}
	return out, nil
}

// String shows the chat's policy and its numbers of messages and tokens.
func (c *Chat) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprintf("chat(policy=%q, messages=%d, tokens=%d)", c.policy, len(c.msgs), len(c.tokens))
}

// Type is "chat".
func (c *Chat) Type() string { return "chat" }

// Truth is true: a chat is a value even with no messages.
func (c *Chat) Truth() starlark.Bool { return true }

// Hash fails: a chat changes as it grows, so it is no dict key.
func (c *Chat) Hash() (uint32, error) {
	return 0, fmt.Errorf("unhashable: chat")
}

// Freeze makes the chat read-only: its methods that add to it fail from then on.
func (c *Chat) Freeze() {
	c.mu.Lock()
	c.frozen = true
	c.mu.Unlock()
}

var chatAttrs = []string{"assistant", "fork", "generate", "loss_mask", "messages", "policy", "tokens", "tool", "turns", "user"}

// AttrNames lists the chat's fields and methods.
func (c *Chat) AttrNames() []string { return chatAttrs }

// Attr returns the field or the bound method called name.
func (c *Chat) Attr(name string) (starlark.Value, error) {
	method := func(f func(*starlark.Thread, *starlark.Builtin, starlark.Tuple, []starlark.Tuple) (starlark.Value, error)) starlark.Value {
		return starlark.NewBuiltin("chat."+name, f).BindReceiver(c)
	}
	switch name {
	case "user":
		return method(c.message("user")), nil
	case "assistant":
		return method(c.message("assistant")), nil
	case "tool":
		return method(c.message("tool")), nil
	case "generate":
		return method(c.generate), nil
	case "fork":
		return method(c.forkMethod), nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch name {
	case "policy":
		return starlark.String(c.policy), nil
	case "tokens":
		t := make(starlark.Tuple, len(c.tokens))
		for i, x := range c.tokens {
			t[i] = starlark.MakeInt(int(x))
		}
		return t, nil
	case "loss_mask":
		t := make(starlark.Tuple, len(c.mask))
		for i, x := range c.mask {
			t[i] = starlark.MakeInt(int(x))
		}
		return t, nil
	case "messages":
		l := make([]starlark.Value, len(c.msgs))
		for i, m := range c.msgs {
			d := starlark.NewDict(2)
			d.SetKey(starlark.String("role"), starlark.String(m.Role))
			d.SetKey(starlark.String("content"), starlark.String(m.Content))
			l[i] = d
		}
		return starlark.NewList(l), nil
	case "turns":
		l := make([]starlark.Value, len(c.turns))
		for i, t := range c.turns {
			l[i] = t
		}
		return starlark.NewList(l), nil
	}
	return nil, nil
}

// message is .user(text), .assistant(text) (an injected turn: rendered, never trained) and
// .tool(text, name=None) (a tool's result, after an assistant turn).
func (c *Chat) message(role string) func(*starlark.Thread, *starlark.Builtin, starlark.Tuple, []starlark.Tuple) (starlark.Value, error) {
	return func(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
		var text, name starlark.Value = nil, starlark.None
		params := []any{"text", &text}
		if role == "tool" {
			params = append(params, "name?", &name)
		}
		if err := starlark.UnpackArgs(b.Name(), args, kwargs, params...); err != nil {
			return nil, err
		}
		s, ok := text.(starlark.String)
		if !ok {
			return nil, fmt.Errorf("%s: text must be a string, got %s (convert it with str() or json.encode())", b.Name(), text.Type())
		}
		if _, ok := name.(starlark.String); name != starlark.None && !ok {
			return nil, fmt.Errorf("%s: name must be a string, got %s", b.Name(), name.Type())
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.frozen {
			return nil, fmt.Errorf("%s: the chat is frozen (shared with parallel); fork() it in the thread that adds to it", b.Name())
		}
		if role == "tool" && !slices.ContainsFunc(c.msgs, func(m engines.Message) bool { return m.Role == "assistant" }) {
			return nil, fmt.Errorf("%s: a tool result answers an assistant turn's tool call, "+
				"and this chat has no assistant turn yet; add the user's request and .generate() first", b.Name())
		}
		c.msgs = append(c.msgs, engines.Message{Role: role, Content: string(s)})
		return starlark.None, nil
	}
}

// forkMethod is .fork(): an independent copy of the conversation.
func (c *Chat) forkMethod(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	if err := starlark.UnpackArgs(b.Name(), args, kwargs); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.copyLocked(ts.ro.Task.ID, ts.next()), nil
}

// copyLocked copies the conversation under a new position in the call tree.
func (c *Chat) copyLocked(task string, key []int) *Chat {
	return &Chat{
		policy: c.policy, tools: c.tools, id: task + "/" + keyString(key), key: key,
		msgs: slices.Clone(c.msgs), rendered: c.rendered, tokens: slices.Clone(c.tokens),
		mask: slices.Clone(c.mask), logprobs: slices.Clone(c.logprobs), turns: slices.Clone(c.turns),
		closing: c.closing,
	}
}

// generate is .generate(n=1, max_tokens=, temperature=, top_p=, stop=, seed=): samples the next
// assistant turn. n=1 extends the chat and returns the turn's completion; n > 1 leaves the chat
// as it is and returns n forks, each extended by one of the samples (its .turns[-1]).
func (c *Chat) generate(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	n := 1
	var maxTokens, temperature, topP, stop, seed starlark.Value = starlark.None, starlark.None, starlark.None, starlark.None, starlark.None
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "n?", &n, "max_tokens?", &maxTokens, "temperature?", &temperature,
		"top_p?", &topP, "stop?", &stop, "seed?", &seed); err != nil {
		return nil, err
	}
	if n < 1 || n > maxSamplesPerCall {
		return nil, fmt.Errorf("%s: n=%d is out of range; ask for 1 to %d samples", b.Name(), n, maxSamplesPerCall)
	}
	ro := ts.ro
	if err := ro.Budget.allowed(b.Name(), c.policy, false); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.frozen {
		return nil, fmt.Errorf("%s: the chat is frozen (shared with parallel); fork() it in the thread that adds to it", b.Name())
	}
	if len(c.msgs) == 0 {
		return nil, fmt.Errorf("%s: the chat has no messages; add the user's request with .user(text) first", b.Name())
	}
	s, key, err := samplingArgs(b.Name(), ts, maxTokens, temperature, topP, stop, seed)
	if err != nil {
		return nil, err
	}
	cs, prompt, mask, err := c.sampleLocked(ro, b.Name(), n, s, key)
	if err != nil {
		return nil, err
	}
	if n == 1 {
		c.appendTurnLocked(prompt, mask, cs[0])
		return cs[0], nil
	}
	forks := make([]starlark.Value, n)
	for i, f := range c.forksLocked(ro, key, prompt, mask, cs) {
		forks[i] = f
	}
	return starlark.NewList(forks), nil
}

// sampleLocked samples n next assistant turns of the conversation with settings s at call-tree
// position key (.generate, and each call of an agent() program), and returns them with the
// prompt they were sampled from and its loss mask; the chat is unchanged: appendTurnLocked
// extends it by one of them, forksLocked makes a fork per sample. It checks what the engine
// answered (the prompt it sampled from, a log-prob per token).
func (c *Chat) sampleLocked(ro *Rollout, fn string, n int, s engines.Sampling, key []int) ([]*Completion, []int32, []float32, error) {
	// Every turn is a generate call of the sandbox's budget, counted before the conversation is
	// rendered: a turn past the context samples nothing, yet costs the host a rendering.
	if err := ro.Budget.call(fn); err != nil {
		return nil, nil, nil, err
	}
	prompt, mask, maxSeq, err := c.promptLocked(ro, fn)
	if err != nil {
		return nil, nil, nil, err
	}
	req := engines.GenerateRequest{ID: ro.Task.ID + "/" + keyString(key), PromptTokens: prompt, N: n, Sampling: s}
	var outs []engines.Completion
	if room := maxSeq - len(prompt); maxSeq > 0 && room < 1 {
		// The conversation fills the policy's context: the turn ends before its first token,
		// as a response that reached max_tokens does, and the script sees why. Each of its
		// samples counts a token (the turn's end), and the line it writes to the run's events is
		// one of the rollout's prints.
		if err := ro.Budget.reserve(fn, n, 1); err != nil {
			return nil, nil, nil, err
		}
		if err := ro.printEvent(fmt.Sprintf("%s: the conversation is %d tokens, the policy %q's whole context (%d); "+
			"the turn ends with finish_reason \"length\" and no tokens",
			fn, len(prompt), c.policy, maxSeq)); err != nil {
			return nil, nil, nil, err
		}
		for i := 0; i < n; i++ {
			outs = append(outs, engines.Completion{RequestID: req.ID, Index: i, PromptTokens: prompt, FinishReason: "length"})
		}
	} else {
		if maxSeq > 0 && req.MaxTokens > room {
			req.MaxTokens = room // the engine cuts the turn at the context, with finish_reason "length"
		}
		if err := ro.Budget.reserve(fn, n, req.MaxTokens); err != nil {
			return nil, nil, nil, err
		}
		var err error
		outs, err = ro.Host.Generate(ro.Ctx, c.policy, req)
		used := 0
		for _, o := range outs {
			used += len(o.Tokens)
		}
		ro.Budget.settle(n*req.MaxTokens, used)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%s: policy %q: %v", fn, c.policy, err)
		}
	}
	msgs := slices.Clone(c.msgs)
	cs := newCompletions(c.policy, req, key, outs)
	for i, cm := range cs {
		cm.messages = msgs
		if !slices.Equal(outs[i].PromptTokens, prompt) {
			return nil, nil, nil, fmt.Errorf("%s: policy %q's engine answered for a prompt of %d tokens, not the conversation's %d",
				fn, c.policy, len(outs[i].PromptTokens), len(prompt))
		}
		if len(cm.logprobs) != len(cm.tokens) {
			return nil, nil, nil, fmt.Errorf("%s: policy %q's engine returned %d log-probs for %d tokens", fn, c.policy, len(cm.logprobs), len(cm.tokens))
		}
		ro.noteCompletion(cm)
		ro.Host.Generated(len(cm.tokens))
	}
	return cs, prompt, mask, nil
}

// forksLocked makes the forks of an n > 1 sampleLocked: copies of the chat, each extended by
// one of the samples.
func (c *Chat) forksLocked(ro *Rollout, key []int, prompt []int32, mask []float32, cs []*Completion) []*Chat {
	forks := make([]*Chat, len(cs))
	for i, cm := range cs {
		f := c.copyLocked(ro.Task.ID, append(slices.Clone(key), i))
		f.appendTurnLocked(prompt, mask, cm)
		forks[i] = f
	}
	return forks
}

// appendTurnLocked makes prompt (the conversation's tokens with the rendered messages, mask
// extended to match) and a sampled turn the conversation.
func (c *Chat) appendTurnLocked(prompt []int32, mask []float32, cm *Completion) {
	lp := slices.Clone(c.logprobs)
	lp = append(lp, make([]float32, len(prompt)-len(c.tokens))...)
	c.tokens = append(slices.Clone(prompt), cm.tokens...)
	c.mask = slices.Clone(mask)
	c.logprobs = append(lp, cm.logprobs...)
	for range cm.tokens {
		c.mask = append(c.mask, 1)
	}
	c.msgs = append(c.msgs, engines.Message{Role: "assistant", Content: cm.text})
	c.rendered = len(c.msgs)
	c.turns = append(c.turns, cm)
}

// promptLocked is the token ids the next turn is sampled from: the conversation so far, the
// template's end of the last sampled turn, and the messages appended since, with the generation
// prompt. It returns the loss mask of the prompt (the conversation's, then 0s) and the policy's
// context length.
func (c *Chat) promptLocked(ro *Rollout, fn string) ([]int32, []float32, int, error) {
	if len(c.turns) == 0 {
		r, err := ro.Host.Render(ro.Ctx, c.policy, []engines.RenderRequest{{Messages: c.msgs, Tools: c.tools, AddGenerationPrompt: true}})
		if err != nil {
			return nil, nil, 0, fmt.Errorf("%s: %v", fn, err)
		}
		return r.Tokens[0], make([]float32, len(r.Tokens[0])), r.MaxSeqLen, nil
	}
	reqs := []engines.RenderRequest{
		{Messages: c.msgs[:c.rendered], Tools: c.tools},
		{Messages: c.msgs, Tools: c.tools, AddGenerationPrompt: true},
	}
	if c.closing == nil {
		// Two one-turn conversations whose assistant contents differ only in their last
		// character: what follows the contents in both is the template's end of a turn.
		for _, a := range []string{"x", "y"} {
			reqs = append(reqs, engines.RenderRequest{Messages: []engines.Message{{Role: "user", Content: "u"}, {Role: "assistant", Content: a}}})
		}
	}
	r, err := ro.Host.Render(ro.Ctx, c.policy, reqs)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("%s: %v", fn, err)
	}
	if c.closing == nil {
		c.closing = commonSuffix(r.Tokens[2], r.Tokens[3])
	}
	inject := slices.Clone(c.closing)
	if last := c.turns[len(c.turns)-1].tokens; len(last) > 0 && len(inject) > 0 && last[len(last)-1] == inject[0] {
		inject = inject[1:] // the model sampled the end-of-turn token itself: it stays, as sampled
	}
	added, err := renderedAfter(r.Tokens[0], r.Tokens[1])
	if err != nil {
		return nil, nil, 0, fmt.Errorf("%s: policy %q's chat template: %v", fn, c.policy, err)
	}
	inject = append(inject, added...)
	prompt := append(slices.Clone(c.tokens), inject...)
	mask := append(slices.Clone(c.mask), make([]float32, len(inject))...)
	return prompt, mask, r.MaxSeqLen, nil
}

// renderedAfter returns the tokens that the messages appended after the last sampled turn add to
// a rendering: with, the template applied to the whole conversation with the generation prompt,
// minus without, applied to the conversation up to that turn. Most templates render a
// conversation append-only, so without is a prefix of with. Templates that render earlier turns
// differently once more follow (Qwen3 drops the <think> of assistant turns before the last user
// query, and adds an empty one to the last turn) do not: then the end of the last turn is found
// in with as the longest tail of without's differing part that occurs there (the turn's content
// and its end-of-turn tokens), and what follows its first occurrence is the new messages.
func renderedAfter(without, with []int32) ([]int32, error) {
	if len(without) <= len(with) && slices.Equal(without, with[:len(without)]) {
		return slices.Clone(with[len(without):]), nil
	}
	p := 0
	for p < len(without) && p < len(with) && without[p] == with[p] {
		p++
	}
	a, b := without[p:], with[p:]
	for k := len(a); k > 0; k-- {
		tail := a[len(a)-k:]
		for j := 0; j+k <= len(b); j++ {
			if slices.Equal(b[j:j+k], tail) {
				return slices.Clone(b[j+k:]), nil
			}
		}
	}
	return nil, fmt.Errorf("the rendering of the conversation with the new messages (%d tokens) does not contain the end of "+
		"its last assistant turn as rendered without them (%d tokens)", len(with), len(without))
}

// commonSuffix is the longest common tail of a and b.
func commonSuffix(a, b []int32) []int32 {
	k := 0
	for k < len(a) && k < len(b) && a[len(a)-1-k] == b[len(b)-1-k] {
		k++
	}
	return slices.Clone(a[len(a)-k:])
}

// conversation is the chat's sample for reward and train: the whole conversation as one
// completion (NewConversation of its turns). It is made once per length of the conversation:
// reward(chat) and then train(chat) name the same sample, and a chat that grew after reward() is
// another sample, without a reward.
func (c *Chat) conversation(fn string) (*Completion, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.turns) == 0 {
		return nil, fmt.Errorf("%s: the chat has no sampled turn (call .generate() first); only sampled tokens are trained", fn)
	}
	if c.sample != nil && len(c.sample.prompt)+len(c.sample.tokens) == len(c.tokens) {
		return c.sample, nil
	}
	if c.sample != nil {
		if _, ok := c.sample.Reward(); ok {
			return nil, fmt.Errorf("%s: the chat has %d more tokens than when reward() was given it; "+
				"reward a conversation after its last turn (or reward and train .fork()s)",
				fn, len(c.tokens)-len(c.sample.prompt)-len(c.sample.tokens))
		}
	}
	key := append(slices.Clone(c.key), len(c.tokens))
	s, err := NewConversation(c.id+"#chat"+strconv.Itoa(len(c.tokens)), key, c.turns)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", fn, err)
	}
	s.messages = slices.Clone(c.msgs)
	c.sample = s
	return s, nil
}

// NewConversation makes the sample of a conversation from its turns, in order: each turn's prompt
// must begin with the previous turn's prompt and sampled tokens (a chat's turns do). Its prompt is
// the first turn's, its response everything after it up to the end of the last turn, with loss
// mask 1 and the rollout log-probs at the turns' sampled tokens, 0 elsewhere. The host of a
// sandboxed rollout rebuilds a conversation this way from its own copies of the turns.
func NewConversation(id string, key []int, turns []*Completion) (*Completion, error) {
	if len(turns) == 0 {
		return nil, fmt.Errorf("conversation %s has no turns", id)
	}
	first, last := turns[0], turns[len(turns)-1]
	full := append(slices.Clone(last.prompt), last.tokens...)
	n := len(full) - len(first.prompt)
	s := &Completion{
		id: id, policy: first.policy, key: key, prompt: slices.Clone(first.prompt), tokens: full[len(first.prompt):],
		logprobs: make([]float32, n), mask: make([]float32, n), finish: last.finish, turns: slices.Clone(turns),
	}
	for k, t := range turns {
		if t.policy != first.policy || t.injected || len(t.logprobs) != len(t.tokens) {
			return nil, fmt.Errorf("conversation %s: turn %d (%s) is not a sampled turn of policy %q", id, k, t.id, first.policy)
		}
		if len(t.prompt)+len(t.tokens) > len(full) || !slices.Equal(full[:len(t.prompt)], t.prompt) ||
			!slices.Equal(full[len(t.prompt):len(t.prompt)+len(t.tokens)], t.tokens) {
			return nil, fmt.Errorf("conversation %s: turn %d (%s) is not part of the conversation its last turn continues", id, k, t.id)
		}
		for i := range t.tokens {
			s.mask[len(t.prompt)-len(first.prompt)+i] = 1
			s.logprobs[len(t.prompt)-len(first.prompt)+i] = t.logprobs[i]
		}
		s.text += t.text
	}
	s.versions = turnVersions(turns)
	return s, nil
}

// turnVersions are a conversation's per-token versions (Completion.versions): nil when no turn was
// continued under a newer version (rollout.partial), else each sampled token's, StepVersion for the
// turns that were not.
func turnVersions(turns []*Completion) []int32 {
	if !slices.ContainsFunc(turns, func(t *Completion) bool { return t.versions != nil }) {
		return nil
	}
	var vs []int32
	for _, t := range turns {
		if t.versions != nil {
			vs = append(vs, t.versions...)
			continue
		}
		for range t.tokens {
			vs = append(vs, StepVersion)
		}
	}
	return vs
}

// jsonEncode is json.encode of the json module.
func jsonEncode(v starlark.Value) (string, error) {
	out, err := starlark.Call(&starlark.Thread{Name: "json"}, starlarkjson.Module.Members["encode"], starlark.Tuple{v}, nil)
	if err != nil {
		return "", err
	}
	return string(out.(starlark.String)), nil
}

// printEvent writes a line the host writes for the rollout to the run's events as print does: it
// counts against sandbox.print_bytes and the rollout's maxPrintsPerRollout lines.
func (ro *Rollout) printEvent(msg string) error {
	ro.mu.Lock()
	ro.prints++
	n := ro.prints
	ro.mu.Unlock()
	if err := ro.Budget.print(len(msg)); err != nil {
		return err
	}
	switch {
	case n <= maxPrintsPerRollout:
		ro.Host.Event(fmt.Sprintf("step %d task %s: %s", ro.Step, ro.Task.ID, msg))
	case n == maxPrintsPerRollout+1:
		ro.Host.Event(fmt.Sprintf("step %d task %s: more print output dropped (limit %d lines a rollout)", ro.Step, ro.Task.ID, maxPrintsPerRollout))
	}
	return nil
}
