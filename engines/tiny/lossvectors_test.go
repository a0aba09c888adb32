package tiny

// This file checks policyLoss and tokenWeights against testdata/slime/loss_vectors.json: inputs
// and the loss, statistics and gradients that THUDM/slime's own loss code computes on them
// (testdata/slime/make_vectors.py regenerates the file from a slime checkout).
//
// Schema:
//
//	{
//	  "description": string,
//	  "cases": [{
//	    "name": string,
//	    "config": {                      // every field explicit, no defaults to resolve
//	      "eps_clip": float,             // ratio clipped below at 1 - eps_clip
//	      "eps_clip_high": float,        // and above at 1 + eps_clip_high (0: at exactly 1)
//	      "kl_loss_coef": float,         // 0: no KL term (ref_logprobs unused)
//	      "kl_loss_type": "k1" | "k2" | "k3" | "low_var_kl",
//	      "entropy_coef": float,
//	      "policy_loss": "ppo" | "gspo",
//	      "aggregation": "sample_mean" | "token_mean" | "group_token_mean" | "token_sum"
//	    },
//	    "samples": [{                    // per-token arrays, all of one length per sample
//	      "group": string,               // "" = a group of its own
//	      "logprobs": [float],           // current policy log-probs (the variables)
//	      "old_logprobs": [float],
//	      "ref_logprobs": [float],
//	      "entropy": [float],            // full-vocabulary entropy per token (also a variable)
//	      "advantages": [float],
//	      "loss_mask": [float]           // a sample may have no trained token at all
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
// testdata/slime/tis_vectors.json has the same schema with slime's off-policy correction on:
// config "use_tis": true, "tis_mode": "tis" | "icepop", "tis_clip", "tis_clip_low"; per sample
// "rollout_logprobs" (old_logprobs are then the trainer's); expected "tis_clip_frac" (tokens whose
// weight was clipped or masked / tokens with loss_mask > 0) and "tis_weight" (the mean weight
// over those tokens).
//
// sample_mean is slime's default reduction and token_mean its calculate_per_token_loss;
// group_token_mean and token_sum are slimen's, applied by the script to slime's per-token terms.
// slime computes the KL estimate in float32, hence the tolerances below.

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/slimen/slimen/engines"
)

var (
	lossVectorsPath = filepath.Join("..", "..", "testdata", "slime", "loss_vectors.json")
	tisVectorsPath  = filepath.Join("..", "..", "testdata", "slime", "tis_vectors.json")
)

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
	UseTIS      bool    `json:"use_tis"`
	TISMode     string  `json:"tis_mode"`
	TISClip     float64 `json:"tis_clip"`
	TISClipLow  float64 `json:"tis_clip_low"`
}

type lossVectorSample struct {
	Group       string    `json:"group"`
	Logprobs    []float64 `json:"logprobs"`
	OldLogprobs []float64 `json:"old_logprobs"`
	RefLogprobs []float64 `json:"ref_logprobs"`
	Entropy     []float64 `json:"entropy"`
	Advantages  []float64 `json:"advantages"`
	LossMask    []float64 `json:"loss_mask"`
	Rollout     []float64 `json:"rollout_logprobs"`
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
	TISClipFrac  float64     `json:"tis_clip_frac"`
	TISWeight    float64     `json:"tis_weight"`
}

func (c lossVectorConfig) resolve(t *testing.T) lossConfig {
	r, err := resolveLoss(engines.LossConfig{EpsClip: c.EpsClip, EpsClipHigh: c.EpsClipHigh, KLLossCoef: c.KLLossCoef,
		KLLossType: c.KLLossType, EntropyCoef: c.EntropyCoef, PolicyLoss: c.PolicyLoss, Aggregation: c.Aggregation,
		UseTIS: c.UseTIS, TISMode: c.TISMode, TISClip: c.TISClip, TISClipLow: c.TISClipLow})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (s lossVectorSample) lossSample() lossSample {
	return lossSample{Group: s.Group, Logp: s.Logprobs, OldLogp: s.OldLogprobs, RefLogp: s.RefLogprobs,
		Entropy: s.Entropy, Adv: s.Advantages, Mask: s.LossMask, RolloutLogp: s.Rollout}
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
	e.TISClipFrac, e.TISWeight = st.tisStats()
	return e
}

func readLossVectors(t *testing.T) lossVectorFile {
	return readVectorFile(t, lossVectorsPath)
}

func readVectorFile(t *testing.T, path string) lossVectorFile {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (testdata/slime/make_vectors.py writes it)", err)
	}
	var f lossVectorFile
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	return f
}

// near reports whether got agrees with slime's want: slime's KL terms are float32, so the
// tolerance is a few float32 roundings of the numbers summed.
func near(got, want, scale float64) bool {
	return math.Abs(got-want) <= 1e-6*math.Max(scale, math.Abs(want))+1e-12
}

// compareWithSlime reports every number of got that differs from slime's (c.Expected), and
// whether all agree: loss, statistics, gradients, and with use_tis the TIS statistics.
func compareWithSlime(t *testing.T, c lossVectorCase, got lossVectorExpected) bool {
	t.Helper()
	want := c.Expected
	scale := 1 + math.Abs(want.PGLoss) + c.Config.KLLossCoef*math.Abs(want.KL) + c.Config.EntropyCoef*math.Abs(want.Entropy)
	ok := true
	check := func(what string, g, w, s float64) {
		if !near(g, w, s) {
			ok = false
			t.Errorf("%s: %s = %.12g, slime %.12g", c.Name, what, g, w)
		}
	}
	check("loss", got.Loss, want.Loss, scale)
	check("pg_loss", got.PGLoss, want.PGLoss, scale)
	check("kl", got.KL, want.KL, 1+math.Abs(want.KL))
	check("entropy", got.Entropy, want.Entropy, 1)
	check("clip_frac", got.ClipFrac, want.ClipFrac, 1)
	if c.Config.UseTIS {
		check("tis_clip_frac", got.TISClipFrac, want.TISClipFrac, 1)
		check("tis_weight", got.TISWeight, want.TISWeight, 1)
	}
	if got.Tokens != want.Tokens {
		ok = false
		t.Errorf("%s: tokens = %d, slime %d", c.Name, got.Tokens, want.Tokens)
	}
	for i := range c.Samples {
		for j := range c.Samples[i].Logprobs {
			check("d loss/d logprobs", got.GradLogprobs[i][j], want.GradLogprobs[i][j], 0.1)
			check("d loss/d entropy", got.GradEntropy[i][j], want.GradEntropy[i][j], 0.1)
		}
	}
	return ok
}

func TestLossVectors(t *testing.T) {
	f := readLossVectors(t)
	covered := map[string]bool{}
	matched := map[string]int{}
	for _, c := range f.Cases {
		got := evalLossVector(t, c)
		if compareWithSlime(t, c, got) {
			matched[c.Config.Aggregation+" "+c.Config.PolicyLoss]++
		}
		// The expected gradients are gradients: central differences of slimen's loss agree.
		checkLossGradients(t, c, got)
		if got.ClipFrac > 0 {
			covered["clipping"] = true
		}
		covered["kl "+c.Config.KLLossType] = covered["kl "+c.Config.KLLossType] || c.Config.KLLossCoef > 0
		covered["eps_clip_high 0"] = covered["eps_clip_high 0"] || c.Config.EpsClipHigh == 0 && got.ClipFrac > 0
		for _, s := range c.Samples {
			mass := 0.0
			for j, lp := range s.Logprobs {
				mass += s.LossMask[j]
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
			if mass == 0 {
				covered["sample without trained tokens, "+c.Config.Aggregation] = true
			}
		}
		covered[c.Config.Aggregation+" "+c.Config.PolicyLoss] = true
	}
	for _, want := range []string{"clipping", "upper clip", "lower clip", "kl clamp", "masked token", "eps_clip_high 0",
		"kl k1", "kl k2", "kl k3", "kl low_var_kl", "sample_mean ppo", "token_mean ppo", "group_token_mean ppo",
		"token_sum ppo", "sample_mean gspo", "token_mean gspo", "sample without trained tokens, sample_mean",
		"sample without trained tokens, token_mean"} {
		if !covered[want] {
			t.Errorf("no case covers %s", want)
		}
	}
	total := 0
	for k, n := range matched {
		total += n
		t.Logf("%s: %d cases match slime", k, n)
	}
	t.Logf("%d of %d loss cases match slime (%s)", total, len(f.Cases), f.Description)
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
				if fd := (up - down) / (2 * eps); math.Abs(fd-v.want) > 1e-6*math.Max(1, math.Abs(fd)) {
					t.Errorf("%s: d loss / d %s[%d][%d] = %v, finite difference %v", c.Name, v.name, i, j, v.want, fd)
				}
			}
		}
	}
}

// TestTISVectors checks the off-policy correction (TIS and IcePop, with ppo and gspo, every
// reduction) against slime's vanilla_tis_function and icepop_function as its loss_function applies
// them: loss, statistics, gradients and the share of clipped or masked tokens.
func TestTISVectors(t *testing.T) {
	f := readVectorFile(t, tisVectorsPath)
	covered := map[string]bool{}
	for _, c := range f.Cases {
		if !c.Config.UseTIS {
			t.Fatalf("%s: use_tis is off", c.Name)
		}
		got := evalLossVector(t, c)
		compareWithSlime(t, c, got)
		// A ratio of exactly 1 (the trainer's old log-probs are the current ones) at an upper clip
		// of exactly 1 (eps_clip_high 0) sits on the kink of the clip: finite differences there
		// average the two sides, while slime and slimen both take the unclipped side.
		kink := c.Config.EpsClipHigh == 0 && slices.ContainsFunc(c.Samples, func(s lossVectorSample) bool {
			return slices.Equal(s.Logprobs, s.OldLogprobs)
		})
		if !kink {
			checkLossGradients(t, c, got)
		}
		mode := c.Config.TISMode + " " + c.Config.PolicyLoss
		covered[mode] = true
		if got.TISClipFrac > 0 {
			covered[mode+" clipped"] = true
		}
		for _, s := range c.Samples {
			for j := range s.Logprobs {
				if s.LossMask[j] == 0 {
					continue
				}
				rho := math.Exp(s.OldLogprobs[j] - s.Rollout[j])
				covered["below the band"] = covered["below the band"] || rho < c.Config.TISClipLow
				covered["above the band"] = covered["above the band"] || rho > c.Config.TISClip
				covered["old = current"] = covered["old = current"] || s.OldLogprobs[j] == s.Logprobs[j] && rho != 1
			}
		}
	}
	for _, want := range []string{"tis ppo clipped", "tis gspo clipped", "icepop ppo clipped", "icepop gspo clipped",
		"below the band", "above the band", "old = current"} {
		if !covered[want] {
			t.Errorf("no case covers %s", want)
		}
	}
	t.Logf("%d TIS/IcePop cases checked (%s)", len(f.Cases), f.Description)
}
