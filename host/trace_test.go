package host

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/host/graph"
)

func TestTraceDebate(t *testing.T) {
	g, err := Trace(context.Background(), "../examples/debate/debate.star", nil,
		Task{ID: "t", Prompt: "Ann has 2 pens and gets 3 more. How many pens?", Label: "5", HasLabel: true})
	if err != nil {
		t.Fatal(err)
	}
	want := []graph.Node{
		{ID: "generator_r0", Policy: "generator", Round: 0, Samples: 3, Label: "1 generate call"},
		{ID: "critic_r1", Policy: "critic", Round: 1, Samples: 3, Label: "3 generate calls"},
		{ID: "critic_r2", Policy: "critic", Round: 2, Samples: 3, Label: "3 generate calls"},
	}
	if d := cmp.Diff(want, g.Nodes); d != "" {
		t.Errorf("nodes (-want +got):\n%s", d)
	}
	// Every critic sees all three answers of the round before: three completions feed each round,
	// however many prompts each of them reached.
	wantEdges := []graph.Edge{{From: "critic_r1", To: "critic_r2", Count: 3}, {From: "generator_r0", To: "critic_r1", Count: 3}}
	if d := cmp.Diff(wantEdges, g.Edges); d != "" {
		t.Errorf("edges (-want +got):\n%s", d)
	}
}
