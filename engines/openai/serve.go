package openai

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
)

// HandlerOptions configure a Handler.
type HandlerOptions struct {
	// Model is the model name the front serves (what /v1/models lists and requests must name);
	// "": the engine's Info().Model.
	Model string
	// Aliases are other names requests may give for Model (`slimen serve --config C --policy P`
	// answers to the policy's name too).
	Aliases []string
	// Token, when not empty, is the API key every request must send as "Authorization: Bearer
	// TOKEN".
	Token string
	// DefaultMaxTokens is max_tokens when a request leaves it out; 0: the engine's context length
	// (Info().MaxSeqLen; the engine stops there), or 1024 if the engine does not say.
	DefaultMaxTokens int
	// Decode, when not nil, gives the text of one token for the "token" of log-probabilities;
	// nil (or a request with return_tokens_as_token_ids): tokens are written "token_id:N".
	Decode func(id int32) string
	// MaxRequestBytes bounds a request body; 0: 64 MiB.
	MaxRequestBytes int64
	// Logf reports failed engine calls; nil: silent.
	Logf func(format string, args ...any)
}

// handler is the OpenAI-compatible front of one engine.
type handler struct {
	eng       engines.Engine
	o         HandlerOptions
	created   int64
	maxSeqLen int // the engine's context length, reported as vLLM's max_model_len
	backend   ChatBackend
	anyModel  bool // requests may name any model (a chat backend's front)
}

// NewHandler returns an OpenAI-compatible HTTP front for eng: POST /v1/chat/completions (with
// streaming), POST /v1/completions (a string or token-id prompt, or a list of them), GET
// /v1/models, and vLLM's POST /tokenize. Token ids and log-probabilities travel in vLLM's fields
// (return_token_ids, logprobs with return_tokens_as_token_ids), so that an Engine of this package
// pointed at the front gets exactly the tokens eng sampled. Errors are the API's error JSON. It
// asks eng for its Info once, here.
func NewHandler(ctx context.Context, eng engines.Engine, o HandlerOptions) (http.Handler, error) {
	info, err := eng.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("openai front: engine info: %w", err)
	}
	if o.Model == "" {
		o.Model = info.Model
	}
	if o.DefaultMaxTokens <= 0 {
		o.DefaultMaxTokens = info.MaxSeqLen
		if o.DefaultMaxTokens <= 0 {
			o.DefaultMaxTokens = 1024
		}
	}
	if o.MaxRequestBytes <= 0 {
		o.MaxRequestBytes = 64 << 20
	}
	h := &handler{eng: eng, o: o, created: time.Now().Unix(), maxSeqLen: info.MaxSeqLen}
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/chat/completions", h.only(http.MethodPost, h.chat))
	mux.HandleFunc("/v1/completions", h.only(http.MethodPost, h.completions))
	mux.HandleFunc("/v1/models", h.only(http.MethodGet, h.models))
	mux.HandleFunc("/v1/models/{id...}", h.only(http.MethodGet, h.model))
	mux.HandleFunc("/tokenize", h.only(http.MethodPost, h.tokenize))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", "", "no such endpoint: %s %s; this server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models and POST /tokenize", r.Method, r.URL.Path)
	})
	return h.auth(mux), nil
}

// apiErr is an error answered to the client: its status, type and parameter.
type apiErr struct {
	status int
	typ    string
	param  string
	msg    string
}

func (e *apiErr) Error() string { return e.msg }

func badRequest(param, format string, args ...any) *apiErr {
	return &apiErr{http.StatusBadRequest, "invalid_request_error", param, fmt.Sprintf(format, args...)}
}

func writeError(w http.ResponseWriter, status int, typ, param, format string, args ...any) {
	body := errorBody{Error: apiError{Message: fmt.Sprintf(format, args...), Type: typ, Code: nil}}
	if param != "" {
		body.Error.Param = &param
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body)
}

func (h *handler) fail(w http.ResponseWriter, err error) {
	var ae *apiErr
	if errors.As(err, &ae) {
		writeError(w, ae.status, ae.typ, ae.param, "%s", ae.msg)
		return
	}
	var be *APIError
	if errors.As(err, &be) {
		writeError(w, be.Status, be.Type, "", "%s", be.Msg)
		return
	}
	if h.o.Logf != nil {
		h.o.Logf("openai front: %v", err)
	}
	status := http.StatusInternalServerError
	if errors.Is(err, engines.ErrNotSupported) {
		status = http.StatusNotImplemented
	}
	writeError(w, status, "server_error", "", "%v", err)
}

func (h *handler) auth(next http.Handler) http.Handler {
	if h.o.Token == "" {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		// Constant time, so that the time a rejection takes says nothing about the key.
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(h.o.Token)) != 1 {
			writeError(w, http.StatusUnauthorized, "invalid_request_error", "", "this server needs the API key of its --token-env as \"Authorization: Bearer KEY\" (OPENAI_API_KEY for the openai client); the request carried none or another")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (h *handler) only(method string, f http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != method {
			w.Header().Set("Allow", method)
			writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "", "%s takes %s, not %s", r.URL.Path, method, r.Method)
			return
		}
		f(w, r)
	}
}

// decode reads a JSON request body into v.
func (h *handler) decode(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, h.o.MaxRequestBytes)
	if err := json.NewDecoder(body).Decode(v); err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return &apiErr{http.StatusRequestEntityTooLarge, "invalid_request_error", "", fmt.Sprintf("the request is over %d bytes", mb.Limit)}
		}
		return badRequest("", "the request body is not the JSON expected: %v", err)
	}
	return nil
}

// serves says whether a request's model names this front's: Model or one of its Aliases.
func (h *handler) serves(name string) bool {
	return name == h.o.Model || slices.Contains(h.o.Aliases, name)
}

// models lists Model, then its Aliases (as vLLM lists each --served-model-name).
func (h *handler) models(w http.ResponseWriter, r *http.Request) {
	list := []modelInfo{h.modelInfo(h.o.Model)}
	for _, a := range h.o.Aliases {
		list = append(list, h.modelInfo(a))
	}
	writeJSON(w, modelList{Object: "list", Data: list})
}

func (h *handler) model(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !h.serves(id) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "model", "the model %q does not exist; this server serves %q", id, h.o.Model)
		return
	}
	writeJSON(w, h.modelInfo(id))
}

func (h *handler) modelInfo(id string) modelInfo {
	return modelInfo{ID: id, Object: "model", Created: h.created, OwnedBy: "slimen", MaxModelLen: h.maxSeqLen}
}

func (h *handler) tokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if err := h.decode(w, r, &req); err != nil {
		h.fail(w, err)
		return
	}
	ids, err := h.eng.Tokenize(r.Context(), []string{req.Prompt})
	if err != nil {
		h.fail(w, err)
		return
	}
	writeJSON(w, tokenizeResponse{Tokens: ids[0], Count: len(ids[0])})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

// extras are request fields the front refuses rather than ignores, because the engines cannot
// honour them.
type extras struct {
	Tools            json.RawMessage `json:"tools"`
	FrequencyPenalty *float64        `json:"frequency_penalty"`
	PresencePenalty  *float64        `json:"presence_penalty"`
	LogitBias        map[string]any  `json:"logit_bias"`
}

func (x extras) check() error {
	switch {
	case len(x.Tools) > 0 && string(x.Tools) != "null" && string(x.Tools) != "[]":
		return badRequest("tools", "tools are not supported by this server")
	case x.FrequencyPenalty != nil && *x.FrequencyPenalty != 0:
		return badRequest("frequency_penalty", "frequency_penalty is not supported by this server; leave it 0")
	case x.PresencePenalty != nil && *x.PresencePenalty != 0:
		return badRequest("presence_penalty", "presence_penalty is not supported by this server; leave it 0")
	case len(x.LogitBias) > 0:
		return badRequest("logit_bias", "logit_bias is not supported by this server")
	}
	return nil
}

// request turns the shared settings into an engine request: the API's defaults (temperature 1,
// top_p 1, n 1, a random seed) where the request says nothing.
func (h *handler) request(s sampling) (engines.GenerateRequest, error) {
	if s.Model != "" && !h.serves(s.Model) && !h.anyModel {
		return engines.GenerateRequest{}, &apiErr{http.StatusNotFound, "invalid_request_error", "model",
			fmt.Sprintf("the model %q does not exist; this server serves %q", s.Model, h.o.Model)}
	}
	r := engines.GenerateRequest{ID: newID(""), N: 1, Sampling: engines.Sampling{MaxTokens: h.o.DefaultMaxTokens, Temperature: 1, TopP: 1, Stop: s.Stop}}
	if s.N != nil {
		if *s.N < 1 || *s.N > 128 {
			return r, badRequest("n", "n = %d; want 1 to 128", *s.N)
		}
		r.N = *s.N
	}
	if s.MaxCompletionTokens != nil {
		r.MaxTokens = *s.MaxCompletionTokens
	} else if s.MaxTokens != nil {
		r.MaxTokens = *s.MaxTokens
	}
	if s.Temperature != nil {
		r.Temperature = *s.Temperature
	}
	if s.TopP != nil {
		r.TopP = *s.TopP
	}
	if s.Seed != nil {
		r.Seed = uint64(*s.Seed) // the client's int64(seed), read back bit for bit
	} else {
		var b [8]byte
		rand.Read(b[:])
		r.Seed = binary.LittleEndian.Uint64(b[:])
	}
	if err := r.Check(); err != nil {
		return r, badRequest("", "%v", err)
	}
	if r.TopP == 0 {
		return r, badRequest("top_p", "top_p 0; want a value in (0, 1]")
	}
	return r, nil
}

func newID(prefix string) string {
	var b [12]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// tokenText is how a token appears in log-probabilities.
func (h *handler) tokenText(id int32, asIDs bool) string {
	if asIDs || h.o.Decode == nil {
		return tokenIDString(id)
	}
	return h.o.Decode(id)
}

func bytesOf(s string) []int {
	out := make([]int, len(s))
	for i := range len(s) {
		out[i] = int(s[i])
	}
	return out
}

func ptr[T any](v T) *T { return &v }

func (h *handler) chat(w http.ResponseWriter, r *http.Request) {
	var req struct {
		chatRequest
		extras
	}
	if err := h.decode(w, r, &req); err != nil {
		h.fail(w, err)
		return
	}
	gr, err := h.request(req.sampling)
	tools := req.extras.Tools
	if h.backend != nil {
		req.extras.Tools = nil // a backend takes tools
	}
	if err == nil {
		err = req.extras.check()
	}
	if err == nil && len(req.Messages) == 0 {
		err = badRequest("messages", "messages is empty")
	}
	if err == nil && req.TopLogprobs != nil && *req.TopLogprobs > 0 {
		err = badRequest("top_logprobs", "top_logprobs = %d: this server returns the sampled token's log-prob only; leave top_logprobs 0", *req.TopLogprobs)
	}
	if err != nil {
		h.fail(w, err)
		return
	}
	for _, m := range req.Messages {
		gr.Messages = append(gr.Messages, engines.Message{Role: m.Role, Content: string(m.Content)})
	}
	id := "chatcmpl-" + gr.ID
	gr.ID = id
	generate := func(ctx context.Context) ([]engines.Completion, error) {
		return h.eng.Generate(ctx, []engines.GenerateRequest{gr})
	}
	withTools := false
	if h.backend != nil {
		call := ChatCall{Request: gr, Stream: req.Stream}
		if req.MaxCompletionTokens != nil {
			call.MaxTokens = *req.MaxCompletionTokens
		} else if req.MaxTokens != nil {
			call.MaxTokens = *req.MaxTokens
		}
		if call.Messages, err = chatMessages(req.Messages); err == nil {
			call.Tools, err = toolsOf(tools)
		}
		if err != nil {
			h.fail(w, err)
			return
		}
		withTools = len(call.Tools) > 0
		generate = func(ctx context.Context) ([]engines.Completion, error) { return h.backend(ctx, call) }
	}
	// message is a sampled turn as the answer's message: with tools offered, its Hermes tool
	// calls become tool_calls (finish_reason "tool_calls").
	message := func(c engines.Completion) (responseMessage, string) {
		msg := responseMessage{Role: "assistant", Content: ptr(c.Text)}
		if !withTools {
			return msg, c.FinishReason
		}
		am := AssistantMessage(c.Text, true)
		if len(am.ToolCalls) == 0 {
			return msg, c.FinishReason
		}
		msg.Content = nil
		if am.Content != "" {
			msg.Content = &am.Content
		}
		for _, tc := range am.ToolCalls {
			wc := wireToolCall{ID: newID("call_"), Type: "function"}
			wc.Function.Name = tc.Name
			wc.Function.Arguments, _ = json.Marshal(tc.Arguments)
			msg.ToolCalls = append(msg.ToolCalls, wc)
		}
		return msg, "tool_calls"
	}
	choice := func(c engines.Completion) chatChoice {
		ch := chatChoice{Index: c.Index, FinishReason: ptr(c.FinishReason)}
		if req.Logprobs {
			ch.Logprobs = &chatLogprobs{Content: make([]tokenLogprob, 0, len(c.Tokens))}
			for k, t := range c.Tokens {
				tok := h.tokenText(t, req.ReturnTokensAsTokenIDs)
				lp := tokenLogprob{Token: tok, Bytes: bytesOf(tok), TopLogprobs: []tokenLogprob{}}
				if k < len(c.Logprobs) {
					lp.Logprob = float64(c.Logprobs[k])
				}
				ch.Logprobs.Content = append(ch.Logprobs.Content, lp)
			}
		}
		if req.ReturnTokenIDs {
			ch.TokenIDs = nonNil(c.Tokens)
		}
		return ch
	}
	head := chatResponse{ID: id, Object: "chat.completion", Created: time.Now().Unix(), Model: h.o.Model}
	if req.Stream {
		head.Object = "chat.completion.chunk"
		sw := startStream(w)
		for i := range gr.N {
			c := head
			c.Choices = []chatChoice{{Index: i, Delta: &responseMessage{Role: "assistant", Content: ptr("")}}}
			sw.send(c)
		}
		comps, err := generate(r.Context())
		if err != nil {
			sw.fail(h, err)
			return
		}
		for _, comp := range comps {
			c := head
			ch := choice(comp)
			msg, finish := message(comp)
			fin := &finish
			msg.Role = ""
			for k := range msg.ToolCalls {
				msg.ToolCalls[k].Index = ptr(k)
			}
			if msg.Content == nil {
				msg.Content = ptr("")
			}
			ch.FinishReason, ch.Delta = nil, &msg
			c.Choices = []chatChoice{ch}
			if req.ReturnTokenIDs && comp.Index == 0 {
				c.PromptTokenIDs = nonNil(comp.PromptTokens)
			}
			sw.send(c)
			c = head
			c.Choices = []chatChoice{{Index: comp.Index, Delta: &responseMessage{}, FinishReason: fin}}
			sw.send(c)
		}
		if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
			c := head
			c.Choices, c.Usage = []chatChoice{}, usageOf(comps)
			sw.send(c)
		}
		sw.done()
		return
	}
	comps, err := generate(r.Context())
	if err != nil {
		h.fail(w, err)
		return
	}
	resp := head
	for _, comp := range comps {
		ch := choice(comp)
		msg, finish := message(comp)
		ch.Message, ch.FinishReason = &msg, &finish
		resp.Choices = append(resp.Choices, ch)
	}
	resp.Usage = usageOf(comps)
	if req.ReturnTokenIDs && len(comps) > 0 {
		resp.PromptTokenIDs = nonNil(comps[0].PromptTokens)
	}
	writeJSON(w, resp)
}

func nonNil(ids []int32) []int32 {
	if ids == nil {
		return []int32{}
	}
	return ids
}

// usageOf counts a request's tokens: its prompt once, every sample's response.
func usageOf(comps []engines.Completion) *usage {
	u := &usage{}
	seen := map[string]bool{}
	for _, c := range comps {
		if !seen[c.RequestID] {
			seen[c.RequestID] = true
			u.PromptTokens += len(c.PromptTokens)
		}
		u.CompletionTokens += len(c.Tokens)
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

func (h *handler) completions(w http.ResponseWriter, r *http.Request) {
	var req struct {
		completionRequest
		extras
	}
	if err := h.decode(w, r, &req); err != nil {
		h.fail(w, err)
		return
	}
	gr, err := h.request(req.sampling)
	if err == nil {
		err = req.extras.check()
	}
	switch {
	case err != nil:
	case len(req.Prompt) == 0:
		err = badRequest("prompt", "prompt is missing")
	case req.Logprobs != nil && *req.Logprobs > 0:
		err = badRequest("logprobs", "logprobs = %d asks for %d alternatives per token; this server returns the sampled token's log-prob only: send logprobs 0", *req.Logprobs, *req.Logprobs)
	case req.Echo:
		err = badRequest("echo", "echo is not supported by this server")
	}
	if err != nil {
		h.fail(w, err)
		return
	}
	id := "cmpl-" + gr.ID
	reqs := make([]engines.GenerateRequest, len(req.Prompt))
	for i, p := range req.Prompt {
		reqs[i] = gr
		reqs[i].ID = fmt.Sprintf("%s-%d", id, i)
		if !p.isText {
			reqs[i].PromptTokens = p.ids
			continue
		}
		ids, err := h.eng.Tokenize(r.Context(), []string{p.text})
		if err != nil {
			h.fail(w, err)
			return
		}
		if len(ids[0]) == 0 {
			h.fail(w, badRequest("prompt", "prompt %d is empty", i))
			return
		}
		reqs[i].PromptTokens = ids[0]
	}
	choice := func(p int, c engines.Completion) completionChoice {
		ch := completionChoice{Index: p*gr.N + c.Index, Text: c.Text, FinishReason: ptr(c.FinishReason)}
		if req.Logprobs != nil {
			lp := &completionLogprobs{Tokens: []string{}, TokenLogprobs: []*float64{}, TextOffset: []int{}}
			off := 0
			for k, t := range c.Tokens {
				tok := h.tokenText(t, req.ReturnTokensAsTokenIDs)
				var v float64
				if k < len(c.Logprobs) {
					v = float64(c.Logprobs[k])
				}
				lp.Tokens, lp.TokenLogprobs, lp.TextOffset = append(lp.Tokens, tok), append(lp.TokenLogprobs, ptr(v)), append(lp.TextOffset, off)
				off += len(tok)
			}
			ch.Logprobs = lp
		}
		if req.ReturnTokenIDs {
			ch.TokenIDs, ch.PromptTokenIDs = nonNil(c.Tokens), nonNil(c.PromptTokens)
		}
		return ch
	}
	index := map[string]int{}
	for i, q := range reqs {
		index[q.ID] = i
	}
	head := completionResponse{ID: id, Object: "text_completion", Created: time.Now().Unix(), Model: h.o.Model}
	var sw *stream
	if req.Stream {
		sw = startStream(w)
	}
	comps, err := h.eng.Generate(r.Context(), reqs)
	if err != nil {
		if sw != nil {
			sw.fail(h, err)
		} else {
			h.fail(w, err)
		}
		return
	}
	resp := head
	for _, c := range comps {
		resp.Choices = append(resp.Choices, choice(index[c.RequestID], c))
	}
	if sw == nil {
		resp.Usage = usageOf(comps)
		writeJSON(w, resp)
		return
	}
	for _, ch := range resp.Choices {
		c := head
		fin := ch.FinishReason
		ch.FinishReason = nil
		c.Choices = []completionChoice{ch}
		sw.send(c)
		c.Choices = []completionChoice{{Index: ch.Index, FinishReason: fin}}
		sw.send(c)
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		c := head
		c.Choices, c.Usage = []completionChoice{}, usageOf(comps)
		sw.send(c)
	}
	sw.done()
}

// stream writes server-sent events: one "data: JSON" per chunk, then "data: [DONE]".
type stream struct {
	w http.ResponseWriter
	f http.Flusher
}

func startStream(w http.ResponseWriter) *stream {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	s := &stream{w: w, f: f}
	s.flush()
	return s
}

func (s *stream) flush() {
	if s.f != nil {
		s.f.Flush()
	}
}

func (s *stream) send(v any) {
	b, _ := json.Marshal(v)
	fmt.Fprintf(s.w, "data: %s\n\n", b)
	s.flush()
}

func (s *stream) done() {
	fmt.Fprint(s.w, "data: [DONE]\n\n")
	s.flush()
}

// fail ends a stream whose headers are out with an error event, as the API does.
func (s *stream) fail(h *handler, err error) {
	if h.o.Logf != nil {
		h.o.Logf("openai front: %v", err)
	}
	s.send(errorBody{Error: apiError{Message: err.Error(), Type: "server_error"}})
	s.done()
}
