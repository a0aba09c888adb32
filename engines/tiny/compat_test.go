package tiny

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/engines"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

// compatDir holds model folders written by the Go side with the logits, token ids and chat
// renderings the Go side computes for them. engines/torch/tests/test_tiny_compat.py loads the same
// folders with transformers and must find the same numbers: that is the proof that the tiny
// engine's checkpoints are ordinary Hugging Face Llama checkpoints.
var compatDir = filepath.Join("..", "..", "testdata", "tiny_compat")

// compatFixture is testdata/tiny_compat/expected.json.
type compatFixture struct {
	// Models maps a folder name to the token sequences fed to it and the logits (sequence ×
	// position × vocabulary) the model computes for them.
	Models map[string]compatModel `json:"models"`
	// Texts are raw strings with their token ids (no chat template).
	Texts []compatText `json:"texts"`
	// Chats are message lists with their rendering by the chat template and its token ids.
	Chats []compatChat `json:"chats"`
}

type compatModel struct {
	Sequences [][]int32     `json:"sequences"`
	Logits    [][][]float32 `json:"logits"`
}

type compatText struct {
	Text string  `json:"text"`
	IDs  []int32 `json:"ids"`
}

type compatChat struct {
	Messages            []engines.Message `json:"messages"`
	AddGenerationPrompt bool              `json:"add_generation_prompt"`
	Rendered            string            `json:"rendered"`
	IDs                 []int32           `json:"ids"`
}

var compatModels = map[string]ModelConfig{
	// Grouped-query attention (2 query heads per key/value head), untied head, long positions.
	"gqa_untied": {Hidden: 32, Intermediate: 48, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 8, MaxSeqLen: 80, RMSNormEps: 1e-6, RopeTheta: 500},
	// Tied embeddings, head_dim different from hidden/heads, one key/value head.
	"tied_mqa": {Hidden: 24, Intermediate: 40, Layers: 1, Heads: 2, KVHeads: 1, HeadDim: 16, MaxSeqLen: 32, TieEmbeddings: true},
}

// compatLogits runs the model over each sequence alone and returns its logits at every position.
func compatLogits(e *Engine, seqs [][]int32) [][][]float32 {
	var out [][][]float32
	vocab := e.m.w.cfg.VocabSize
	for _, s := range seqs {
		rows := make([]int, len(s))
		for i := range rows {
			rows[i] = i
		}
		logits, _ := e.m.forward(e.threads, s, []seqView[float32]{{n: len(s)}}, rows, false)
		var seq [][]float32
		for i := range s {
			seq = append(seq, logits[i*vocab:(i+1)*vocab])
		}
		out = append(out, seq)
	}
	return out
}

func compatInputs(tok *Tokenizer) ([]compatText, []compatChat) {
	var texts []compatText
	for _, s := range []string{
		"Ann has 12 pens and gets 7 more. How many pens?",
		`\boxed{19}`,
		"line one\nline two\ttab",
		"<|user|>hi<|end|><|assistant|>",
		"<|user partial <|end|<|end|>>",
		"café ☕ naïve",
		"  spaces  ",
		"",
	} {
		texts = append(texts, compatText{Text: s, IDs: tok.Encode(s)})
	}
	var chats []compatChat
	for _, c := range []struct {
		msgs []engines.Message
		gen  bool
	}{
		{[]engines.Message{{Role: "user", Content: "Bo has 3 eggs. How many eggs?"}}, true},
		{[]engines.Message{{Role: "system", Content: "Answer in \\boxed{}."}, {Role: "user", Content: "1+1? Answers: 2, 3."},
			{Role: "assistant", Content: `\boxed{2}`}, {Role: "user", Content: "Sure? {{ not jinja }} 'quoted' \"double\""}}, true},
		{[]engines.Message{{Role: "user", Content: "multi\nline"}, {Role: "assistant", Content: "ok"}}, false},
	} {
		r := renderChat(c.msgs, c.gen)
		chats = append(chats, compatChat{Messages: c.msgs, AddGenerationPrompt: c.gen, Rendered: r, IDs: tok.Encode(r)})
	}
	return texts, chats
}

// buildCompatFixture makes the fixture's model folders under dir with today's code (random
// weights, then noise, both from fixed seeds) and returns what the Go side computes for them.
func buildCompatFixture(t *testing.T, dir string) compatFixture {
	t.Helper()
	fx := compatFixture{Models: map[string]compatModel{}}
	for name, cfg := range compatModels {
		e, err := New(cfg, 3, Options{})
		if err != nil {
			t.Fatal(err)
		}
		// Weights far from the near-uniform initialisation, so the logits have structure.
		r := rand.New(rand.NewPCG(5, uint64(len(name))))
		for _, tn := range e.m.w.tensors() {
			for i := range tn.data {
				tn.data[i] += float32(0.4 * r.NormFloat64())
			}
		}
		if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
		if err := e.Save(ctx, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
		seqs := [][]int32{e.tok.Encode(renderChat([]engines.Message{{Role: "user", Content: "Di has 5 cards."}}, true))}
		long := make([]int32, cfg.MaxSeqLen)
		for i := range long {
			long[i] = int32(r.IntN(e.tok.VocabSize()))
		}
		seqs = append(seqs, long, []int32{7})
		fx.Models[name] = compatModel{Sequences: seqs, Logits: compatLogits(e, seqs)}
	}
	fx.Texts, fx.Chats = compatInputs(newCharTokenizer())
	return fx
}

// TestCompatFixture checks testdata/tiny_compat both ways: the committed folders, opened with
// today's code, give the logits of expected.json; and today's Save, run again on the same
// weights, writes the committed folders byte for byte (a change in the checkpoint format, which
// the Python suite validates against transformers only on the committed files, must come with a
// regenerated fixture: go test ./engines/tiny -run TestCompat -update).
func TestCompatFixture(t *testing.T) {
	path := filepath.Join(compatDir, "expected.json")
	if *update {
		fx := buildCompatFixture(t, compatDir)
		b, err := json.MarshalIndent(fx, "", " ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run TestCompatFixture -update to create it)", err)
	}
	var fx compatFixture
	if err := json.Unmarshal(b, &fx); err != nil {
		t.Fatal(err)
	}
	for name, want := range fx.Models {
		e, err := Open(filepath.Join(compatDir, name), Options{})
		if err != nil {
			t.Fatal(err)
		}
		checkLogits(t, name, compatLogits(e, want.Sequences), want.Logits)
	}
	texts, chats := compatInputs(newCharTokenizer())
	if !jsonEqual(t, texts, fx.Texts) || !jsonEqual(t, chats, fx.Chats) {
		t.Fatal("tokenization or chat rendering differs from the fixture (rerun with -update if intended)")
	}

	// Today's code re-creates the fixture: the same files, the same inputs, the same logits.
	tmp := t.TempDir()
	again := buildCompatFixture(t, tmp)
	if len(again.Models) != len(fx.Models) {
		t.Fatalf("the fixture has %d models, today's code makes %d", len(fx.Models), len(again.Models))
	}
	for name, m := range again.Models {
		sameFiles(t, filepath.Join(compatDir, name), filepath.Join(tmp, name))
		want, ok := fx.Models[name]
		if !ok {
			t.Fatalf("model %s is missing from expected.json", name)
		}
		if !jsonEqual(t, m.Sequences, want.Sequences) {
			t.Errorf("%s: today's code feeds other token sequences than expected.json (rerun with -update if intended)", name)
			continue
		}
		checkLogits(t, name+" (re-created)", m.Logits, want.Logits)
	}
}

// checkLogits compares logits with a fixture's, elementwise, to 1e-6 relative (absolute below 1).
func checkLogits(t *testing.T, name string, got, want [][][]float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d sequences of logits, fixture %d", name, len(got), len(want))
	}
	for s := range want {
		if len(got[s]) != len(want[s]) {
			t.Fatalf("%s: sequence %d: %d positions, fixture %d", name, s, len(got[s]), len(want[s]))
		}
		for p := range want[s] {
			if len(got[s][p]) != len(want[s][p]) {
				t.Fatalf("%s: sequence %d position %d: %d logits, fixture %d", name, s, p, len(got[s][p]), len(want[s][p]))
			}
			for v, w := range want[s][p] {
				if g := got[s][p][v]; math.Abs(float64(g-w)) > 1e-6*math.Max(1, math.Abs(float64(w))) {
					t.Fatalf("%s: sequence %d position %d token %d: logit %v, fixture %v", name, s, p, v, g, w)
				}
			}
		}
	}
}

// sameFiles fails unless the folders hold the same file names with the same bytes.
func sameFiles(t *testing.T, committed, fresh string) {
	t.Helper()
	names := func(dir string) []string {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range entries {
			out = append(out, e.Name())
		}
		return out
	}
	if a, b := names(committed), names(fresh); !jsonEqual(t, a, b) {
		t.Fatalf("%s holds %v; today's Save writes %v (rerun with -update if intended)", committed, a, b)
	}
	for _, n := range names(committed) {
		a, err := os.ReadFile(filepath.Join(committed, n))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(fresh, n))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			i := 0
			for i < len(a) && i < len(b) && a[i] == b[i] {
				i++
			}
			t.Errorf("%s: today's Save writes other bytes (%d vs %d bytes, first difference at byte %d); rerun with -update if intended",
				filepath.Join(committed, n), len(a), len(b), i)
		}
	}
}

func jsonEqual(t *testing.T, a, b any) bool {
	ja, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// tinyArithFixture is testdata/tiny_compat/tiny_arith.json: what the Go engine computes with the
// embedded checkpoint builtin:tiny-arith (engines/tiny/builtin/tiny-arith) for a few chats.
// engines/torch/tests/test_tiny_compat.py loads that folder with transformers and must find the
// same rendering, token ids and logits.
type tinyArithFixture struct {
	Model string          `json:"model"`
	Cases []tinyArithCase `json:"cases"`
}

type tinyArithCase struct {
	// Messages, rendered with the chat template and a generation prompt, then Response: Text.
	Messages []engines.Message `json:"messages"`
	Response string            `json:"response"`
	Text     string            `json:"text"`
	IDs      []int32           `json:"ids"`
	// Logits at every position of IDs (position × vocabulary).
	Logits [][]float32 `json:"logits"`
}

var tinyArithInputs = []struct {
	msgs     []engines.Message
	response string
}{
	{[]engines.Message{{Role: "user", Content: "Ann has 12 pens and gets 7 more. How many pens?"}}, `\boxed{19}<|end|>`},
	{[]engines.Message{{Role: "system", Content: `Answer in \boxed{}.`},
		{Role: "user", Content: "Bo has 8 apples and eats 3. How many apples are left? Answers: 5, 6."}}, `So \boxed{5}.<|end|>`},
}

func tinyArithCases(t *testing.T, e *Engine) []tinyArithCase {
	t.Helper()
	var out []tinyArithCase
	for _, in := range tinyArithInputs {
		text := renderChat(in.msgs, true) + in.response
		ids := e.tok.Encode(text)
		out = append(out, tinyArithCase{Messages: in.msgs, Response: in.response, Text: text, IDs: ids, Logits: compatLogits(e, [][]int32{ids})[0]})
	}
	return out
}

// TestCompatTinyArith keeps testdata/tiny_compat/tiny_arith.json in step with the embedded
// checkpoint and today's forward pass and tokenizer; -update rewrites it.
func TestCompatTinyArith(t *testing.T) {
	path := filepath.Join(compatDir, "tiny_arith.json")
	e, err := Open("builtin:tiny-arith", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if *update {
		b, err := json.Marshal(tinyArithFixture{Model: "builtin:tiny-arith", Cases: tinyArithCases(t, e)})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run TestCompatTinyArith -update to create it)", err)
	}
	var fx tinyArithFixture
	if err := json.Unmarshal(b, &fx); err != nil {
		t.Fatal(err)
	}
	got := tinyArithCases(t, e)
	if len(fx.Cases) != len(got) {
		t.Fatalf("fixture has %d cases, the test %d (rerun with -update if intended)", len(fx.Cases), len(got))
	}
	for i, want := range fx.Cases {
		g := got[i]
		if g.Text != want.Text || !jsonEqual(t, g.Messages, want.Messages) || !jsonEqual(t, g.IDs, want.IDs) {
			t.Fatalf("case %d: rendering or token ids differ from the fixture:\n got %q %v\nwant %q %v", i, g.Text, g.IDs, want.Text, want.IDs)
		}
		if len(g.IDs) < 40 {
			t.Fatalf("case %d: only %d tokens", i, len(g.IDs))
		}
		checkLogits(t, fmt.Sprintf("builtin:tiny-arith case %d", i), [][][]float32{g.Logits}, [][][]float32{want.Logits})
	}
}
