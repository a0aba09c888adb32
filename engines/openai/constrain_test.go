package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// TestFrontResponseFormat: response_format json_schema and json_object are kept by constrained
// decoding on the tiny engine: the arithmetic model, which answers in \boxed{} prose, answers
// with JSON of the schema under every seed.
func TestFrontResponseFormat(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{})
	schema := `{"type":"object","properties":{"answer":{"type":"integer"},"sure":{"type":"boolean"}},"required":["answer","sure"],"additionalProperties":false}`
	for seed := range 6 {
		for _, format := range []string{`{"type":"json_schema","json_schema":{"name":"a","strict":true,"schema":` + schema + `}}`, `{"type":"json_object"}`} {
			status, body := post(t, base+"/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":"Tom has 5 apples and buys 8 more. How many?"}],"max_tokens":120,"seed":%d,"response_format":%s}`, seed, format))
			var resp chatResponse
			if status != 200 || json.Unmarshal([]byte(body), &resp) != nil || len(resp.Choices) != 1 {
				t.Fatalf("%d %s", status, body)
			}
			ch := resp.Choices[0]
			if *ch.FinishReason != "stop" {
				continue // cut by max_tokens
			}
			var v map[string]any
			if err := json.Unmarshal([]byte(*ch.Message.Content), &v); err != nil {
				t.Fatalf("seed %d, %s: %q is not a JSON object", seed, format, *ch.Message.Content)
			}
			if strings.Contains(format, "json_schema") {
				if _, ok := v["answer"].(float64); !ok || len(v) != 2 {
					t.Fatalf("seed %d: %q does not follow the schema", seed, *ch.Message.Content)
				}
				if _, ok := v["sure"].(bool); !ok {
					t.Fatalf("seed %d: %q does not follow the schema", seed, *ch.Message.Content)
				}
			}
		}
	}
	// Without the format the model answers in prose: the constraint is what makes it JSON.
	status, body := post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"Tom has 5 apples and buys 8 more. How many?"}],"max_tokens":120,"seed":1}`)
	if status != 200 || strings.Contains(body, `"content":"{`) {
		t.Fatalf("unconstrained: %d %s", status, body)
	}
}

// TestFrontToolChoiceDecoding: tool_choice "required", a named function and
// parallel_tool_calls false are kept in decoding on the tiny engine, whose arithmetic model never
// calls a tool by itself: every answer is exactly the calls asked for, arguments of the
// function's schema.
func TestFrontToolChoiceDecoding(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{ToolsPrompt: func(tools []string) string { return "Tools: add, ask." }})
	tools := `"tools":[{"type":"function","function":{"name":"add","parameters":{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}},"required":["a","b"],"additionalProperties":false}}},` +
		`{"type":"function","function":{"name":"ask","parameters":{"type":"object","properties":{"q":{"type":"string"}},"required":["q"],"additionalProperties":false}}}]`
	// The tools' description is short: the arithmetic model's context is 512 tokens.
	ask := `"messages":[{"role":"user","content":"What is 12+30?"}],"max_tokens":400,`
	for _, tc := range []struct {
		name, extra string
		one         bool
		fn          string
	}{
		{"required", `"tool_choice":"required"`, false, ""},
		{"required, one call", `"tool_choice":"required","parallel_tool_calls":false`, true, ""},
		{"named", `"tool_choice":{"type":"function","function":{"name":"add"}}`, false, "add"},
		{"auto, one call", `"parallel_tool_calls":false`, true, ""},
	} {
		made := 0
		for seed := range 6 {
			status, body := post(t, base+"/chat/completions", fmt.Sprintf(`{%s%s,"seed":%d,%s}`, ask, tc.extra, seed, tools))
			var resp chatResponse
			if status != 200 || json.Unmarshal([]byte(body), &resp) != nil {
				t.Fatalf("%s: %d %s", tc.name, status, body)
			}
			ch := resp.Choices[0]
			if *ch.FinishReason == "length" {
				continue
			}
			calls := ch.Message.ToolCalls
			if tc.name == "auto, one call" && len(calls) == 0 {
				if ch.Message.Content == nil || strings.Contains(*ch.Message.Content, "<tool_call>") {
					t.Fatalf("%s: %s", tc.name, body)
				}
				continue
			}
			made++
			if len(calls) == 0 || (tc.one && len(calls) != 1) || *ch.FinishReason != "tool_calls" {
				t.Fatalf("%s, seed %d: %s", tc.name, seed, body)
			}
			if tc.name != "auto, one call" && ch.Message.Content != nil {
				t.Fatalf("%s, seed %d: text beside the calls: %s", tc.name, seed, body)
			}
			for _, c := range calls {
				var args string
				json.Unmarshal(c.Function.Arguments, &args)
				var v map[string]any
				if err := json.Unmarshal([]byte(args), &v); err != nil {
					t.Fatalf("%s: arguments %q", tc.name, args)
				}
				switch {
				case tc.fn != "" && c.Function.Name != tc.fn:
					t.Fatalf("%s: called %q", tc.name, c.Function.Name)
				case c.Function.Name == "add" && (len(v) != 2 || v["a"] == nil || v["b"] == nil):
					t.Fatalf("%s: add(%s)", tc.name, args)
				case c.Function.Name == "ask" && (len(v) != 1 || v["q"] == nil):
					t.Fatalf("%s: ask(%s)", tc.name, args)
				}
			}
		}
		if made == 0 && tc.name != "auto, one call" {
			t.Errorf("%s: no answer finished within max_tokens", tc.name)
		}
	}
	// Left to itself (tool_choice auto), the model makes no call.
	for seed := range 3 {
		_, body := post(t, base+"/chat/completions", fmt.Sprintf(`{%s"seed":%d,%s}`, ask, seed, tools))
		if strings.Contains(body, `"tool_calls":[`) {
			t.Fatalf("the model calls a tool by itself: %s", body)
		}
	}
}

// TestFrontNoConstraintEngine: an engine that does not constrain decoding (no "constrain"
// capability) refuses response_format and parallel_tool_calls false with a 400 naming them.
func TestFrontNoConstraintEngine(t *testing.T) {
	eng := scripted.New(func(r scripted.Request) string { return "plain" })
	base := front(t, eng, HandlerOptions{ToolsPrompt: func(tools []string) string { return "TOOLS" }})
	tool := `"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]`
	for _, tc := range []struct{ body, param string }{
		{`{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}`, "response_format"},
		{`{"messages":[{"role":"user","content":"hi"}],"parallel_tool_calls":false,` + tool + `}`, "parallel_tool_calls"},
	} {
		status, body := post(t, base+"/chat/completions", tc.body)
		wantError(t, tc.body, status, body, 400, tc.param, "", "does not constrain decoding")
	}
}

// TestFrontFormatBesideTools: response_format beside tools with tool_choice auto: the answer is
// either the calls or the format's JSON, never prose; on /v1/responses text.format is kept alike.
func TestFrontFormatBesideTools(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{ToolsPrompt: func(tools []string) string { return "Tools: go." }})
	tools := `"tools":[{"type":"function","function":{"name":"go","parameters":{"type":"object","additionalProperties":false}}}]`
	format := `"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}}}`
	for seed := range 6 {
		status, body := post(t, base+"/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":"2+3="}],"seed":%d,%s,%s}`, seed, tools, format))
		var resp chatResponse
		if status != 200 || json.Unmarshal([]byte(body), &resp) != nil {
			t.Fatalf("%d %s", status, body)
		}
		ch := resp.Choices[0]
		switch {
		case *ch.FinishReason == "length":
		case *ch.FinishReason == "tool_calls":
			if len(ch.Message.ToolCalls) == 0 || ch.Message.ToolCalls[0].Function.Name != "go" {
				t.Fatalf("seed %d: %s", seed, body)
			}
		default:
			var v map[string]bool
			if err := json.Unmarshal([]byte(*ch.Message.Content), &v); err != nil || len(v) != 1 {
				t.Fatalf("seed %d: %q is neither a call nor the format's JSON", seed, *ch.Message.Content)
			}
		}
	}
	status, body := post(t, base+"/responses", `{"input":"2+3=","max_output_tokens":100,"seed":1,"text":{"format":{"type":"json_schema","name":"a","schema":{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}}}}`)
	if status != 200 || !strings.Contains(body, `"output_text"`) {
		t.Fatalf("%d %s", status, body)
	}
	var r struct {
		Status string `json:"status"`
		Output []struct {
			Content []struct {
				Text string `json:"text"`
			} `json:"content"`
		} `json:"output"`
	}
	json.Unmarshal([]byte(body), &r)
	if r.Status == "completed" {
		var v map[string]bool
		if err := json.Unmarshal([]byte(r.Output[0].Content[0].Text), &v); err != nil {
			t.Fatalf("responses: %q is not the format's JSON", r.Output[0].Content[0].Text)
		}
	}
}

// TestEngineRefusesConstraint: the openai engine (an external server) is never silently sent a
// constraint it would drop: it refuses the request with ErrNotSupported.
func TestEngineRefusesConstraint(t *testing.T) {
	e, err := New(Options{BaseURL: "http://127.0.0.1:1/v1", Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	_, err = e.Generate(context.Background(), []engines.GenerateRequest{{ID: "x", PromptTokens: []int32{1},
		Sampling: engines.Sampling{MaxTokens: 4, Temperature: 1, Constraint: `{"json_schema": {"type": "object"}}`}}})
	if !errors.Is(err, engines.ErrNotSupported) {
		t.Fatalf("error %v; want ErrNotSupported", err)
	}
}
