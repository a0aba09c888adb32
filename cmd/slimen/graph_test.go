package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/host/graph"
	"github.com/slimen/slimen/host/tasks"
)

// `slimen graph SCRIPT` writes its drawings into runs/NAME/ under the current folder, not beside
// the script (where they would land in a source tree), and prints their paths.
func TestGraphDefaultOutput(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(src, "pair.star")
	err := os.WriteFile(script, []byte(`def rollout(task):
    a = generate("solver", task.prompt, n = 2)
    b = generate("judge", "\n".join([c.text for c in a]))
    reward(a + [b], 1.0)
`), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(slimenBin, "graph", script)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("slimen graph: %v\n%s", err, out)
	}
	want := []string{filepath.Join("runs", "pair", "pair.mmd"), filepath.Join("runs", "pair", "pair.svg")}
	if got := strings.Fields(string(out)); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("printed %q, want %q", got, want)
	}
	for _, f := range want {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
	if mmd, _ := os.ReadFile(filepath.Join(dir, want[0])); !strings.Contains(string(mmd), "-->|2|") {
		t.Errorf("the arrow from the solver's 2 completions to the judge is not numbered 2:\n%s", mmd)
	}
	if entries, _ := os.ReadDir(src); len(entries) != 1 {
		t.Errorf("slimen graph wrote beside the script: %v", entries)
	}
}

func TestTraceDebate(t *testing.T) {
	g, err := traceGraph(context.Background(), "../../examples/debate/debate.star", nil,
		tasks.Task{ID: "t", Prompt: "Ann has 2 pens and gets 3 more. How many pens?", Label: "5", HasLabel: true})
	if err != nil {
		t.Fatal(err)
	}
	want := []graph.Node{
		{ID: "generator_r0", Policy: "generator", Round: 0, Samples: 18, Label: "6 generate calls"},
		{ID: "critic_r1", Policy: "critic", Round: 1, Samples: 18, Label: "18 generate calls"},
		{ID: "critic_r2", Policy: "critic", Round: 2, Samples: 18, Label: "18 generate calls"},
	}
	if d := cmp.Diff(want, g.Nodes); d != "" {
		t.Errorf("nodes (-want +got):\n%s", d)
	}
	// The example's rollout plays six debates (DEBATES = 6). Every critic sees all three answers
	// of its debate's round before: eighteen completions feed each round, however many prompts each
	// of them reached.
	wantEdges := []graph.Edge{{From: "critic_r1", To: "critic_r2", Count: 18}, {From: "generator_r0", To: "critic_r1", Count: 18}}
	if d := cmp.Diff(wantEdges, g.Edges); d != "" {
		t.Errorf("edges (-want +got):\n%s", d)
	}
	if g.Title != "../../examples/debate/debate.star: dataflow of one rollout" {
		t.Errorf("title %q", g.Title)
	}
}
