package host

import (
	"fmt"
	"math"

	"github.com/slimen/slimen/host/config"
)

// AdvInput is one sample as the advantage estimators see it.
type AdvInput struct {
	Reward   float64
	Group    string
	Tokens   int       // response length
	Override []float64 // advantage given by the script: 1 value (whole sequence) or one per token
}

// Estimator names an advantage estimator and its settings (REFERENCE.md, Formulas).
type Estimator struct {
	Name         string  // grpo | gspo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
	Normalize    bool    // rewards_normalization: false trains on raw rewards
	StdNormalize bool    // grpo_std_normalization: divide by the group's std
	Gamma        float64 // discount of reinforce_plus_plus returns (G_t = r_t + γ·G_{t+1}); 1 undiscounted
}

func estimatorOf(tc config.TrainConfig) Estimator {
	return Estimator{
		Name: tc.AdvantageEstimator, Normalize: tc.RewardsNormalization,
		StdNormalize: tc.GRPOStdNormalization, Gamma: tc.Gamma,
	}
}

// groupEps is added to the group std, as in slime: A = (r − mean)/(std + 1e-6).
const groupEps = 1e-6

// ComputeAdvantages returns per-token advantages for each sample, in input order. Samples with an
// Override keep it (broadcast to every token when it is one number) and take no part in the
// statistics of their group.
//
//	grpo, gspo:  A = (r − mean_g)/(std_g + 1e-6), std unbiased (n−1); without std normalisation
//	             (or for groups of one) A = r − mean_g; without reward normalisation A = r.
//	rloo:        A_i = r_i − mean of the other samples of its group (0 alone).
//	reinforce_plus_plus: the reward sits on the last token and token t of T gets the discounted
//	             return G_t = r_t + γ·G_{t+1} = γ^(T−1−t)·r (no reward-side KL), then all
//	             tokens of the batch are whitened: (A − mean)/sqrt(var + 1e-8), var unbiased,
//	             as slime's distributed_masked_whiten.
//	reinforce_plus_plus_baseline: r − mean_g (r without reward normalisation; no discount, as in
//	             slime), then whitened the same way.
func ComputeAdvantages(est Estimator, in []AdvInput) ([][]float32, error) {
	seq := make([]float64, len(in))
	groups := map[string][]int{}
	var order []string
	for i, s := range in {
		if s.Override != nil {
			continue
		}
		if _, ok := groups[s.Group]; !ok {
			order = append(order, s.Group)
		}
		groups[s.Group] = append(groups[s.Group], i)
	}
	switch est.Name {
	case "", "grpo", "gspo":
		for _, g := range order {
			idx := groups[g]
			mean, std := groupStats(in, idx)
			for _, i := range idx {
				switch {
				case !est.Normalize:
					seq[i] = in[i].Reward
				case est.StdNormalize && len(idx) > 1:
					seq[i] = (in[i].Reward - mean) / (std + groupEps)
				default:
					seq[i] = in[i].Reward - mean
				}
			}
		}
	case "rloo":
		for _, g := range order {
			idx := groups[g]
			var sum float64
			for _, i := range idx {
				sum += in[i].Reward
			}
			for _, i := range idx {
				if len(idx) > 1 {
					seq[i] = in[i].Reward - (sum-in[i].Reward)/float64(len(idx)-1)
				}
			}
		}
	case "reinforce_plus_plus", "reinforce_plus_plus_baseline":
		for _, g := range order {
			idx := groups[g]
			mean, _ := groupStats(in, idx)
			for _, i := range idx {
				seq[i] = in[i].Reward
				if est.Name == "reinforce_plus_plus_baseline" && est.Normalize {
					seq[i] -= mean
				}
			}
		}
	default:
		return nil, fmt.Errorf("advantage estimator %q is not supported by the host (supported: grpo, gspo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)", est.Name)
	}
	out := make([][]float32, len(in))
	for i, s := range in {
		a := make([]float32, s.Tokens)
		switch {
		case len(s.Override) == s.Tokens && s.Tokens != 1:
			for t := range a {
				a[t] = float32(s.Override[t])
			}
		case s.Override != nil:
			for t := range a {
				a[t] = float32(s.Override[0])
			}
		case est.Name == "reinforce_plus_plus":
			// G_t = r_t + γ·G_{t+1} with the reward on the last token only.
			g := seq[i]
			for t := len(a) - 1; t >= 0; t-- {
				a[t] = float32(g)
				g *= est.Gamma
			}
		default:
			for t := range a {
				a[t] = float32(seq[i])
			}
		}
		out[i] = a
	}
	if est.Name == "reinforce_plus_plus" || est.Name == "reinforce_plus_plus_baseline" {
		whiten(in, out)
	}
	return out, nil
}

// groupStats returns the mean and unbiased std of the rewards of idx.
func groupStats(in []AdvInput, idx []int) (float64, float64) {
	var sum float64
	for _, i := range idx {
		sum += in[i].Reward
	}
	mean := sum / float64(len(idx))
	if len(idx) < 2 {
		return mean, 0
	}
	var v float64
	for _, i := range idx {
		d := in[i].Reward - mean
		v += d * d
	}
	return mean, math.Sqrt(v / float64(len(idx)-1))
}

// whiten normalises the estimator's advantages over every token of the batch (overrides stay).
func whiten(in []AdvInput, adv [][]float32) {
	var sum, sq float64
	n := 0
	for i, a := range adv {
		if in[i].Override != nil {
			continue
		}
		for _, x := range a {
			sum += float64(x)
			n++
		}
	}
	if n == 0 {
		return
	}
	mean := sum / float64(n)
	for i, a := range adv {
		if in[i].Override != nil {
			continue
		}
		for _, x := range a {
			sq += (float64(x) - mean) * (float64(x) - mean)
		}
	}
	// slime's distributed_masked_whiten: Bessel-corrected variance, (x − mean)·rsqrt(var + 1e-8).
	variance := sq / float64(n)
	if n >= 2 {
		variance = sq / float64(n-1)
	}
	scale := 1 / math.Sqrt(variance+1e-8)
	for i, a := range adv {
		if in[i].Override != nil {
			continue
		}
		for t := range a {
			a[t] = float32((float64(a[t]) - mean) * scale)
		}
	}
}
