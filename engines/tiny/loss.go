package tiny

import (
	"fmt"
	"math"
	"slices"

	"github.com/slimen/slimen/engines"
)

// The policy loss (docs/architecture.md), over per-token numbers only. The model's backward pass
// and the test vectors in testdata/slime/loss_vectors.json (computed by slime's own loss code)
// both go through policyLoss, so what the vectors pin down is exactly what the engine trains
// with; the Python engine reproduces the same vectors.
// A PPO critic's value loss (valueLoss) is reduced with the same token weights.

// lossSample is one sample's per-token inputs; all slices have one entry per response token.
type lossSample struct {
	Group   string
	Logp    []float64 // current policy
	OldLogp []float64 // the ratio's old log-probs: at rollout time, or the trainer's with TIS
	// RolloutLogp (read with TIS only) are the log-probs at rollout time, the denominator of the
	// TIS ratio exp(OldLogp − RolloutLogp).
	RolloutLogp []float64
	RefLogp     []float64 // frozen reference; only read when KLLossCoef > 0
	Entropy     []float64 // full-vocabulary entropy of the current policy
	Adv         []float64
	Mask        []float64
	// PPO critic: the value head's current values, the values at rollout time (only read when
	// value clipping is on) and the returns they are trained towards.
	Values, OldValues, Returns []float64
}

// lossStats are the reduced numbers of one loss evaluation.
type lossStats struct {
	Loss, PG, KL, Entropy float64
	Clipped, Tokens       int // tokens with loss mask > 0 whose ratio (or value) was clipped; tokens with loss mask > 0
	// TIS: trained tokens whose weight differs from their ratio (clipped or masked), and the sum
	// of the weights over trained tokens.
	TISClipped int
	TISWeight  float64
	// The rollout/trainer log-prob mismatch |trainer − rollout| over trained tokens: its sum, its
	// sum weighted as the loss is, and its largest (engines.TrainStats.LogprobDiffMean).
	DiffSum, DiffWeighted, DiffMax float64
}

func (s *lossStats) add(o lossStats) {
	s.Loss += o.Loss
	s.PG += o.PG
	s.KL += o.KL
	s.Entropy += o.Entropy
	s.Clipped += o.Clipped
	s.Tokens += o.Tokens
	s.TISClipped += o.TISClipped
	s.TISWeight += o.TISWeight
	s.DiffSum += o.DiffSum
	s.DiffWeighted += o.DiffWeighted
	if o.DiffMax > s.DiffMax || math.IsNaN(o.DiffMax) {
		s.DiffMax = o.DiffMax
	}
}

// diffStats returns the rollout/trainer log-prob mismatch: its mean over trained tokens, its
// largest, and its sum weighted as the loss is (slime's train_rollout_logprob_abs_diff).
func (s lossStats) diffStats() (mean, maxDiff, weighted float64) {
	if s.Tokens == 0 {
		return 0, 0, 0
	}
	return s.DiffSum / float64(s.Tokens), s.DiffMax, s.DiffWeighted
}

// tisStats returns the share of trained tokens whose TIS weight was clipped or masked and the
// mean weight.
func (s lossStats) tisStats() (clipFrac, weight float64) {
	if s.Tokens == 0 {
		return 0, 0
	}
	return float64(s.TISClipped) / float64(s.Tokens), s.TISWeight / float64(s.Tokens)
}

// clipFrac is the fraction of trained tokens that were clipped.
func (s lossStats) clipFrac() float64 {
	if s.Tokens == 0 {
		return 0
	}
	return float64(s.Clipped) / float64(s.Tokens)
}

// lossConfig is a LossConfig with its defaults resolved and its names checked.
type lossConfig struct {
	epsLo, epsHi    float64
	klCoef, entCoef float64
	klType, policy  string
	aggregation     string
	valueClip       float64
	// Off-policy correction (LossConfig.UseTIS): tisMode "tis" or "icepop", the weight band
	// [tisLow, tisHigh].
	useTIS          bool
	tisMode         string
	tisLow, tisHigh float64
}

// tisModes are the names LossConfig.TISMode accepts.
var tisModes = []string{"tis", "icepop"}

func resolveLoss(c engines.LossConfig) (lossConfig, error) {
	r := lossConfig{epsLo: c.EpsClip, epsHi: c.EpsClipHigh, klCoef: c.KLLossCoef, entCoef: c.EntropyCoef,
		klType: c.KLLossType, policy: c.PolicyLoss, aggregation: c.Aggregation, valueClip: c.ValueClip,
		useTIS: c.UseTIS, tisMode: c.TISMode, tisLow: c.TISClipLow, tisHigh: c.TISClip}
	if r.tisMode == "" {
		r.tisMode = "tis"
	}
	if r.tisHigh == 0 {
		r.tisHigh = 2
	}
	if r.klType == "" {
		r.klType = "low_var_kl"
	}
	if r.policy == "" {
		r.policy = "ppo"
	}
	if r.aggregation == "" {
		r.aggregation = "sample_mean"
	}
	switch {
	case r.klType != "k1" && r.klType != "k2" && r.klType != "k3" && r.klType != "low_var_kl":
		return r, fmt.Errorf("kl_loss_type %q is not one of k1, k2, k3, low_var_kl", r.klType)
	case r.policy != "ppo" && r.policy != "gspo":
		return r, fmt.Errorf("policy_loss %q is not one of ppo, gspo", r.policy)
	case r.aggregation != "sample_mean" && r.aggregation != "token_mean" && r.aggregation != "group_token_mean" && r.aggregation != "token_sum":
		return r, fmt.Errorf("aggregation %q is not one of sample_mean, token_mean, group_token_mean, token_sum", r.aggregation)
	case r.epsLo < 0 || r.epsHi < 0 || r.klCoef < 0 || r.entCoef < 0 || r.valueClip < 0:
		return r, fmt.Errorf("eps_clip, eps_clip_high, kl_loss_coef, entropy_coef and value_clip must not be negative")
	case r.useTIS && !slices.Contains(tisModes, r.tisMode):
		return r, fmt.Errorf("tis_mode %q is not one of tis, icepop", r.tisMode)
	case r.useTIS && (r.tisLow < 0 || r.tisLow > r.tisHigh):
		return r, fmt.Errorf("tis_clip_low %g and tis_clip %g are not a band: need 0 ≤ tis_clip_low ≤ tis_clip", r.tisLow, r.tisHigh)
	}
	return r, nil
}

// tokenWeights returns each token's weight w in the reduced loss Σ w·ℓ, over the N samples of
// one optimizer step. With m a sample's mask sum:
//
//	sample_mean:      mean over samples of each sample's token-mean, w = mask/(N·max(m, 1))
//	                  (slime's default, cp_utils.get_sum_of_sample_mean over the step's samples);
//	token_mean:       w = mask/Σ_samples max(m, 1) (slime's calculate_per_token_loss);
//	group_token_mean: mean over groups of each group's token-mean, w = mask/(G·Σ_group mask), G
//	                  counting the groups that have a trained token;
//	token_sum:        w = mask.
//
// In the two slime reductions a sample with no trained token still counts: as one of the N
// samples, or as one token. A sample with an empty Group is a group of its own.
func tokenWeights(samples []lossSample, aggregation string) [][]float64 {
	w := make([][]float64, len(samples))
	tokens := 0.0 // token_mean's denominator
	mass := make([]float64, len(samples))
	groupMass := map[string]float64{}
	key := func(i int) string {
		if samples[i].Group == "" {
			return fmt.Sprintf("\x00%d", i)
		}
		return samples[i].Group
	}
	for i, s := range samples {
		for _, m := range s.Mask {
			mass[i] += m
		}
		groupMass[key(i)] += mass[i]
		tokens += max(mass[i], 1)
	}
	groups := 0
	for _, m := range groupMass {
		if m > 0 {
			groups++
		}
	}
	for i, s := range samples {
		w[i] = make([]float64, len(s.Mask))
		for t, m := range s.Mask {
			if m == 0 {
				continue
			}
			switch aggregation {
			case "token_sum":
				w[i][t] = m
			case "token_mean":
				w[i][t] = m / tokens
			case "group_token_mean":
				w[i][t] = m / (float64(groups) * groupMass[key(i)])
			default:
				w[i][t] = m / (float64(len(samples)) * max(mass[i], 1))
			}
		}
	}
	return w
}

// policyLoss returns Σ_tokens w·(pg + kl_coef·kl − entropy_coef·H) and its gradients with respect
// to every token's logp and entropy. pg = max(−r·A, −clip(r, 1−ε_lo, 1+ε_hi)·A) with
// r = exp(logp − logp_old) per token (ppo) or r = exp(mask-weighted mean of logp − logp_old) per
// sample (gspo). kl: k1 = Δ, k2 = Δ²/2, k3 = e^−Δ − 1 + Δ, low_var_kl = k3 clamped to [−10, 10],
// with Δ = logp − logp_ref (slime's definitions). With TIS, pg is multiplied by the detached
// weight of ρ = exp(logp_old − logp_rollout) (tisWeight). The statistics are reduced with the same
// weights, so Loss = PG + kl_coef·KL − entropy_coef·Entropy.
func policyLoss(samples []lossSample, w [][]float64, c lossConfig) (st lossStats, dLogp, dEnt [][]float64) {
	dLogp, dEnt = make([][]float64, len(samples)), make([][]float64, len(samples))
	for i, s := range samples {
		n := len(s.Logp)
		dLogp[i], dEnt[i] = make([]float64, n), make([]float64, n)
		// gspo: one log-ratio per sample, the mask-weighted mean over its tokens.
		seqLogRatio, mass := 0.0, 0.0
		if c.policy == "gspo" {
			for t := range n {
				if s.Mask[t] != 0 {
					seqLogRatio += s.Mask[t] * (s.Logp[t] - s.OldLogp[t])
					mass += s.Mask[t]
				}
			}
			if mass > 0 {
				seqLogRatio /= mass
			}
		}
		dSeq := 0.0 // gspo: ∂loss/∂(sequence log-ratio)
		for t := range n {
			wt := w[i][t]
			if s.Mask[t] == 0 {
				continue
			}
			st.Tokens++
			// The mismatch: this forward's log-prob (with TIS, the trainer's old one) against the
			// rollout's.
			trainer, rollout := s.Logp[t], s.OldLogp[t]
			if c.useTIS {
				trainer, rollout = s.OldLogp[t], s.RolloutLogp[t]
			}
			d := math.Abs(trainer - rollout)
			st.DiffSum += d
			st.DiffWeighted += wt * d
			if d > st.DiffMax || math.IsNaN(d) {
				st.DiffMax = d
			}
			logRatio := s.Logp[t] - s.OldLogp[t]
			if c.policy == "gspo" {
				logRatio = seqLogRatio
			}
			ratio := exp64(logRatio)
			a := s.Adv[t]
			clipped := min(max(ratio, 1-c.epsLo), 1+c.epsHi)
			l1, l2 := -ratio*a, -clipped*a
			pg, dRatio := l1, -a
			if l2 > l1 {
				// The clipped branch is taken only outside the clip range, where it is constant.
				pg, dRatio = l2, 0
				st.Clipped++
			}
			if c.useTIS {
				tw, masked := tisWeight(exp64(s.OldLogp[t]-s.RolloutLogp[t]), c)
				pg, dRatio = tw*pg, tw*dRatio
				st.TISWeight += tw
				if masked {
					st.TISClipped++
				}
			}
			st.PG += wt * pg
			dLog := wt * dRatio * ratio // ∂(w·pg)/∂logRatio
			if c.policy == "gspo" {
				dSeq += dLog
			} else {
				dLogp[i][t] += dLog
			}
			if c.klCoef > 0 {
				kl, dkl := klTerm(s.Logp[t]-s.RefLogp[t], c.klType)
				st.KL += wt * kl
				dLogp[i][t] += wt * c.klCoef * dkl
			}
			st.Entropy += wt * s.Entropy[t]
			dEnt[i][t] = -wt * c.entCoef
		}
		if c.policy == "gspo" && mass > 0 {
			for t := range n {
				dLogp[i][t] += dSeq * s.Mask[t] / mass
			}
		}
	}
	st.Loss = st.PG + c.klCoef*st.KL - c.entCoef*st.Entropy
	return st, dLogp, dEnt
}

// tisWeight returns the off-policy weight of a token whose trainer-over-rollout ratio is rho, and
// whether it differs from rho: clamp(rho, low, high) (tis, slime's vanilla_tis_function) or rho
// inside [low, high] and 0 outside (icepop, slime's icepop_function).
func tisWeight(rho float64, c lossConfig) (w float64, changed bool) {
	if rho >= c.tisLow && rho <= c.tisHigh {
		return rho, false
	}
	if c.tisMode == "icepop" {
		return 0, true
	}
	return min(max(rho, c.tisLow), c.tisHigh), true
}

// valueLoss returns a PPO critic's clipped value loss Σ_tokens w·max((V − R)², (clip(V, V_old ±
// value_clip) − R)²) — the clipped term only when value_clip > 0 — and its gradient with respect
// to every token's value V. Clipped counts the trained tokens where the clipped term is the
// larger, as the PyTorch engine does.
func valueLoss(samples []lossSample, w [][]float64, c lossConfig) (st lossStats, dV [][]float64) {
	dV = make([][]float64, len(samples))
	for i, s := range samples {
		dV[i] = make([]float64, len(s.Values))
		for t, v := range s.Values {
			if s.Mask[t] == 0 {
				continue
			}
			st.Tokens++
			r := s.Returns[t]
			l, dl := (v-r)*(v-r), 2*(v-r)
			if c.valueClip > 0 {
				// V itself inside the range (not old + (V − old), which may round off V).
				vc, old := v, s.OldValues[t]
				if d := v - old; d > c.valueClip || d < -c.valueClip {
					vc = old + min(max(d, -c.valueClip), c.valueClip)
				}
				if l2 := (vc - r) * (vc - r); l2 > l {
					// Only where the clamp is active, where the clipped term is constant in V.
					l, dl = l2, 0
					st.Clipped++
				}
			}
			st.Loss += w[i][t] * l
			dV[i][t] = w[i][t] * dl
		}
	}
	return st, dV
}

// klTerm returns the KL estimate for Δ = logp − logp_ref and its derivative in Δ.
func klTerm(delta float64, kind string) (kl, dkl float64) {
	switch kind {
	case "k1":
		return delta, 1
	case "k2":
		return delta * delta / 2, delta
	}
	e := exp64(-delta)
	kl, dkl = e-1+delta, 1-e
	if kind == "low_var_kl" && (kl > 10 || kl < -10) {
		return min(max(kl, -10), 10), 0 // torch.clamp passes no gradient outside its range
	}
	return kl, dkl
}
