package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/tasks"
)

// slimen export writes the synthetic source line for line as the host and the tiny corpus make it.
func TestExport(t *testing.T) {
	dir := t.TempDir()
	sft, taskFile := filepath.Join(dir, "sft.jsonl"), filepath.Join(dir, "tasks.jsonl")
	if out, err := slimen(t, nil, "export", "--task", "synthetic:arith?difficulty=3", "--seed", "7", "--start", "5", "--n", "40", "--out", sft); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := slimen(t, nil, "export", "--format", "tasks", "--seed", "7", "--n", "40", "--out", taskFile); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	a3 := tasks.Arith{Seed: 7, Difficulty: 3}
	hints := 0
	for i, row := range readJSONL(t, sft) {
		prompt, response := a3.Example(5 + i)
		if row["prompt"] != prompt || row["response"] != response || len(row) != 2 {
			t.Fatalf("sft line %d: %v, want %q → %q", i, row, prompt, response)
		}
		if !strings.HasPrefix(row["response"], `\boxed{`) {
			t.Fatalf("sft line %d: response %q", i, row["response"])
		}
		if strings.Contains(row["prompt"], " Answers: ") {
			hints++
		}
	}
	if hints == 0 || hints == 40 {
		t.Fatalf("%d of 40 prompts list candidate answers, want some but not all", hints)
	}
	a2 := tasks.Arith{Seed: 7, Difficulty: 2} // the default difficulty of synthetic:arith
	rows := readJSONL(t, taskFile)
	if len(rows) != 40 {
		t.Fatalf("%d task lines, want 40", len(rows))
	}
	for i, row := range rows {
		p := a2.Problem(i)
		if row["id"] != p.ID || row["prompt"] != p.Prompt || row["label"] != p.Label {
			t.Fatalf("task line %d: %v, want %+v", i, row, p)
		}
	}
	for _, args := range [][]string{
		{"export", "--task", "data.jsonl"},
		{"export", "--task", "synthetic:arith?difficulty=9"},
		{"export", "--format", "csv"},
		{"export", "--n", "-1"},
		{"export", "extra"},
	} {
		if out, err := slimen(t, nil, args...); err == nil || !strings.Contains(out, "slimen export") {
			t.Errorf("%v: err %v, output %q; want exit 2 with a message", args, err, out)
		}
	}
}

func readJSONL(t *testing.T, path string) []map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []map[string]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var row map[string]string
		if err := json.Unmarshal(sc.Bytes(), &row); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		rows = append(rows, row)
	}
	return rows
}

// slimen export --merge folds a LoRA adapter folder into its base: the tiny engine's own test
// (TestLoRAMergedExport) checks the logits; here the command writes the folder the fixture holds.
func TestExportMerge(t *testing.T) {
	out := filepath.Join(t.TempDir(), "merged")
	adapter := filepath.Join("testdata", "lora_peft", "adapter") // the command runs in the repository root
	if log, err := slimen(t, nil, "export", "--merge", adapter, "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	for _, f := range []string{"config.json", "model.safetensors"} {
		a, err := os.ReadFile(filepath.Join(out, f))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "lora_peft", "merged", f))
		if err != nil || !bytes.Equal(a, b) {
			t.Errorf("%s differs from testdata/lora_peft/merged (%v)", f, err)
		}
	}
	for _, args := range [][]string{
		{"export", "--merge", adapter},
		{"export", "--merge", t.TempDir(), "--out", out},
		{"export", "--base", "builtin:tiny-arith"},
	} {
		if log, err := slimen(t, nil, args...); err == nil || !strings.Contains(log, "slimen export") {
			t.Errorf("%v: err %v, output %q; want a failure with a message", args, err, log)
		}
	}
}

// slimen export --task synthetic:chat writes the chat corpus line for line as tasks.ChatCorpus
// makes it: the conversation as a message list, the tool schemas as JSON objects, the response,
// its kind and whether it is right; --token-ids adds the ids the tiny engine trains on.
func TestExportChat(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "chat.jsonl")
	if out, err := slimen(t, nil, "export", "--task", "synthetic:chat", "--seed", "3", "--start", "10", "--n", "60",
		"--token-ids", "builtin:tiny-chat", "--out", file); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if len(lines) != 60 {
		t.Fatalf("%d lines, want 60", len(lines))
	}
	c := tasks.ChatCorpus{Seed: 3}
	var model struct {
		EOS int32 `json:"eos_token_id"` // <|im_end|>: what every response's ids end with
	}
	if b, err := os.ReadFile("../../engines/tiny/builtin/tiny-chat/config.json"); err != nil || json.Unmarshal(b, &model) != nil {
		t.Fatalf("reading builtin:tiny-chat's config.json: %v", err)
	}
	eos := model.EOS
	kinds, tools := map[string]int{}, 0
	for i, line := range lines {
		var row struct {
			Prompt      []engines.Message `json:"prompt"`
			Tools       []map[string]any  `json:"tools"`
			Response    string            `json:"response"`
			Kind        string            `json:"kind"`
			Right       bool              `json:"right"`
			PromptIDs   []int32           `json:"prompt_ids"`
			ResponseIDs []int32           `json:"response_ids"`
		}
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&row); err != nil {
			t.Fatalf("line %d: %v: %s", i, err, line)
		}
		ex := c.Example(10 + i)
		if !slices.Equal(row.Prompt, ex.Context) || row.Response != ex.Response || row.Kind != ex.Kind || row.Right != ex.Right {
			t.Fatalf("line %d: %s\nwant %+v", i, line, ex)
		}
		if len(row.Tools) != len(ex.Tools) {
			t.Fatalf("line %d: %d tools, want %d", i, len(row.Tools), len(ex.Tools))
		}
		for k, schema := range row.Tools { // an object, the same JSON as the corpus's string
			b, _ := json.Marshal(schema)
			var want map[string]any
			if err := json.Unmarshal([]byte(ex.Tools[k]), &want); err != nil {
				t.Fatal(err)
			}
			w, _ := json.Marshal(want)
			if !bytes.Equal(b, w) {
				t.Fatalf("line %d: tool %d is %s, want %s", i, k, b, ex.Tools[k])
			}
		}
		if len(row.PromptIDs) < 10 || len(row.ResponseIDs) < 2 || row.ResponseIDs[len(row.ResponseIDs)-1] != eos {
			t.Fatalf("line %d: prompt ids %v, response ids %v (want the response ended by <|im_end|>, %d)", i, row.PromptIDs, row.ResponseIDs, eos)
		}
		kinds[row.Kind]++
		tools += len(row.Tools)
	}
	if len(kinds) < 4 || tools == 0 {
		t.Fatalf("kinds %v, %d tools in 60 lines: want most of the corpus's parts", kinds, tools)
	}
	// Without --token-ids the lines have no ids.
	out, err := slimen(t, nil, "export", "--task", "synthetic:chat", "--n", "2")
	if err != nil || strings.Contains(out, "_ids") || strings.Count(out, "\n") != 2 {
		t.Fatalf("%v: %q", err, out)
	}
	// vary_chunks=true: the variant corpus, line for line as tasks.ChatCorpus makes it.
	out, err = slimen(t, nil, "export", "--task", "synthetic:chat?vary_chunks=true", "--seed", "3", "--n", "40")
	if err != nil {
		t.Fatalf("%v: %q", err, out)
	}
	vary := tasks.ChatCorpus{Seed: 3, VaryChunks: true}
	for i, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		var row struct {
			Prompt   []engines.Message `json:"prompt"`
			Response string            `json:"response"`
		}
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatal(err)
		}
		if want := vary.Example(i); row.Response != want.Response || !reflect.DeepEqual(row.Prompt, want.Context) {
			t.Fatalf("vary_chunks line %d: %+v; want %+v", i, row, want)
		}
	}
	for _, args := range [][]string{
		{"export", "--task", "synthetic:chat", "--format", "tasks"},
		{"export", "--task", "synthetic:chat?seed=2"},
		{"export", "--task", "synthetic:chat?vary_chunks=yes"},
		{"export", "--format", "tasks", "--token-ids", "builtin:tiny-chat"},
		{"export", "--task", "synthetic:chat", "--token-ids", filepath.Join(dir, "missing")},
	} {
		if out, err := slimen(t, nil, args...); err == nil || !strings.Contains(out, "slimen export") {
			t.Errorf("%v: err %v, output %q; want exit 2 with a message", args, err, out)
		}
	}
}

// Bad flags of slimen export are said at once with status 2, naming the flag or the task, and
// write nothing.
func TestExportBadFlags(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"--base", "b"}, "--base goes with --merge"},
		{[]string{"--merge", "x"}, "--merge needs --out"},
		{[]string{"--format", "csv"}, `--format "csv": use sft or tasks`},
		{[]string{"--format", "tasks", "--token-ids", "builtin:tiny-arith"}, "--token-ids goes with --format sft"},
		{[]string{"--n", "-1"}, "--n and --start must not be negative"},
		{[]string{"--task", "nothing.jsonl"}, `--task "nothing.jsonl": only synthetic sources can be exported`},
		{[]string{"--task", "synthetic:arith?difficulty=9"}, "difficulty must be 1..4"},
		{[]string{"--task", "synthetic:calc"}, "only synthetic:arith has worked responses"},
		{[]string{"--task", "synthetic:calc?x=1", "--format", "tasks"}, `unknown parameter "x"`},
		{[]string{"--task", "synthetic:chat", "--format", "tasks"}, "export it with --format sft"},
		{[]string{"--task", "synthetic:sudoku"}, `unknown synthetic task "sudoku"`},
		{[]string{"--token-ids", filepath.Join(dir, "nowhere")}, "--token-ids " + filepath.Join(dir, "nowhere")},
		{[]string{"--n", "2", "--out", filepath.Join(dir, "no", "x.jsonl")}, filepath.Join(dir, "no", "x.jsonl")},
	} {
		out, err := slimen(t, nil, append([]string{"export"}, c.args...)...)
		if code := exitCode(t, err); code != 2 || !strings.Contains(out, c.want) {
			t.Errorf("export %v: status %d, output:\n%s\nwant status 2 and %q", c.args, code, out, c.want)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("bad flags wrote %v", entries)
	}
}
