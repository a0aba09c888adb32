// Package constrain keeps a sampler to a grammar: a JSON value following a JSON schema (the
// OpenAI API's response_format) or Hermes tool calls whose arguments follow their functions'
// parameters (tool_choice "required" or a named function, parallel_tool_calls false). A grammar
// is compiled to a byte-level pushdown automaton (Grammar); a Matcher pairs it with a tokenizer's
// vocabulary and says, at each step, which tokens may come next: a token is allowed when its
// text walks the automaton without a dead end, special tokens only as an end-of-sequence token
// where the automaton accepts.
//
// The automaton never reaches a state with no way to an accepted end, so a sampler that picks
// only allowed tokens produces a string of the grammar unless max_tokens cuts it. Whitespace
// between JSON tokens is bounded (MaxSpace bytes a run) and numbers are at most MaxNumber bytes,
// so the model cannot stall in them forever. engines/torch/slimen_torch/constrain.py is the same
// automaton in Python; testdata/constrain/cases.json holds the cases both test suites run.
package constrain

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// Spec is what a response must follow, as it travels in engines.Sampling.Constraint (as JSON).
// Schema or Calls is set, or both: then the response is either the calls or, instead of any call,
// a JSON value of Schema (tools offered with tool_choice "auto" beside response_format).
type Spec struct {
	// Schema: the response is one JSON value following this JSON schema ({"type": "object"} is
	// response_format json_object), with at most MaxSpace bytes of whitespace before and after.
	Schema json.RawMessage `json:"json_schema,omitempty"`
	// Calls: the response is Hermes tool calls.
	Calls *Calls `json:"tool_calls,omitempty"`
}

// Calls is a response of Hermes tool calls: <tool_call>{"name": NAME, "arguments": {…}}</tool_call>,
// NAME one of Tools' and the arguments following its parameters, with whitespace around the JSON
// and between calls.
type Calls struct {
	Tools []Tool `json:"tools"`
	// Text lets the response begin with free text before its first call (and be text only); the
	// call, once its tag is written, follows the grammar.
	Text bool `json:"text,omitempty"`
	// Min is the least number of calls (0 or 1), Max the most (0: no limit). parallel_tool_calls
	// false is Max 1: the turn ends after the first call.
	Min int `json:"min,omitempty"`
	Max int `json:"max,omitempty"`
}

// Tool is a function a call may name, with the JSON schema of its arguments (nil: any object).
type Tool struct {
	Name       string          `json:"name"`
	Parameters json.RawMessage `json:"parameters,omitempty"`
}

// Tool call tags, as engines.ToolCallOpen and ToolCallClose write them.
const (
	callOpen  = "<tool_call>"
	callClose = "</tool_call>"
)

// MaxSpace is the most whitespace bytes in a run between two JSON tokens (or around a value or a
// call). MaxNumber is the most bytes of a number.
const (
	MaxSpace  = 4
	MaxNumber = 24
)

// Parse reads a Spec from its JSON (engines.Sampling.Constraint).
func Parse(text string) (Spec, error) {
	var s Spec
	d := json.NewDecoder(strings.NewReader(text))
	d.DisallowUnknownFields()
	if err := d.Decode(&s); err != nil {
		return Spec{}, fmt.Errorf("constraint: %v", err)
	}
	if len(s.Schema) == 0 && s.Calls == nil {
		return Spec{}, fmt.Errorf("constraint: set json_schema or tool_calls")
	}
	return s, nil
}

// String is the Spec as JSON, what engines.Sampling.Constraint holds.
func (s Spec) String() string {
	b, _ := json.Marshal(s)
	return string(b)
}

// Compile compiles a Spec. Errors name the place in the spec (json_schema.properties.age.minimum,
// tool_calls.tools[0].parameters.format); CompileSchema and CompileCalls take the prefix a
// request gives the same place.
func Compile(s Spec) (*Grammar, error) {
	if s.Calls != nil {
		g, err := CompileCalls(*s.Calls, "tool_calls.tools")
		if err != nil || len(s.Schema) == 0 {
			return g, err
		}
		if s.Calls.Text {
			return nil, fmt.Errorf("tool_calls.text: free text and a json_schema answer together are not supported")
		}
		a, err := CompileSchema(s.Schema, "json_schema")
		if err != nil {
			return nil, err
		}
		g.answer = a.body
		return g, nil
	}
	return CompileSchema(s.Schema, "json_schema")
}

// CompileSchema compiles a grammar of one JSON value following schema. path names the schema in
// errors: "response_format.json_schema.schema.properties.age.minimum is not supported".
func CompileSchema(schema json.RawMessage, path string) (*Grammar, error) {
	c := newCompiler(schema, path)
	n, err := c.compile(schema, path)
	if err != nil {
		return nil, err
	}
	return &Grammar{root: frame{kind: kEnd}, body: n, nodes: c.count}, nil
}

// CompileCalls compiles a grammar of Hermes tool calls. path names the tools in errors (the
// function i's parameters are path[i].parameters).
func CompileCalls(calls Calls, path string) (*Grammar, error) {
	if len(calls.Tools) == 0 {
		return nil, fmt.Errorf("%s: no tools to call", path)
	}
	if calls.Min < 0 || calls.Min > 1 || calls.Max < 0 || (calls.Max > 0 && calls.Max < calls.Min) {
		return nil, fmt.Errorf("%s: calls min %d, max %d; want min 0 or 1 and max 0 (any) or at least min", path, calls.Min, calls.Max)
	}
	c := newCompiler(nil, path)
	body := c.newNode()
	for i, t := range calls.Tools {
		where := fmt.Sprintf("%s[%d]", path, i)
		if t.Name == "" {
			return nil, fmt.Errorf("%s.name is empty", where)
		}
		params := t.Parameters
		if len(bytes.TrimSpace(params)) == 0 || string(bytes.TrimSpace(params)) == "null" {
			params = json.RawMessage(`{"type": "object"}`)
		}
		pc := newCompiler(params, where+".parameters")
		pc.count = c.count
		args, err := pc.compile(params, where+".parameters")
		if err != nil {
			return nil, err
		}
		c.count = pc.count
		if !args.types.has(tObject) || args.lits != nil || len(args.anyOf) > 0 {
			return nil, fmt.Errorf("%s.parameters: a function's parameters must be an object schema", where)
		}
		if args.types != tObject { // a schema without a type: the arguments are still an object
			obj := *args
			obj.types = tObject
			args = &obj
		}
		name := c.newNode()
		name.lits = newLitTrie()
		name.lits.id = name.id
		enc, _ := json.Marshal(t.Name)
		name.lits.add(enc)
		call := c.newNode()
		call.types = tObject
		call.addProp("name", name)
		call.addProp("arguments", args)
		call.required = 3
		body.anyOf = append(body.anyOf, call)
	}
	for _, n := range body.anyOf {
		n.finish()
	}
	g := &Grammar{root: frame{kind: kCalls, st: callsBefore}, body: body, nodes: c.count,
		calls: &callsSpec{text: calls.Text, min: calls.Min, max: calls.Max,
			open: litsOf(-3, callOpen), close: litsOf(-4, callClose)}}
	if calls.Text {
		g.root.st = callsText
	}
	return g, nil
}

// Grammar is a compiled constraint: an automaton over the bytes of the response.
type Grammar struct {
	root  frame // the bottom frame: kEnd (a value, then whitespace) or kCalls
	body  *node // the value (kEnd) or one call's JSON object (kCalls)
	calls *callsSpec
	// answer (kCalls): a value that may stand instead of the calls (nil: none).
	answer *node
	nodes  int
}

type callsSpec struct {
	text        bool
	min, max    int
	open, close *litTrie
}

// Start is the state before the response's first byte.
func (g *Grammar) Start() State {
	s := &stack{f: g.root}
	if g.root.kind == kEnd {
		s = &stack{f: frame{kind: kValue, n: g.body}, up: s}
	}
	return State{g: g, alts: []*stack{s}}
}

// State is where the automaton is: the stacks of the ways the bytes so far can be read (more
// than one only inside anyOf alternatives that begin alike). States are values: Feed returns a
// new one.
type State struct {
	g    *Grammar
	alts []*stack
}

// Dead says whether no way of reading the bytes is left.
func (s State) Dead() bool { return len(s.alts) == 0 }

// Feed returns the state after text's bytes; a dead state (Dead) when the grammar has no string
// that begins with what was fed.
func (s State) Feed(text string) State {
	for i := 0; i < len(text) && !s.Dead(); i++ {
		s = s.feed(int(text[i]))
	}
	return s
}

func (s State) feed(b int) State {
	var out []*stack
	for _, a := range s.alts {
		out = s.g.step(a, b, out)
		if len(out) > maxAlts {
			out = out[:maxAlts]
		}
	}
	return State{g: s.g, alts: out}
}

// maxAlts bounds the ways a State keeps (anyOf alternatives that begin alike).
const maxAlts = 64

// Accepts says whether the response may end here.
func (s State) Accepts() bool {
	for _, a := range s.alts {
		for _, t := range s.g.step(a, eof, nil) {
			if t == accepted {
				return true
			}
		}
	}
	return false
}

// Match says whether text is a whole string of the grammar.
func (g *Grammar) Match(text string) bool {
	s := g.Start().Feed(text)
	return !s.Dead() && s.Accepts()
}
