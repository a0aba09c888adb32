package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
)

// slimen pretrain --corpus with --tokenizer bpe:N and --positions makes a new chat model from a
// JSONL file of prompt/response pairs and of conversations with a system prompt and tools; the
// folder opens with that vocabulary, template and length.
func TestPretrainCorpusBPE(t *testing.T) {
	dir := t.TempDir()
	schema := `{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}`
	var lines []string
	for i := range 40 {
		var v any
		if i%2 == 0 {
			v = map[string]any{"prompt": fmt.Sprintf("What is %d plus %d?", i, 2*i), "response": fmt.Sprintf(`\boxed{%d}`, 3*i)}
		} else {
			v = map[string]any{
				"messages": []engines.Message{{Role: "system", Content: "Use the tools."}, {Role: "user", Content: fmt.Sprintf("What is %d times 7?", i)}},
				"tools":    []json.RawMessage{json.RawMessage(schema)},
				"response": fmt.Sprintf("<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\": \"%d*7\"}}\n</tool_call>", i),
			}
		}
		b, _ := json.Marshal(v)
		lines = append(lines, string(b))
	}
	corpus := filepath.Join(dir, "corpus.jsonl")
	os.WriteFile(corpus, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
	out := filepath.Join(dir, "model")
	args := []string{"--corpus", corpus, "--tokenizer", "bpe:300", "--tokenizer-examples", "36", "--positions", "4096",
		"--hidden", "16", "--intermediate", "24", "--layers", "1", "--heads", "2", "--kv-heads", "1",
		"--steps", "3", "--batch-size", "4", "--warmup", "1", "--eval-n", "4", "--threads", "1", "--out", out}
	if code := cmdPretrain(args); code != 0 {
		t.Fatalf("slimen pretrain %s: status %d", strings.Join(args, " "), code)
	}
	e, err := tiny.Open(out, tiny.Options{})
	if err != nil {
		t.Fatal(err)
	}
	info, _ := e.Info(context.Background())
	if info.VocabSize != 300 || info.MaxSeqLen != 4096 || info.ChatTemplate != tiny.QwenChatTemplate {
		t.Fatalf("the model has %d tokens, %d positions, template %.30q…", info.VocabSize, info.MaxSeqLen, info.ChatTemplate)
	}
	if ids := e.Tokenizer().Encode("<tool_call>"); len(ids) != 1 {
		t.Fatalf("<tool_call> is %d tokens", len(ids))
	}

	// A bad line is named by file and line.
	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte(lines[0]+"\n"+`{"prompt": "x"}`+"\n"), 0o644)
	if code := cmdPretrain([]string{"--corpus", bad, "--out", out}); code != 2 {
		t.Fatalf("a corpus line without a response: status %d", code)
	}
	if _, _, err := readCorpus(bad); err == nil || !strings.Contains(err.Error(), "bad.jsonl:2") {
		t.Fatalf("readCorpus: %v", err)
	}
	if code := cmdPretrain([]string{"--corpus", corpus, "--tokenizer", "bpe:x", "--eval-n", "4", "--out", out}); code != 2 {
		t.Fatalf("--tokenizer bpe:x: status %d", code)
	}
}

// slimen pretrain --task synthetic:chat trains a chat model on the chat corpus (tasks.ChatCorpus)
// and evaluates it with tasks.ChatEval; without a chat vocabulary it is refused.
func TestPretrainChatCorpus(t *testing.T) {
	out := filepath.Join(t.TempDir(), "model")
	args := []string{"--task", "synthetic:chat", "--tokenizer", "bpe:400", "--tokenizer-examples", "200", "--positions", "1024",
		"--hidden", "16", "--intermediate", "24", "--layers", "1", "--heads", "2", "--kv-heads", "1",
		"--steps", "2", "--batch-size", "2", "--warmup", "1", "--eval-n", "3", "--eval-every", "0", "--threads", "1", "--out", out}
	if code := cmdPretrain(args); code != 0 {
		t.Fatalf("slimen pretrain %s: status %d", strings.Join(args, " "), code)
	}
	e, err := tiny.Open(out, tiny.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if info, _ := e.Info(context.Background()); info.ChatTemplate != tiny.QwenChatTemplate {
		t.Fatalf("the model's template is %.30q…", info.ChatTemplate)
	}
	if code := cmdPretrain([]string{"--task", "synthetic:chat", "--out", out}); code != 2 {
		t.Fatalf("synthetic:chat on the character vocabulary: status %d", code)
	}
}

// pinnedChat is the sha256 of model.safetensors after 3 steps of builtin:tiny-chat's first
// command (docs/tiny.md). Like tiny's TestPretrainPinned, it guards `slimen pretrain`'s
// reproduction of an embedded checkpoint: the chat corpus, the BPE trainer, the chat template's
// ids and the training numerics all feed it. If a change is intended, rebuild builtin:tiny-chat
// with the two commands of engines/tiny/builtin/README.md and refresh this from the test's message.
const pinnedChat = "fe0b6ec12930ae70d80566093fcf38063c6e37c25f0dd4d7598e2dc52805d199"

// TestPretrainChatPinned: the recipe of builtin:tiny-chat trains the embedded vocabulary byte for
// byte, and its first steps give pinned weights.
func TestPretrainChatPinned(t *testing.T) {
	out := filepath.Join(t.TempDir(), "model")
	args := []string{"--task", "synthetic:chat", "--tokenizer", "bpe:1024", "--positions", "4096", "--steps", "3",
		"--batch-size", "32", "--lr", "3e-3", "--warmup", "100", "--eval-every", "0", "--eval-n", "1", "--out", out}
	if code := cmdPretrain(args); code != 0 {
		t.Fatalf("slimen pretrain %s: status %d", strings.Join(args, " "), code)
	}
	for _, f := range []string{"tokenizer.json", "tokenizer_config.json"} {
		got, _ := os.ReadFile(filepath.Join(out, f))
		want, err := os.ReadFile(filepath.Join("..", "..", "engines", "tiny", "builtin", "tiny-chat", f))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Errorf("the recipe's %s differs from builtin:tiny-chat's: the chat corpus, the BPE trainer or the template changed", f)
		}
	}
	w, err := os.ReadFile(filepath.Join(out, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprintf("%x", sha256.Sum256(w)); got != pinnedChat {
		t.Fatalf("3 steps of builtin:tiny-chat's recipe give model.safetensors with sha256 %s, pinned %s: the training numerics or the chat corpus changed", got, pinnedChat)
	}
}

// A corpus line the model cannot take is refused before any step, named by file and line (blank
// lines counted), whether it would be trained on or held out; --eval-only numbers its lines so too.
func TestPretrainCorpusLineTheModelCannotTake(t *testing.T) {
	dir := t.TempDir()
	arith := `{"prompt": "1+1=", "response": "2"}`
	tools := `{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], "response": "hello"}`
	long := `{"prompt": "` + strings.Repeat("1+", 300) + `1=", "response": "301"}`
	for _, c := range []struct {
		name, text, want string
	}{
		{"trained", arith + "\n\n" + tools + "\n" + arith + "\n" + arith + "\n", "c.jsonl:3: the character vocabulary's chat template has no tools variable"},
		{"held out", arith + "\n" + arith + "\n\n" + tools + "\n", "c.jsonl:4: the character vocabulary's chat template has no tools variable"},
		{"too long", arith + "\n" + long + "\n" + arith + "\n", "c.jsonl:2: the example is 609 tokens with its end of turn, more than the model's 512 positions"},
	} {
		path := filepath.Join(dir, "c.jsonl")
		os.WriteFile(path, []byte(c.text), 0o644)
		out, err := slimen(t, nil, "pretrain", "--init", "builtin:tiny-arith", "--corpus", path, "--eval-n", "1", "--steps", "1",
			"--out", filepath.Join(dir, "m"))
		if code := exitCode(t, err); code != 2 || !strings.Contains(out, c.want) || strings.Contains(out, "step 1/") {
			t.Errorf("%s: status %d, output:\n%s\nwant status 2 and %q before any step", c.name, code, out, c.want)
		}
	}
	os.WriteFile(filepath.Join(dir, "c.jsonl"), []byte(arith+"\n\n"+arith+"\n"), 0o644)
	out, err := slimen(t, nil, "pretrain", "--eval-only", "--init", "builtin:tiny-arith", "--corpus", filepath.Join(dir, "c.jsonl"))
	if err != nil || !strings.Contains(out, "line 1: ") || !strings.Contains(out, "line 3: ") {
		t.Errorf("--eval-only: %v\n%s", err, out)
	}
}

// Bad flags of slimen pretrain are said at once with status 2, naming the flag: an --out that
// cannot take the model before any step (not after the training, whose work the failed save
// lost), an argument after which the flags were not read, a bad option of synthetic:arith.
func TestPretrainBadFlagsBeforeTraining(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--steps", "1", "--out", filepath.Join(file, "model")}, "--out " + filepath.Join(file, "model") + " cannot be made"},
		{[]string{"extra", "--out", "x"}, `unexpected argument "extra"`},
		{[]string{"--task", "synthetic:arith?difficulty=9", "--out", "x"}, "--task synthetic:arith?difficulty=9: difficulty must be 1..4"},
	} {
		out, err := slimen(t, nil, append([]string{"pretrain"}, c.args...)...)
		if code := exitCode(t, err); code != 2 || !strings.Contains(out, c.want) || strings.Contains(out, "step 1/") {
			t.Errorf("pretrain %v: status %d, output:\n%s\nwant status 2 and %q before any step", c.args, code, out, c.want)
		}
	}
}
