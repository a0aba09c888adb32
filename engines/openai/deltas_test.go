package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// pacedEngine answers every request with its pieces joined, handing them over one by one as a
// TokenStreamer; after the first it waits until the test has seen it arrive (gate), so a stream
// that sends nothing before sampling ends never gets past that wait (10 s, then an error).
type pacedEngine struct {
	*scripted.Engine
	pieces []string
	gate   chan struct{}
}

func newPaced(pieces ...string) *pacedEngine {
	return &pacedEngine{Engine: scripted.Echo(strings.Join(pieces, "")), pieces: pieces, gate: make(chan struct{})}
}

func (p *pacedEngine) GenerateStream(ctx context.Context, reqs []engines.GenerateRequest, piece func(req, index int, text string)) ([]engines.Completion, error) {
	for k, s := range p.pieces {
		if piece != nil {
			piece(0, 0, s)
		}
		if k == 0 {
			select {
			case <-p.gate:
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(10 * time.Second):
				return nil, errors.New("the first piece did not reach the client while the engine sampled")
			}
		}
	}
	return p.Engine.Generate(ctx, reqs)
}

func (p *pacedEngine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return p.GenerateStream(ctx, reqs, nil)
}

// readStream posts body and calls data with each event's data (not [DONE]) as it arrives.
func readStream(t *testing.T, url, body string, data func(line string)) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line, ok := strings.CutPrefix(sc.Text(), "data: "); ok && line != "[DONE]" {
			data(line)
		}
	}
}

// TestStreamAsSampled: a streamed chat completion sends the text the engine has sampled while it
// still samples (the engine waits, after its first piece, for the client to have it), and the
// deltas add up to the answer; with include_usage the last chunk has the usage.
func TestStreamAsSampled(t *testing.T) {
	eng := newPaced("Hel", "lo, ", "world.")
	base := front(t, eng, HandlerOptions{})
	var text string
	var last chatResponse
	readStream(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`, func(line string) {
		var c chatResponse
		if err := json.Unmarshal([]byte(line), &c); err != nil || c.Object != "chat.completion.chunk" {
			t.Fatalf("chunk %s", line)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil {
				text += *ch.Delta.Content
			}
		}
		if text == "Hel" {
			select {
			case <-eng.gate:
			default:
				close(eng.gate)
			}
		}
		last = c
	})
	if text != "Hello, world." || last.Usage == nil || last.Usage.CompletionTokens == 0 {
		t.Fatalf("streamed %q, last chunk %+v", text, last)
	}
}

// TestCompletionsStreamAsSampled: /v1/completions streams a prompt's text the same way.
func TestCompletionsStreamAsSampled(t *testing.T) {
	eng := newPaced("12", "+30")
	base := front(t, eng, HandlerOptions{})
	var text string
	readStream(t, base+"/completions", `{"prompt":[5,6,7],"stream":true}`, func(line string) {
		var c completionResponse
		if err := json.Unmarshal([]byte(line), &c); err != nil || len(c.Choices) != 1 {
			t.Fatalf("chunk %s", line)
		}
		if text += c.Choices[0].Text; text == "12" {
			close(eng.gate)
		}
	})
	if text != "12+30" {
		t.Fatalf("streamed %q", text)
	}
}

// TestResponsesStreamAsSampled: /v1/responses streams its output text the same way: the message
// item is announced and its first delta sent while the engine samples; the deltas add up to the
// text of the completed response, whose message item has the announced id.
func TestResponsesStreamAsSampled(t *testing.T) {
	eng := newPaced("Hel", "lo.")
	base := front(t, eng, HandlerOptions{})
	var text, itemID string
	var done map[string]any
	readStream(t, base+"/responses", `{"input":"hi","stream":true}`, func(line string) {
		var ev map[string]any
		json.Unmarshal([]byte(line), &ev)
		switch ev["type"] {
		case "response.output_item.added":
			itemID = ev["item"].(map[string]any)["id"].(string)
		case "response.output_text.delta":
			if ev["item_id"] != itemID {
				t.Errorf("a delta of item %v; the item added is %q", ev["item_id"], itemID)
			}
			text += ev["delta"].(string)
			if text == "Hel" {
				close(eng.gate)
			}
		case "response.completed":
			done = ev["response"].(map[string]any)
		case "error":
			t.Fatalf("error event %s", line)
		}
	})
	if text != "Hello." || done == nil {
		t.Fatalf("streamed %q, completed %v", text, done)
	}
	out := done["output"].([]any)[0].(map[string]any)
	if out["id"] != itemID || out["content"].([]any)[0].(map[string]any)["text"] != "Hello." {
		t.Errorf("completed output %v; the streamed item %q", out, itemID)
	}
}

// TestStreamToolCallDeltas: with tools, the text before a call streams as content (its trailing
// space held back, as a message with calls has its content trimmed), the call's tag and JSON
// never do, and the call goes out as the API's deltas of tool_calls: its index, id, type and name
// with empty arguments, then its arguments; finish_reason tool_calls.
func TestStreamToolCallDeltas(t *testing.T) {
	eng := newPaced("Let me ", "check. <tool", `_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>`)
	close(eng.gate)
	base := front(t, eng, HandlerOptions{ToolsPrompt: func([]string) string { return "tools" }})
	var content []string
	var calls []wireToolCall
	var finish string
	readStream(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"1+2?"}],"stream":true,
		"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]}`, func(line string) {
		var c chatResponse
		json.Unmarshal([]byte(line), &c)
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil && *ch.Delta.Content != "" {
				content = append(content, *ch.Delta.Content)
			}
			calls = append(calls, ch.Delta.ToolCalls...)
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
	})
	if strings.Join(content, "|") != "Let me| check." {
		t.Errorf("content deltas %q", content)
	}
	if len(calls) != 2 || *calls[0].Index != 0 || calls[0].ID == "" || calls[0].Type != "function" || calls[0].Function.Name != "calc" ||
		string(calls[0].Function.Arguments) != `""` || *calls[1].Index != 0 || calls[1].ID != "" || calls[1].Function.Name != "" ||
		string(calls[1].Function.Arguments) != `"{\"expr\":\"1+2\"}"` || finish != "tool_calls" {
		t.Errorf("tool call deltas %+v, finish %q", calls, finish)
	}
}

// TestTextDeltas: what a stream may send of a growing text: never a stop string or what may
// become one, never a tool call's tag (with tools), nor whitespace a message with calls would
// trim, nor half a UTF-8 character; rest is the remainder of the final content.
func TestTextDeltas(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stops  []string
		tools  bool
		pieces []string
		want   []string // what each piece lets out
		final  string   // the answer's content
		rest   string
	}{
		{"plain", nil, false, []string{"a", "b "}, []string{"a", "b "}, "ab ", ""},
		{"a stop string held back, then cut", []string{"END"}, false, []string{"x E", "N", "Dy"}, []string{"x ", "", ""}, "x ", ""},
		{"a false start of a stop string", []string{"END"}, false, []string{"x EN", "o"}, []string{"x ", "ENo"}, "x ENo", ""},
		{"a tool call closes the content", nil, true, []string{"\n", "Hi <tool_", "call>{}", " more"}, []string{"", "\nHi", "", ""}, "Hi more", ""},
		{"whitespace before a call is never sent", nil, true, []string{"\n\n", "<tool_call>"}, []string{"", ""}, "", ""},
		{"a cut character waits", nil, false, []string{"caf\xc3", "\xa9!"}, []string{"caf", "é!"}, "café!", ""},
		{"the end sends what was held", []string{"END"}, false, []string{"x E"}, []string{"x "}, "x E", "E"},
	} {
		d := newTextDeltas(tc.stops, tc.tools)
		var got []string
		for _, p := range tc.pieces {
			got = append(got, d.add(p))
		}
		if strings.Join(got, "|") != strings.Join(tc.want, "|") {
			t.Errorf("%s: deltas %q; want %q", tc.name, got, tc.want)
		}
		if r := d.rest(tc.final); r != tc.rest {
			t.Errorf("%s: rest %q; want %q", tc.name, r, tc.rest)
		}
	}
}
