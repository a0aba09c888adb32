package host

// This file checks host/advantage's Compute and the ppo path (ppoRewards, gae) against
// testdata/slime/advantage_vectors.json: inputs and the advantages (and ppo returns) that
// THUDM/slime's own code computes on them — RolloutManager._post_process_rewards for the group
// normalisation, then compute_advantages_and_returns (testdata/slime/make_vectors.py regenerates
// the file from a slime checkout).
//
// Schema:
//
//	{"description": string, "cases": [{
//	  "name": string,
//	  "estimator": {"name": string, "rewards_normalization": bool, "grpo_std_normalization": bool,
//	                "gamma": float, "lambda": float, "kl_coef": float, "kl_loss_type": string},
//	  "samples": [{"group": string, "reward": float,       // raw reward; groups contiguous
//	               "logprobs": [float],                     // rollout log-probs
//	               "ref_logprobs": [float],                 // the KL reference's
//	               "loss_mask": [int],                      // may have zeros inside
//	               "values": [float]}],                     // ppo only: the critic's values
//	  "expected": {"advantages": [[float]], "returns": [[float]]}  // returns: ppo only
//	}]}
//
// slime computes in float32 (log-probs, KL, whitening statistics), hence the tolerance.

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/host/advantage"
)

type advVectorCase struct {
	Name      string `json:"name"`
	Estimator struct {
		Name                 string  `json:"name"`
		RewardsNormalization bool    `json:"rewards_normalization"`
		GRPOStdNormalization bool    `json:"grpo_std_normalization"`
		Gamma                float64 `json:"gamma"`
		Lambda               float64 `json:"lambda"`
		KLCoef               float64 `json:"kl_coef"`
		KLLossType           string  `json:"kl_loss_type"`
	} `json:"estimator"`
	Samples []struct {
		Group       string    `json:"group"`
		Reward      float64   `json:"reward"`
		Logprobs    []float32 `json:"logprobs"`
		RefLogprobs []float32 `json:"ref_logprobs"`
		LossMask    []float64 `json:"loss_mask"`
		Values      []float32 `json:"values"`
	} `json:"samples"`
	Expected struct {
		Advantages [][]float64 `json:"advantages"`
		Returns    [][]float64 `json:"returns"`
	} `json:"expected"`
}

func TestAdvantageVectors(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "testdata", "slime", "advantage_vectors.json"))
	if err != nil {
		t.Fatalf("%v (testdata/slime/make_vectors.py writes it)", err)
	}
	var f struct {
		Description string          `json:"description"`
		Cases       []advVectorCase `json:"cases"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	matched, total := map[string]int{}, map[string]int{}
	covered := map[string]bool{}
	for _, c := range f.Cases {
		e := c.Estimator
		est := advantage.Estimator{Name: e.Name, Normalize: e.RewardsNormalization, StdNormalize: e.GRPOStdNormalization,
			Gamma: e.Gamma, KLCoef: e.KLCoef}
		var adv, ret [][]float32
		if e.Name == "ppo" {
			for _, s := range c.Samples {
				a, r := gae(ppoRewards(s.Reward, e.KLCoef, tokenKL(s.Logprobs, s.RefLogprobs, e.KLLossType), len(s.Values)), s.Values, e.Gamma, e.Lambda)
				adv, ret = append(adv, a), append(ret, r)
			}
		} else {
			var in []advantage.Input
			for _, s := range c.Samples {
				in = append(in, advantage.Input{Reward: s.Reward, Group: s.Group, Tokens: len(s.Logprobs), Mask: s.LossMask,
					KL: tokenKL(s.Logprobs, s.RefLogprobs, e.KLLossType)})
			}
			if adv, err = advantage.Compute(est, in); err != nil {
				t.Fatalf("%s: %v", c.Name, err)
			}
		}
		key := e.Name
		if e.KLCoef > 0 {
			key += " kl_coef"
		}
		ok := true
		compare := func(what string, got [][]float32, want [][]float64) {
			for i := range want {
				for j, w := range want[i] {
					if g := float64(got[i][j]); math.Abs(g-w) > 2e-5*math.Max(1, math.Abs(w)) {
						ok = false
						t.Errorf("%s: %s[%d][%d] = %.7g, slime %.7g", c.Name, what, i, j, g, w)
					}
				}
			}
		}
		compare("advantages", adv, c.Expected.Advantages)
		if e.Name == "ppo" {
			compare("returns", ret, c.Expected.Returns)
		}
		total[key]++
		if ok {
			matched[key]++
		}
		covered[key] = true
		for _, s := range c.Samples {
			for j := 1; j+1 < len(s.LossMask); j++ {
				if s.LossMask[j] == 0 && (e.Name == "reinforce_plus_plus" || e.Name == "reinforce_plus_plus_baseline") {
					covered["interior mask "+e.Name] = true
				}
			}
		}
		covered["gamma < 1 "+e.Name] = covered["gamma < 1 "+e.Name] || e.Gamma < 1
		covered["no std "+e.Name] = covered["no std "+e.Name] || !e.GRPOStdNormalization
	}
	for _, want := range []string{"grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
		"reinforce_plus_plus kl_coef", "reinforce_plus_plus_baseline kl_coef", "ppo kl_coef",
		"interior mask reinforce_plus_plus", "interior mask reinforce_plus_plus_baseline",
		"gamma < 1 reinforce_plus_plus", "gamma < 1 ppo", "no std grpo"} {
		if !covered[want] {
			t.Errorf("no case covers %s", want)
		}
	}
	n, m := 0, 0
	for k, c := range total {
		n, m = n+c, m+matched[k]
		t.Logf("%s: %d of %d cases match slime", k, matched[k], c)
	}
	t.Logf("%d of %d advantage cases match slime (%s)", m, n, f.Description)
}
