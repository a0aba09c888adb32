package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/host/tasks"
)

// slimen export --task synthetic:calc said `unknown synthetic task "calc" (known: arith, calc,
// ...)` (issue 35): calc's tasks export with --format tasks as a run sees them; sft, which only
// arith has, says so and names --format tasks; an unknown family still lists the known ones.
func TestExportOtherSyntheticFamilies(t *testing.T) {
	file := filepath.Join(t.TempDir(), "calc.jsonl")
	if out, err := slimen(t, nil, "export", "--task", "synthetic:calc", "--format", "tasks", "--seed", "3", "--n", "5", "--out", file); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	src, err := tasks.Open("synthetic:calc", tasks.Options{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	rows := readJSONL(t, file)
	if len(rows) != 5 {
		t.Fatalf("%d lines, want 5", len(rows))
	}
	for i, row := range rows {
		want := src.Task(i)
		if row["id"] != want.ID || row["prompt"] != want.Prompt || row["label"] != want.Label || row["expr"] != want.Metadata["expr"] {
			t.Errorf("line %d: %v, want %+v", i, row, want)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"export", "--task", "synthetic:calc"}, "only synthetic:arith has worked responses to export as --format sft; export its tasks with --format tasks"},
		{[]string{"pretrain", "--out", filepath.Join(t.TempDir(), "m"), "--task", "synthetic:facts"}, "--task synthetic:facts: pretrain takes synthetic:arith[?difficulty=N], synthetic:calc or synthetic:chat"},
		{[]string{"export", "--task", "synthetic:sudoku"}, `unknown synthetic task "sudoku" (known: arith, calc, facts, multipart)`},
	} {
		out, err := slimen(t, nil, tc.args...)
		if code := exitCode(t, err); code != 2 || !strings.Contains(out, tc.want) || strings.Contains(out, `unknown synthetic task "calc"`) {
			t.Errorf("slimen %s: status %d, output %q; want 2 and %q", strings.Join(tc.args, " "), code, out, tc.want)
		}
	}
}
