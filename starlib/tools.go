package starlib

import (
	"fmt"
	"math/big"
	"strings"

	"go.starlark.net/lib/json"
	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"

	"github.com/slimen/slimen/engines"
)

// Tools is @slimen//tools.star: tool calls in the Hermes format that Qwen's chat templates use,
// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
var Tools = &starlarkstruct.Module{
	Name: "tools",
	Members: starlark.StringDict{
		"parse_tool_calls": starlark.NewBuiltin("tools.parse_tool_calls", toolsParse),
		"system_prompt":    starlark.NewBuiltin("tools.system_prompt", toolsSystemPrompt),
		"calc":             starlark.NewBuiltin("tools.calc", toolsCalc),
	},
}

const toolCallClose = engines.ToolCallClose

// toolsParse is parse_tool_calls(completion or text): the tool calls of a response, in order,
// each a dict {"name", "arguments", "error", "raw"}. A well-formed call has a string name, an
// arguments dict (a JSON object, or a string holding one) and error None; a malformed one (not
// JSON, no name, arguments not an object, no closing tag) has name and arguments None and error
// saying what is wrong, so a script can see it and reward it. raw is the text between the tags.
func toolsParse(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var v starlark.Value
	if err := starlark.UnpackPositionalArgs(b.Name(), args, kwargs, 1, &v); err != nil {
		return nil, err
	}
	text, err := textOf(b.Name(), v)
	if err != nil {
		return nil, err
	}
	var out []starlark.Value
	calls, _ := engines.SplitToolCalls(text)
	for _, raw := range calls {
		out = append(out, parseToolCall(thread, raw))
	}
	return starlark.NewList(out), nil
}

// textOf is a string argument, or the text of a completion (any value with a string .text).
func textOf(fn string, v starlark.Value) (string, error) {
	if s, ok := v.(starlark.String); ok {
		return string(s), nil
	}
	if h, ok := v.(starlark.HasAttrs); ok {
		if t, err := h.Attr("text"); err == nil {
			if s, ok := t.(starlark.String); ok {
				return string(s), nil
			}
		}
	}
	return "", fmt.Errorf("%s: want a completion or a string, got %s", fn, v.Type())
}

func parseToolCall(thread *starlark.Thread, c engines.RawToolCall) starlark.Value {
	raw := strings.TrimSpace(c.Text)
	d := starlark.NewDict(4)
	d.SetKey(starlark.String("raw"), starlark.String(raw))
	fail := func(msg string) starlark.Value {
		d.SetKey(starlark.String("name"), starlark.None)
		d.SetKey(starlark.String("arguments"), starlark.None)
		d.SetKey(starlark.String("error"), starlark.String(msg))
		return d
	}
	if !c.Closed {
		return fail("the tool call has no closing " + toolCallClose)
	}
	obj, err := jsonDecode(thread, raw)
	if err != nil {
		return fail("not JSON: " + err.Error())
	}
	m, ok := obj.(*starlark.Dict)
	if !ok {
		return fail(fmt.Sprintf("a tool call is a JSON object, got %s", obj.Type()))
	}
	name, _, _ := m.Get(starlark.String("name"))
	if s, ok := name.(starlark.String); !ok || s == "" {
		return fail(`the tool call has no "name" string`)
	}
	a, found, _ := m.Get(starlark.String("arguments"))
	if !found {
		a = starlark.NewDict(0) // a call of a function without parameters
	}
	switch x := a.(type) {
	case *starlark.Dict:
	case starlark.String: // some models write the arguments as a JSON string
		inner, err := jsonDecode(thread, string(x))
		if _, isDict := inner.(*starlark.Dict); err != nil || !isDict {
			return fail(`"arguments" is a string that does not hold a JSON object`)
		}
		a = inner
	default:
		return fail(fmt.Sprintf(`"arguments" must be a JSON object, got %s`, a.Type()))
	}
	d.SetKey(starlark.String("name"), name)
	d.SetKey(starlark.String("arguments"), a)
	d.SetKey(starlark.String("error"), starlark.None)
	return d
}

func jsonDecode(thread *starlark.Thread, s string) (starlark.Value, error) {
	return starlark.Call(thread, json.Module.Members["decode"], starlark.Tuple{starlark.String(s)}, nil)
}

// toolsSystemPrompt is system_prompt(tools): ToolsSystemPrompt of a list of schemas (dicts or
// JSON strings).
func toolsSystemPrompt(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var tools starlark.Iterable
	if err := starlark.UnpackPositionalArgs(b.Name(), args, kwargs, 1, &tools); err != nil {
		return nil, err
	}
	var schemas []string
	for i, t := range collect(tools) {
		switch t := t.(type) {
		case starlark.String:
			schemas = append(schemas, string(t))
		case *starlark.Dict:
			s, err := starlark.Call(thread, json.Module.Members["encode"], starlark.Tuple{t}, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: tools[%d]: %v", b.Name(), i, err)
			}
			schemas = append(schemas, string(s.(starlark.String)))
		default:
			return nil, fmt.Errorf("%s: tools[%d] is a %s; a tool schema is a dict", b.Name(), i, t.Type())
		}
	}
	return starlark.String(ToolsSystemPrompt(schemas)), nil
}

// ToolsSystemPrompt describes tools (JSON schemas) and the Hermes call format in a system
// message's words: what a chat puts in its system message for a model whose chat template has no
// `tools` variable.
func ToolsSystemPrompt(schemas []string) string {
	var b strings.Builder
	b.WriteString("# Tools\n\nYou may call functions to help with the request. Their signatures are within <tools></tools>:\n<tools>")
	for _, s := range schemas {
		b.WriteString("\n" + s)
	}
	b.WriteString("\n</tools>\n\nTo call a function, answer with a JSON object of its name and arguments within <tool_call></tool_call> tags:\n" +
		"<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
	return b.String()
}

// toolsCalc is calc(expr): the calculator tool of the agent examples. It evaluates integer
// arithmetic with + - * and the usual precedence (spaces ignored) and returns the result as a
// string, or "error: …" for anything else, the message a tool gives back to the model.
func toolsCalc(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var expr string
	if err := starlark.UnpackPositionalArgs(b.Name(), args, kwargs, 1, &expr); err != nil {
		return nil, err
	}
	return starlark.String(Calc(expr)), nil
}

// Calc evaluates integer arithmetic with + - * (see calc in @slimen//tools.star). Results are
// exact at any size, but an expression longer than 200 characters is refused.
func Calc(expr string) string {
	s := strings.ReplaceAll(expr, " ", "")
	switch {
	case s == "":
		return "error: empty expression"
	case len(s) > 200:
		return "error: expression too long"
	}
	total, term := new(big.Int), big.NewInt(1)
	sign, num := 1, ""
	for i := 0; i <= len(s); i++ {
		ch := byte('+')
		if i < len(s) {
			ch = s[i]
		}
		if ch >= '0' && ch <= '9' {
			num += string(ch)
			continue
		}
		if (ch != '+' && ch != '-' && ch != '*') || num == "" {
			return fmt.Sprintf("error: cannot read %q", expr)
		}
		n, _ := new(big.Int).SetString(num, 10)
		term.Mul(term, n)
		num = ""
		if ch == '*' {
			continue
		}
		if sign < 0 {
			term.Neg(term)
		}
		total.Add(total, term)
		sign, term = 1, big.NewInt(1)
		if ch == '-' {
			sign = -1
		}
	}
	return total.String()
}
