package host

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// AdvInput is one sample as the advantage estimators see it.
type AdvInput struct {
	Reward   float64
	Group    string
	Tokens   int       // response length
	Override []float64 // advantage given by the script: 1 value (whole sequence) or one per token
	// Mask is the loss mask, one entry per token (nil: every token is trained). REINFORCE++ puts
	// the reward on the last trained token, and whitening averages over trained tokens only.
	Mask []float64
	// KL is the per-token KL estimate between the rollout policy and the reference (see
	// tokenKL), read by the reward-side KL of the REINFORCE++ estimators when KLCoef > 0.
	KL []float64
}

// Estimator names an advantage estimator and its settings (REFERENCE.md, Formulas).
type Estimator struct {
	Name         string  // grpo | gspo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
	Normalize    bool    // rewards_normalization: false trains on raw rewards
	StdNormalize bool    // grpo_std_normalization: divide by the group's std
	Gamma        float64 // discount of reinforce_plus_plus returns (G_t = r_t + γ·G_{t+1}); 1 undiscounted
	KLCoef       float64 // kl_coef: the reward-side KL, −kl_coef·KL_t added to each token's reward
}

func estimatorOf(tc config.TrainConfig) Estimator {
	return Estimator{
		Name: tc.AdvantageEstimator, Normalize: tc.RewardsNormalization,
		StdNormalize: tc.GRPOStdNormalization, Gamma: tc.Gamma, KLCoef: tc.KLCoef,
	}
}

// usesRewardKL reports whether an estimator applies kl_coef, as slime's do: reinforce_plus_plus,
// reinforce_plus_plus_baseline and ppo (grpo, gspo and rloo ignore it).
func usesRewardKL(estimator string) bool {
	return estimator == "reinforce_plus_plus" || estimator == "reinforce_plus_plus_baseline" || estimator == "ppo"
}

// rewardKL returns the per-token KL between the rollout policy and the frozen reference of each of
// a policy's samples, for the reward-side KL; nil when kl_coef is 0 or the estimator ignores it.
// The reference log-probs are scored by the policy's own engine (ScoreRequest.Reference), the
// KL estimate is kl_loss_type's, as in slime.
func (r *Run) rewardKL(ctx context.Context, p *policy, ss []trainSample) ([][]float64, error) {
	tc := p.cfg.Train
	if tc.KLCoef == 0 || !usesRewardKL(tc.AdvantageEstimator) || len(ss) == 0 {
		return nil, nil
	}
	info, err := p.eng.Info(ctx)
	if err != nil {
		return nil, &EngineError{Step: r.step + 1, Policy: p.name, Err: fmt.Errorf("info: %w", err), Hint: r.engineErrorHint()}
	}
	if !slices.Contains(info.Capabilities, "reference") {
		return nil, fmt.Errorf("policy %q: kl_coef %g needs the log-probs of the KL reference, which its engine (%s) cannot score (no \"reference\" capability)", p.name, tc.KLCoef, info.Model)
	}
	reqs := make([]engines.ScoreRequest, len(ss))
	for i, s := range ss {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.c.prompt, Tokens: s.c.tokens, Reference: true}
	}
	scores, err := p.eng.Score(ctx, reqs)
	if err != nil {
		return nil, &EngineError{Step: r.step + 1, Policy: p.name, Err: fmt.Errorf("scoring %d samples with the KL reference: %w", len(ss), err), Hint: r.engineErrorHint()}
	}
	out := make([][]float64, len(ss))
	for i, s := range ss {
		if len(scores[i].Logprobs) != len(s.c.tokens) || len(s.c.logprobs) != len(s.c.tokens) {
			return nil, fmt.Errorf("policy %q: the KL reference returned %d log-probs for %d tokens (%d rollout log-probs)", p.name, len(scores[i].Logprobs), len(s.c.tokens), len(s.c.logprobs))
		}
		out[i] = tokenKL(s.c.logprobs, scores[i].Logprobs, tc.KLLossType)
	}
	return out, nil
}

// tokenKL returns the per-token KL estimate of slime's compute_approx_kl with Δ = logp − ref:
// k1 = Δ, k2 = Δ²/2, k3 = e^−Δ − 1 + Δ, low_var_kl = k3 clamped to [−10, 10].
func tokenKL(logp, ref []float32, kind string) []float64 {
	out := make([]float64, len(logp))
	for t := range logp {
		d := float64(logp[t]) - float64(ref[t])
		switch kind {
		case "k1":
			out[t] = d
		case "k2":
			out[t] = d * d / 2
		default:
			out[t] = math.Exp(-d) - 1 + d
			if kind == "low_var_kl" {
				out[t] = min(max(out[t], -10), 10)
			}
		}
	}
	return out
}

// ppoRewards are the per-token rewards GAE runs on for ppo: −kl_coef·KL_t on every token (kl may
// be nil: no KL) and the reward added at the last position, as slime's ppo branch does.
func ppoRewards(reward, klCoef float64, kl []float64, n int) []float64 {
	r := make([]float64, n)
	for t := range r {
		if kl != nil {
			r[t] = -klCoef * kl[t]
		}
	}
	if n > 0 {
		r[n-1] += reward
	}
	return r
}

// maskAt is token t's loss mask (1 without a mask).
func (s AdvInput) maskAt(t int) float64 {
	if s.Mask == nil {
		return 1
	}
	return s.Mask[t]
}

// klAt is kl_coef·KL_t, or 0 without KL.
func (s AdvInput) klAt(est Estimator, t int) float64 {
	if est.KLCoef == 0 || s.KL == nil {
		return 0
	}
	return est.KLCoef * s.KL[t]
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
//	reinforce_plus_plus: token t's reward is −kl_coef·KL_t·mask_t, plus r on the last trained
//	             token; token t gets the discounted return G_t = r_t + γ·G_{t+1} (over every
//	             position, trained or not), then the batch is whitened: (A − mean)/sqrt(var +
//	             1e-8), mean and unbiased var over trained tokens, every token shifted, as
//	             slime's distributed_masked_whiten.
//	reinforce_plus_plus_baseline: r − mean_g − kl_coef·KL_t (r without reward normalisation;
//	             no discount, as in slime), then whitened the same way.
func ComputeAdvantages(est Estimator, in []AdvInput) ([][]float32, error) {
	for i, s := range in {
		if (s.Mask != nil && len(s.Mask) != s.Tokens) || (s.KL != nil && len(s.KL) != s.Tokens) {
			return nil, fmt.Errorf("advantages: sample %d has %d tokens but a loss mask of %d and a KL of %d", i, s.Tokens, len(s.Mask), len(s.KL))
		}
	}
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
			// G_t = r_t + γ·G_{t+1}: the reward on the last trained token, the KL on every
			// trained one. (slime refuses a sample without trained tokens; here it keeps 0.)
			last := -1
			for t := range a {
				if s.maskAt(t) != 0 {
					last = t
				}
			}
			g := 0.0
			for t := len(a) - 1; t >= 0; t-- {
				r := -s.klAt(est, t) * s.maskAt(t)
				if t == last {
					r += seq[i]
				}
				g = r + est.Gamma*g
				a[t] = float32(g)
			}
		case est.Name == "reinforce_plus_plus_baseline":
			for t := range a {
				a[t] = float32(seq[i] - s.klAt(est, t))
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

// whiten normalises the estimator's advantages over the batch (overrides stay): mean and variance
// over trained tokens, weighted by their loss mask, applied to every token (slime's
// distributed_masked_whiten: Bessel-corrected variance, (x − mean)·rsqrt(var + 1e-8)).
func whiten(in []AdvInput, adv [][]float32) {
	var sum, mass float64
	for i, a := range adv {
		if in[i].Override != nil {
			continue
		}
		for t, x := range a {
			sum += in[i].maskAt(t) * float64(x)
			mass += in[i].maskAt(t)
		}
	}
	if mass == 0 {
		return
	}
	mean := sum / mass
	var sq float64
	for i, a := range adv {
		if in[i].Override != nil {
			continue
		}
		for t, x := range a {
			sq += in[i].maskAt(t) * (float64(x) - mean) * (float64(x) - mean)
		}
	}
	variance := sq / mass
	if mass >= 2 {
		variance = sq / (mass - 1)
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
