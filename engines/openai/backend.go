package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
)

// A chat backend answers the chat completions of a front that has no engine of its own: the
// endpoint of agent() (host/script), where each call continues a conversation recorded as token
// ids. The front parses the request (tool fields included) and shapes the answer (tool calls,
// streaming); the backend samples.

// ChatMessage is one message of a chat-completions request, with the API's tool fields.
type ChatMessage struct {
	Role       string
	Content    string
	ToolCalls  []ToolCall // an assistant message's calls
	ToolCallID string     // a tool message: the id of the call it answers
	Name       string
}

// ToolCall is a function call: its id, its name, and its arguments as JSON text (an object).
type ToolCall struct {
	ID        string
	Name      string
	Arguments string
}

// ChatCall is one chat-completions request for a ChatBackend.
type ChatCall struct {
	// Request has the API's defaults where the request said nothing (temperature 1, top_p 1, a
	// random seed, max_tokens the front's default), N, Stop and the id of the response.
	Request engines.GenerateRequest
	// MaxTokens is the request's max_tokens (or max_completion_tokens); 0: it gave none.
	MaxTokens int
	Messages  []ChatMessage
	Tools     []string // each tool of the request's tools, as JSON
	// NoToolCalls: the request offered tools with tool_choice "none", so the answer is text and
	// its turn is not read for tool calls.
	NoToolCalls bool
	// RequireCall is tool_choice "required" ("*") or a named function (its name): only an
	// answer that calls it may be given (RequiredCall).
	RequireCall string
	// Constraint is the decoding constraint of tool_choice, parallel_tool_calls false and
	// response_format (engines/constrain's Spec as JSON; "": none): the backend sets it on the
	// request where its engine constrains decoding. Where it does not, RequireCall is met by
	// sampling again, and a call whose Strict field (the one that needs the constraint) is set
	// is answered NoConstraint(Strict).
	Constraint string
	Strict     string
	Stream     bool
}

// RequiredAttempts is how many times a call with tool_choice "required" or a named function is
// sampled (each with its own seed) for an answer that makes the call; a model that makes none in
// that many is a 500: the server could not meet the request, and says so rather than answer
// outside it.
const RequiredAttempts = 8

// RequiredCall says whether a sampled turn meets tool_choice: require "" always; "*" when it
// calls any tool; otherwise when it calls the named function.
func RequiredCall(require, text string) bool {
	if require == "" {
		return true
	}
	for _, c := range AssistantMessage(text, true).ToolCalls {
		if require == "*" || c.Name == require {
			return true
		}
	}
	return false
}

// NoRequiredCall is the error of a call whose samples never made the required call.
func NoRequiredCall(require string) error {
	what := "a tool"
	if require != "*" {
		what = fmt.Sprintf("the function %q", require)
	}
	return &APIError{Status: http.StatusInternalServerError, Type: "server_error",
		Msg: fmt.Sprintf("tool_choice asks for a call of %s, and the model made none in %d samples", what, RequiredAttempts)}
}

// ChatBackend samples the completions of a chat call. The completions' Text is the assistant's
// raw turn: Hermes tool calls in it (<tool_call>{…}</tool_call>) become the answer's tool_calls
// when the request offered tools.
type ChatBackend func(ctx context.Context, call ChatCall) ([]engines.Completion, error)

// NewChatHandler returns an OpenAI-compatible front of a chat backend: POST /v1/chat/completions
// (tools and streaming), POST /v1/responses (the same calls in the Responses API's form) and GET
// /v1/models, which lists o.Model. Requests may name any model.
// Errors the backend returns as *APIError reach the client with their status (429 for a
// rollout over its budget, say).
func NewChatHandler(o HandlerOptions, backend ChatBackend) http.Handler {
	if o.DefaultMaxTokens <= 0 {
		o.DefaultMaxTokens = 1024
	}
	o = withDefaults(o)
	h := &handler{o: o, created: time.Now().Unix(), backend: backend, anyModel: true}
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/chat/completions", h.only(http.MethodPost, h.chat))
	mux.HandleFunc("/v1/responses", h.only(http.MethodPost, h.responses))
	mux.HandleFunc("/v1/models", h.only(http.MethodGet, h.models))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", "", "no such endpoint: %s %s; "+
			"this server has POST /v1/chat/completions, POST /v1/responses and GET /v1/models", r.Method, r.URL.Path)
	})
	return h.auth(mux)
}

// APIError is an error a backend answers with its HTTP status, the API's error type and, where
// they apply, the parameter at fault and the error's code ("context_length_exceeded").
type APIError struct {
	Status int
	Type   string
	Param  string
	Code   string
	Msg    string
}

// Error returns the message the backend gave.
func (e *APIError) Error() string { return e.Msg }

// chatMessages converts a request's messages: the roles of the API, "developer" read as
// "system" (what it replaced), any other role refused.
func chatMessages(ms []chatMessage) ([]ChatMessage, error) {
	out := make([]ChatMessage, len(ms))
	for i, m := range ms {
		role := m.Role
		switch role {
		case "system", "user", "assistant", "tool":
		case "developer":
			role = "system"
		default:
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "messages[%d].role %q; want system, developer, user, assistant or tool", i, m.Role)
		}
		out[i] = ChatMessage{Role: role, Content: string(m.Content), ToolCallID: m.ToolCallID, Name: m.Name}
		for k, c := range m.ToolCalls {
			args, err := argumentsText(c.Function.Arguments)
			if err != nil {
				return nil, badRequest(fmt.Sprintf("messages[%d].tool_calls[%d].function.arguments", i, k), "%v", err)
			}
			out[i].ToolCalls = append(out[i].ToolCalls, ToolCall{ID: c.ID, Name: c.Function.Name, Arguments: args})
		}
	}
	return out, nil
}

// argumentsText reads a call's arguments: a JSON string holding them (the API's form) or the
// object itself (what some clients send back).
func argumentsText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "{}", nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", err
		}
		return s, nil
	}
	if raw[0] != '{' {
		return "", fmt.Errorf("arguments must be a JSON string or object")
	}
	return string(raw), nil
}

// toolsOf returns each tool of a request's tools as JSON.
func toolsOf(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, badRequest("tools", "tools must be a list of tool objects")
	}
	out := make([]string, len(list))
	for i, t := range list {
		var b bytes.Buffer
		if err := json.Compact(&b, t); err != nil {
			return nil, badRequest("tools", "tools[%d]: %v", i, err)
		}
		out[i] = b.String()
	}
	return out, nil
}

// AssistantMessage is a sampled turn as the front answers it: with tools offered, its
// well-formed Hermes tool calls (a JSON object with a string "name" and an "arguments" object, or
// a string holding one) become calls (ids left empty), the rest of the text the content; a
// malformed block stays in the content, as text the client shows. Without tools, the content is
// the text.
func AssistantMessage(text string, withTools bool) ChatMessage {
	m := ChatMessage{Role: "assistant", Content: text}
	if !withTools {
		return m
	}
	raws, rest := engines.SplitToolCalls(text)
	var bad strings.Builder
	for _, r := range raws {
		var obj struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		}
		args := ""
		if err := json.Unmarshal([]byte(strings.TrimSpace(r.Text)), &obj); err == nil && r.Closed && obj.Name != "" {
			if a, err := argumentsText(obj.Arguments); err == nil && json.Valid([]byte(a)) && strings.HasPrefix(strings.TrimSpace(a), "{") {
				var b bytes.Buffer
				json.Compact(&b, []byte(a))
				args = b.String()
			}
		}
		if args == "" {
			bad.WriteString(engines.ToolCallOpen + r.Text)
			if r.Closed {
				bad.WriteString(engines.ToolCallClose)
			}
			continue
		}
		m.ToolCalls = append(m.ToolCalls, ToolCall{Name: obj.Name, Arguments: args})
	}
	if len(m.ToolCalls) > 0 {
		m.Content = strings.TrimSpace(rest + bad.String())
	}
	return m
}

// EngineMessage is a request's message as an engine renders it: an assistant message's tool
// calls written after its content in the Hermes format, as a sampled turn holds them.
func EngineMessage(m ChatMessage) engines.Message {
	if m.Role == "assistant" && len(m.ToolCalls) > 0 {
		return engines.Message{Role: "assistant", Content: HermesText(m.Content, m.ToolCalls)}
	}
	return engines.Message{Role: m.Role, Content: m.Content}
}

// HermesText writes an assistant message's tool calls after its content in the Hermes format:
// how a message the program wrote itself (not a sampled turn) is rendered.
func HermesText(content string, calls []ToolCall) string {
	var b strings.Builder
	b.WriteString(content)
	for _, c := range calls {
		if b.Len() > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "%s\n{\"name\": %s, \"arguments\": %s}\n%s", engines.ToolCallOpen, mustJSON(c.Name), c.Arguments, engines.ToolCallClose)
	}
	return b.String()
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
