package openai

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"

	"github.com/slimen/slimen/engines"
)

// Generate sends each request as one HTTP request for its n samples, at most MaxConcurrency at a
// time: a request with Messages to chat/completions (the server applies its chat template), one
// with PromptTokens to completions with the token ids as the prompt. The first failure cancels
// the rest and is returned.
func (e *Engine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	if e.closed.Load() {
		return nil, e.closedErr()
	}
	for i, r := range reqs {
		err := r.Check()
		if err == nil && (len(r.Messages) == 0) == (len(r.PromptTokens) == 0) {
			err = errors.New("set exactly one of messages and prompt tokens")
		}
		if err == nil && r.Constraint != "" {
			// The server's own response_format could not keep tool calls, nor report the
			// constrained tokens' log-probs as the contract wants: not sent, refused.
			err = fmt.Errorf("a decoding constraint is not supported by an OpenAI-compatible server engine: %w", engines.ErrNotSupported)
		}
		if err != nil {
			return nil, fmt.Errorf("openai engine at %s: generate request %d (%q): %w", e.base, i, r.ID, err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make([][]engines.Completion, len(reqs))
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	for i, r := range reqs {
		if !e.acquire(ctx) {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-e.sem }()
			cs, err := e.generateOne(ctx, r)
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = fmt.Errorf("generate request %d (%q): %w", i, r.ID, err)
				}
				mu.Unlock()
				cancel()
				return
			}
			results[i] = cs
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("openai engine at %s: generate: %w", e.base, err)
	}
	var out []engines.Completion
	for _, cs := range results {
		out = append(out, cs...)
	}
	return out, nil
}

// acquire takes a slot of the concurrency cap; false (holding none) when ctx ends first.
func (e *Engine) acquire(ctx context.Context) bool {
	select {
	case e.sem <- struct{}{}:
		if ctx.Err() != nil {
			<-e.sem
			return false
		}
		return true
	case <-ctx.Done():
		return false
	}
}

// generateOne asks for one request's samples. A server that refuses by name vLLM's token-id
// fields (TokenIDs "auto"), or max_tokens in favour of max_completion_tokens (MaxTokensField
// "auto"; OpenAI's reasoning models do), is asked again without them, and the engine remembers.
func (e *Engine) generateOne(ctx context.Context, r engines.GenerateRequest) ([]engines.Completion, error) {
	for {
		plain, mct := e.plain.Load(), e.completionTokens.Load()
		cs, err := e.send(ctx, r, !plain, mct)
		var he *HTTPError
		if err == nil || !errors.As(err, &he) || (he.Status != http.StatusBadRequest && he.Status != http.StatusUnprocessableEntity) {
			return cs, err
		}
		switch {
		case !plain && e.o.TokenIDs != "vllm" && strings.Contains(he.Message, "return_to"):
			if !e.plain.Swap(true) {
				e.logf("openai engine at %s refuses vLLM's token-id fields (%s): its completions are text only", e.base, he.Message)
			}
		case !mct && e.o.MaxTokensField != "max_tokens" && strings.Contains(he.Message, "max_tokens") && strings.Contains(he.Message, "max_completion_tokens"):
			if !e.completionTokens.Swap(true) {
				e.logf("openai engine at %s refuses max_tokens (%s): sending max_completion_tokens instead", e.base, he.Message)
			}
		default:
			return cs, err
		}
	}
}

// wireSampling is the request's sampling settings on the wire, the response's length as
// max_completion_tokens when mct, else as max_tokens.
func wireSampling(model string, r engines.GenerateRequest, ids, mct bool) sampling {
	s := engines.NormalizeSampling(r.Sampling)
	n, maxTokens, temp, topP := max(r.N, 1), s.MaxTokens, s.Temperature, s.TopP
	// The seed's 64 bits travel as the signed integer the API takes; the front reads them back.
	seed := int64(s.Seed)
	w := sampling{Model: model, N: &n, Temperature: &temp, TopP: &topP,
		Stop: s.Stop, Seed: &seed, ReturnTokenIDs: ids, ReturnTokensAsTokenIDs: ids}
	if mct {
		w.MaxCompletionTokens = &maxTokens
	} else {
		w.MaxTokens = &maxTokens
	}
	return w
}

func (e *Engine) send(ctx context.Context, r engines.GenerateRequest, ids, mct bool) ([]engines.Completion, error) {
	n := max(r.N, 1)
	if len(r.Messages) > 0 {
		msgs := make([]chatMessage, len(r.Messages))
		for i, m := range r.Messages {
			msgs[i] = chatMessage{Role: m.Role, Content: textContent(m.Content)}
		}
		var resp chatResponse
		if err := e.call(ctx, http.MethodPost, e.base+"/chat/completions",
			chatRequest{sampling: wireSampling(e.o.Model, r, ids, mct), Messages: msgs, Logprobs: ids}, &resp); err != nil {
			return nil, err
		}
		out, err := e.chatCompletions(r, n, resp)
		if err != nil {
			return nil, fmt.Errorf("openai engine at %s: chat/completions: %w", e.base, err)
		}
		return out, nil
	}
	req := completionRequest{sampling: wireSampling(e.o.Model, r, ids, mct), Prompt: prompts{{ids: r.PromptTokens}}}
	if ids {
		zero := 0
		req.Logprobs = &zero // the sampled token's log-prob, no alternatives
	}
	var resp completionResponse
	if err := e.call(ctx, http.MethodPost, e.base+"/completions", req, &resp); err != nil {
		return nil, err
	}
	out, err := e.textCompletions(r, n, resp)
	if err != nil {
		return nil, fmt.Errorf("openai engine at %s: completions: %w", e.base, err)
	}
	return out, nil
}

// byIndex orders a response's choices by their index and checks there is one per sample.
func byIndex[C any](choices []C, index func(C) int, n int) ([]C, error) {
	if len(choices) != n {
		return nil, fmt.Errorf("the server answered %d choices for n = %d", len(choices), n)
	}
	out := make([]C, n)
	seen := make([]bool, n)
	for _, c := range choices {
		i := index(c)
		if i < 0 || i >= n || seen[i] {
			return nil, fmt.Errorf("the server answered a choice with index %d (n = %d) twice or out of range", i, n)
		}
		out[i], seen[i] = c, true
	}
	return out, nil
}

func finishReason(p *string) string {
	if p != nil && *p == "length" {
		return "length"
	}
	return "stop"
}

func (e *Engine) chatCompletions(r engines.GenerateRequest, n int, resp chatResponse) ([]engines.Completion, error) {
	choices, err := byIndex(resp.Choices, func(c chatChoice) int { return c.Index }, n)
	if err != nil {
		return nil, err
	}
	out := make([]engines.Completion, n)
	for i, c := range choices {
		if c.Message == nil {
			return nil, fmt.Errorf("choice %d has no message", i)
		}
		var text string
		if c.Message.Content != nil {
			text = *c.Message.Content
		}
		var lps []tokenLogprob
		if c.Logprobs != nil {
			lps = c.Logprobs.Content
		}
		toks, logprobs := e.tokens(c.TokenIDs, len(lps), func(k int) (string, float64) { return lps[k].Token, lps[k].Logprob })
		out[i] = engines.Completion{RequestID: r.ID, Index: i, PromptTokens: resp.PromptTokenIDs, Tokens: toks,
			Logprobs: logprobs, Text: text, FinishReason: finishReason(c.FinishReason)}
	}
	return out, nil
}

func (e *Engine) textCompletions(r engines.GenerateRequest, n int, resp completionResponse) ([]engines.Completion, error) {
	choices, err := byIndex(resp.Choices, func(c completionChoice) int { return c.Index }, n)
	if err != nil {
		return nil, err
	}
	out := make([]engines.Completion, n)
	for i, c := range choices {
		var lp completionLogprobs
		if c.Logprobs != nil {
			lp = *c.Logprobs
		}
		if len(lp.TokenLogprobs) != len(lp.Tokens) {
			lp.Tokens = nil
		}
		toks, logprobs := e.tokens(c.TokenIDs, len(lp.Tokens), func(k int) (string, float64) {
			if lp.TokenLogprobs[k] == nil {
				return lp.Tokens[k], 0
			}
			return lp.Tokens[k], *lp.TokenLogprobs[k]
		})
		out[i] = engines.Completion{RequestID: r.ID, Index: i, PromptTokens: slices.Clone(r.PromptTokens), Tokens: toks,
			Logprobs: logprobs, Text: c.Text, FinishReason: finishReason(c.FinishReason)}
	}
	return out, nil
}

// tokens works out a choice's response token ids and log-probabilities from what the server
// sent: ids from token_ids, else from log-prob tokens written "token_id:N"; log-probabilities
// only when there is one per token id. A server that sends neither gives text only (nil, nil).
func (e *Engine) tokens(ids []int32, nlp int, lp func(k int) (string, float64)) ([]int32, []float32) {
	if ids == nil && nlp > 0 {
		ids = make([]int32, nlp)
		for k := range nlp {
			tok, _ := lp(k)
			id, ok := parseTokenID(tok)
			if !ok {
				ids = nil
				break
			}
			ids[k] = id
		}
	}
	if ids == nil {
		return nil, nil
	}
	e.sawIDs.Store(true)
	if nlp != len(ids) {
		return ids, nil
	}
	logprobs := make([]float32, nlp)
	for k := range nlp {
		_, v := lp(k)
		logprobs[k] = float32(v)
	}
	e.sawLogprobs.Store(true)
	return ids, logprobs
}
