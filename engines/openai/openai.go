// Package openai speaks the OpenAI API in both directions.
//
// Engine is an engines.Engine backed by an OpenAI-compatible HTTP server (vLLM, SGLang,
// llama.cpp, a hosted API): it generates through /v1/chat/completions (a request with Messages)
// and /v1/completions (a request with PromptTokens, sent as a token-id prompt), with timeouts,
// retries and a concurrency cap. It cannot score, train, save or load, so it serves frozen
// policies: judges, experts, teachers. Completions carry token ids and log-probabilities when the
// server returns them (vLLM's return_token_ids, or logprobs with return_tokens_as_token_ids), and
// text only otherwise.
//
// Handler is the other direction: an OpenAI-compatible HTTP front for any engines.Engine, which
// returns token ids and log-probabilities in the same vLLM fields, so that an Engine talking to a
// Handler gets exactly the tokens the engine behind it sampled.
package openai

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slimen/slimen/engines"
)

// Options configure an Engine.
type Options struct {
	// BaseURL is the API's root including its version, as OPENAI_BASE_URL is written:
	// http://127.0.0.1:8000/v1. Plain http is allowed to any address (a key sent over it can be
	// read on the way).
	BaseURL string
	// Model is the model name sent with every request (what the server's /v1/models lists).
	Model string
	// APIKey is sent as "Authorization: Bearer KEY" when not empty.
	APIKey string
	// Timeout bounds one HTTP attempt (a whole response, not only its first byte); 0: 10 minutes.
	Timeout time.Duration
	// MaxRetries is how often a failed attempt is retried (429, 5xx, 408, a timeout, a broken
	// connection); 0: 4; negative: never.
	MaxRetries int
	// MaxConcurrency caps the HTTP requests in flight at once; 0: 32.
	MaxConcurrency int
	// MinBackoff and MaxBackoff bound the exponential wait between attempts (with jitter);
	// 0: 500 ms and 30 s. A Retry-After (or retry-after-ms) header sets the wait instead, up to
	// MaxRetryAfter.
	MinBackoff, MaxBackoff time.Duration
	// MaxRetryAfter caps the wait a server's Retry-After asks for; 0: 2 minutes.
	MaxRetryAfter time.Duration
	// TokenIDs says whether to ask for vLLM's token-id fields (return_token_ids,
	// return_tokens_as_token_ids): "auto" or "" asks, and stops asking once a server refuses them
	// by name (the OpenAI API does: "Unrecognized request argument"); "vllm" always asks; "none"
	// never asks, and completions are text only.
	TokenIDs string
	// MaxTokensField names the field the response's length travels in: "auto" or "" sends
	// max_tokens, and max_completion_tokens from the first time the server refuses max_tokens
	// by name (OpenAI's reasoning models do); "max_tokens" or "max_completion_tokens" always
	// sends that one.
	MaxTokensField string
	// HTTPClient sends the requests; nil: a client of its own.
	HTTPClient *http.Client
	// Logf reports what the engine learns about the server (that it refused the token-id
	// fields); nil: silent.
	Logf func(format string, args ...any)
}

// Engine is an engines.Engine on an OpenAI-compatible server. It is safe for concurrent use.
type Engine struct {
	o      Options
	base   string // BaseURL without a trailing slash
	root   string // base without its /v1, where vLLM serves /tokenize
	client *http.Client
	sem    chan struct{}

	plain            atomic.Bool  // the server refused the token-id fields
	completionTokens atomic.Bool  // max_completion_tokens is sent instead of max_tokens
	sawIDs           atomic.Bool  // a response carried token ids
	sawLogprobs      atomic.Bool  // … and their log-probabilities
	maxModelLen      atomic.Int64 // from /v1/models (vLLM), 0 when unknown
	closed           atomic.Bool
	closeOnce        sync.Once
}

var _ engines.Engine = (*Engine)(nil)

// New returns an Engine for the server at o.BaseURL without contacting it; Open also checks that
// the server answers and serves the model.
func New(o Options) (*Engine, error) {
	u, err := url.Parse(o.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("openai engine: base_url %q: want an http:// or https:// URL such as http://127.0.0.1:8000/v1", o.BaseURL)
	}
	if o.Model == "" {
		return nil, fmt.Errorf("openai engine at %s: model is empty; set it to a name the server's /v1/models lists", o.BaseURL)
	}
	switch o.TokenIDs {
	case "", "auto", "vllm", "none":
	default:
		return nil, fmt.Errorf("openai engine at %s: token_ids %q is not one of auto, vllm, none", o.BaseURL, o.TokenIDs)
	}
	switch o.MaxTokensField {
	case "", "auto", "max_tokens", "max_completion_tokens":
	default:
		return nil, fmt.Errorf("openai engine at %s: max_tokens_field %q is not one of auto, max_tokens, max_completion_tokens", o.BaseURL, o.MaxTokensField)
	}
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Minute
	}
	if o.MaxRetries == 0 {
		o.MaxRetries = 4
	} else if o.MaxRetries < 0 {
		o.MaxRetries = 0
	}
	if o.MaxConcurrency <= 0 {
		o.MaxConcurrency = 32
	}
	if o.MinBackoff <= 0 {
		o.MinBackoff = 500 * time.Millisecond
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = 30 * time.Second
	}
	o.MaxBackoff = max(o.MaxBackoff, o.MinBackoff)
	if o.MaxRetryAfter <= 0 {
		o.MaxRetryAfter = 2 * time.Minute
	}
	client := o.HTTPClient
	if client == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = o.MaxConcurrency
		client = &http.Client{Transport: t}
	}
	base := strings.TrimRight(o.BaseURL, "/")
	e := &Engine{o: o, base: base, root: strings.TrimSuffix(base, "/v1"), client: client, sem: make(chan struct{}, o.MaxConcurrency)}
	e.plain.Store(o.TokenIDs == "none")
	e.completionTokens.Store(o.MaxTokensField == "max_completion_tokens")
	return e, nil
}

// Open returns an Engine after checking that the server answers GET /v1/models and lists
// o.Model, so that a wrong address, key or model name fails at start-up rather than at the first
// generate.
func Open(ctx context.Context, o Options) (*Engine, error) {
	e, err := New(o)
	if err != nil {
		return nil, err
	}
	if err := e.checkModel(ctx); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Engine) checkModel(ctx context.Context) error {
	var list modelList
	if err := e.call(ctx, http.MethodGet, e.base+"/models", nil, &list); err != nil {
		return err
	}
	var names []string
	for _, m := range list.Data {
		if m.ID == e.o.Model {
			e.maxModelLen.Store(int64(m.MaxModelLen))
			return nil
		}
		names = append(names, m.ID)
	}
	return fmt.Errorf("openai engine at %s does not serve model %q; its /v1/models lists: %s", e.base, e.o.Model, strings.Join(names, ", "))
}

// BaseURL returns the server's API root, as the engine names it in errors.
func (e *Engine) BaseURL() string { return e.base }

// Info describes the model as far as the server tells: its name, its context length (when its
// /v1/models reports max_model_len, as vLLM does) and the capabilities: "generate", plus
// "token_ids" and "logprobs" once a response carried them.
func (e *Engine) Info(ctx context.Context) (engines.Info, error) {
	if e.closed.Load() {
		return engines.Info{}, e.closedErr()
	}
	caps := []string{"generate"}
	if e.sawIDs.Load() {
		caps = append(caps, "token_ids")
	}
	if e.sawLogprobs.Load() {
		caps = append(caps, "logprobs")
	}
	return engines.Info{Model: e.o.Model, MaxSeqLen: int(e.maxModelLen.Load()), Devices: []string{e.base}, Capabilities: caps}, nil
}

func (e *Engine) unsupported(op string) error {
	return fmt.Errorf("openai engine at %s: %s: %w: "+
		"an OpenAI-compatible server only generates, so a policy on it is frozen (trainable: false)", e.base, op, engines.ErrNotSupported)
}

// Score is not part of the OpenAI API.
func (e *Engine) Score(context.Context, []engines.ScoreRequest) ([]engines.Scores, error) {
	return nil, e.unsupported("score")
}

// Train is not part of the OpenAI API.
func (e *Engine) Train(context.Context, engines.Batch) (engines.TrainStats, error) {
	return engines.TrainStats{}, e.unsupported("train")
}

// Save is not part of the OpenAI API.
func (e *Engine) Save(context.Context, string) error { return e.unsupported("save") }

// Load is not part of the OpenAI API.
func (e *Engine) Load(context.Context, string) error { return e.unsupported("load") }

// Tokenize asks the server's /tokenize (at the root, beside /v1: vLLM and slimen serve --openai
// have it), one text per request, without special tokens. A server without it answers
// engines.ErrNotSupported.
func (e *Engine) Tokenize(ctx context.Context, texts []string) ([][]int32, error) {
	if e.closed.Load() {
		return nil, e.closedErr()
	}
	out := make([][]int32, len(texts))
	for i, t := range texts {
		var r tokenizeResponse
		err := e.call(ctx, http.MethodPost, e.root+"/tokenize", tokenizeRequest{Model: e.o.Model, Prompt: t}, &r)
		var he *HTTPError
		if asHTTPError(err, &he) && (he.Status == http.StatusNotFound || he.Status == http.StatusMethodNotAllowed) {
			return nil, fmt.Errorf("openai engine at %s: tokenize: the server has no %s/tokenize (HTTP %d): %w", e.base, e.root, he.Status, engines.ErrNotSupported)
		}
		if err != nil {
			return nil, err
		}
		out[i] = r.Tokens
		if out[i] == nil {
			out[i] = []int32{}
		}
	}
	return out, nil
}

// Close makes later calls fail and closes idle connections.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		e.closed.Store(true)
		e.client.CloseIdleConnections()
	})
	return nil
}

func (e *Engine) closedErr() error {
	return fmt.Errorf("openai engine at %s is closed", e.base)
}

func (e *Engine) logf(format string, args ...any) {
	if e.o.Logf != nil {
		e.o.Logf(format, args...)
	}
}
