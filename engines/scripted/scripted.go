// Package scripted is an engine whose completions come from a Go function instead of a model. The
// host's tests run topologies on it, and users unit-test their scripts' reward logic with it
// (`slimen test`): what a policy "says" is fixed, so every reward and advantage can be checked by
// hand. It tokenizes bytewise (token = byte value, 256 = end of response) and records every
// request and training batch it receives.
package scripted

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/slimen/slimen/engines"
)

// EOS is the token that ends every scripted response.
const EOS = 256

// Request is what a Responder sees of one sample to produce.
type Request struct {
	Messages []engines.Message // the chat prompt (nil when the request carried tokens)
	Prompt   string            // the rendered prompt text
	Index    int               // sample index within the request
	Seed     uint64
}

// Responder returns the text of one completion.
type Responder func(Request) string

// Engine is a scripted engine. The zero value is not usable: make one with New.
type Engine struct {
	respond Responder
	// Logprob is the log-probability reported for every generated or scored token.
	Logprob float32
	// Value is what Values reports for every token: a scripted PPO critic.
	Value float32

	mu      sync.Mutex
	calls   [][]engines.GenerateRequest
	batches []engines.Batch
	saved   int
}

// New returns an engine answering with respond.
func New(respond Responder) *Engine {
	return &Engine{respond: respond, Logprob: -0.5}
}

// Echo returns an engine that answers every prompt with the fixed text.
func Echo(text string) *Engine {
	return New(func(Request) string { return text })
}

// Render is the scripted chat template: "role: content" lines, then "assistant: ".
func Render(msgs []engines.Message) string { return RenderChat(msgs, true) }

// RenderChat is the scripted chat template with or without the generation prompt.
func RenderChat(msgs []engines.Message, addGenerationPrompt bool) string {
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "%s: %s\n", m.Role, m.Content)
	}
	if addGenerationPrompt {
		b.WriteString("assistant: ")
	}
	return b.String()
}

// LastMessage is the content of the last message of a prompt rendered with RenderChat and the
// generation prompt: what a request that carries tokens (a chat turn) answers. A content line
// that itself begins with "user: " (or another role) is taken for the message's start.
func LastMessage(prompt string) string {
	p := strings.TrimSuffix(strings.TrimSuffix(prompt, "assistant: "), "\n")
	start := 0
	for _, role := range []string{"system", "user", "assistant", "tool"} {
		if k := strings.LastIndex("\n"+p, "\n"+role+": "); k >= 0 && k+len(role)+2 > start {
			start = k + len(role) + 2
		}
	}
	return p[start:]
}

// Render encodes each request's messages rendered with the scripted template (tools, when given,
// as one "tools: …" line first).
func (e *Engine) Render(_ context.Context, reqs []engines.RenderRequest) ([][]int32, error) {
	out := make([][]int32, len(reqs))
	for i, r := range reqs {
		text := RenderChat(r.Messages, r.AddGenerationPrompt)
		if len(r.Tools) > 0 {
			text = "tools: " + strings.Join(r.Tools, " ") + "\n" + text
		}
		out[i] = Encode(text)
	}
	return out, nil
}

// Encode tokenizes text bytewise.
func Encode(s string) []int32 {
	out := make([]int32, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = int32(s[i])
	}
	return out
}

// Decode turns bytewise tokens back into text, dropping EOS.
func Decode(toks []int32) string {
	b := make([]byte, 0, len(toks))
	for _, t := range toks {
		if t >= 0 && t < 256 {
			b = append(b, byte(t))
		}
	}
	return string(b)
}

// Calls returns the Generate batches received so far, one slice per call.
func (e *Engine) Calls() [][]engines.GenerateRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([][]engines.GenerateRequest(nil), e.calls...)
}

// Batches returns the training batches received so far.
func (e *Engine) Batches() []engines.Batch {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]engines.Batch(nil), e.batches...)
}

// Info describes the scripted model: bytes for tokens, one EOS, a context no test reaches.
func (e *Engine) Info(context.Context) (engines.Info, error) {
	return engines.Info{
		Model: "scripted", Architecture: "scripted", VocabSize: 257, MaxSeqLen: 1 << 20,
		EOSTokens: []int32{EOS}, Devices: []string{"cpu"},
		Capabilities: []string{"generate", "score", "train"},
	}, nil
}

// Generate records the requests and answers each sample with the engine's function, cut at the
// first stop string and at max_tokens, every token with log-prob e.Logprob.
func (e *Engine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	e.mu.Lock()
	e.calls = append(e.calls, append([]engines.GenerateRequest(nil), reqs...))
	e.mu.Unlock()
	var out []engines.Completion
	for _, r := range reqs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := r.Check(); err != nil {
			return nil, fmt.Errorf("request %s: %w", r.ID, err)
		}
		s := engines.NormalizeSampling(r.Sampling)
		prompt, promptToks := Decode(r.PromptTokens), r.PromptTokens
		if r.Messages != nil {
			prompt = Render(r.Messages)
			promptToks = Encode(prompt)
		}
		n := max(r.N, 1)
		for i := 0; i < n; i++ {
			text := e.respond(Request{Messages: r.Messages, Prompt: prompt, Index: i, Seed: r.Seed})
			finish := "stop"
			for _, st := range s.Stop {
				if k := strings.Index(text, st); st != "" && k >= 0 {
					text = text[:k]
				}
			}
			toks := Encode(text)
			if len(toks) >= s.MaxTokens {
				toks, finish = toks[:s.MaxTokens], "length"
				text = Decode(toks)
			} else {
				toks = append(toks, EOS)
			}
			lp := make([]float32, len(toks))
			for j := range lp {
				lp[j] = e.Logprob
			}
			out = append(out, engines.Completion{
				RequestID: r.ID, Index: i, PromptTokens: promptToks, Tokens: toks,
				Logprobs: lp, Text: text, FinishReason: finish,
			})
		}
	}
	return out, nil
}

// Score gives every token the log-prob e.Logprob.
func (e *Engine) Score(_ context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	out := make([]engines.Scores, len(reqs))
	for i, r := range reqs {
		lp := make([]float32, len(r.Tokens))
		for j := range lp {
			lp[j] = e.Logprob
		}
		out[i] = engines.Scores{Logprobs: lp}
	}
	return out, nil
}

// Values answers like a critic whose every estimate is e.Value.
func (e *Engine) Values(_ context.Context, reqs []engines.ScoreRequest) ([][]float32, error) {
	out := make([][]float32, len(reqs))
	for i, r := range reqs {
		out[i] = make([]float32, len(r.Tokens))
		for j := range out[i] {
			out[i][j] = e.Value
		}
	}
	return out, nil
}

// Train records the batch and reports the token-mean of −A·mask as its loss, which is the policy
// loss at ratio 1: enough for tests to see that advantages reached the engine.
func (e *Engine) Train(_ context.Context, b engines.Batch) (engines.TrainStats, error) {
	e.mu.Lock()
	e.batches = append(e.batches, b)
	e.mu.Unlock()
	var sum float64
	var n int
	for _, s := range b.Samples {
		for t, a := range s.Advantages {
			if s.LossMask == nil || s.LossMask[t] > 0 {
				sum += -float64(a)
				n++
			}
		}
	}
	st := engines.TrainStats{Tokens: n}
	if n > 0 {
		st.Loss, st.PGLoss = sum/float64(n), sum/float64(n)
	}
	return st, nil
}

// Tokenize encodes each text as Encode does.
func (e *Engine) Tokenize(_ context.Context, texts []string) ([][]int32, error) {
	out := make([][]int32, len(texts))
	for i, t := range texts {
		out[i] = Encode(t)
	}
	return out, nil
}

// Save writes a marker file so that checkpoint code has something to find.
func (e *Engine) Save(_ context.Context, dir string) error {
	e.mu.Lock()
	e.saved++
	n := len(e.batches)
	e.mu.Unlock()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "scripted.txt"), []byte(fmt.Sprintf("trained batches: %d\n", n)), 0o644)
}

// Load checks that dir holds the marker file Save writes; it loads nothing else.
func (e *Engine) Load(_ context.Context, dir string) error {
	if _, err := os.Stat(filepath.Join(dir, "scripted.txt")); err != nil {
		return fmt.Errorf("load scripted engine: %w", err)
	}
	return nil
}

// Close has nothing to release.
func (e *Engine) Close() error { return nil }

var (
	_ engines.Engine   = (*Engine)(nil)
	_ engines.Valuer   = (*Engine)(nil)
	_ engines.Renderer = (*Engine)(nil)
)
