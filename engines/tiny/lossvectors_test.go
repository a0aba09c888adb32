package tiny

// This file generates and checks testdata/loss_vectors.json, the reference for the policy loss
// that every slimen engine implements (DESIGN §4). Regenerate with
//
//	go test ./engines/tiny -run TestLossVectors -update
//
// Schema:
//
//	{
//	  "description": string,
//	  "cases": [{
//	    "name": string,
//	    "config": {                      // every field explicit, no defaults to resolve
//	      "eps_clip": float,             // ratio clipped below at 1 - eps_clip
//	      "eps_clip_high": float,        // and above at 1 + eps_clip_high
//	      "kl_loss_coef": float,         // 0: no KL term (ref_logprobs unused)
//	      "kl_loss_type": "k1" | "k2" | "k3" | "low_var_kl",
//	      "entropy_coef": float,
//	      "policy_loss": "ppo" | "gspo",
//	      "aggregation": "group_token_mean" | "token_mean" | "token_sum"
//	    },
//	    "samples": [{                    // per-token arrays, all of one length per sample
//	      "group": string,               // "" = a group of its own
//	      "logprobs": [float],           // current policy log-probs (the variables)
//	      "old_logprobs": [float],
//	      "ref_logprobs": [float],
//	      "entropy": [float],            // full-vocabulary entropy per token (also a variable)
//	      "advantages": [float],
//	      "loss_mask": [float]
//	    }],
//	    "expected": {
//	      "loss": float,                 // = pg_loss + kl_loss_coef*kl - entropy_coef*entropy
//	      "pg_loss": float, "kl": float, "entropy": float,  // each reduced like the loss
//	      "clip_frac": float,            // clipped tokens / tokens with loss_mask > 0
//	      "tokens": int,                 // tokens with loss_mask > 0
//	      "grad_logprobs": [[float]],    // d loss / d logprobs, per sample and token
//	      "grad_entropy": [[float]]      // d loss / d entropy
//	    }
//	  }]
//	}
//
// The definitions are policyLoss's (loss.go): ratio r = exp(logp - old) per token (ppo) or
// exp(mask-weighted mean over the sample of logp - old) for every token of a sample (gspo);
// pg = max(-r*A, -clip(r, 1-eps_clip, 1+eps_clip_high)*A), whose gradient is zero where the clipped
// term is strictly larger; a token counts as clipped there. KL with d = logp - ref: k1 = d,
// k2 = d²/2, k3 = exp(-d) - 1 + d, low_var_kl = k3 clamped to [-10, 10] (zero gradient when
// clamped). Reduction: a token's weight is mask/(G * group mask sum) for group_token_mean (G =
// groups with a positive mask sum), mask/(batch mask sum) for token_mean, mask for token_sum.

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/slimen/slimen/engines"
)

var lossVectorsPath = filepath.Join("..", "..", "testdata", "loss_vectors.json")

type lossVectorFile struct {
	Description string           `json:"description"`
	Cases       []lossVectorCase `json:"cases"`
}

type lossVectorCase struct {
	Name     string             `json:"name"`
	Config   lossVectorConfig   `json:"config"`
	Samples  []lossVectorSample `json:"samples"`
	Expected lossVectorExpected `json:"expected"`
}

type lossVectorConfig struct {
	EpsClip     float64 `json:"eps_clip"`
	EpsClipHigh float64 `json:"eps_clip_high"`
	KLLossCoef  float64 `json:"kl_loss_coef"`
	KLLossType  string  `json:"kl_loss_type"`
	EntropyCoef float64 `json:"entropy_coef"`
	PolicyLoss  string  `json:"policy_loss"`
	Aggregation string  `json:"aggregation"`
}

type lossVectorSample struct {
	Group       string    `json:"group"`
	Logprobs    []float64 `json:"logprobs"`
	OldLogprobs []float64 `json:"old_logprobs"`
	RefLogprobs []float64 `json:"ref_logprobs"`
	Entropy     []float64 `json:"entropy"`
	Advantages  []float64 `json:"advantages"`
	LossMask    []float64 `json:"loss_mask"`
}

type lossVectorExpected struct {
	Loss         float64     `json:"loss"`
	PGLoss       float64     `json:"pg_loss"`
	KL           float64     `json:"kl"`
	Entropy      float64     `json:"entropy"`
	ClipFrac     float64     `json:"clip_frac"`
	Tokens       int         `json:"tokens"`
	GradLogprobs [][]float64 `json:"grad_logprobs"`
	GradEntropy  [][]float64 `json:"grad_entropy"`
}

func (c lossVectorConfig) resolve(t *testing.T) lossConfig {
	r, err := resolveLoss(engines.LossConfig{EpsClip: c.EpsClip, EpsClipHigh: c.EpsClipHigh, KLLossCoef: c.KLLossCoef,
		KLLossType: c.KLLossType, EntropyCoef: c.EntropyCoef, PolicyLoss: c.PolicyLoss, Aggregation: c.Aggregation})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (s lossVectorSample) lossSample() lossSample {
	return lossSample{Group: s.Group, Logp: s.Logprobs, OldLogp: s.OldLogprobs, RefLogp: s.RefLogprobs,
		Entropy: s.Entropy, Adv: s.Advantages, Mask: s.LossMask}
}

// round6 keeps the inputs short and exactly reproducible from their decimal form.
func round6(x float64) float64 { return math.Round(x*1e6) / 1e6 }

// lossVectorInputs builds the cases' inputs: groups of different sizes, masked tokens, ratios on
// both sides of the clip range with advantages of both signs, and for low_var_kl reference
// log-probs far enough to hit the clamp.
func lossVectorInputs() []lossVectorCase {
	base := lossVectorConfig{EpsClip: 0.2, EpsClipHigh: 0.28, KLLossType: "low_var_kl", PolicyLoss: "ppo", Aggregation: "group_token_mean"}
	with := func(f func(*lossVectorConfig)) lossVectorConfig { c := base; f(&c); return c }
	cases := []struct {
		name string
		cfg  lossVectorConfig
	}{
		{"ppo_group_token_mean", base},
		{"ppo_symmetric_clip", with(func(c *lossVectorConfig) { c.EpsClipHigh = 0.2 })},
		{"kl_k1", with(func(c *lossVectorConfig) { c.KLLossCoef, c.KLLossType = 0.1, "k1" })},
		{"kl_k2", with(func(c *lossVectorConfig) { c.KLLossCoef, c.KLLossType = 0.1, "k2" })},
		{"kl_k3", with(func(c *lossVectorConfig) { c.KLLossCoef, c.KLLossType = 0.1, "k3" })},
		{"kl_low_var_kl_clamped", with(func(c *lossVectorConfig) { c.KLLossCoef, c.KLLossType = 0.1, "low_var_kl" })},
		{"entropy_bonus", with(func(c *lossVectorConfig) { c.EntropyCoef = 0.01 })},
		{"token_mean_kl_entropy", with(func(c *lossVectorConfig) { c.Aggregation, c.KLLossCoef, c.EntropyCoef = "token_mean", 0.05, 0.02 })},
		{"token_sum", with(func(c *lossVectorConfig) { c.Aggregation = "token_sum" })},
		{"gspo", with(func(c *lossVectorConfig) { c.PolicyLoss = "gspo"; c.EpsClip, c.EpsClipHigh = 0.05, 0.08 })},
		{"gspo_token_mean_kl", with(func(c *lossVectorConfig) {
			c.PolicyLoss, c.Aggregation, c.KLLossCoef, c.KLLossType = "gspo", "token_mean", 0.2, "k2"
			c.EpsClip, c.EpsClipHigh = 0.05, 0.08
		})},
	}
	var out []lossVectorCase
	for ci, c := range cases {
		r := rand.New(rand.NewPCG(2024, uint64(ci)))
		groups := []string{"g0", "g0", "g0", "g1", "g2", "g2", "", ""} // sizes 3, 1, 2 and two loners
		var samples []lossVectorSample
		for _, g := range groups {
			n := 1 + r.IntN(6)
			s := lossVectorSample{Group: g}
			adv := r.NormFloat64() // GRPO: one advantage per sample
			for range n {
				lp := -3 * r.Float64()
				ref := lp + 0.3*r.NormFloat64()
				if c.cfg.KLLossType == "low_var_kl" && r.IntN(4) == 0 {
					ref = lp + 3 + r.Float64() // exp(-d) - 1 + d > 10: the clamp
				}
				mask := 1.0
				if r.IntN(6) == 0 {
					mask = 0
				}
				s.Logprobs = append(s.Logprobs, round6(lp))
				s.OldLogprobs = append(s.OldLogprobs, round6(lp+0.8*(r.Float64()-0.5)))
				s.RefLogprobs = append(s.RefLogprobs, round6(ref))
				s.Entropy = append(s.Entropy, round6(0.1+2*r.Float64()))
				s.Advantages = append(s.Advantages, round6(adv))
				s.LossMask = append(s.LossMask, mask)
			}
			samples = append(samples, s)
		}
		out = append(out, lossVectorCase{Name: c.name, Config: c.cfg, Samples: samples})
	}
	return out
}

func evalLossVector(t *testing.T, c lossVectorCase) lossVectorExpected {
	samples := make([]lossSample, len(c.Samples))
	for i, s := range c.Samples {
		samples[i] = s.lossSample()
	}
	cfg := c.Config.resolve(t)
	st, dl, de := policyLoss(samples, tokenWeights(samples, cfg.aggregation), cfg)
	e := lossVectorExpected{Loss: st.Loss, PGLoss: st.PG, KL: st.KL, Entropy: st.Entropy, Tokens: st.Tokens,
		GradLogprobs: dl, GradEntropy: de}
	if st.Tokens > 0 {
		e.ClipFrac = float64(st.Clipped) / float64(st.Tokens)
	}
	return e
}

func TestLossVectors(t *testing.T) {
	if *update {
		f := lossVectorFile{Description: "Policy-loss test vectors for slimen engines; schema and definitions in engines/tiny/lossvectors_test.go."}
		for _, c := range lossVectorInputs() {
			c.Expected = evalLossVector(t, c)
			f.Cases = append(f.Cases, c)
		}
		b, err := json.MarshalIndent(f, "", " ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(lossVectorsPath, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(lossVectorsPath)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	var f lossVectorFile
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	covered := map[string]bool{}
	for _, c := range f.Cases {
		got := evalLossVector(t, c)
		if diff := cmp.Diff(c.Expected, got, cmpopts.EquateApprox(1e-12, 1e-15)); diff != "" {
			t.Errorf("%s: policyLoss differs from the file (-file +now):\n%s", c.Name, diff)
		}
		// The expected gradients are gradients: central differences of the loss agree.
		checkLossGradients(t, c, got)
		if got.ClipFrac > 0 {
			covered["clipping"] = true
		}
		covered["kl "+c.Config.KLLossType] = covered["kl "+c.Config.KLLossType] || c.Config.KLLossCoef > 0
		for _, s := range c.Samples {
			for j, lp := range s.Logprobs {
				if s.LossMask[j] == 0 {
					covered["masked token"] = true
					continue
				}
				r, a := math.Exp(lp-s.OldLogprobs[j]), s.Advantages[j]
				covered["upper clip"] = covered["upper clip"] || (c.Config.PolicyLoss == "ppo" && a > 0 && r > 1+c.Config.EpsClipHigh)
				covered["lower clip"] = covered["lower clip"] || (c.Config.PolicyLoss == "ppo" && a < 0 && r < 1-c.Config.EpsClip)
				if k3, _ := klTerm(lp-s.RefLogprobs[j], "k3"); c.Config.KLLossType == "low_var_kl" && c.Config.KLLossCoef > 0 && k3 > 10 {
					covered["kl clamp"] = true
				}
			}
		}
		covered[c.Config.Aggregation+" "+c.Config.PolicyLoss] = true
	}
	for _, want := range []string{"clipping", "upper clip", "lower clip", "kl clamp", "masked token", "kl k1", "kl k2", "kl k3", "kl low_var_kl", "group_token_mean ppo", "token_mean ppo", "token_sum ppo", "group_token_mean gspo"} {
		if !covered[want] {
			t.Errorf("no case covers %s", want)
		}
	}
}

func checkLossGradients(t *testing.T, c lossVectorCase, got lossVectorExpected) {
	cfg := c.Config.resolve(t)
	lossAt := func(samples []lossVectorSample) float64 {
		ls := make([]lossSample, len(samples))
		for i, s := range samples {
			ls[i] = s.lossSample()
		}
		st, _, _ := policyLoss(ls, tokenWeights(ls, cfg.aggregation), cfg)
		return st.Loss
	}
	const eps = 1e-6
	for i, s := range c.Samples {
		for j := range s.Logprobs {
			for _, v := range []struct {
				name string
				x    []float64
				want float64
			}{{"logprobs", s.Logprobs, got.GradLogprobs[i][j]}, {"entropy", s.Entropy, got.GradEntropy[i][j]}} {
				orig := v.x[j]
				v.x[j] = orig + eps
				up := lossAt(c.Samples)
				v.x[j] = orig - eps
				down := lossAt(c.Samples)
				v.x[j] = orig
				if fd := (up - down) / (2 * eps); math.Abs(fd-v.want) > 1e-7*math.Max(1, math.Abs(fd)) {
					t.Errorf("%s: d loss / d %s[%d][%d] = %v, finite difference %v", c.Name, v.name, i, j, v.want, fd)
				}
			}
		}
	}
}
