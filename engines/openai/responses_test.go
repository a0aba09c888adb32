package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// scriptedFront serves a scripted engine that answers every prompt with reply and records the
// prompts, with tools described in the system message (the tiny engine's template has no tools
// variable).
func scriptedFront(t *testing.T, reply string) (string, *[]string) {
	var prompts []string
	eng := scripted.New(func(r scripted.Request) string {
		prompts = append(prompts, r.Prompt)
		return reply
	})
	base := front(t, eng, HandlerOptions{Model: "s", ToolsPrompt: func(tools []string) string { return "TOOLS " + strings.Join(tools, ";") }})
	return base, &prompts
}

// sseEvents reads a Responses stream: each event's name (the "event:" line) and its data, which
// must carry the same type and sequence numbers 0, 1, 2, ...
func sseEvents(t *testing.T, body string) ([]string, []map[string]any) {
	t.Helper()
	var names []string
	var datas []map[string]any
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(nil, 1<<20)
	name := ""
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			var d map[string]any
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &d); err != nil {
				t.Fatalf("event data %q: %v", line, err)
			}
			if d["type"] != name || d["sequence_number"] != float64(len(datas)) {
				t.Fatalf("event %q (number %d) has data %v", name, len(datas), d)
			}
			names, datas = append(names, name), append(datas, d)
		}
	}
	return names, datas
}

// TestResponsesText: /v1/responses answers text from the chat path: instructions as the system
// message, a string input as the user's, the response object's fields, usage; a list input with
// an earlier turn, its function call and the call's output is rendered exactly as the same
// conversation sent to /v1/chat/completions.
func TestResponsesText(t *testing.T) {
	base, prompts := scriptedFront(t, "Paris.")
	status, body := post(t, base+"/responses", `{"model":"s","instructions":"Be brief.","input":"Capital of France?","max_output_tokens":20,"temperature":0.5}`)
	var resp struct {
		ID, Object, Status, Model string
		Output                    []struct {
			Type, ID, Role, Status string
			Content                []struct{ Type, Text string }
		}
		Usage struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
			TotalTokens  int `json:"total_tokens"`
		}
		Temperature     float64
		MaxOutputTokens int `json:"max_output_tokens"`
	}
	if status != 200 || json.Unmarshal([]byte(body), &resp) != nil {
		t.Fatalf("%d %s", status, body)
	}
	if !strings.HasPrefix(resp.ID, "resp_") || resp.Object != "response" || resp.Status != "completed" || resp.Model != "s" ||
		len(resp.Output) != 1 || resp.Output[0].Type != "message" || resp.Output[0].Role != "assistant" || !strings.HasPrefix(resp.Output[0].ID, "msg_") ||
		len(resp.Output[0].Content) != 1 || resp.Output[0].Content[0].Type != "output_text" || resp.Output[0].Content[0].Text != "Paris." ||
		resp.Usage.InputTokens == 0 || resp.Usage.OutputTokens == 0 || resp.Usage.TotalTokens != resp.Usage.InputTokens+resp.Usage.OutputTokens ||
		resp.Temperature != 0.5 || resp.MaxOutputTokens != 20 {
		t.Errorf("response %s", body)
	}
	want := scripted.RenderChat([]engines.Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Capital of France?"}}, true)
	if len(*prompts) != 1 || (*prompts)[0] != want {
		t.Errorf("the engine's prompt %q, want %q", *prompts, want)
	}

	// A conversation in items, and the same one as chat messages.
	*prompts = nil
	status, body = post(t, base+"/responses", `{"model":"s","input":[
		{"role":"developer","content":"Use the tool."},
		{"type":"message","role":"user","content":[{"type":"input_text","text":"12*34"},{"type":"input_text","text":"?"}]},
		{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Let me see."}]},
		{"type":"function_call","call_id":"c1","name":"calc","arguments":"{\"expr\": \"12*34\"}"},
		{"type":"function_call_output","call_id":"c1","output":"408"}]}`)
	if status != 200 {
		t.Fatalf("%d %s", status, body)
	}
	status, body = post(t, base+"/chat/completions", `{"model":"s","messages":[
		{"role":"system","content":"Use the tool."},
		{"role":"user","content":"12*34?"},
		{"role":"assistant","content":"Let me see.","tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":"{\"expr\": \"12*34\"}"}}]},
		{"role":"tool","tool_call_id":"c1","content":"408"}]}`)
	if status != 200 || len(*prompts) != 2 || (*prompts)[0] != (*prompts)[1] || !strings.Contains((*prompts)[0], "408") {
		t.Errorf("responses and chat prompts differ: %q (%d %s)", *prompts, status, body)
	}
}

// TestResponsesToolCall: function tools in the Responses form reach the template as the chat
// API's tools; the policy's Hermes call is a function_call item with a call_id, its arguments a
// JSON string; tool_choice "none" leaves it text.
func TestResponsesToolCall(t *testing.T) {
	base, prompts := scriptedFront(t, `Sure.<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>`)
	tools := `"tools":[{"type":"function","name":"calc","description":"Evaluates arithmetic.","parameters":{"type":"object","properties":{"expr":{"type":"string"}}},"strict":true}]`
	status, body := post(t, base+"/responses", `{"model":"s","input":"12*34?",`+tools+`}`)
	var resp struct {
		Status string
		Output []struct {
			Type, ID, Status, Name, Arguments string
			CallID                            string `json:"call_id"`
			Content                           []struct{ Text string }
		}
		Tools []map[string]any
	}
	if status != 200 || json.Unmarshal([]byte(body), &resp) != nil || len(resp.Output) != 2 {
		t.Fatalf("%d %s", status, body)
	}
	msg, call := resp.Output[0], resp.Output[1]
	if msg.Type != "message" || msg.Content[0].Text != "Sure." || call.Type != "function_call" || call.Name != "calc" ||
		call.Arguments != `{"expr":"12*34"}` || !strings.HasPrefix(call.CallID, "call_") || !strings.HasPrefix(call.ID, "fc_") ||
		call.Status != "completed" || resp.Status != "completed" || len(resp.Tools) != 1 || resp.Tools[0]["name"] != "calc" {
		t.Errorf("response %s", body)
	}
	wantTools := `TOOLS {"type":"function","function":{"name":"calc","description":"Evaluates arithmetic.","parameters":{"type":"object","properties":{"expr":{"type":"string"}}}}}`
	if len(*prompts) != 1 || !strings.Contains((*prompts)[0], wantTools) {
		t.Errorf("the engine's prompt %q, want the tools %s", *prompts, wantTools)
	}
	status, body = post(t, base+"/responses", `{"model":"s","input":"12*34?","tool_choice":"none",`+tools+`}`)
	if status != 200 || !strings.Contains(body, `"text":"Sure.\u003ctool_call\u003e`) || strings.Contains(body, `"function_call"`) {
		t.Errorf("tool_choice none: %d %s", status, body)
	}
}

// TestResponsesStream: a streamed response is the API's events in order, with the text and the
// calls, and response.completed carries the whole response.
func TestResponsesStream(t *testing.T) {
	for _, tc := range []struct {
		name, reply string
		want        []string
	}{
		{"text", "Paris.", []string{"response.created", "response.in_progress",
			"response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.done",
			"response.content_part.done", "response.output_item.done", "response.completed"}},
		{"call", `<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>`, []string{"response.created", "response.in_progress",
			"response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
			"response.output_item.done", "response.completed"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base, _ := scriptedFront(t, tc.reply)
			status, body := post(t, base+"/responses", `{"model":"s","input":"hi","stream":true,"tools":[{"type":"function","name":"calc","parameters":{"type":"object"}}]}`)
			if status != 200 {
				t.Fatalf("%d %s", status, body)
			}
			names, datas := sseEvents(t, body)
			if !slices.Equal(names, tc.want) {
				t.Fatalf("events %q, want %q\n%s", names, tc.want, body)
			}
			final := datas[len(datas)-1]["response"].(map[string]any)
			out := final["output"].([]any)
			item := out[0].(map[string]any)
			if final["status"] != "completed" || len(out) != 1 || datas[0]["response"].(map[string]any)["status"] != "in_progress" {
				t.Fatalf("final response %v", final)
			}
			done := datas[len(datas)-2]["item"].(map[string]any)
			if done["id"] != item["id"] || datas[2]["item"].(map[string]any)["id"] != item["id"] {
				t.Errorf("the items' ids differ: %s", body)
			}
			switch tc.name {
			case "text":
				if datas[4]["delta"] != "Paris." || datas[5]["text"] != "Paris." || item["content"].([]any)[0].(map[string]any)["text"] != "Paris." {
					t.Errorf("text events: %s", body)
				}
			case "call":
				if item["type"] != "function_call" || item["name"] != "calc" || item["arguments"] != `{"expr":"1+1"}` ||
					datas[3]["delta"] != `{"expr":"1+1"}` || datas[4]["arguments"] != `{"expr":"1+1"}` {
					t.Errorf("call events: %s", body)
				}
			}
		})
	}
}

// TestResponsesRefusals: what the server does not do is a 400 naming the field, never ignored;
// a cut answer is incomplete with max_output_tokens as the reason.
func TestResponsesRefusals(t *testing.T) {
	base, _ := scriptedFront(t, "a long answer")
	for _, tc := range []struct{ body, param, msg string }{
		{`{"input":"hi","previous_response_id":"resp_1"}`, "previous_response_id", "does not store responses"},
		{`{"input":"hi","tools":[{"type":"web_search"}]}`, "tools[0].type", `"web_search"`},
		{`{"input":[{"type":"reasoning","summary":[]}]}`, "input[0].type", `"reasoning"`},
		{`{"input":[{"role":"user","content":[{"type":"input_image","image_url":"x"}]}]}`, "input[0].content[0].type", "text only"},
		{`{"input":[{"role":"tool","content":"x"}]}`, "input[0].role", `"tool"`},
		{`{"input":"hi","max_output_tokens":0}`, "max_output_tokens", "max_output_tokens = 0"},
		{`{"input":"hi","include":["reasoning.encrypted_content"]}`, "include", "reasoning.encrypted_content"},
		{`{"input":[]}`, "input", "input is empty"},
		{`{"instructions":"x"}`, "input", "input is missing"},
		{`{"input":"hi","text":{"format":{"type":"json_schema","name":"x","schema":{"type":"object"}}}}`, "text.format", "text.format is not supported by this server's engine: it does not constrain decoding"},
		{`{"input":"hi","text":{"format":{"type":"json_schema","name":"x","schema":{"type":"string","format":"email"}}}}`, "text.format.schema", "text.format.schema.format is not supported"},
	} {
		status, body := post(t, base+"/responses", tc.body)
		wantError(t, tc.body, status, body, 400, tc.param, "", tc.msg)
	}
	status, body := post(t, base+"/responses", `{"input":"hi","max_output_tokens":2}`)
	if status != 200 || !strings.Contains(body, `"status":"incomplete"`) || !strings.Contains(body, `"incomplete_details":{"reason":"max_output_tokens"}`) {
		t.Errorf("a cut answer: %d %s", status, body)
	}
}

// TestResponsesContextNames: a conversation past the context is answered on /v1/responses with
// the Responses API's names (input, max_output_tokens), streamed or not, from the front's own
// check and from a chat backend's (agent()'s endpoint); the chat path keeps messages and
// max_tokens.
func TestResponsesContextNames(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{})
	long := strings.Repeat("1+", 300) // 600 tokens: past tiny-arith's 512
	for _, tc := range []struct{ name, path, body, param, msg string }{
		{"input past the context", "/responses", `{"input":"` + long + `"}`, "input", "your input resulted in"},
		{"max_output_tokens beside the input", "/responses", `{"input":"` + strings.Repeat("1", 100) + `","max_output_tokens":500}`, "max_output_tokens", "(103 in the input, 500 in the output (max_output_tokens)). Please reduce the length of the input or max_output_tokens."},
		{"the chat's names", "/chat/completions", `{"messages":[{"role":"user","content":"` + strings.Repeat("1", 100) + `"}],"max_tokens":500}`, "max_tokens", "(103 in the messages, 500 in the completion)"},
	} {
		status, body := post(t, base+tc.path, tc.body)
		wantError(t, tc.name, status, body, 400, tc.param, "context_length_exceeded", tc.msg)
	}
	_, body := post(t, base+"/responses", `{"input":"`+long+`","stream":true}`)
	if !strings.Contains(body, `"param":"input"`) || !strings.Contains(body, "your input resulted in") {
		t.Errorf("streamed: %s", body)
	}

	backend := httptest.NewServer(NewChatHandler(HandlerOptions{}, func(context.Context, ChatCall) ([]engines.Completion, error) {
		return nil, &APIError{Status: 400, Type: "invalid_request_error", Param: "messages", Code: "context_length_exceeded",
			Msg: "This model's maximum context length is 8 tokens. However, your messages resulted in 9 tokens, which leaves no room for a response. Please reduce the length of the messages."}
	}))
	defer backend.Close()
	status, body := post(t, backend.URL+"/v1/responses", `{"input":"hi"}`)
	wantError(t, "a backend's overflow", status, body, 400, "input", "context_length_exceeded", "your input resulted in 9 tokens, which leaves no room for a response. Please reduce the length of the input.")
}

// TestResponsesBackendFormatName: a chat backend's refusal of response_format (agent()'s, on an
// engine that does not constrain) names text.format on /v1/responses.
func TestResponsesBackendFormatName(t *testing.T) {
	backend := httptest.NewServer(NewChatHandler(HandlerOptions{}, func(context.Context, ChatCall) ([]engines.Completion, error) {
		return nil, NoConstraint("response_format")
	}))
	defer backend.Close()
	status, body := post(t, backend.URL+"/v1/responses", `{"input":"hi","text":{"format":{"type":"json_object"}}}`)
	wantError(t, "a backend's refusal", status, body, 400, "text.format", "", "text.format is not supported by this server's engine")
	if strings.Contains(body, "response_format") {
		t.Errorf("the refusal names the chat API's field: %s", body)
	}
}

// TestResponsesOpenAIClient: the official openai Python package's client.responses.create (plain,
// with a tool call, the call's output sent back, streamed) and its responses.stream helper,
// which checks the events' order, against the front. Skipped without python3 and openai.
func TestResponsesOpenAIClient(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err == nil {
		err = exec.Command(py, "-c", "import openai").Run()
	}
	if err != nil {
		t.Skip("needs python3 with the openai package")
	}
	var prompts []string
	eng := scripted.New(func(r scripted.Request) string {
		prompts = append(prompts, r.Prompt)
		if strings.Contains(r.Prompt, "calc") && !strings.Contains(r.Prompt, "408") {
			return `<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>`
		}
		return "It is 408."
	})
	base := front(t, eng, HandlerOptions{Model: "s", Token: "sk-x", ToolsPrompt: func(tools []string) string { return "TOOLS " + strings.Join(tools, ";") }})
	script := filepath.Join(t.TempDir(), "client.py")
	os.WriteFile(script, []byte(`
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="sk-x", max_retries=0)
r = c.responses.create(model="s", instructions="Be brief.", input="hi", max_output_tokens=50, temperature=0.7, top_p=0.9)
assert r.output_text == "It is 408.", r
assert r.status == "completed" and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > 0, r
tools = [{"type": "function", "name": "calc", "description": "Evaluates.", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}]
r = c.responses.create(model="s", input="12*34?", tools=tools)
call = r.output[0]
assert call.type == "function_call" and call.name == "calc" and json.loads(call.arguments) == {"expr": "12*34"}, r
history = [{"role": "user", "content": "12*34?"}] + [o.model_dump(exclude_none=True) for o in r.output]
history.append({"type": "function_call_output", "call_id": call.call_id, "output": "408"})
r = c.responses.create(model="s", input=history, tools=tools)
assert r.output_text == "It is 408.", r
kinds = [e.type for e in c.responses.create(model="s", input="12*34?", tools=tools, stream=True)]
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
with c.responses.stream(model="s", input="hi") as s:
    text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    final = s.get_final_response()
assert text == "It is 408." == final.output_text, (text, final)
print("OK")
`), 0o644)
	out, err := exec.Command(py, script, base).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "OK" {
		t.Fatalf("the openai client: %v\n%s", err, out)
	}
	if len(prompts) != 5 || !strings.Contains(prompts[2], "408") || !strings.Contains(prompts[2], `"name": "calc"`) {
		t.Errorf("the engine's prompts %q", prompts)
	}
}
