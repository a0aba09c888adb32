package tiny

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/slimen/slimen/engines"
)

// Save then Load restores weights and optimizer state: the next step is the same as without the
// round trip.
func TestSaveLoadRoundTrip(t *testing.T) {
	e := newSmall(t, 2)
	b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%2)*2 - 1 })
	if _, err := e.Train(ctx, b); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := e.Save(ctx, dir); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{fileConfig, fileWeights, fileTokenizer, fileTokenizerConfig, fileOptimizer, fileOptimizerState} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("Save did not write %s", f)
		}
	}
	opened, err := Open(dir, Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	if !cmp.Equal(snapshot(e), snapshot(opened)) || opened.opt.step != 1 {
		t.Fatal("opened checkpoint differs from the saved engine")
	}
	// Load into a fresh engine of the same architecture; its next step matches the original's.
	fresh := newSmall(t, 1)
	if err := fresh.Load(ctx, dir); err != nil {
		t.Fatal(err)
	}
	st1, _ := e.Train(ctx, b)
	st2, _ := fresh.Train(ctx, b)
	if !cmp.Equal(snapshot(e), snapshot(fresh)) || st1.Loss != st2.Loss {
		t.Fatal("training after Load diverged from training without the round trip")
	}
	// A folder without optimizer state resets it.
	plain := newSmall(t, 1)
	pdir := t.TempDir()
	if err := plain.Save(ctx, pdir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(pdir, fileOptimizer)); !os.IsNotExist(err) {
		t.Fatal("an untrained engine wrote optimizer state")
	}
	if err := fresh.Load(ctx, pdir); err != nil || fresh.opt.step != 0 {
		t.Fatalf("load without optimizer state: err %v, step %d", err, fresh.opt.step)
	}
	other, _ := New(ModelConfig{Hidden: 8, Intermediate: 8, Layers: 1, Heads: 2, MaxSeqLen: 16}, 1, Options{})
	if err := other.Load(ctx, dir); err == nil || !strings.Contains(err.Error(), "architecture") {
		t.Fatalf("loading a different architecture: %v", err)
	}
}

// Broken folders fail with the file, and the tensor, at fault.
func TestOpenBadFolders(t *testing.T) {
	e := newSmall(t, 1)
	good := t.TempDir()
	if err := e.Save(ctx, good); err != nil {
		t.Fatal(err)
	}
	copyDir := func() string {
		dir := t.TempDir()
		entries, _ := os.ReadDir(good)
		for _, en := range entries {
			b, _ := os.ReadFile(filepath.Join(good, en.Name()))
			os.WriteFile(filepath.Join(dir, en.Name()), b, 0o644)
		}
		return dir
	}
	rewriteWeights := func(dir string, edit func(map[string]tensor)) {
		b, _ := os.ReadFile(filepath.Join(dir, fileWeights))
		ts, err := decodeSafetensors(b)
		if err != nil {
			t.Fatal(err)
		}
		edit(ts)
		var list []tensor
		for _, x := range ts {
			list = append(list, x)
		}
		os.WriteFile(filepath.Join(dir, fileWeights), encodeSafetensors(list, nil), 0o644)
	}
	editJSON := func(dir, file string, edit func(map[string]any)) {
		b, _ := os.ReadFile(filepath.Join(dir, file))
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		edit(m)
		b, _ = json.Marshal(m)
		os.WriteFile(filepath.Join(dir, file), b, 0o644)
	}
	const q = "model.layers.1.self_attn.q_proj.weight"
	for _, tc := range []struct {
		name    string
		corrupt func(dir string)
		want    []string
	}{
		{"missing tensor", func(dir string) { rewriteWeights(dir, func(ts map[string]tensor) { delete(ts, q) }) },
			[]string{fileWeights, q, "missing"}},
		{"mis-shaped tensor", func(dir string) {
			rewriteWeights(dir, func(ts map[string]tensor) { x := ts[q]; x.shape = []int{8, 32}; ts[q] = x })
		}, []string{fileWeights, q, "shape [8 32]", "want [16 16]"}},
		{"unexpected tensor", func(dir string) {
			rewriteWeights(dir, func(ts map[string]tensor) {
				ts["model.layers.9.mlp.up_proj.weight"] = tensor{name: "model.layers.9.mlp.up_proj.weight", shape: []int{1}, data: []float32{1}}
			})
		}, []string{fileWeights, "model.layers.9.mlp.up_proj.weight"}},
		{"truncated weights", func(dir string) {
			b, _ := os.ReadFile(filepath.Join(dir, fileWeights))
			os.WriteFile(filepath.Join(dir, fileWeights), b[:len(b)-10], 0o644)
		}, []string{fileWeights, "data offsets"}},
		{"unsupported architecture", func(dir string) {
			editJSON(dir, fileConfig, func(m map[string]any) { m["architectures"] = []string{"MistralForCausalLM"} })
		}, []string{fileConfig, "MistralForCausalLM", "LlamaForCausalLM"}},
		{"broken tokenizer", func(dir string) {
			os.WriteFile(filepath.Join(dir, fileTokenizer), []byte(`{"model": {"type": "BPE", "vocab": {`), 0o644)
		}, []string{fileTokenizer, "not valid JSON"}},
		{"word-level tokenizer", func(dir string) {
			editJSON(dir, fileTokenizer, func(m map[string]any) { m["model"].(map[string]any)["merges"] = []string{"a b"} })
		}, []string{fileTokenizer, "merges"}},
		{"foreign chat template", func(dir string) {
			editJSON(dir, fileTokenizerConfig, func(m map[string]any) { m["chat_template"] = "{{ messages }}" })
		}, []string{fileTokenizerConfig, "chat_template"}},
		{"missing config", func(dir string) { os.Remove(filepath.Join(dir, fileConfig)) }, []string{fileConfig, "missing"}},
		{"missing optimizer step", func(dir string) {
			os.WriteFile(filepath.Join(dir, fileOptimizer), encodeSafetensors(nil, nil), 0o644)
		}, []string{fileOptimizerState, "step count"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := copyDir()
			tc.corrupt(dir)
			_, err := Open(dir, Options{})
			if err == nil {
				t.Fatal("Open succeeded")
			}
			for _, w := range append(tc.want, dir) {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	if _, err := Open("builtin:nope", Options{}); err == nil || !strings.Contains(err.Error(), "builtin:nope") {
		t.Fatalf("unknown builtin: %v", err)
	}
}

// Load of builtin:NAME puts back the built-in model and a fresh optimizer: a trained engine opened
// on it is then the engine just opened (a served engine is reset so).
func TestLoadBuiltinResets(t *testing.T) {
	e, err := Open("builtin:tiny-arith", Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	fresh, err := Open("builtin:tiny-arith", Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%2)*2 - 1 })
	if _, err := e.Train(ctx, b); err != nil {
		t.Fatal(err)
	}
	if cmp.Equal(snapshot(e), snapshot(fresh)) {
		t.Fatal("the training step changed nothing: the test cannot tell a reset")
	}
	if err := e.Load(ctx, "builtin:tiny-arith"); err != nil {
		t.Fatal(err)
	}
	if !cmp.Equal(snapshot(e), snapshot(fresh)) || e.opt.step != 0 {
		t.Errorf("after Load(builtin:tiny-arith) the engine differs from a fresh one (optimizer step %d)", e.opt.step)
	}
	if err := e.Load(ctx, "builtin:nope"); err == nil || !strings.Contains(err.Error(), "unknown model builtin:nope") {
		t.Errorf("Load(builtin:nope): %v", err)
	}
}
