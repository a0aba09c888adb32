package openai

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/constrain"
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
	// BodyTimeout bounds the time a request's body takes to arrive once its headers have; 0: one
	// minute. (The headers' own timeout and the idle connections' are the http.Server's: see
	// NewServer.)
	BodyTimeout time.Duration
	// MaxRequestTokens caps the tokens one request may make the engine hold: the sum over its
	// prompts of the prompt's tokens and n × max_tokens. A request over it is refused with a 400;
	// 0: DefaultMaxRequestTokens, or 128 × the context length if that is more.
	MaxRequestTokens int64
	// MaxRequestSamples caps the samples of one request: its prompts × n. An engine holds a row
	// of activations per sample it decodes at once, whatever the tokens (the tiny engine about
	// 12 KB), so many short samples cost memory too; 0: DefaultMaxRequestSamples.
	MaxRequestSamples int64
	// MaxTokensInFlight caps the tokens (counted as for MaxRequestTokens) of all the requests
	// being answered at once, and 4 × MaxRequestSamples their samples; a request that would go
	// past either is answered 429 with Retry-After. 0: 4 × MaxRequestTokens.
	MaxTokensInFlight int64
	// ToolsPrompt, when not nil, describes a request's tools (JSON schemas) as a system message
	// for a model whose chat template has no tools variable (the tiny engine's); nil: such a
	// model refuses tools.
	ToolsPrompt func(tools []string) string
	// ModelFor, when not nil, names the model a request is served by (what /v1/models lists and
	// answers carry) instead of Model: agent()'s endpoint answers each program with the name it
	// was given.
	ModelFor func(r *http.Request) string
	// Logf reports failed engine calls; nil: silent.
	Logf func(format string, args ...any)
}

// DefaultMaxRequestTokens is HandlerOptions.MaxRequestTokens's default (before the context
// length raises it).
const DefaultMaxRequestTokens = 1 << 20

// DefaultMaxRequestSamples is HandlerOptions.MaxRequestSamples's default.
const DefaultMaxRequestSamples = 4096

// maxTokensLimit is the most max_tokens a request may ask for when the model does not say its
// context length: what every engine's wire format holds.
const maxTokensLimit = math.MaxInt32

// handler is the OpenAI-compatible front of one engine.
type handler struct {
	eng       engines.Engine
	o         HandlerOptions
	created   int64
	info      engines.Info
	maxSeqLen int              // the engine's context length, reported as vLLM's max_model_len
	renderer  engines.Renderer // the engine's, when it renders its chat template
	budget    *tokenBudget     // tokens in flight; nil: unbounded (a chat backend's front)
	backend   ChatBackend
	anyModel  bool // requests may name any model (a chat backend's front)
}

// NewHandler returns an OpenAI-compatible HTTP front for eng: POST /v1/chat/completions (with
// streaming), POST /v1/completions (a string or token-id prompt, or a list of them), POST
// /v1/responses (the Responses API, answered by the chat path), GET
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
	o = withDefaults(o)
	if o.MaxRequestTokens <= 0 {
		o.MaxRequestTokens = max(DefaultMaxRequestTokens, 128*int64(info.MaxSeqLen))
	}
	if o.MaxTokensInFlight <= 0 {
		o.MaxTokensInFlight = 4 * o.MaxRequestTokens
	}
	if o.MaxRequestSamples <= 0 {
		o.MaxRequestSamples = DefaultMaxRequestSamples
	}
	h := &handler{eng: eng, o: o, created: time.Now().Unix(), info: info, maxSeqLen: info.MaxSeqLen,
		budget: &tokenBudget{max: o.MaxTokensInFlight, maxSamples: 4 * o.MaxRequestSamples}}
	h.renderer, _ = eng.(engines.Renderer)
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/chat/completions", h.only(http.MethodPost, h.chat))
	mux.HandleFunc("/v1/completions", h.only(http.MethodPost, h.completions))
	mux.HandleFunc("/v1/responses", h.only(http.MethodPost, h.responses))
	mux.HandleFunc("/v1/models", h.only(http.MethodGet, h.models))
	mux.HandleFunc("/v1/models/{id...}", h.only(http.MethodGet, h.model))
	mux.HandleFunc("/tokenize", h.only(http.MethodPost, h.tokenize))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", "", "no such endpoint: %s %s; "+
			"this server has POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models and POST /tokenize", r.Method, r.URL.Path)
	})
	return h.auth(mux), nil
}

// withDefaults fills in the options every front shares.
func withDefaults(o HandlerOptions) HandlerOptions {
	if o.MaxRequestBytes <= 0 {
		o.MaxRequestBytes = 64 << 20
	}
	if o.BodyTimeout <= 0 {
		o.BodyTimeout = time.Minute
	}
	return o
}

// NewServer is the http.Server a front is served with: the request headers must arrive within
// 30 s and an idle keep-alive connection is closed after 2 minutes (the body's time is the
// front's BodyTimeout; a response has no time limit, as a generation takes what it takes).
func NewServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
}

// apiErr is an error answered to the client: its status, type, parameter and code.
type apiErr struct {
	status int
	typ    string
	param  string
	msg    string
	code   string
}

func (e *apiErr) Error() string { return e.msg }

func badRequest(param, format string, args ...any) *apiErr {
	return &apiErr{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, msg: fmt.Sprintf(format, args...)}
}

func writeError(w http.ResponseWriter, status int, typ, param, format string, args ...any) {
	writeAPIError(w, &apiErr{status: status, typ: typ, param: param, msg: fmt.Sprintf(format, args...)})
}

func writeAPIError(w http.ResponseWriter, e *apiErr) {
	body := errorBody{Error: apiError{Message: e.msg, Type: e.typ, Code: nil}}
	if e.param != "" {
		body.Error.Param = &e.param
	}
	if e.code != "" {
		body.Error.Code = e.code
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	json.NewEncoder(w).Encode(body)
}

// fail answers err: a client's mistake (apiErr, a backend's APIError, an upstream server's 4xx
// refusal) with its 4xx, the server's own failures with 500 (501 for what the engine lacks).
func (h *handler) fail(w http.ResponseWriter, err error) {
	var ae *apiErr
	if errors.As(err, &ae) {
		writeAPIError(w, ae)
		return
	}
	var be *APIError
	if errors.As(err, &be) {
		if be.Status == http.StatusTooManyRequests {
			w.Header().Set("Retry-After", "1")
		}
		writeAPIError(w, &apiErr{status: be.Status, typ: be.Type, param: be.Param, msg: be.Msg, code: be.Code})
		return
	}
	var he *HTTPError
	if errors.As(err, &he) && clientError(he.Status) {
		// An engine of kind openai whose server refused the request for what it asks: the
		// client's mistake here too.
		writeAPIError(w, &apiErr{status: he.Status, typ: "invalid_request_error", msg: err.Error()})
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

// clientError reports whether a status says the request itself was wrong (not the key, not the
// server's load or failure).
func clientError(status int) bool {
	switch status {
	case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		return true
	}
	return false
}

// BearerToken is the key of a request's "Authorization: Bearer KEY" header; the scheme's name is
// case-insensitive (RFC 9110), as some clients write it "bearer".
func BearerToken(r *http.Request) (string, bool) {
	scheme, key, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	return strings.TrimSpace(key), true
}

// Unauthorized answers 401 before anything of the body is read, and closes the connection: the
// server does not wait for (or read) a body it will not use.
func Unauthorized(w http.ResponseWriter, msg string) {
	w.Header().Set("Connection", "close")
	writeError(w, http.StatusUnauthorized, "invalid_request_error", "", "%s", msg)
}

func (h *handler) auth(next http.Handler) http.Handler {
	if h.o.Token == "" {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := BearerToken(r)
		// Constant time, so that the time a rejection takes says nothing about the key.
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(h.o.Token)) != 1 {
			Unauthorized(w, "this server needs the API key of its --token-env as \"Authorization: Bearer KEY\" "+
				"(OPENAI_API_KEY for the openai client); the request carried none or another")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (h *handler) only(method string, f http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != method {
			w.Header().Set("Allow", method)
			w.Header().Set("Connection", "close")
			writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "", "%s takes %s, not %s", r.URL.Path, method, r.Method)
			return
		}
		f(w, r)
	}
}

// decode reads a JSON request body into v, within BodyTimeout and MaxRequestBytes, to its end:
// once the body is read, the server notices a client that leaves, and cancels the request's
// context (a non-streamed request too).
func (h *handler) decode(w http.ResponseWriter, r *http.Request, v any) error {
	rc := http.NewResponseController(w)
	rc.SetReadDeadline(time.Now().Add(h.o.BodyTimeout))
	defer rc.SetReadDeadline(time.Time{})
	body := http.MaxBytesReader(w, r.Body, h.o.MaxRequestBytes)
	err := json.NewDecoder(body).Decode(v)
	if err == nil {
		_, err = io.Copy(io.Discard, body)
	}
	if err != nil {
		w.Header().Set("Connection", "close")
		var mb *http.MaxBytesError
		var ne net.Error
		switch {
		case errors.As(err, &mb):
			return &apiErr{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", msg: fmt.Sprintf("the request is over %d bytes", mb.Limit)}
		case errors.As(err, &ne) && ne.Timeout():
			return &apiErr{status: http.StatusRequestTimeout, typ: "invalid_request_error",
				msg: fmt.Sprintf("the request body did not arrive within %s", h.o.BodyTimeout)}
		}
		return badRequest("", "the request body is not the JSON expected: %v", err)
	}
	return nil
}

// modelName is the name of the model that answers r.
func (h *handler) modelName(r *http.Request) string {
	if h.o.ModelFor != nil {
		return h.o.ModelFor(r)
	}
	return h.o.Model
}

// serves says whether a request's model names this front's: Model or one of its Aliases.
func (h *handler) serves(name string) bool {
	return name == h.o.Model || slices.Contains(h.o.Aliases, name)
}

// models lists Model, then its Aliases (as vLLM lists each --served-model-name).
func (h *handler) models(w http.ResponseWriter, r *http.Request) {
	list := []modelInfo{h.modelInfo(h.modelName(r))}
	for _, a := range h.o.Aliases {
		list = append(list, h.modelInfo(a))
	}
	writeJSON(w, modelList{Object: "list", Data: list})
}

func (h *handler) model(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !h.serves(id) && id != h.modelName(r) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "model", "the model %q does not exist; this server serves %q", id, h.modelName(r))
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

// extras are request fields the front refuses rather than ignores where the engines cannot
// honour them.
type extras struct {
	Tools             json.RawMessage `json:"tools"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	ResponseFormat    json.RawMessage `json:"response_format"`
	FrequencyPenalty  *float64        `json:"frequency_penalty"`
	PresencePenalty   *float64        `json:"presence_penalty"`
	LogitBias         map[string]any  `json:"logit_bias"`
}

// check refuses the sampling settings no engine has.
func (x extras) check() error {
	switch {
	case x.FrequencyPenalty != nil && *x.FrequencyPenalty != 0:
		return badRequest("frequency_penalty", "frequency_penalty is not supported by this server; leave it 0")
	case x.PresencePenalty != nil && *x.PresencePenalty != 0:
		return badRequest("presence_penalty", "presence_penalty is not supported by this server; leave it 0")
	case len(x.LogitBias) > 0:
		return badRequest("logit_bias", "logit_bias is not supported by this server")
	}
	return nil
}

// toolUse is what a request's tools fields ask of its answer: the tools (each as JSON), whether
// the answer is read for tool calls, the call it must make (RequiredCall; "": none), and the
// constraint of its decoding (engines/constrain's Spec as JSON; "": none), which only an engine
// that constrains may honour where strict is set (response_format, parallel_tool_calls false),
// and where it is not (tool_choice "required" or named alone) sampling again stands in for.
type toolUse struct {
	tools      []string
	read       bool
	require    string
	constraint string
	strict     string // the field that needs the constraint: "response_format", "parallel_tool_calls"; "": none
}

// toolFields reads a chat request's tools, tool_choice, parallel_tool_calls and
// response_format. tool_choice "auto" (the default) and "none" are honoured ("none": the answer
// is text, never read for calls). "required", a named function, parallel_tool_calls false and
// response_format json_object or json_schema are honoured by constrained decoding (Constraint);
// on an engine without it (chooseSampling) "required" and a named function by sampling again
// until the answer makes the call (RequiredAttempts), never by answering without it, and the
// others are refused. A schema feature the constraint does not have is a 400 naming its place.
func (x extras) toolFields() (toolUse, error) {
	tools, err := toolsOf(x.Tools)
	if err != nil {
		return toolUse{}, err
	}
	none, require := false, ""
	if raw := bytes.TrimSpace(x.ToolChoice); len(raw) > 0 && string(raw) != "null" {
		var s string
		var named struct {
			Type     string `json:"type"`
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		}
		switch {
		case json.Unmarshal(raw, &s) == nil:
		case json.Unmarshal(raw, &named) == nil && named.Type == "function" && named.Function.Name != "":
			s, require = "function", named.Function.Name
		default:
			return toolUse{}, badRequest("tool_choice", "tool_choice: want \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}")
		}
		switch s {
		case "auto":
		case "none":
			none = true
		case "required":
			require = "*"
		case "function":
			if !slices.ContainsFunc(tools, func(t string) bool { return toolName(t) == require }) {
				return toolUse{}, badRequest("tool_choice", "tool_choice names the function %q, which tools does not offer", require)
			}
		default:
			return toolUse{}, badRequest("tool_choice", "tool_choice %q; want \"auto\", \"none\" or \"required\"", s)
		}
		if require != "" && len(tools) == 0 {
			return toolUse{}, badRequest("tool_choice", "tool_choice asks for a tool call, and the request offers no tools")
		}
	}
	tu := toolUse{tools: tools, read: len(tools) > 0 && !none, require: require}
	single := x.ParallelToolCalls != nil && !*x.ParallelToolCalls && tu.read
	format, err := responseFormat(x.ResponseFormat)
	if err != nil {
		return toolUse{}, err
	}
	var spec constrain.Spec
	switch {
	case format != nil:
		spec.Schema, tu.strict = format, "response_format"
	case single:
		tu.strict = "parallel_tool_calls"
	}
	if tu.read && (require != "" || single || format != nil) {
		calls, err := callsOf(tools, require)
		if err != nil {
			return toolUse{}, err
		}
		switch {
		case require != "":
			calls.Min = 1
			spec.Schema = nil // a call is required: no answer of the format
		case format == nil:
			calls.Text = true // text, or text and then one call
		}
		if single {
			calls.Max = 1
		}
		spec.Calls = &calls
	}
	if spec.Schema != nil || spec.Calls != nil {
		tu.constraint = spec.String()
	}
	return tu, nil
}

// responseFormat reads response_format: nil for none or text, else the JSON schema the answer
// must follow ({"type": "object"} for json_object), checked to be one the constraint compiles.
func responseFormat(raw json.RawMessage) (json.RawMessage, error) {
	if raw = bytes.TrimSpace(raw); len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var f struct {
		Type       string `json:"type"`
		JSONSchema *struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
			Strict *bool           `json:"strict"`
		} `json:"json_schema"`
	}
	if err := json.Unmarshal(raw, &f); err != nil || f.Type == "" {
		return nil, badRequest("response_format", "response_format: want an object with a type")
	}
	switch f.Type {
	case "text":
		return nil, nil
	case "json_object":
		return json.RawMessage(`{"type": "object"}`), nil
	case "json_schema":
		if f.JSONSchema == nil || len(bytes.TrimSpace(f.JSONSchema.Schema)) == 0 {
			return nil, badRequest("response_format.json_schema.schema", "response_format of type json_schema needs json_schema.schema")
		}
		if _, err := constrain.CompileSchema(f.JSONSchema.Schema, "response_format.json_schema.schema"); err != nil {
			return nil, badRequest("response_format.json_schema.schema", "%v: this server keeps the answer to the schema by "+
				"constrained decoding, which has type, properties, required, additionalProperties, "+
				"items, enum, const, anyOf and $ref into the schema", err)
		}
		return f.JSONSchema.Schema, nil
	}
	return nil, badRequest("response_format.type", "response_format of type %q; want text, json_object or json_schema", f.Type)
}

// callsOf is the constraint's tools: every tool (require "*" or ""), or the one named, each with
// its parameters where the constraint compiles them. A strict function's parameters that it does
// not compile are a 400; another's arguments are kept to a JSON object (the API enforces the
// parameters of strict functions only).
func callsOf(tools []string, require string) (constrain.Calls, error) {
	var calls constrain.Calls
	for i, t := range tools {
		var tool struct {
			Name       string          `json:"name"`
			Parameters json.RawMessage `json:"parameters"`
			Strict     bool            `json:"strict"`
			Function   *struct {
				Name       string          `json:"name"`
				Parameters json.RawMessage `json:"parameters"`
				Strict     bool            `json:"strict"`
			} `json:"function"`
		}
		json.Unmarshal([]byte(t), &tool)
		where := fmt.Sprintf("tools[%d]", i)
		if f := tool.Function; f != nil {
			tool.Name, tool.Parameters, tool.Strict = f.Name, f.Parameters, f.Strict
			where += ".function"
		}
		if tool.Name == "" || (require != "" && require != "*" && tool.Name != require) {
			continue
		}
		params := tool.Parameters
		if p := bytes.TrimSpace(params); len(p) > 0 && string(p) != "null" {
			_, err := constrain.CompileSchema(params, where+".parameters")
			if err == nil {
				_, err = constrain.CompileCalls(constrain.Calls{Tools: []constrain.Tool{{Name: tool.Name, Parameters: params}}}, "tools")
			}
			if err != nil {
				if tool.Strict {
					return calls, badRequest(where+".parameters", "%v: the function is strict, and this server keeps its arguments to "+
						"the schema by constrained decoding, which has type, properties, required, "+
						"additionalProperties, items, enum, const, anyOf and $ref into the schema", err)
				}
				params = nil
			}
		}
		calls.Tools = append(calls.Tools, constrain.Tool{Name: tool.Name, Parameters: params})
	}
	if len(calls.Tools) == 0 {
		return calls, badRequest("tools", "tools offers no function with a name")
	}
	return calls, nil
}

// toolName is the function name of a tool of a request's tools (as JSON).
func toolName(tool string) string {
	var t struct {
		Name     string `json:"name"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	json.Unmarshal([]byte(tool), &t)
	if t.Function.Name != "" {
		return t.Function.Name
	}
	return t.Name
}

// request turns the shared settings into an engine request: the API's defaults (temperature 1,
// top_p 1, n 1, a random seed) where the request says nothing. It also says whether the request
// gave max_tokens (or max_completion_tokens), which must then be within the model's context and
// what every engine's wire format holds.
func (h *handler) request(s sampling) (engines.GenerateRequest, bool, error) {
	if s.Model != "" && !h.serves(s.Model) && !h.anyModel {
		return engines.GenerateRequest{}, false, &apiErr{status: http.StatusNotFound, typ: "invalid_request_error", param: "model",
			msg: fmt.Sprintf("the model %q does not exist; this server serves %q", s.Model, h.o.Model)}
	}
	r := engines.GenerateRequest{ID: newID(""), N: 1, Sampling: engines.Sampling{MaxTokens: h.o.DefaultMaxTokens, Temperature: 1, TopP: 1, Stop: s.Stop}}
	if s.N != nil {
		if *s.N < 1 || *s.N > 128 {
			return r, false, badRequest("n", "n = %d; want 1 to 128", *s.N)
		}
		r.N = *s.N
	}
	param, mt := "", 0
	if s.MaxCompletionTokens != nil {
		param, mt = "max_completion_tokens", *s.MaxCompletionTokens
		if s.maxTokensParam != "" {
			param = s.maxTokensParam
		}
	} else if s.MaxTokens != nil {
		param, mt = "max_tokens", *s.MaxTokens
	}
	if param != "" {
		switch {
		case mt < 1:
			return r, false, badRequest(param, "%s = %d; want at least 1", param, mt)
		case h.maxSeqLen > 0 && mt > h.maxSeqLen:
			return r, false, badRequest(param, "%s = %d is more than the model's context length of %d tokens (prompt and response together)", param, mt, h.maxSeqLen)
		case mt > maxTokensLimit:
			return r, false, badRequest(param, "%s = %d is more than %d", param, mt, maxTokensLimit)
		}
		r.MaxTokens = mt
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
		return r, false, badRequest("", "%v", err)
	}
	if r.TopP == 0 {
		return r, false, badRequest("top_p", "top_p 0; want a value in (0, 1]")
	}
	return r, param != "", nil
}

// fit checks a prompt of promptLen tokens against the model's context: a prompt that fills it,
// or an explicit max_tokens that does not fit beside it, is the client's mistake (400
// context_length_exceeded, in OpenAI's words); the default max_tokens is cut to the room left.
func (h *handler) fit(gr *engines.GenerateRequest, promptLen int, explicit bool, what string) error {
	if h.maxSeqLen <= 0 {
		return nil
	}
	if promptLen >= h.maxSeqLen {
		return &apiErr{status: http.StatusBadRequest, typ: "invalid_request_error", param: what, code: "context_length_exceeded",
			msg: fmt.Sprintf("This model's maximum context length is %d tokens. However, your %s resulted in %d tokens, "+
				"which leaves no room for a response. Please reduce the length of the %s.", h.maxSeqLen, what, promptLen, what)}
	}
	if room := h.maxSeqLen - promptLen; gr.MaxTokens > room {
		if explicit {
			return &apiErr{status: http.StatusBadRequest, typ: "invalid_request_error", param: "max_tokens", code: "context_length_exceeded",
				msg: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, "+
					"%d in the completion). Please reduce the length of the %s or the completion.", h.maxSeqLen, promptLen+gr.MaxTokens, promptLen, what, gr.MaxTokens, what)}
		}
		gr.MaxTokens = room
	}
	return nil
}

// reserve takes a request's tokens (its prompts' and n × max_tokens for each) and samples
// (prompts × n) from the budget in flight, and returns what gives them back: a request over a
// per-request cap is refused (400), one past the budget answered 429 with Retry-After.
func (h *handler) reserve(w http.ResponseWriter, tokens, samples int64) (func(), error) {
	if samples > h.o.MaxRequestSamples {
		return nil, badRequest("n", "the request asks for %d samples (its prompts × n), more than this server takes in one "+
			"request (%d, slimen serve --openai-max-request-samples): lower n or send fewer prompts", samples, h.o.MaxRequestSamples)
	}
	if tokens > h.o.MaxRequestTokens {
		return nil, badRequest("max_tokens", "the request may make the engine hold %d tokens (its prompts' tokens and n × "+
			"max_tokens for each), more than this server takes in one request (%d, "+
			"slimen serve --openai-max-request-tokens): lower n or max_tokens, or send fewer prompts", tokens, h.o.MaxRequestTokens)
	}
	if held, heldSamples, ok := h.budget.take(tokens, samples); !ok {
		w.Header().Set("Retry-After", "1")
		return nil, &apiErr{status: http.StatusTooManyRequests, typ: "rate_limit_exceeded", code: "rate_limit_exceeded",
			msg: fmt.Sprintf("the server is busy: the requests under way hold %d of its %d tokens and %d of its %d samples in "+
				"flight, and this one needs %d and %d; retry shortly (slimen serve --openai-max-tokens-in-flight)",
				held, h.budget.max, heldSamples, h.budget.maxSamples, tokens, samples)}
	}
	return func() { h.budget.give(tokens, samples) }, nil
}

// tokenBudget counts the tokens and samples of the requests being answered.
type tokenBudget struct {
	mu                sync.Mutex
	held, heldSamples int64
	max, maxSamples   int64
}

// take adds a request's tokens and samples to what is held if both stay within their maxima;
// else it returns what is held.
func (b *tokenBudget) take(tokens, samples int64) (int64, int64, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.held+tokens > b.max || b.heldSamples+samples > b.maxSamples {
		return b.held, b.heldSamples, false
	}
	b.held += tokens
	b.heldSamples += samples
	return b.held, b.heldSamples, true
}

func (b *tokenBudget) give(tokens, samples int64) {
	b.mu.Lock()
	b.held -= tokens
	b.heldSamples -= samples
	b.mu.Unlock()
}

// chatPrompt sets a chat request's prompt: with an engine that renders its chat template, the
// messages (and tools) as its token ids, checked against the context; otherwise the messages,
// which the engine renders. Tools go to the template's tools variable, or, for a template
// without one, to the system message (ToolsPrompt), as agent()'s tools_prompt="system".
//
// It returns the prompt's length in tokens, or, for messages the engine renders, their bytes: a
// bound on their tokens for the budget.
func (h *handler) chatPrompt(ctx context.Context, gr *engines.GenerateRequest, msgs []ChatMessage, tools []string, explicit bool) (int, error) {
	em := make([]engines.Message, len(msgs))
	for i, m := range msgs {
		em[i] = EngineMessage(m)
	}
	if len(tools) > 0 {
		switch {
		case h.renderer == nil:
			return 0, badRequest("tools", "tools are not supported by this server: its engine does not render a chat template here")
		case !strings.Contains(h.info.ChatTemplate, "tools"):
			if h.o.ToolsPrompt == nil {
				return 0, badRequest("tools", "tools are not supported by this server: the model's chat template has no tools variable")
			}
			em, tools = ToolsInSystem(em, h.o.ToolsPrompt(tools)), nil
		}
	}
	if h.renderer == nil {
		gr.Messages = em
		n := 0
		for _, m := range em {
			n += len(m.Role) + len(m.Content)
		}
		return n, nil
	}
	ids, err := h.renderer.Render(ctx, []engines.RenderRequest{{Messages: em, Tools: tools, AddGenerationPrompt: true}})
	if err != nil {
		return 0, err
	}
	gr.PromptTokens = ids[0]
	return len(ids[0]), h.fit(gr, len(ids[0]), explicit, "messages")
}

// ToolsInSystem adds a description of tools to the system message (a first one, made if there
// is none).
func ToolsInSystem(msgs []engines.Message, desc string) []engines.Message {
	if len(msgs) > 0 && msgs[0].Role == "system" {
		out := slices.Clone(msgs)
		out[0].Content += "\n\n" + desc
		return out
	}
	return append([]engines.Message{{Role: "system", Content: desc}}, msgs...)
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

// generator prepares a chat request for sampling, the one path of chat completions and
// responses: with a backend (agent()'s endpoint) the call as it is handed to it; with an engine,
// the prompt rendered and checked against the context and the request's tokens taken from the
// budget in flight (release gives them back). generate samples its completions, handing piece
// (when not nil) each sample's text as it grows where the engine streams (TokenStreamer) and no
// sample may be thrown away (a required call is checked on whole samples).
func (h *handler) generator(w http.ResponseWriter, r *http.Request, gr engines.GenerateRequest, explicit, stream bool, msgs []ChatMessage,
	tu toolUse) (generate func(ctx context.Context, piece func(index int, text string)) ([]engines.Completion, error), release func(), err error) {
	if h.backend != nil {
		call := ChatCall{Request: gr, Stream: stream, Messages: msgs, Tools: tu.tools, NoToolCalls: len(tu.tools) > 0 && !tu.read, RequireCall: tu.require,
			Constraint: tu.constraint, Strict: tu.strict}
		if explicit {
			call.MaxTokens = gr.MaxTokens
		}
		return func(ctx context.Context, _ func(int, string)) ([]engines.Completion, error) {
			return h.backend(ctx, call)
		}, func() {}, nil
	}
	require, err := h.constrained(&gr, tu)
	promptLen := 0
	if err == nil {
		promptLen, err = h.chatPrompt(r.Context(), &gr, msgs, tu.tools, explicit)
	}
	if err == nil {
		release, err = h.reserve(w, int64(promptLen)+int64(gr.N)*int64(gr.MaxTokens), int64(gr.N))
	}
	if err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, piece func(int, string)) ([]engines.Completion, error) {
		if require != "" {
			piece = nil
		}
		return SampleRequired(require, gr.N, func(attempt int) ([]engines.Completion, error) {
			g := gr
			g.Seed += uint64(attempt) * 0x9E3779B97F4A7C15
			return h.sampleStreaming(ctx, g, piece)
		})
	}, release, nil
}

// constrained sets a request's constraint where the engine constrains decoding (it lists
// "constrain" in Info.Capabilities) and returns the call sampling must still check (RequiredCall):
// none then. An engine without it gets none: tool_choice "required" or a named function is met by
// sampling again, and response_format or parallel_tool_calls false, which nothing else can keep,
// are refused with a 400 naming them.
func (h *handler) constrained(gr *engines.GenerateRequest, tu toolUse) (string, error) {
	switch {
	case tu.constraint == "":
		return tu.require, nil
	case slices.Contains(h.info.Capabilities, "constrain"):
		gr.Constraint = tu.constraint
		return "", nil
	case tu.strict != "":
		return "", badRequest(tu.strict, "%s", noConstraint(tu.strict))
	}
	return tu.require, nil
}

// NoConstraint is the 400 of a request whose field (response_format, parallel_tool_calls) needs
// constrained decoding from an engine without it.
func NoConstraint(field string) error {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: field, Msg: noConstraint(field)}
}

func noConstraint(field string) string {
	return fmt.Sprintf("%s is not supported by this server's engine: it does not constrain decoding (an external "+
		"OpenAI-compatible server, or a worker older than constrained decoding), "+
		"so the answer would not be guaranteed to follow it; leave %[1]s out", field)
}

// SampleRequired samples until n completions meet require (RequiredCall), at most
// RequiredAttempts times; sample(attempt) samples with attempt's seed. Without a requirement it
// samples once.
func SampleRequired(require string, n int, sample func(attempt int) ([]engines.Completion, error)) ([]engines.Completion, error) {
	var kept []engines.Completion
	for attempt := range RequiredAttempts {
		cs, err := sample(attempt)
		if err != nil || require == "" {
			return cs, err
		}
		for _, c := range cs {
			if RequiredCall(require, c.Text) && len(kept) < max(n, 1) {
				c.Index = len(kept)
				kept = append(kept, c)
			}
		}
		if len(kept) >= max(n, 1) {
			return kept, nil
		}
	}
	return nil, NoRequiredCall(require)
}

// answerMessage is a sampled turn as the answer's message: with tools offered, its Hermes tool
// calls become tool_calls (finish_reason "tool_calls").
func answerMessage(c engines.Completion, withTools bool) (responseMessage, string) {
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

// checkPrompt refuses an empty prompt and token ids outside the vocabulary, naming the prompt
// (i of n).
func (h *handler) checkPrompt(i, n int, ids []int32) error {
	which := "the prompt"
	if n > 1 {
		which = fmt.Sprintf("prompt %d", i)
	}
	if len(ids) == 0 {
		return badRequest("prompt", "%s is empty", which)
	}
	if v := h.info.VocabSize; v > 0 {
		for k, t := range ids {
			if t < 0 || int(t) >= v {
				return badRequest("prompt", "%s: token id %d at index %d is outside the model's vocabulary [0, %d)", which, t, k, v)
			}
		}
	}
	return nil
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
