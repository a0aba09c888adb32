package script

import (
	"fmt"
	"sync"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// Completion is what generate returns to a script: one sampled response of one policy. Its fields
// are immutable; its reward is set once by reward() (host-side state, not a Starlark attribute
// assignment), and train() queues it at most once.
type Completion struct {
	id       string
	policy   string
	messages []engines.Message
	prompt   []int32
	tokens   []int32
	logprobs []float32
	text     string
	finish   string
	key      []int // deterministic order within its rollout
	injected bool  // made by completion(), not sampled: it cannot be trained
	// mask is the loss mask of tokens; nil: every token was sampled (a generate call). A
	// conversation's sample (chat) has 0 at the tokens rendered between its turns.
	mask  []float32
	turns []*Completion // a conversation's sampled turns
	// versions, per token, are the weights versions that sampled it when a partial rollout
	// continued it under a newer one (engines.Completion.Versions); nil: its step's version.
	// A conversation's sample has one per sampled token (mask 1), in order, once one of its turns
	// was continued; StepVersion stands for the tokens of its other turns.
	versions []int32

	mu      sync.Mutex
	reward  float64
	rewSet  bool
	trained bool
}

var (
	_ starlark.HasAttrs = (*Completion)(nil)
	_ starlark.Value    = (*Completion)(nil)
)

// String shows the completion's policy and text.
func (c *Completion) String() string {
	return fmt.Sprintf("completion(policy=%q, text=%q)", c.policy, c.text)
}

// Type is "completion".
func (c *Completion) Type() string { return "completion" }

// Freeze does nothing: a completion's fields are immutable, and its reward is host-side state.
func (c *Completion) Freeze() {}

// Truth is true, even for an empty text.
func (c *Completion) Truth() starlark.Bool { return true }

// Hash is the hash of the completion's id, so that completions can key a dict.
func (c *Completion) Hash() (uint32, error) { return starlark.String(c.id).Hash() }

// Reward returns the reward set by reward(), if any.
func (c *Completion) Reward() (float64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reward, c.rewSet
}

// Text is the decoded response.
func (c *Completion) Text() string { return c.text }

// Policy is the policy that produced the completion.
func (c *Completion) Policy() string { return c.policy }

// ID is the completion's id, "TASK/CALL#i": the same in every run of the same seed.
func (c *Completion) ID() string { return c.id }

// Messages is the prompt the completion answers.
func (c *Completion) Messages() []engines.Message { return c.messages }

// PromptTokens are the prompt's token ids as the engine encoded it.
func (c *Completion) PromptTokens() []int32 { return c.prompt }

// Tokens are the response's token ids.
func (c *Completion) Tokens() []int32 { return c.tokens }

// Logprobs are the sampling log-probabilities of Tokens.
func (c *Completion) Logprobs() []float32 { return c.logprobs }

// LossMask is 1 at the tokens that were sampled and are trained, 0 at injected ones (the
// messages rendered between a conversation's turns): all ones for a generate call's completion.
func (c *Completion) LossMask() []float32 {
	if c.mask != nil {
		return c.mask
	}
	m := make([]float32, len(c.tokens))
	for i := range m {
		m[i] = 1
	}
	return m
}

// Versions returns, per token, the weights version that sampled it when the generation was
// continued under a newer version (rollout.partial); nil: all from its step's version.
func (c *Completion) Versions() []int32 { return c.versions }

// StepVersion in a conversation's Versions stands for the version its rollout's step sampled from
// (a turn that was not continued records no versions of its own).
const StepVersion = -1

// Turns are the sampled turns of a conversation's sample (chat), in order; nil for others.
func (c *Completion) Turns() []*Completion { return c.turns }

// Key is the completion's position in its rollout's call tree (the order of samples).
func (c *Completion) Key() []int { return c.key }

// Conversation says whether c is a chat's sample (its tokens hold injected messages).
func (c *Completion) Conversation() bool { return c.mask != nil }

// FinishReason is "stop" or "length".
func (c *Completion) FinishReason() string { return c.finish }

// Before says whether c was made before d in their rollout's call tree: the order of samples
// and of traces, whatever the order the calls were scheduled in.
func (c *Completion) Before(d *Completion) bool { return lessKey(c.key, d.key) }

var completionAttrs = []string{"finish_reason", "id", "logprobs", "policy", "prompt_tokens", "reward", "text", "tokens"}

// AttrNames lists the completion's fields.
func (c *Completion) AttrNames() []string { return completionAttrs }

// Attr returns the field called name.
func (c *Completion) Attr(name string) (starlark.Value, error) {
	switch name {
	case "text":
		return starlark.String(c.text), nil
	case "policy":
		return starlark.String(c.policy), nil
	case "id":
		return starlark.String(c.id), nil
	case "finish_reason":
		return starlark.String(c.finish), nil
	case "prompt_tokens":
		return starlark.MakeInt(len(c.prompt)), nil
	case "tokens":
		t := make(starlark.Tuple, len(c.tokens))
		for i, x := range c.tokens {
			t[i] = starlark.MakeInt(int(x))
		}
		return t, nil
	case "logprobs":
		t := make(starlark.Tuple, len(c.logprobs))
		for i, x := range c.logprobs {
			t[i] = starlark.Float(x)
		}
		return t, nil
	case "reward":
		if r, ok := c.Reward(); ok {
			return starlark.Float(r), nil
		}
		return starlark.None, nil
	}
	return nil, nil
}

// lessKey orders call-tree positions.
func lessKey(a, b []int) bool {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return len(a) < len(b)
}

func builtinCompletion(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var policy, text string
	finish := "stop"
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "policy", &policy, "text", &text, "finish_reason?", &finish); err != nil {
		return nil, err
	}
	id := "injected"
	var key []int
	if ts, _ := thread.Local(threadLocal).(*threadState); ts != nil {
		key = ts.next()
		id = ts.ro.Task.ID + "/" + keyString(key) + "#injected"
	}
	return &Completion{id: id, policy: policy, text: text, finish: finish, injected: true, key: key}, nil
}
