package remote_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
)

// TestConstraintOverTheWire: a request's constraint reaches a served engine that constrains
// (the tiny engine: the same JSON as in-process, token for token), and a server that does not
// list "constrain" is never sent one: the client refuses it with ErrNotSupported instead of
// letting the server sample unconstrained.
func TestConstraintOverTheWire(t *testing.T) {
	eng, err := tiny.New(tiny.ModelConfig{Hidden: 16, Intermediate: 32, Layers: 1, Heads: 2, MaxSeqLen: 128}, 3, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	req := engines.GenerateRequest{ID: "c", PromptTokens: []int32{9, 10, 11}, N: 2, Sampling: engines.Sampling{
		MaxTokens: 100, Temperature: 1, TopP: 1, Seed: 4, Constraint: `{"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}}`}}
	ctx := context.Background()
	want, err := eng.Generate(ctx, []engines.GenerateRequest{req})
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, remote.Options{Address: serve(t, eng, server.Options{})})
	got, err := c.Generate(ctx, []engines.GenerateRequest{req})
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if !slices.Equal(got[i].Tokens, want[i].Tokens) {
			t.Errorf("sample %d over the wire %q, in-process %q", i, got[i].Text, want[i].Text)
		}
		var v map[string]bool
		if got[i].FinishReason == "stop" && json.Unmarshal([]byte(got[i].Text), &v) != nil {
			t.Errorf("sample %d %q is not the schema's JSON", i, got[i].Text)
		}
	}
	old := dial(t, remote.Options{Address: serve(t, newFake(), server.Options{})})
	if _, err := old.Generate(ctx, []engines.GenerateRequest{req}); !errors.Is(err, engines.ErrNotSupported) {
		t.Errorf("a server without constraints: %v; want ErrNotSupported", err)
	}
}
