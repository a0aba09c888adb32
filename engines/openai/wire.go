package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// The JSON of the OpenAI API, as far as slimen speaks it, in both directions: the client (Engine)
// sends requests and reads responses, the front (Handler) reads requests and sends responses.
// vLLM's extensions ride along: return_token_ids asks for prompt_token_ids and token_ids in the
// response, return_tokens_as_token_ids writes each log-prob's token as "token_id:N".

type chatMessage struct {
	Role       string         `json:"role"`
	Content    textContent    `json:"content"`
	ToolCalls  []wireToolCall `json:"tool_calls,omitempty"`   // an assistant's calls
	ToolCallID string         `json:"tool_call_id,omitempty"` // a tool message: the call it answers
	Name       string         `json:"name,omitempty"`
}

// wireToolCall is one tool call of an assistant message (or, with Index, of a stream's delta).
type wireToolCall struct {
	Index    *int   `json:"index,omitempty"`
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string          `json:"name,omitempty"` // left out of a stream's deltas after a call's first
		Arguments json.RawMessage `json:"arguments"`      // a JSON string holding the object; some clients send the object
	} `json:"function"`
}

// textContent is a message's content: a string, or a list of parts of which only text parts are
// understood (what the API allows for every role).
type textContent string

func (c *textContent) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte("null")) {
		*c = ""
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*c = textContent(s)
		return nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(b, &parts); err != nil {
		return fmt.Errorf("content: want a string or a list of text parts")
	}
	var sb strings.Builder
	for _, p := range parts {
		if p.Type != "text" {
			return fmt.Errorf("content part of type %q: only text parts are supported", p.Type)
		}
		sb.WriteString(p.Text)
	}
	*c = textContent(sb.String())
	return nil
}

// stopList is stop: a string or a list of strings.
type stopList []string

func (s *stopList) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte("null")) {
		*s = nil
		return nil
	}
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*s = stopList{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return fmt.Errorf("stop: want a string or a list of strings")
	}
	*s = many
	return nil
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// sampling are the settings chat and text completions share.
type sampling struct {
	Model               string         `json:"model"`
	N                   *int           `json:"n,omitempty"`
	MaxTokens           *int           `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int           `json:"max_completion_tokens,omitempty"`
	Temperature         *float64       `json:"temperature,omitempty"`
	TopP                *float64       `json:"top_p,omitempty"`
	Stop                stopList       `json:"stop,omitempty"`
	Seed                *int64         `json:"seed,omitempty"`
	Stream              bool           `json:"stream,omitempty"`
	StreamOptions       *streamOptions `json:"stream_options,omitempty"`
	// vLLM's extensions.
	ReturnTokenIDs         bool `json:"return_token_ids,omitempty"`
	ReturnTokensAsTokenIDs bool `json:"return_tokens_as_token_ids,omitempty"`
	// maxTokensParam, when not empty, is what the request called MaxCompletionTokens, for its
	// errors (a Responses request's max_output_tokens).
	maxTokensParam string
}

type chatRequest struct {
	sampling
	Messages    []chatMessage `json:"messages"`
	Logprobs    bool          `json:"logprobs,omitempty"`
	TopLogprobs *int          `json:"top_logprobs,omitempty"`
}

type completionRequest struct {
	sampling
	Prompt   prompts `json:"prompt"`
	Logprobs *int    `json:"logprobs,omitempty"` // how many alternatives besides the sampled token
	Echo     bool    `json:"echo,omitempty"`
}

// prompts is a completion request's prompt: a string, a list of token ids, or a list of either.
// Exactly one of each element's text and ids is set; the client sends ids only.
type prompts []prompt

type prompt struct {
	text   string
	ids    []int32
	isText bool
}

func (p prompts) MarshalJSON() ([]byte, error) {
	if len(p) == 1 && !p[0].isText {
		return json.Marshal(p[0].ids)
	}
	out := make([]any, len(p))
	for i, q := range p {
		if q.isText {
			out[i] = q.text
		} else {
			out[i] = q.ids
		}
	}
	return json.Marshal(out)
}

func (p *prompts) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*p = prompts{{text: s, isText: true}}
		return nil
	}
	var ids []int32
	if err := json.Unmarshal(b, &ids); err == nil {
		if len(ids) == 0 {
			return fmt.Errorf("prompt: an empty list")
		}
		*p = prompts{{ids: ids}}
		return nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(b, &list); err != nil || len(list) == 0 {
		return fmt.Errorf("prompt: want a string, a list of token ids, or a non-empty list of either")
	}
	out := make(prompts, len(list))
	for i, e := range list {
		if err := json.Unmarshal(e, &out[i].text); err == nil {
			out[i].isText = true
		} else if err := json.Unmarshal(e, &out[i].ids); err != nil {
			return fmt.Errorf("prompt[%d]: want a string or a list of token ids", i)
		}
	}
	*p = out
	return nil
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type chatResponse struct {
	ID             string       `json:"id"`
	Object         string       `json:"object"`
	Created        int64        `json:"created"`
	Model          string       `json:"model"`
	Choices        []chatChoice `json:"choices"`
	Usage          *usage       `json:"usage,omitempty"`
	PromptTokenIDs []int32      `json:"prompt_token_ids,omitempty"` // vLLM, with return_token_ids
}

type chatChoice struct {
	Index        int              `json:"index"`
	Message      *responseMessage `json:"message,omitempty"` // a response
	Delta        *responseMessage `json:"delta,omitempty"`   // a stream chunk
	Logprobs     *chatLogprobs    `json:"logprobs"`
	FinishReason *string          `json:"finish_reason"`
	TokenIDs     []int32          `json:"token_ids,omitempty"` // vLLM, with return_token_ids
}

type responseMessage struct {
	Role      string         `json:"role,omitempty"`
	Content   *string        `json:"content,omitempty"`
	ToolCalls []wireToolCall `json:"tool_calls,omitempty"`
}

type chatLogprobs struct {
	Content []tokenLogprob `json:"content"`
}

type tokenLogprob struct {
	Token       string         `json:"token"`
	Logprob     float64        `json:"logprob"`
	Bytes       []int          `json:"bytes"`
	TopLogprobs []tokenLogprob `json:"top_logprobs"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   *usage             `json:"usage,omitempty"`
}

type completionChoice struct {
	Index          int                 `json:"index"`
	Text           string              `json:"text"`
	Logprobs       *completionLogprobs `json:"logprobs"`
	FinishReason   *string             `json:"finish_reason"`
	PromptTokenIDs []int32             `json:"prompt_token_ids,omitempty"` // vLLM, with return_token_ids
	TokenIDs       []int32             `json:"token_ids,omitempty"`        // vLLM, with return_token_ids
}

type completionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []*float64           `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

type modelList struct {
	Object string      `json:"object"`
	Data   []modelInfo `json:"data"`
}

type modelInfo struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	MaxModelLen int    `json:"max_model_len,omitempty"` // vLLM
}

// errorBody is the error JSON of the API.
type errorBody struct {
	Error apiError `json:"error"`
}

type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    any     `json:"code"`
}

// tokenizeRequest and tokenizeResponse are vLLM's /tokenize (at the server's root, not under /v1).
type tokenizeRequest struct {
	Model            string `json:"model,omitempty"`
	Prompt           string `json:"prompt"`
	AddSpecialTokens bool   `json:"add_special_tokens"`
}

type tokenizeResponse struct {
	Tokens      []int32 `json:"tokens"`
	Count       int     `json:"count"`
	MaxModelLen int     `json:"max_model_len,omitempty"`
}

// tokenIDString is how return_tokens_as_token_ids writes a token: "token_id:N".
func tokenIDString(id int32) string { return "token_id:" + strconv.Itoa(int(id)) }

// parseTokenID reads a "token_id:N" token.
func parseTokenID(s string) (int32, bool) {
	n, ok := strings.CutPrefix(s, "token_id:")
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseInt(n, 10, 32)
	return int32(v), err == nil
}
