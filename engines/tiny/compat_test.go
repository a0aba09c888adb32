package tiny

import (
	"encoding/json"
	"flag"
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

func TestCompatFixture(t *testing.T) {
	path := filepath.Join(compatDir, "expected.json")
	if *update {
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
			if err := os.RemoveAll(filepath.Join(compatDir, name)); err != nil {
				t.Fatal(err)
			}
			if err := e.Save(ctx, filepath.Join(compatDir, name)); err != nil {
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
		got := compatLogits(e, want.Sequences)
		for s := range want.Logits {
			for p := range want.Logits[s] {
				for v, w := range want.Logits[s][p] {
					if g := got[s][p][v]; math.Abs(float64(g-w)) > 1e-6*math.Max(1, math.Abs(float64(w))) {
						t.Fatalf("%s: sequence %d position %d token %d: logit %v, fixture %v", name, s, p, v, g, w)
					}
				}
			}
		}
	}
	texts, chats := compatInputs(newCharTokenizer())
	if !jsonEqual(t, texts, fx.Texts) || !jsonEqual(t, chats, fx.Chats) {
		t.Fatal("tokenization or chat rendering differs from the fixture (rerun with -update if intended)")
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
