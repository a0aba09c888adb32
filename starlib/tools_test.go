package starlib

import (
	"strings"
	"testing"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

func TestParseToolCalls(t *testing.T) {
	header := `
load("@slimen//tools.star", "parse_tool_calls", "system_prompt")
def names(calls):
    return [(c["name"], c["arguments"], c["error"]) for c in calls]`
	runScriptCases(t, header, []scriptCase{
		{src: `got = names(parse_tool_calls('I will compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "12*34"}}\n</tool_call>'))`,
			want: `[("calc", {"expr": "12*34"}, None)]`},
		{src: `got = parse_tool_calls("no calls here")`, want: `[]`},
		// two calls, in order; arguments written as a JSON string; no arguments at all
		{src: `got = names(parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call> and <tool_call>{"name": "b"}</tool_call>'))`,
			want: `[("a", {"k": 2}, None), ("b", {}, None)]`},
		// malformed: a visible result, never a crash
		{src: `got = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call>')[0]["error"].startswith("not JSON")`, want: `True`},
		{src: `got = parse_tool_calls('<tool_call>[1, 2]</tool_call>')[0]["error"]`, want: `"a tool call is a JSON object, got list"`},
		{src: `got = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[0]["error"]`, want: `"the tool call has no \"name\" string"`},
		{src: `got = parse_tool_calls('<tool_call>{"name": "f", "arguments": 3}</tool_call>')[0]["error"]`, want: `"\"arguments\" must be a JSON object, got int"`},
		{src: `got = names(parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}'))`, want: `[(None, None, "the tool call has no closing </tool_call>")]`},
		{src: `got = parse_tool_calls('<tool_call>{"name": "f"} <tool_call>{"name": "g"}</tool_call>')[1]["name"]`, want: `"g"`},
		{src: `got = parse_tool_calls('<tool_call> {"name": "f"} </tool_call>')[0]["raw"]`, want: `"{\"name\": \"f\"}"`},
		{src: `got = "<tools>\n{\"name\":\"calc\"}\n</tools>" in system_prompt([{"name": "calc"}])`, want: `True`},
		{src: `got = parse_tool_calls(3)`, wantErr: "tools.parse_tool_calls: want a completion or a string, got int"},
	})
	// A completion (any value with a string .text) is read by its text.
	c := starlarkstruct.FromStringDict(starlarkstruct.Default, starlark.StringDict{"text": starlark.String(`<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>`)})
	got, err := starlark.Call(&starlark.Thread{}, Tools.Members["parse_tool_calls"], starlark.Tuple{c}, nil)
	if err != nil || !strings.Contains(got.String(), `"name": "calc"`) {
		t.Errorf("parse_tool_calls(completion) = %v, %v", got, err)
	}
	if !strings.Contains(ToolsSystemPrompt([]string{`{"a":1}`}), "<tool_call>") {
		t.Error("the system prompt does not show the call format")
	}
}

func TestCalc(t *testing.T) {
	for expr, want := range map[string]string{
		"12*34": "408", "2+3*4-5": "9", " 7 ": "7", "47*29": "1363", "100-250": "-150", "2*3*4+1": "25",
		"99999999999*99999999999": "9999999999800000000001",
	} {
		if got := Calc(expr); got != want {
			t.Errorf("Calc(%q) = %q, want %q", expr, got, want)
		}
	}
	for _, bad := range []string{"", "2**3", "1+", "(1+2)", "x", "-3"} {
		if got := Calc(bad); !strings.HasPrefix(got, "error: ") {
			t.Errorf("Calc(%q) = %q, want an error", bad, got)
		}
	}
}
