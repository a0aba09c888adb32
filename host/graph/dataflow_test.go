package graph

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

// A solver's two answers reach one summarizer prompt, and one of them reaches a judge beside the
// summary: rounds follow the longest chain, edges count completions, not prompts.
func TestDataflow(t *testing.T) {
	g := Dataflow("t", []Call{
		{Policy: "solver", Prompt: "2+3?", Outputs: []string{`\boxed{90001}`, `\boxed{90002}`}},
		{Policy: "summarizer", Prompt: "answers: 90001, 90002, 90001", Outputs: []string{`\boxed{90003}`}},
		{Policy: "judge", Prompt: "summary 90003 vs 90002", Outputs: []string{`\boxed{90004}`}},
		{Policy: "judge", Prompt: "no markers, 1234", Outputs: []string{`\boxed{90005}`}},
	})
	want := Graph{Title: "t", Nodes: []Node{
		{ID: "solver_r0", Policy: "solver", Samples: 2, Label: "1 generate call"},
		{ID: "summarizer_r1", Policy: "summarizer", Round: 1, Samples: 1, Label: "1 generate call"},
		{ID: "judge_r2", Policy: "judge", Round: 2, Samples: 1, Label: "1 generate call"},
		{ID: "judge_r0", Policy: "judge", Samples: 1, Label: "1 generate call"},
	}, Edges: []Edge{
		{From: "solver_r0", To: "judge_r2", Count: 1},
		{From: "solver_r0", To: "summarizer_r1", Count: 2},
		{From: "summarizer_r1", To: "judge_r2", Count: 1},
	}}
	if d := cmp.Diff(want, g); d != "" {
		t.Fatalf("graph (-want +got):\n%s", d)
	}
}
