package tasks

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/engines"
)

const testdata = "../../testdata/data/"

func open(t *testing.T, path string, o Options) Source {
	t.Helper()
	s, err := Open(path, o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func all(s Source) []Task {
	out := make([]Task, s.Len())
	for i := range out {
		out[i] = s.Task(i)
	}
	return out
}

func TestStringPromptsAndLabels(t *testing.T) {
	s := open(t, testdata+"arith.jsonl", Options{})
	want := []Task{
		{ID: "arith-1", Prompt: "What is 2 + 3?", Label: "5", HasLabel: true, Metadata: map[string]any{"source": "hand"}, Index: 0},
		{ID: "q-7", Prompt: "Halve 5.", Label: "2.5", HasLabel: true, Metadata: map[string]any{"difficulty": int64(2), "tags": []any{"easy", 1.5}}, Index: 1},
		{ID: "arith-4", Prompt: "What is 10 × 100?", Label: "1000", HasLabel: true, Metadata: map[string]any{}, Index: 2},
		{ID: "arith-5", Prompt: "Name a prime.", Metadata: map[string]any{}, Index: 3},
		{ID: "arith-6", Prompt: "Say hi.", Metadata: map[string]any{}, Index: 4},
		{ID: "12", Prompt: "What is 12345678901234567890 + 0?", Label: "12345678901234567890", HasLabel: true, Metadata: map[string]any{}, Index: 5},
	}
	if diff := cmp.Diff(want, all(s)); diff != "" {
		t.Errorf("tasks (-want +got):\n%s", diff)
	}
	if w := s.Warnings(); len(w) != 0 {
		t.Errorf("warnings on a clean file: %q", w)
	}
}

func TestMessagePromptsAndKeys(t *testing.T) {
	s := open(t, testdata+"chat.jsonl", Options{InputKey: "question", LabelKey: "answer"})
	want := []Task{
		{ID: "chat-1", Prompt: []engines.Message{{Role: "system", Content: `Answer in \boxed{}.`}, {Role: "user", Content: "What is 6 × 7?"}},
			Label: "42", HasLabel: true, Metadata: map[string]any{}, Index: 0},
		{ID: "chat-2", Prompt: []engines.Message{{Role: "user", Content: "And 6 + 7?"}},
			Label: "13", HasLabel: true, Metadata: map[string]any{"level": int64(1)}, Index: 1},
	}
	if diff := cmp.Diff(want, all(s)); diff != "" {
		t.Errorf("tasks (-want +got):\n%s", diff)
	}
}

// A bad line costs that line, with a warning saying where and what; the run goes on.
func TestMalformedLinesAreSkippedWithWarnings(t *testing.T) {
	path := testdata + "malformed.jsonl"
	s := open(t, path, Options{})
	var ids []string
	for _, task := range all(s) {
		ids = append(ids, task.ID)
	}
	if want := []string{"malformed-1", "malformed-10"}; !slices.Equal(ids, want) {
		t.Errorf("kept %v, want %v", ids, want)
	}
	want := []string{
		path + ":2: not a JSON object (each line must be one {…}); line skipped",
		path + ":3: not a JSON object (each line must be one {…}); line skipped",
		path + `:4: no "prompt" key (the prompt; set data.input_key if it is under another key); line skipped`,
		path + `:5: "prompt": the prompt must be a string or a list of {"role": …, "content": …} messages; line skipped`,
		path + `:6: "label": must be a string or a number; line skipped`,
		path + `:7: "prompt": message 0 has no "role" string; line skipped`,
		path + `:8: "prompt": the prompt is empty; line skipped`,
		path + `:9: not valid JSON: invalid character 't' after top-level value; line skipped`,
	}
	if diff := cmp.Diff(want, s.Warnings()); diff != "" {
		t.Errorf("warnings (-want +got):\n%s", diff)
	}
}

func TestUnusableFiles(t *testing.T) {
	for _, tc := range []struct{ path, want string }{
		{testdata + "all_bad.jsonl", "has no usable task: all 2 lines were skipped; the first:\n  " + testdata + "all_bad.jsonl:1: not a JSON object"},
		{testdata + "empty.jsonl", `has no tasks; write one JSON object per line, with the prompt under "prompt"`},
		{testdata + "nowhere.jsonl", "does not exist; give a JSONL file or synthetic:arith"},
		{"synthetic:arith?difficulty=0", "difficulty must be 1..4"},
		{"synthetic:sudoku", `unknown synthetic task "sudoku"`},
		{"train.parquet", "convert it to JSONL"},
	} {
		_, err := Open(tc.path, Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Open(%q) = %v; want an error containing %q", tc.path, err, tc.want)
		}
	}
}

func TestWarningsAreCapped(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"prompt": "ok", "label": "1"}` + "\n")
	for range 150 {
		b.WriteString("{bad\n")
	}
	path := filepath.Join(t.TempDir(), "many.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	w := open(t, path, Options{}).Warnings()
	if len(w) != maxWarnings+1 || w[maxWarnings] != path+": … and 50 more problems" {
		t.Errorf("%d warnings, last %q", len(w), w[len(w)-1])
	}
}

func TestSyntheticIsDeterministic(t *testing.T) {
	a := open(t, "synthetic:arith?difficulty=3", Options{Seed: 5})
	b := open(t, "synthetic:arith?difficulty=3", Options{Seed: 5})
	if a.Len() != -1 {
		t.Errorf("Len = %d, want -1 (endless)", a.Len())
	}
	if diff := cmp.Diff(Batch(a, 3, 8), Batch(b, 3, 8)); diff != "" {
		t.Errorf("same seed, different tasks:\n%s", diff)
	}
	t0 := a.Task(0)
	if !t0.HasLabel || t0.Label == "" || t0.Prompt == "" || t0.Metadata["difficulty"] != int64(3) {
		t.Errorf("task 0 = %+v", t0)
	}
	// The path's seed= wins over the run's seed.
	c := open(t, "synthetic:arith?difficulty=3&seed=5", Options{Seed: 99})
	if c.Task(7).ID != a.Task(7).ID {
		t.Errorf("seed=5 in the path gave %q, want %q", c.Task(7).ID, a.Task(7).ID)
	}
}

// Eval problems come from another seed, so they are not the problems the run trains on.
func TestEvalSeedGivesOtherProblems(t *testing.T) {
	train := open(t, "synthetic:arith?difficulty=4", Options{Seed: 1})
	eval := open(t, "synthetic:arith?difficulty=4", Options{Seed: EvalSeed(1)})
	seen := map[string]bool{}
	for i := range 200 {
		seen[train.Task(i).ID] = true
	}
	tasks, err := EvalTasks(eval, 50)
	if err != nil {
		t.Fatal(err)
	}
	same := 0
	for _, task := range tasks {
		if seen[task.ID] {
			t.Fatalf("eval task %s is a training task", task.ID)
		}
		if task.Prompt == train.Task(task.Index).Prompt {
			same++
		}
	}
	if same > 5 {
		t.Errorf("%d of 50 eval prompts equal the training prompt of the same index", same)
	}
}

func TestFilesWrapAround(t *testing.T) {
	s := open(t, testdata+"chat.jsonl", Options{InputKey: "question", LabelKey: "answer"})
	b := Batch(s, 1, 3) // tasks 3, 4, 5 of a 2-task file: epochs 1 and 2
	got := []string{b[0].ID, b[1].ID, b[2].ID}
	if want := []string{"chat-2", "chat-1", "chat-2"}; !slices.Equal(got, want) {
		t.Errorf("batch 1 = %v, want %v", got, want)
	}
	if b[0].Index != 3 || b[2].Index != 5 {
		t.Errorf("indexes %d, %d; want 3, 5", b[0].Index, b[2].Index)
	}
	// Each call hands out its own metadata map.
	b[1].Metadata["x"] = 1
	if _, ok := s.Task(0).Metadata["x"]; ok {
		t.Error("changing a task's metadata changed the source")
	}
}

func TestShuffleIsAPermutationPerEpoch(t *testing.T) {
	var b strings.Builder
	for i := range 20 {
		fmt.Fprintf(&b, `{"prompt": "p%d"}`+"\n", i)
	}
	path := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	epoch := func(s Source, e int) []string {
		var ids []string
		for _, task := range Batch(s, e, 20) {
			ids = append(ids, task.ID)
		}
		return ids
	}
	s := open(t, path, Options{Shuffle: true, Seed: 3})
	plain := epoch(open(t, path, Options{}), 0)
	e0, e1 := epoch(s, 0), epoch(s, 1)
	if slices.Equal(e0, plain) || slices.Equal(e0, e1) {
		t.Errorf("no new order: file %v, epoch 0 %v, epoch 1 %v", plain, e0, e1)
	}
	for _, e := range [][]string{e0, e1} {
		sorted := slices.Clone(e)
		slices.Sort(sorted)
		want := slices.Clone(plain)
		slices.Sort(want)
		if !slices.Equal(sorted, want) {
			t.Errorf("epoch %v is not a permutation of the file", e)
		}
	}
	again := open(t, path, Options{Shuffle: true, Seed: 3})
	if got := epoch(again, 1); !slices.Equal(got, e1) {
		t.Errorf("same seed, epoch 1: %v then %v", e1, got)
	}
	// Going back to an older epoch gives the same order again.
	if got := epoch(s, 0); !slices.Equal(got, e0) {
		t.Errorf("epoch 0 revisited: %v, first %v", got, e0)
	}
}

func TestEvalTasks(t *testing.T) {
	s := open(t, testdata+"arith.jsonl", Options{})
	for _, tc := range []struct{ limit, want int }{{0, 6}, {4, 4}, {10, 6}} {
		tasks, err := EvalTasks(s, tc.limit)
		if err != nil || len(tasks) != tc.want {
			t.Errorf("EvalTasks(limit %d) = %d tasks, %v; want %d", tc.limit, len(tasks), err, tc.want)
		}
	}
	if _, err := EvalTasks(open(t, "synthetic:arith", Options{}), 0); err == nil || !strings.Contains(err.Error(), "give the eval dataset a limit") {
		t.Errorf("endless source without a limit: %v", err)
	}
}

// A label under another key reads as no label: the source says so, naming the key it looked for
// and the keys the lines have. A file where some line has the key is not warned about.
func TestNoLineHasTheLabelKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qa.jsonl")
	if err := os.WriteFile(path, []byte(`{"prompt": "2+6=", "answer": "8"}`+"\n"+`{"prompt": "1+1=", "answer": 2, "id": "b"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	want := []string{path + `: no line has the label key "label", so every task.label is None (set data.label_key if the label is under another key; the lines have the keys answer, id, prompt)`}
	if diff := cmp.Diff(want, open(t, path, Options{}).Warnings()); diff != "" {
		t.Errorf("warnings (-want +got):\n%s", diff)
	}
	if w := open(t, path, Options{LabelKey: "answer"}).Warnings(); len(w) != 0 {
		t.Errorf("label_key answer: warnings %q", w)
	}
	// arith.jsonl has lines without a label and lines with one: no warning (TestStringPromptsAndLabels).
}
