package engines

import "strings"

// Tool calls in the Hermes format that Qwen's chat templates use: `<tool_call>{"name": …,
// "arguments": {…}}</tool_call>` inside an assistant turn's text. starlib's tools.star parses them
// for scripts, and the OpenAI front of agent() turns them into the API's tool_calls.
const (
	ToolCallOpen  = "<tool_call>"
	ToolCallClose = "</tool_call>"
)

// RawToolCall is one `<tool_call>` block of a text: what stands between the tags, and whether the
// block was closed.
type RawToolCall struct {
	Text   string
	Closed bool
}

// SplitToolCalls returns the tool-call blocks of text, in order, and the text outside them (the
// content of the turn besides its calls). A block opened again before it closed ends there; one
// never closed runs to the end of the text.
func SplitToolCalls(text string) (calls []RawToolCall, rest string) {
	var outside strings.Builder
	for {
		i := strings.Index(text, ToolCallOpen)
		if i < 0 {
			outside.WriteString(text)
			return calls, outside.String()
		}
		outside.WriteString(text[:i])
		text = text[i+len(ToolCallOpen):]
		j := strings.Index(text, ToolCallClose)
		if k := strings.Index(text, ToolCallOpen); k >= 0 && (j < 0 || k < j) {
			calls = append(calls, RawToolCall{Text: text[:k]})
			text = text[k:]
			continue
		}
		if j < 0 {
			return append(calls, RawToolCall{Text: text}), outside.String()
		}
		calls = append(calls, RawToolCall{Text: text[:j], Closed: true})
		text = text[j+len(ToolCallClose):]
	}
}
