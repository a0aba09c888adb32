package host

import (
	"context"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// A tiny policy that starts from a load: folder keeps measuring its KL loss against
// hf_checkpoint (or ref_load), as slime-n does: the first step's KL is that of the loaded weights
// against the base model, not zero.
func TestTinyKLReferenceIsNotTheLoadFolder(t *testing.T) {
	ctx := context.Background()
	base, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer base.Close()
	cs, err := base.Generate(ctx, []engines.GenerateRequest{{ID: "a", N: 8,
		Messages: []engines.Message{{Role: "user", Content: "Ann has 3 pens and gets 4 more. How many pens?"}},
		Sampling: engines.Sampling{MaxTokens: 12, Temperature: 1, Seed: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	batch := func(kl float64) engines.Batch {
		b := engines.Batch{Loss: engines.LossConfig{LR: 1e-2, MaxGradNorm: 1, EpsClip: 0.2, KLLossCoef: kl}}
		for i, c := range cs {
			s := engines.Sample{Prompt: c.PromptTokens, Response: c.Tokens, OldLogprobs: c.Logprobs, Group: "g"}
			for range c.Tokens {
				s.LossMask = append(s.LossMask, 1)
				s.Advantages = append(s.Advantages, float32(i%2)*2-1)
			}
			b.Samples = append(b.Samples, s)
		}
		return b
	}
	// The folder a policy warm-starts from: the base model moved by a few optimizer steps.
	for range 3 {
		if _, err := base.Train(ctx, batch(0)); err != nil {
			t.Fatal(err)
		}
	}
	moved := t.TempDir()
	if err := base.Save(ctx, moved); err != nil {
		t.Fatal(err)
	}

	firstKL := func(p config.PolicyConfig) float64 {
		t.Helper()
		e, err := openEngine(ctx, p, "", engineLogs{})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		st, err := e.Train(ctx, batch(0.1))
		if err != nil {
			t.Fatal(err)
		}
		return st.KL
	}
	p := config.DefaultPolicy("p")
	p.Load = moved
	if kl := firstKL(p); kl <= 1e-6 {
		t.Errorf("load: %s, reference hf_checkpoint: first KL %g, want > 0 (the reference is the loaded weights)", moved, kl)
	}
	p.RefLoad = moved
	if kl := firstKL(p); kl != 0 {
		t.Errorf("load: and ref_load: the same folder: first KL %g, want 0", kl)
	}
	p = config.DefaultPolicy("p")
	if kl := firstKL(p); kl != 0 {
		t.Errorf("no load: first KL %g, want 0", kl)
	}
}
