package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
)

// slimen pretrain --eval-only evaluates a model and exits: the chat corpus's held-out greedy
// answers, or a corpus file's lines with each one's log-prob, which are the tiny engine's scores
// of the ids `slimen export --token-ids` writes for the same lines.
func TestPretrainEvalOnly(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "never")
	log, err := slimen(t, nil, "pretrain", "--init", "builtin:tiny-chat", "--task", "synthetic:chat", "--eval-only", "--eval-n", "6", "--out", out)
	if err != nil || !strings.Contains(log, "step 0: held-out chat corpus, greedy answers equal to the right ones: ") ||
		strings.Contains(log, "saved") || strings.Contains(log, "loss") {
		t.Fatalf("%v\n%s", err, log)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Fatalf("--eval-only wrote %s (%v)", out, err)
	}
	// A variant of the corpus (its options) is evaluated on its own held-out lines.
	log, err = slimen(t, nil, "pretrain", "--init", "builtin:tiny-chat", "--task", "synthetic:chat?easy_calc=true", "--eval-only", "--eval-n", "6", "--out", out)
	if err != nil || !strings.Contains(log, "step 0: held-out chat corpus, greedy answers equal to the right ones: ") {
		t.Fatalf("%v\n%s", err, log)
	}

	exported := filepath.Join(dir, "chat.jsonl")
	if log, err := slimen(t, nil, "export", "--task", "synthetic:chat", "--n", "5", "--token-ids", "builtin:tiny-chat", "--out", exported); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	data, err := os.ReadFile(exported)
	if err != nil {
		t.Fatal(err)
	}
	// The corpus file form of the same lines, and the tiny engine's own scores of their ids.
	e, err := tiny.Open("builtin:tiny-chat", tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var corpus strings.Builder
	var reqs []engines.ScoreRequest
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var row struct {
			Prompt      []engines.Message `json:"prompt"`
			Tools       []json.RawMessage `json:"tools"`
			Response    string            `json:"response"`
			PromptIDs   []int32           `json:"prompt_ids"`
			ResponseIDs []int32           `json:"response_ids"`
		}
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(map[string]any{"messages": row.Prompt, "tools": row.Tools, "response": row.Response})
		corpus.Write(append(b, '\n'))
		reqs = append(reqs, engines.ScoreRequest{PromptTokens: row.PromptIDs, Tokens: row.ResponseIDs})
	}
	scores, err := e.Score(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "corpus.jsonl")
	if err := os.WriteFile(file, []byte(corpus.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err = slimen(t, nil, "pretrain", "--init", "builtin:tiny-chat", "--corpus", file, "--eval-only", "--eval-n", "0")
	if err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	lineRE := regexp.MustCompile(`line (\d+): (\d+) response tokens, log-prob (-?[0-9.]+)`)
	got := lineRE.FindAllStringSubmatch(log, -1)
	if len(got) != len(reqs) || strings.Contains(log, "saved") {
		t.Fatalf("want %d scored lines and nothing saved:\n%s", len(reqs), log)
	}
	total, tokens := 0.0, 0
	for i, m := range got {
		want := 0.0
		for _, lp := range scores[i].Logprobs {
			want += float64(lp)
		}
		v, _ := strconv.ParseFloat(m[3], 64)
		if m[1] != strconv.Itoa(i+1) || m[2] != strconv.Itoa(len(reqs[i].Tokens)) || math.Abs(v-want) > 1e-5*max(1, math.Abs(want)) {
			t.Errorf("%s: want line %d, %d tokens, log-prob %.6f", m[0], i+1, len(reqs[i].Tokens), want)
		}
		total -= want
		tokens += len(reqs[i].Tokens)
	}
	if want := fmt.Sprintf("step 0: held-out loss %.4f per response token (%d tokens)", total/float64(tokens), tokens); !strings.Contains(log, want) {
		t.Errorf("want %q in\n%s", want, log)
	}
	for _, args := range [][]string{
		{"pretrain", "--eval-only", "--task", "synthetic:chat"},
		{"pretrain", "--eval-only", "--init", "builtin:tiny-chat", "--task", "synthetic:chat?easy_calc=1"},
		{"pretrain", "--eval-only", "--init", "builtin:tiny-chat", "--corpus", filepath.Join(dir, "missing.jsonl")},
	} {
		if log, err := slimen(t, nil, args...); err == nil || !strings.Contains(log, "slimen pretrain") {
			t.Errorf("%v: err %v, output %q; want a failure with a message", args, err, log)
		}
	}
}
