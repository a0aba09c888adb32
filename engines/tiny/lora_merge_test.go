package tiny

import (
	"bytes"
	"context"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// A merged export (the PEFT fixture folded into builtin:tiny-arith) opens as a plain model that
// gives the logits of the base with the adapter. testdata/lora_peft/merged is that export, which
// engines/torch/tests/test_peft_lora.py loads with transformers (-update rewrites it).
func TestLoRAMergedExport(t *testing.T) {
	ctx := context.Background()
	out := filepath.Join(t.TempDir(), "merged")
	if err := MergeAdapter(ctx, filepath.Join(loraPEFTDir, "adapter"), "", out, Options{}); err != nil {
		t.Fatal(err)
	}
	e, err := Open("builtin:tiny-arith", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.AddAdapter("a", LoRAConfig{Rank: 1, Alpha: 1, Targets: []string{"q_proj"}}, 1); err != nil {
		t.Fatal(err)
	}
	v, _ := e.Adapter("a")
	if err := v.Load(ctx, filepath.Join(loraPEFTDir, "adapter")); err != nil {
		t.Fatal(err)
	}
	m, err := Open(out, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ids := e.tok.Encode(renderChat(tinyArithInputs[0].msgs, true) + tinyArithInputs[0].response)
	want, base, got := adapterLogits(e, "a", ids), adapterLogits(e, "", ids), adapterLogits(m, "", ids)
	worst, moved := 0.0, 0.0
	for i := range want {
		for j := range want[i] {
			worst = max(worst, math.Abs(float64(got[i][j]-want[i][j])))
			moved = max(moved, math.Abs(float64(base[i][j]-want[i][j])))
		}
	}
	if worst > 1e-4 {
		t.Errorf("the merged model's logits differ from base + adapter by up to %g", worst)
	}
	if moved < 1e-2 {
		t.Errorf("the adapter changes the logits by only %g: the test shows nothing", moved)
	}
	fixture := filepath.Join(loraPEFTDir, "merged")
	if *update {
		if err := os.RemoveAll(fixture); err != nil {
			t.Fatal(err)
		}
		if err := os.CopyFS(fixture, os.DirFS(out)); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} {
		a, err := os.ReadFile(filepath.Join(out, f))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(fixture, f))
		if err != nil || !bytes.Equal(a, b) {
			t.Errorf("%s differs from a fresh merge (%v); go test ./engines/tiny -run TestLoRAMergedExport -update rewrites it", filepath.Join(fixture, f), err)
		}
	}
}
