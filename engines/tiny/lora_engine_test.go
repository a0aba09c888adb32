package tiny

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/slimen/slimen/engines"
)

func loraTestEngine(t *testing.T) *Engine {
	t.Helper()
	e, err := Open("builtin:tiny-arith", Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func loraReqs() []engines.GenerateRequest {
	var reqs []engines.GenerateRequest
	for i, p := range []string{"1+2=", "7*3=", "12-5="} {
		reqs = append(reqs, engines.GenerateRequest{ID: p, Messages: []engines.Message{{Role: "user", Content: p}}, N: 2,
			Sampling: engines.Sampling{MaxTokens: 6, Temperature: 1, Seed: uint64(i)}})
	}
	return reqs
}

// A new adapter (B = 0) samples exactly what the base samples.
func TestLoRAZeroAdapterIsTheBase(t *testing.T) {
	ctx := context.Background()
	e := loraTestEngine(t)
	if err := e.AddAdapter("a", LoRAConfig{Rank: 4, Alpha: 8, Targets: LoRATargets}, 1); err != nil {
		t.Fatal(err)
	}
	base, err := e.Generate(ctx, loraReqs())
	if err != nil {
		t.Fatal(err)
	}
	v, _ := e.Adapter("a")
	got, err := v.Generate(ctx, loraReqs())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, base) {
		t.Fatalf("a zero adapter sampled\n%+v\nthe base\n%+v", got, base)
	}
}

// trainAdapter takes a few steps of the adapter on its own samples with random advantages.
func trainAdapter(t *testing.T, v engines.Engine, steps int) engines.TrainStats {
	t.Helper()
	ctx := context.Background()
	var st engines.TrainStats
	for s := range steps {
		cs, err := v.Generate(ctx, loraReqs())
		if err != nil {
			t.Fatal(err)
		}
		var b engines.Batch
		for i, c := range cs {
			n := len(c.Tokens)
			adv, mask := make([]float32, n), make([]float32, n)
			for j := range n {
				adv[j], mask[j] = float32((i+s)%3)-1, 1
			}
			b.Samples = append(b.Samples, engines.Sample{Prompt: c.PromptTokens, Response: c.Tokens, LossMask: mask, OldLogprobs: c.Logprobs, Advantages: adv, Group: c.RequestID})
		}
		b.Loss = engines.LossConfig{LR: 1e-2, EpsClip: 0.2, EpsClipHigh: 0.28, KLLossCoef: 0.1}
		var err2 error
		if st, err2 = v.Train(ctx, b); err2 != nil {
			t.Fatal(err2)
		}
		if st.Skipped {
			t.Fatalf("step %d skipped: %s", s, st.Reason)
		}
	}
	return st
}

// Two trained adapters and the base in one batch give each request what it gets alone, the base
// does not move when an adapter trains, and an adapter's reference is the base.
func TestLoRAMixedBatch(t *testing.T) {
	ctx := context.Background()
	e := loraTestEngine(t)
	before, _ := e.Generate(ctx, loraReqs())
	for i, name := range []string{"a", "b"} {
		if err := e.AddAdapter(name, LoRAConfig{Rank: 2 + i, Alpha: 16, Targets: []string{"q_proj", "v_proj", "down_proj"}}, uint64(i)); err != nil {
			t.Fatal(err)
		}
		v, _ := e.Adapter(name)
		trainAdapter(t, v, 2+i)
	}
	after, _ := e.Generate(ctx, loraReqs())
	if !reflect.DeepEqual(after, before) {
		t.Fatal("training an adapter changed the base's samples")
	}
	alone := map[string][]engines.Completion{"": after}
	for _, name := range []string{"a", "b"} {
		v, _ := e.Adapter(name)
		alone[name], _ = v.Generate(ctx, loraReqs())
	}
	if reflect.DeepEqual(alone["a"], alone["b"]) || reflect.DeepEqual(alone["a"], after) {
		t.Fatal("the trained adapters sample what the base samples: the test would not see a mix-up")
	}
	var reqs []engines.GenerateRequest
	var names []string
	for _, r := range loraReqs() {
		for _, name := range []string{"b", "", "a"} {
			reqs, names = append(reqs, r), append(names, name)
		}
	}
	mixed, err := e.GenerateAdapters(ctx, reqs, names)
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range names {
		k := i / 3
		for j := range 2 {
			got, want := mixed[2*i+j], alone[name][2*k+j]
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("request %d sample %d with adapter %q: mixed batch %+v, alone %+v", i, j, name, got, want)
			}
		}
	}
	// The reference scores of an adapter are the base's scores.
	v, _ := e.Adapter("a")
	sreq := []engines.ScoreRequest{{PromptTokens: mixed[0].PromptTokens, Tokens: mixed[0].Tokens, Reference: true}}
	ref, err := v.Score(ctx, sreq)
	if err != nil {
		t.Fatal(err)
	}
	sreq[0].Reference = false
	baseScores, _ := e.Score(ctx, sreq)
	if !reflect.DeepEqual(ref, baseScores) {
		t.Fatalf("adapter reference scores %v, base scores %v", ref, baseScores)
	}
}

// A saved adapter is a PEFT folder that loads back with its optimizer state: training on from it
// gives the same step as training on without the round trip.
func TestLoRASaveLoad(t *testing.T) {
	ctx := context.Background()
	e := loraTestEngine(t)
	cfg := LoRAConfig{Rank: 4, Alpha: 8, Targets: []string{"q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"}}
	for _, n := range []string{"a", "b"} {
		if err := e.AddAdapter(n, cfg, 7); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := e.Adapter("a")
	trainAdapter(t, a, 2)
	dir := t.TempDir()
	if err := a.Save(ctx, dir); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"adapter_config.json", "adapter_model.safetensors", "adapter_optimizer.safetensors"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	raw, _ := os.ReadFile(filepath.Join(dir, "adapter_model.safetensors"))
	ts, err := decodeSafetensors(raw)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := ts["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]; !ok || len(ts) != 2*5*e.Config().Layers {
		t.Fatalf("adapter tensors %d, want PEFT names, A and B for 5 targets per layer", len(ts))
	}
	b, _ := e.Adapter("b")
	if err := b.Load(ctx, dir); err != nil {
		t.Fatal(err)
	}
	ga, _ := a.Generate(ctx, loraReqs())
	gb, _ := b.Generate(ctx, loraReqs())
	if !reflect.DeepEqual(ga, gb) {
		t.Fatal("the loaded adapter samples differently from the saved one")
	}
	sa, sb := trainAdapter(t, a, 1), trainAdapter(t, b, 1)
	if sa != sb || math.IsNaN(sa.Loss) {
		t.Fatalf("a step after the round trip: %+v; without it: %+v", sb, sa)
	}
	ga, _ = a.Generate(ctx, loraReqs())
	gb, _ = b.Generate(ctx, loraReqs())
	if !reflect.DeepEqual(ga, gb) {
		t.Fatal("after one more step the loaded adapter (with its optimizer state) differs from the saved one")
	}
}
