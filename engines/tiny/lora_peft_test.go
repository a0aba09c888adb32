package tiny

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

// loraPEFTDir is testdata/lora_peft: a PEFT adapter folder this engine saved for
// builtin:tiny-arith (adapter/) and the logits it computes with it (expected.json).
// engines/torch/tests/test_peft_lora.py loads the folder with peft onto transformers' model of the
// same checkpoint and must find the same logits.
var loraPEFTDir = filepath.Join("..", "..", "testdata", "lora_peft")

type loraPEFTFixture struct {
	Base   string      `json:"base"`
	IDs    []int32     `json:"ids"`
	Logits [][]float32 `json:"logits"` // position × vocabulary
}

func adapterLogits(e *Engine, name string, ids []int32) [][]float32 {
	m := *e.m
	if name != "" {
		m.ad = e.adapters[name].w
	}
	rows := make([]int, len(ids))
	for i := range rows {
		rows[i] = i
	}
	flat, _ := m.forward(1, ids, []seqView[float32]{{n: len(ids)}}, rows, false)
	v := e.m.w.cfg.VocabSize
	out := make([][]float32, len(ids))
	for i := range out {
		out[i] = flat[i*v : (i+1)*v]
	}
	return out
}

// TestLoRAPEFTFixture keeps testdata/lora_peft in step: the saved adapter loads back and gives
// the recorded logits. -update draws a new adapter (every projection, B not zero) and rewrites
// both.
func TestLoRAPEFTFixture(t *testing.T) {
	e, err := Open("builtin:tiny-arith", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ids := e.tok.Encode(renderChat(tinyArithInputs[0].msgs, true) + tinyArithInputs[0].response)
	dir := filepath.Join(loraPEFTDir, "adapter")
	if *update {
		if err := e.AddAdapter("fixture", LoRAConfig{Rank: 4, Alpha: 8, Targets: LoRATargets}, 3); err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(5, 6))
		for _, tn := range e.adapters["fixture"].w.tensors() {
			for i := range tn.data {
				tn.data[i] += float32(0.05 * r.NormFloat64())
			}
		}
		v, _ := e.Adapter("fixture")
		if err := v.Save(t.Context(), dir); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(loraPEFTFixture{Base: "builtin:tiny-arith", IDs: ids, Logits: adapterLogits(e, "fixture", ids)})
		if err := os.WriteFile(filepath.Join(loraPEFTDir, "expected.json"), append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(filepath.Join(loraPEFTDir, "expected.json"))
	if err != nil {
		t.Fatalf("%v (run go test ./engines/tiny -run TestLoRAPEFTFixture -update to create it)", err)
	}
	var fx loraPEFTFixture
	if err := json.Unmarshal(b, &fx); err != nil {
		t.Fatal(err)
	}
	if err := e.AddAdapter("loaded", LoRAConfig{Rank: 1, Alpha: 1, Targets: []string{"q_proj"}}, 0); err != nil {
		t.Fatal(err)
	}
	v, _ := e.Adapter("loaded")
	if err := v.Load(t.Context(), dir); err != nil {
		t.Fatal(err)
	}
	if !jsonEqual(t, fx.IDs, ids) {
		t.Fatalf("fixture ids %v, today's tokenizer %v", fx.IDs, ids)
	}
	checkLogits(t, "the PEFT fixture adapter", [][][]float32{adapterLogits(e, "loaded", ids)}, [][][]float32{fx.Logits})
	// The adapter must change the logits, or the comparison with peft would not see a lost one.
	base := adapterLogits(e, "", ids)
	if jsonEqual(t, base, fx.Logits) {
		t.Fatal("the fixture adapter computes what the base computes")
	}
}
