// Package advantage turns the rewards of a batch into per-token advantages. Each estimator is
// one entry of a table found by name; the config's validation lists the names from the same
// table, so an estimator is a function and a line.
package advantage

import (
	"fmt"
	"math"
	"strings"
)

// Input is one sample as the advantage estimators see it.
type Input struct {
	Reward   float64
	Group    string
	Tokens   int       // response length
	Override []float64 // advantage given by the script: 1 value (whole sequence) or one per token
	// Mask is the loss mask, one entry per token (nil: every token is trained). REINFORCE++ puts
	// the reward on the last trained token, and whitening averages over trained tokens only.
	Mask []float64
	// KL is the per-token KL estimate between the rollout policy and the reference, read by the
	// reward-side KL of the REINFORCE++ estimators when KLCoef > 0.
	KL []float64
}

// Estimator names an advantage estimator and its settings (docs/config.md, `train:`).
type Estimator struct {
	Name         string  // grpo | gspo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
	Normalize    bool    // rewards_normalization: false trains on raw rewards
	StdNormalize bool    // grpo_std_normalization: divide by the group's std
	Gamma        float64 // discount of reinforce_plus_plus returns (G_t = r_t + γ·G_{t+1}); 1 undiscounted
	KLCoef       float64 // kl_coef: the reward-side KL, −kl_coef·KL_t added to each token's reward
}

// maskAt is token t's loss mask (1 without a mask).
func (s Input) maskAt(t int) float64 {
	if s.Mask == nil {
		return 1
	}
	return s.Mask[t]
}

// klAt is kl_coef·KL_t, or 0 without KL.
func (s Input) klAt(est Estimator, t int) float64 {
	if est.KLCoef == 0 || s.KL == nil {
		return 0
	}
	return est.KLCoef * s.KL[t]
}

// groupEps is added to the group std, as in slime: A = (r − mean)/(std + 1e-6).
const groupEps = 1e-6

// estimator is one advantage estimator of the table.
type estimator struct {
	name string
	// sequence sets seq[i], the sequence-level advantage of every sample i of the groups (each
	// group's indices, groups in order of first appearance); nil: the host computes the
	// advantages itself (ppo: from a critic's values).
	sequence func(est Estimator, in []Input, groups map[string][]int, order []string, seq []float64)
	// perToken spreads sample s's sequence advantage over its tokens a; nil: every token gets it.
	perToken func(est Estimator, s Input, seq float64, a []float32)
	whiten   bool // normalise over the batch's trained tokens afterwards
	grouped  bool // the baseline is the sample's group: a group of one sample has advantage 0
}

// estimators is the table of the estimators, in the order messages list them ("" is grpo).
var estimators = []estimator{
	{name: "grpo", sequence: groupNormalised, grouped: true},
	{name: "rloo", sequence: leaveOneOut, grouped: true},
	{name: "reinforce_plus_plus", sequence: rawRewards, perToken: discountedReturns, whiten: true},
	{name: "reinforce_plus_plus_baseline", sequence: rawRewards, perToken: minusKL, whiten: true, grouped: true},
	{name: "gspo", sequence: groupNormalised, grouped: true},
	{name: "ppo"}, // GAE over a critic's values: the host's PPO (it needs the critic engine)
}

// Names lists the estimators a config may name (train.advantage_estimator).
func Names() []string {
	names := make([]string, len(estimators))
	for i, e := range estimators {
		names[i] = e.name
	}
	return names
}

// Grouped reports whether an estimator's baseline is the sample's group (grpo, rloo, gspo,
// reinforce_plus_plus_baseline): with one sample a group, every advantage is 0 and nothing trains.
func Grouped(name string) bool {
	e, ok := lookup(name)
	return ok && e.grouped
}

// Singletons reports whether the samples that take part in group statistics (no Override) all
// sit in groups of one — and there is at least one.
func Singletons(in []Input) bool {
	n := map[string]int{}
	for _, s := range in {
		if s.Override == nil {
			n[s.Group]++
		}
	}
	for _, k := range n {
		if k > 1 {
			return false
		}
	}
	return len(n) > 0
}

// lookup finds an estimator by name.
func lookup(name string) (estimator, bool) {
	if name == "" {
		name = "grpo"
	}
	for _, e := range estimators {
		if e.name == name {
			return e, true
		}
	}
	return estimator{}, false
}

// Compute returns per-token advantages for each sample, in input order. Samples with an
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
func Compute(est Estimator, in []Input) ([][]float32, error) {
	e, ok := lookup(est.Name)
	if !ok || e.sequence == nil {
		var names []string
		for _, e := range estimators {
			if e.sequence != nil {
				names = append(names, e.name)
			}
		}
		return nil, fmt.Errorf("advantage estimator %q is not supported by the host (supported: %s)", est.Name, strings.Join(names, ", "))
	}
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
	e.sequence(est, in, groups, order, seq)
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
		case e.perToken != nil:
			e.perToken(est, s, seq[i], a)
		default:
			for t := range a {
				a[t] = float32(seq[i])
			}
		}
		out[i] = a
	}
	if e.whiten {
		whiten(in, out)
	}
	return out, nil
}

// groupNormalised is grpo's and gspo's: the group-normalised reward.
func groupNormalised(est Estimator, in []Input, groups map[string][]int, order []string, seq []float64) {
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
}

// leaveOneOut is rloo's: the reward less the mean of the other samples of its group.
func leaveOneOut(_ Estimator, in []Input, groups map[string][]int, order []string, seq []float64) {
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
}

// rawRewards is reinforce_plus_plus's (the reward) and reinforce_plus_plus_baseline's (the
// reward less its group's mean, with reward normalisation).
func rawRewards(est Estimator, in []Input, groups map[string][]int, order []string, seq []float64) {
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
}

// discountedReturns is reinforce_plus_plus's: G_t = r_t + γ·G_{t+1}, the reward on the last
// trained token, the KL on every trained one. (slime refuses a sample without trained tokens;
// here it keeps 0.)
func discountedReturns(est Estimator, s Input, seq float64, a []float32) {
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
			r += seq
		}
		g = r + est.Gamma*g
		a[t] = float32(g)
	}
}

// minusKL is reinforce_plus_plus_baseline's: the sequence advantage less kl_coef·KL_t.
func minusKL(est Estimator, s Input, seq float64, a []float32) {
	for t := range a {
		a[t] = float32(seq - s.klAt(est, t))
	}
}

// groupStats returns the mean and unbiased std of the rewards of idx.
func groupStats(in []Input, idx []int) (float64, float64) {
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
func whiten(in []Input, adv [][]float32) {
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
