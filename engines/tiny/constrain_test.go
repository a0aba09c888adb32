package tiny

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/constrain"
)

// personSchema is the schema of the constrained-decoding tests: nested objects, an array, an
// enum, an optional property and a nullable one.
const personSchema = `{"type": "object", "properties": {
	"name": {"type": "string"},
	"age": {"type": "integer"},
	"ok": {"type": "boolean"},
	"tags": {"type": "array", "items": {"enum": ["a", "b"]}},
	"pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"], "additionalProperties": false}]}
}, "required": ["name", "age", "tags", "pet"], "additionalProperties": false}`

// validate checks v against a schema of the subset the constraint compiles: type, properties,
// required, additionalProperties false, enum, items, anyOf. It is written here, apart from the
// automaton, so that a mistake in one is not repeated in the other.
func validate(schema map[string]any, v any, path string) error {
	if alts, ok := schema["anyOf"].([]any); ok {
		for _, a := range alts {
			if validate(a.(map[string]any), v, path) == nil {
				return nil
			}
		}
		return fmt.Errorf("%s: %v matches no anyOf alternative", path, v)
	}
	if enum, ok := schema["enum"].([]any); ok {
		for _, e := range enum {
			if fmt.Sprint(e) == fmt.Sprint(v) {
				return nil
			}
		}
		return fmt.Errorf("%s: %v not in enum", path, v)
	}
	switch schema["type"] {
	case "object":
		obj, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: %v is not an object", path, v)
		}
		props, _ := schema["properties"].(map[string]any)
		for _, r := range schema["required"].([]any) {
			if _, ok := obj[r.(string)]; !ok {
				return fmt.Errorf("%s: %q missing", path, r)
			}
		}
		for k, x := range obj {
			p, ok := props[k]
			if !ok {
				if schema["additionalProperties"] == false {
					return fmt.Errorf("%s: %q not allowed", path, k)
				}
				continue
			}
			if err := validate(p.(map[string]any), x, path+"."+k); err != nil {
				return err
			}
		}
	case "array":
		list, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%s: %v is not an array", path, v)
		}
		for i, x := range list {
			if err := validate(schema["items"].(map[string]any), x, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	case "string":
		if _, ok := v.(string); !ok {
			return fmt.Errorf("%s: %v is not a string", path, v)
		}
	case "integer":
		f, ok := v.(float64)
		if !ok || f != float64(int64(f)) {
			return fmt.Errorf("%s: %v is not an integer", path, v)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			return fmt.Errorf("%s: %v is not a boolean", path, v)
		}
	case "null":
		if v != nil {
			return fmt.Errorf("%s: %v is not null", path, v)
		}
	}
	return nil
}

// TestConstrainedJSON: a random-weights model (which writes noise unconstrained) answers with JSON
// of the schema under every seed, finished by EOS; the log-probs are the model's own (what Score
// computes for the same tokens); a request samples the same tokens alone and in a batch.
func TestConstrainedJSON(t *testing.T) {
	e, err := New(ModelConfig{Hidden: 16, Intermediate: 32, Layers: 1, Heads: 2, MaxSeqLen: 256}, 3, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var schema map[string]any
	if err := json.Unmarshal([]byte(personSchema), &schema); err != nil {
		t.Fatal(err)
	}
	spec := constrain.Spec{Schema: json.RawMessage(personSchema)}.String()
	ctx := context.Background()
	prompt := e.tok.Encode("<|user|>Who?<|end|><|assistant|>")
	var reqs []engines.GenerateRequest
	for seed := range 24 {
		temp := 1.0
		if seed%6 == 5 {
			temp = 0
		}
		reqs = append(reqs, engines.GenerateRequest{ID: fmt.Sprint(seed), PromptTokens: prompt, N: 1,
			Sampling: engines.Sampling{MaxTokens: 200, Temperature: temp, TopP: 0.95, Seed: uint64(seed), Constraint: spec}})
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	g, err := constrain.CompileSchema(json.RawMessage(personSchema), "schema")
	if err != nil {
		t.Fatal(err)
	}
	stopped := 0
	for i, c := range cs {
		if c.FinishReason != "stop" {
			if !g.Start().Feed(c.Text).Dead() {
				continue // cut by max_tokens: a beginning of the grammar
			}
			t.Fatalf("seed %d: %q is not even a beginning of the schema's JSON", i, c.Text)
		}
		stopped++
		var v any
		if err := json.Unmarshal([]byte(c.Text), &v); err != nil {
			t.Fatalf("seed %d: %q is not JSON: %v", i, c.Text, err)
		}
		if err := validate(schema, v, "$"); err != nil {
			t.Fatalf("seed %d: %q: %v", i, c.Text, err)
		}
		if last := c.Tokens[len(c.Tokens)-1]; last != e.tok.eos {
			t.Fatalf("seed %d: ends with token %d, not EOS", i, last)
		}
	}
	if stopped < len(cs)/4 {
		t.Fatalf("only %d of %d answers finished within 200 tokens", stopped, len(cs))
	}
	// The recorded log-probs are the model's, before the mask: what the trainer computes.
	sc, err := e.Score(ctx, []engines.ScoreRequest{{PromptTokens: prompt, Tokens: cs[0].Tokens}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(sc[0].Logprobs, cs[0].Logprobs) {
		t.Errorf("log-probs %v differ from Score's %v", cs[0].Logprobs[:4], sc[0].Logprobs[:4])
	}
	// Alone, the same tokens as in the batch.
	alone, err := e.Generate(ctx, reqs[7:8])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(alone[0].Tokens, cs[7].Tokens) {
		t.Errorf("alone %q; in the batch %q", alone[0].Text, cs[7].Text)
	}
	// Unconstrained, the model writes no JSON: the test means something.
	free := slices.Clone(reqs[:4])
	for i := range free {
		free[i].Constraint = ""
	}
	fs, err := e.Generate(ctx, free)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range fs {
		if json.Valid([]byte(c.Text)) {
			t.Fatalf("unconstrained the model wrote JSON %q", c.Text)
		}
	}
}

// TestConstrainedToolCall: tool_choice "required" with parallel_tool_calls false as a constraint:
// exactly one call of a named function with its arguments, then the end.
func TestConstrainedToolCall(t *testing.T) {
	e, err := New(ModelConfig{Hidden: 16, Intermediate: 32, Layers: 1, Heads: 2, MaxSeqLen: 256}, 5, Options{})
	if err != nil {
		t.Fatal(err)
	}
	spec := constrain.Spec{Calls: &constrain.Calls{Min: 1, Max: 1, Tools: []constrain.Tool{
		{Name: "add", Parameters: json.RawMessage(`{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": false}`)},
		{Name: "noop", Parameters: json.RawMessage(`{"type": "object", "properties": {}, "additionalProperties": false}`)},
	}}}.String()
	prompt := e.tok.Encode("<|user|>Add 2 and 3<|end|><|assistant|>")
	var reqs []engines.GenerateRequest
	for seed := range 12 {
		reqs = append(reqs, engines.GenerateRequest{ID: fmt.Sprint(seed), PromptTokens: prompt,
			Sampling: engines.Sampling{MaxTokens: 200, Temperature: 1, TopP: 1, Seed: uint64(seed), Constraint: spec}})
	}
	cs, err := e.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	done := 0
	for i, c := range cs {
		if c.FinishReason != "stop" {
			continue
		}
		done++
		raws, rest := engines.SplitToolCalls(c.Text)
		if len(raws) != 1 || !raws[0].Closed || strings.TrimSpace(rest) != "" {
			t.Fatalf("seed %d: %q is not one call alone", i, c.Text)
		}
		var call struct {
			Name      string         `json:"name"`
			Arguments map[string]any `json:"arguments"`
		}
		if err := json.Unmarshal([]byte(raws[0].Text), &call); err != nil {
			t.Fatalf("seed %d: %q: %v", i, raws[0].Text, err)
		}
		if call.Name != "add" && call.Name != "noop" {
			t.Fatalf("seed %d: calls %q", i, call.Name)
		}
	}
	if done < len(cs)/2 {
		t.Fatalf("only %d of %d calls finished within 200 tokens", done, len(cs))
	}
}

// TestConstraintRefused: a constraint that does not compile is the request's error, naming it.
func TestConstraintRefused(t *testing.T) {
	e, err := New(ModelConfig{Hidden: 8, Intermediate: 8, Layers: 1, Heads: 2, MaxSeqLen: 16}, 1, Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.Generate(context.Background(), []engines.GenerateRequest{{ID: "x", PromptTokens: []int32{7},
		Sampling: engines.Sampling{MaxTokens: 4, Temperature: 1, Constraint: `{"json_schema": {"type": "string", "pattern": "a"}}`}}})
	if err == nil || !strings.Contains(err.Error(), "json_schema.pattern is not supported") {
		t.Fatalf("error %v", err)
	}
}
