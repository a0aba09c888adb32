package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
)

// The Responses API (POST /v1/responses), read as a chat-completions request and answered from
// the same path (generator): `input` (a string, or a list of items: messages with text parts,
// function_call and function_call_output items) becomes the chat's messages, `instructions` a
// first system message, function tools the chat's tools. Responses are not stored:
// previous_response_id and the features that need them are refused, as is any field that asks
// for what the server does not do.

// responsesRequest is a Responses API request as far as the server reads it.
type responsesRequest struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	Tools              json.RawMessage `json:"tools"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	ParallelToolCalls  *bool           `json:"parallel_tool_calls"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	Stream             bool            `json:"stream"`
	Text               *responseText   `json:"text"`
	Metadata           json.RawMessage `json:"metadata"`
	Store              *bool           `json:"store"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Conversation       json.RawMessage `json:"conversation"`
	Prompt             json.RawMessage `json:"prompt"`
	Reasoning          *struct {
		Effort  *string `json:"effort"`
		Summary *string `json:"summary"`
	} `json:"reasoning"`
	Include      []string `json:"include"`
	Truncation   *string  `json:"truncation"`
	TopLogprobs  *int     `json:"top_logprobs"`
	MaxToolCalls *int     `json:"max_tool_calls"`
	Background   *bool    `json:"background"`
}

type responseText struct {
	Format json.RawMessage `json:"format,omitempty"`
}

// responseInputItem is one item of a request's input list.
type responseInputItem struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// responseObject is the API's Response object.
type responseObject struct {
	ID                 string             `json:"id"`
	Object             string             `json:"object"`
	CreatedAt          int64              `json:"created_at"`
	Status             string             `json:"status"`
	Error              *responseError     `json:"error"`
	IncompleteDetails  *incompleteDetails `json:"incomplete_details"`
	Instructions       *string            `json:"instructions"`
	MaxOutputTokens    *int               `json:"max_output_tokens"`
	Model              string             `json:"model"`
	Output             []any              `json:"output"`
	ParallelToolCalls  bool               `json:"parallel_tool_calls"`
	PreviousResponseID *string            `json:"previous_response_id"`
	Reasoning          *struct{}          `json:"reasoning"`
	Store              bool               `json:"store"`
	Temperature        float64            `json:"temperature"`
	Text               responseText       `json:"text"`
	ToolChoice         json.RawMessage    `json:"tool_choice"`
	Tools              []json.RawMessage  `json:"tools"`
	TopP               float64            `json:"top_p"`
	Truncation         string             `json:"truncation"`
	Usage              *responseUsage     `json:"usage"`
	Metadata           json.RawMessage    `json:"metadata"`
}

type responseError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type incompleteDetails struct {
	Reason string `json:"reason"`
}

type responseUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// outputMessage is an output item of type message: the assistant's text.
type outputMessage struct {
	Type    string       `json:"type"`
	ID      string       `json:"id"`
	Status  string       `json:"status"`
	Role    string       `json:"role"`
	Content []outputText `json:"content"`
}

type outputText struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
	Logprobs    []any  `json:"logprobs"`
}

// outputCall is an output item of type function_call.
type outputCall struct {
	Type      string `json:"type"`
	ID        string `json:"id"`
	Status    string `json:"status"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// responsesChat reads a Responses request as a chat request: its messages, its tools (each in
// the chat API's form, as JSON) and the extras the chat path checks (tool_choice,
// parallel_tool_calls, the text format as response_format).
func responsesChat(req *responsesRequest) ([]ChatMessage, extras, error) {
	var x extras
	switch {
	case req.PreviousResponseID != nil && *req.PreviousResponseID != "":
		return nil, x, badRequest("previous_response_id", "previous_response_id is not supported by this server: "+
			"it does not store responses; send the whole conversation in input")
	case isSet(req.Conversation):
		return nil, x, badRequest("conversation", "conversation is not supported by this server: "+
			"it does not store conversations; send the whole conversation in input")
	case isSet(req.Prompt):
		return nil, x, badRequest("prompt", "prompt (a stored prompt template) is not supported by this server; send instructions and input")
	case req.Reasoning != nil && (req.Reasoning.Effort != nil || req.Reasoning.Summary != nil):
		return nil, x, badRequest("reasoning", "reasoning settings are not supported by this server: "+
			"it cannot set the model's reasoning effort or summarise it; leave reasoning out")
	case len(req.Include) > 0:
		return nil, x, badRequest("include", "include %q is not supported by this server: its responses carry no extra data; leave include out", req.Include[0])
	case req.Truncation != nil && *req.Truncation != "disabled":
		return nil, x, badRequest("truncation", "truncation %q is not supported by this server: a conversation past the "+
			"context is an error; leave truncation out (or \"disabled\")", *req.Truncation)
	case req.TopLogprobs != nil && *req.TopLogprobs > 0:
		return nil, x, badRequest("top_logprobs", "top_logprobs = %d is not supported on /v1/responses; leave it 0", *req.TopLogprobs)
	case req.MaxToolCalls != nil:
		return nil, x, badRequest("max_tool_calls", "max_tool_calls is not supported by this server: it cannot bound the calls the model makes; leave it out")
	case req.Background != nil && *req.Background:
		return nil, x, badRequest("background", "background responses are not supported by this server; leave background out")
	}
	var msgs []ChatMessage
	if req.Instructions != nil && *req.Instructions != "" {
		msgs = append(msgs, ChatMessage{Role: "system", Content: *req.Instructions})
	}
	in, err := responsesInput(req.Input)
	if err != nil {
		return nil, x, err
	}
	msgs = append(msgs, in...)
	if len(msgs) == 0 {
		return nil, x, badRequest("input", "input is empty")
	}
	if x.Tools, err = responsesTools(req.Tools); err != nil {
		return nil, x, err
	}
	x.ToolChoice = req.ToolChoice
	var choice struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	if raw := bytes.TrimSpace(req.ToolChoice); len(raw) > 0 && raw[0] == '{' && json.Unmarshal(raw, &choice) == nil && choice.Type == "function" {
		// A named function, in the chat API's form.
		x.ToolChoice, _ = json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": choice.Name}})
	}
	x.ParallelToolCalls = req.ParallelToolCalls
	if req.Text != nil && isSet(req.Text.Format) {
		var f map[string]json.RawMessage
		if err := json.Unmarshal(req.Text.Format, &f); err != nil {
			return nil, x, badRequest("text.format", "text.format: want an object with a type")
		}
		// The chat API's form: json_schema's name, schema and strict inside "json_schema".
		var typ string
		json.Unmarshal(f["type"], &typ)
		if typ == "json_schema" {
			inner := map[string]json.RawMessage{}
			for k, v := range f {
				if k != "type" {
					inner[k] = v
				}
			}
			x.ResponseFormat, _ = json.Marshal(map[string]any{"type": "json_schema", "json_schema": inner})
		} else {
			x.ResponseFormat = req.Text.Format
		}
	}
	return msgs, x, nil
}

// responsesNames names the chat API's fields in a client error (the front's own, or a chat
// backend's: agent()'s) as the Responses API has them: response_format is text.format (whose
// json_schema's schema is text.format.schema), and a conversation past the context
// (context_length_exceeded) is the input's, with max_output_tokens for max_tokens.
func responsesNames(err error) error {
	var ae *apiErr
	var be *APIError
	format := strings.NewReplacer("response_format.json_schema", "text.format", "response_format", "text.format")
	switch {
	case errors.As(err, &ae) && strings.HasPrefix(ae.param, "response_format"):
		ae.param, ae.msg = format.Replace(ae.param), format.Replace(ae.msg)
	case errors.As(err, &be) && strings.HasPrefix(be.Param, "response_format"): // agent()'s refusal
		be.Param, be.Msg = format.Replace(be.Param), format.Replace(be.Msg)
	case errors.As(err, &ae) && ae.code == "context_length_exceeded":
		ae.param, ae.msg = inputNames(ae.param, ae.msg)
	case errors.As(err, &be) && be.Code == "context_length_exceeded":
		be.Param, be.Msg = inputNames(be.Param, be.Msg)
	}
	return err
}

// inputNames are a context-overflow error's parameter and message with the Responses API's
// names: the chat's messages are the input, its max_tokens max_output_tokens.
func inputNames(param, msg string) (string, string) {
	switch param {
	case "messages":
		param = "input"
	case "max_tokens", "max_completion_tokens":
		param = "max_output_tokens"
	}
	r := strings.NewReplacer("your messages", "your input", "in the messages", "in the input", "of the messages", "of the input",
		"in the completion", "in the output (max_output_tokens)", "or the completion", "or max_output_tokens")
	return param, r.Replace(msg)
}

func isSet(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && string(raw) != "null"
}

// responsesInput reads input: a string (one user message) or a list of items. A function_call
// item joins the assistant message just before it (the turn that made the call), or makes one;
// a function_call_output item is a tool message.
func responsesInput(raw json.RawMessage) ([]ChatMessage, error) {
	if !isSet(raw) {
		return nil, badRequest("input", "input is missing: send a string or a list of items")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []ChatMessage{{Role: "user", Content: s}}, nil
	}
	var items []responseInputItem
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("input", "input: want a string or a list of items (%v)", err)
	}
	var out []ChatMessage
	for i, it := range items {
		param := fmt.Sprintf("input[%d]", i)
		typ := it.Type
		if typ == "" && it.Role != "" {
			typ = "message"
		}
		switch typ {
		case "message":
			role := it.Role
			switch role {
			case "user", "assistant", "system":
			case "developer":
				role = "system"
			default:
				return nil, badRequest(param+".role", "%s.role %q; want user, assistant, system or developer", param, it.Role)
			}
			text, err := partsText(it.Content, param+".content")
			if err != nil {
				return nil, err
			}
			out = append(out, ChatMessage{Role: role, Content: text})
		case "function_call":
			if it.Name == "" {
				return nil, badRequest(param+".name", "%s: a function_call item needs a name", param)
			}
			args, err := argumentsText(it.Arguments)
			if err != nil {
				return nil, badRequest(param+".arguments", "%s.arguments: %v", param, err)
			}
			call := ToolCall{ID: it.CallID, Name: it.Name, Arguments: args}
			if n := len(out); n > 0 && out[n-1].Role == "assistant" {
				out[n-1].ToolCalls = append(out[n-1].ToolCalls, call)
			} else {
				out = append(out, ChatMessage{Role: "assistant", ToolCalls: []ToolCall{call}})
			}
		case "function_call_output":
			text, err := partsText(it.Output, param+".output")
			if err != nil {
				return nil, err
			}
			out = append(out, ChatMessage{Role: "tool", Content: text, ToolCallID: it.CallID})
		default:
			return nil, badRequest(param+".type", "%s is an item of type %q, which this server does not take; it takes message, "+
				"function_call and function_call_output items", param, typ)
		}
	}
	return out, nil
}

// partsText is a message's content or a call's output: a string, or a list of text parts
// (input_text, output_text).
func partsText(raw json.RawMessage, param string) (string, error) {
	if !isSet(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest(param, "%s: want a string or a list of text parts", param)
	}
	var b bytes.Buffer
	for k, p := range parts {
		switch p.Type {
		case "input_text", "output_text", "text":
			b.WriteString(p.Text)
		default:
			return "", badRequest(fmt.Sprintf("%s[%d].type", param, k), "%s[%d] is a part of type %q; this server takes text only "+
				"(input_text, output_text)", param, k, p.Type)
		}
	}
	return b.String(), nil
}

// responsesTools turns function tools ({type: function, name, description, parameters}) into
// the chat API's form ({type: function, function: {...}}), which the chat template renders.
func responsesTools(raw json.RawMessage) (json.RawMessage, error) {
	if !isSet(raw) {
		return nil, nil
	}
	var list []struct {
		Type        string          `json:"type"`
		Name        string          `json:"name"`
		Description string          `json:"description,omitempty"`
		Parameters  json.RawMessage `json:"parameters,omitempty"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, badRequest("tools", "tools must be a list of tool objects")
	}
	type function struct {
		Name        string          `json:"name"`
		Description string          `json:"description,omitempty"`
		Parameters  json.RawMessage `json:"parameters,omitempty"`
	}
	type chatTool struct {
		Type     string   `json:"type"`
		Function function `json:"function"`
	}
	out := make([]chatTool, len(list))
	for i, t := range list {
		if t.Type != "function" {
			return nil, badRequest(fmt.Sprintf("tools[%d].type", i), "tools[%d] is a tool of type %q; this server has function tools only", i, t.Type)
		}
		if t.Name == "" {
			return nil, badRequest(fmt.Sprintf("tools[%d].name", i), "tools[%d] has no name", i)
		}
		p := t.Parameters
		if !isSet(p) {
			p = nil
		}
		out[i] = chatTool{Type: "function", Function: function{Name: t.Name, Description: t.Description, Parameters: p}}
	}
	return json.Marshal(out)
}

// responseOutput is a sampled turn as a response's output items: a message with its text
// (left out when the turn is only tool calls), then a function_call item for each call, and
// whether the turn was cut by max_output_tokens.
func responseOutput(c engines.Completion, withTools bool) ([]any, bool) {
	am := AssistantMessage(c.Text, withTools)
	incomplete := c.FinishReason == "length"
	status := "completed"
	if incomplete {
		status = "incomplete"
	}
	var out []any
	if am.Content != "" || len(am.ToolCalls) == 0 {
		out = append(out, outputMessage{Type: "message", ID: newID("msg_"), Status: status, Role: "assistant",
			Content: []outputText{{Type: "output_text", Text: am.Content, Annotations: []any{}, Logprobs: []any{}}}})
	}
	for _, tc := range am.ToolCalls {
		out = append(out, outputCall{Type: "function_call", ID: newID("fc_"), Status: "completed", CallID: newID("call_"), Name: tc.Name, Arguments: tc.Arguments})
	}
	return out, incomplete
}

// responses answers POST /v1/responses through the chat path: parsed, checked and read as a chat
// call (parseResponses), sampled (generator), and written as one Response object or, streamed,
// as the API's events (responseOut).
func (h *handler) responses(w http.ResponseWriter, r *http.Request) {
	c, err := h.parseResponses(w, r)
	if err != nil {
		h.fail(w, err)
		return
	}
	generate, release, err := h.generator(w, r, c.gr, c.explicit, c.req.Stream, c.msgs, c.tu)
	if err != nil {
		h.fail(w, responsesNames(err))
		return
	}
	defer release()
	out := h.startResponse(w, r, c)
	comps, err := generate(r.Context(), out.piece())
	if err != nil {
		out.fail(r.Context(), err)
		return
	}
	out.write(comps)
}

// responsesCall is a Responses request, parsed and checked: the request, its engine request (the
// sampling settings, ID "resp_…"), whether it gave max_output_tokens, and the chat messages and
// tool use it reads as.
type responsesCall struct {
	req      responsesRequest
	gr       engines.GenerateRequest
	explicit bool
	msgs     []ChatMessage
	tu       toolUse
}

// parseResponses reads a Responses request and checks it as a chat call (responsesChat); its
// errors are the client's, past the body's decoding in the Responses API's names.
func (h *handler) parseResponses(w http.ResponseWriter, r *http.Request) (responsesCall, error) {
	var c responsesCall
	if err := h.decode(w, r, &c.req); err != nil {
		return c, err
	}
	req := &c.req
	msgs, x, err := responsesChat(req)
	if err == nil {
		s := sampling{Model: req.Model, MaxCompletionTokens: req.MaxOutputTokens, Temperature: req.Temperature, TopP: req.TopP, maxTokensParam: "max_output_tokens"}
		c.gr, c.explicit, err = h.request(s)
	}
	if err == nil {
		c.tu, err = x.toolFields()
	}
	if err != nil {
		return c, responsesNames(err)
	}
	c.msgs = msgs
	c.gr.ID = "resp_" + c.gr.ID
	return c, nil
}

// responseOut writes the answer to a Responses call: the Response object once the sample is done
// or, streamed, the API's events: created and in_progress at once, the message's text as the
// engine samples it (where it streams), then each output item and the completed (or incomplete)
// response.
type responseOut struct {
	h      *handler
	w      http.ResponseWriter
	read   bool // tool calls are read from the answer (toolUse.read)
	obj    responseObject
	ev     *eventStream // nil: not streamed
	deltas *textDeltas
	msgID  string // the message item announced while sampling; "": none yet
}

// startResponse begins the answer: the Response object before sampling (in_progress, with the
// request's settings) and, streamed, its created and in_progress events.
func (h *handler) startResponse(w http.ResponseWriter, r *http.Request, c responsesCall) *responseOut {
	req := &c.req
	obj := responseObject{ID: c.gr.ID, Object: "response", CreatedAt: time.Now().Unix(), Status: "in_progress",
		Instructions: req.Instructions, MaxOutputTokens: req.MaxOutputTokens, Model: h.modelName(r), Output: []any{},
		ParallelToolCalls: req.ParallelToolCalls == nil || *req.ParallelToolCalls, Temperature: c.gr.Temperature, TopP: c.gr.TopP,
		Text: responseText{Format: json.RawMessage(`{"type":"text"}`)}, ToolChoice: json.RawMessage(`"auto"`), Tools: []json.RawMessage{},
		Truncation: "disabled", Metadata: json.RawMessage(`{}`)}
	if req.Text != nil && isSet(req.Text.Format) {
		obj.Text.Format = req.Text.Format
	}
	if isSet(req.ToolChoice) {
		obj.ToolChoice = req.ToolChoice
	}
	if isSet(req.Metadata) {
		obj.Metadata = req.Metadata
	}
	if isSet(req.Tools) {
		json.Unmarshal(req.Tools, &obj.Tools)
	}
	o := &responseOut{h: h, w: w, read: c.tu.read, obj: obj}
	if !req.Stream {
		return o
	}
	o.ev = &eventStream{s: startStream(w)}
	o.ev.send("response.created", map[string]any{"response": o.obj})
	o.ev.send("response.in_progress", map[string]any{"response": o.obj})
	o.deltas = newTextDeltas(c.gr.Stop, c.tu.read)
	return o
}

// piece is what sampling hands the sample's text as it grows: streamed, it sends what is new
// (held back where it may turn out to be a stop sequence or a tool call), announcing the message
// item with the first text that may be sent; nil when not streamed.
func (o *responseOut) piece() func(index int, text string) {
	if o.ev == nil {
		return nil
	}
	return func(index int, text string) {
		delta := o.deltas.add(text)
		if index != 0 || delta == "" {
			return
		}
		if o.msgID == "" {
			o.msgID = newID("msg_")
			o.ev.send("response.output_item.added", map[string]any{"output_index": 0,
				"item": outputMessage{Type: "message", ID: o.msgID, Status: "in_progress", Role: "assistant", Content: []outputText{}}})
			o.ev.send("response.content_part.added", map[string]any{"item_id": o.msgID, "output_index": 0, "content_index": 0,
				"part": outputText{Type: "output_text", Annotations: []any{}, Logprobs: []any{}}})
		}
		o.textDelta(delta)
	}
}

// textDelta sends more text of the message item announced while sampling.
func (o *responseOut) textDelta(delta string) {
	o.ev.send("response.output_text.delta", map[string]any{"item_id": o.msgID, "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []any{}})
}

// fail answers a failed sampling: an error event once the stream has begun (nothing to a client
// that left: ctx is done), else the API's error.
func (o *responseOut) fail(ctx context.Context, err error) {
	if o.ev == nil {
		o.h.fail(o.w, responsesNames(err))
		return
	}
	if ctx.Err() == nil {
		o.ev.fail(o.h, responsesNames(err))
	}
}

// write answers the sample: the completed Response object or, streamed, the events of its
// output items and its end.
func (o *responseOut) write(comps []engines.Completion) {
	o.complete(comps)
	if o.ev == nil {
		writeJSON(o.w, o.obj)
		return
	}
	for i, item := range o.obj.Output {
		switch it := item.(type) {
		case outputMessage:
			item = o.sendMessage(i, it)
		case outputCall:
			o.sendCall(i, it)
		}
		o.ev.send("response.output_item.done", map[string]any{"output_index": i, "item": item})
	}
	if o.obj.Status == "incomplete" {
		o.ev.send("response.incomplete", map[string]any{"response": o.obj})
	} else {
		o.ev.send("response.completed", map[string]any{"response": o.obj})
	}
}

// complete fills the Response object in from the sample: its output items, its status (incomplete
// when cut by max_output_tokens) and its usage.
func (o *responseOut) complete(comps []engines.Completion) {
	o.obj.Status = "completed"
	if len(comps) == 0 {
		return
	}
	c := comps[0]
	var incomplete bool
	o.obj.Output, incomplete = responseOutput(c, o.read)
	if incomplete {
		o.obj.Status, o.obj.IncompleteDetails = "incomplete", &incompleteDetails{Reason: "max_output_tokens"}
	}
	u := &responseUsage{InputTokens: len(c.PromptTokens), OutputTokens: len(c.Tokens)}
	u.TotalTokens = u.InputTokens + u.OutputTokens
	o.obj.Usage = u
}

// sendMessage streams output item i, a message: the rest of its text when it was announced while
// sampling, else the whole item; then its text's and part's ends. It returns the item as sent
// (with the announced item's id).
func (o *responseOut) sendMessage(i int, it outputMessage) outputMessage {
	part := it.Content[0]
	if i == 0 && o.msgID != "" { // announced while sampling: the rest of its text
		it.ID = o.msgID
		o.obj.Output[i] = it
		if rest := o.deltas.rest(part.Text); rest != "" {
			o.textDelta(rest)
		}
	} else {
		added := it
		added.Status, added.Content = "in_progress", []outputText{}
		o.ev.send("response.output_item.added", map[string]any{"output_index": i, "item": added})
		empty := part
		empty.Text = ""
		o.ev.send("response.content_part.added", map[string]any{"item_id": it.ID, "output_index": i, "content_index": 0, "part": empty})
		o.ev.send("response.output_text.delta", map[string]any{"item_id": it.ID, "output_index": i, "content_index": 0, "delta": part.Text, "logprobs": []any{}})
	}
	o.ev.send("response.output_text.done", map[string]any{"item_id": it.ID, "output_index": i, "content_index": 0, "text": part.Text, "logprobs": []any{}})
	o.ev.send("response.content_part.done", map[string]any{"item_id": it.ID, "output_index": i, "content_index": 0, "part": part})
	return it
}

// sendCall streams output item i, a function call: the item, then its arguments in one delta.
func (o *responseOut) sendCall(i int, it outputCall) {
	added := it
	added.Status, added.Arguments = "in_progress", ""
	o.ev.send("response.output_item.added", map[string]any{"output_index": i, "item": added})
	o.ev.send("response.function_call_arguments.delta", map[string]any{"item_id": it.ID, "output_index": i, "delta": it.Arguments})
	o.ev.send("response.function_call_arguments.done", map[string]any{"item_id": it.ID, "output_index": i, "name": it.Name, "arguments": it.Arguments})
}

// eventStream writes the Responses API's server-sent events: "event: TYPE" and the event's
// JSON, with its type and sequence number.
type eventStream struct {
	s   *stream
	seq int
}

func (e *eventStream) send(typ string, fields map[string]any) {
	fields["type"] = typ
	fields["sequence_number"] = e.seq
	e.seq++
	b, _ := json.Marshal(fields)
	fmt.Fprintf(e.s.w, "event: %s\ndata: %s\n\n", typ, b)
	e.s.flush()
}

// fail ends the stream with an error event: a client's mistake (a conversation past the
// context, say) with its code, the server's own failure as server_error.
func (e *eventStream) fail(h *handler, err error) {
	code, param := "server_error", ""
	var ae *apiErr
	var be *APIError
	switch {
	case errors.As(err, &ae):
		code, param = ae.code, ae.param
		if code == "" {
			code = ae.typ
		}
	case errors.As(err, &be):
		code, param = be.Code, be.Param
		if code == "" {
			code = be.Type
		}
	default:
		if h.o.Logf != nil {
			h.o.Logf("openai front: %v", err)
		}
	}
	f := map[string]any{"code": code, "message": err.Error(), "param": nil}
	if param != "" {
		f["param"] = param
	}
	e.send("error", f)
}
