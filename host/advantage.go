package host

// This file defines the host's side of the advantages: which estimator a policy's config names,
// the reward-side KL some of them take, scored by the policy's engine, and a step's advantages
// per policy or shared buffer, with the teacher terms of on-policy distillation. The estimators
// themselves are host/advantage's.

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/advantage"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// estimatorOf is the advantage estimator a policy's train: settings name.
func estimatorOf(tc config.TrainConfig) advantage.Estimator {
	return advantage.Estimator{
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
func (tr *trainer) rewardKL(ctx context.Context, step int, p *policy, ss []trainSample) ([][]float64, error) {
	tc := p.cfg.Train
	if tc.KLCoef == 0 || !usesRewardKL(tc.AdvantageEstimator) || len(ss) == 0 {
		return nil, nil
	}
	info, err := p.eng.Info(ctx)
	if err != nil {
		return nil, &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("info: %w", err), Hint: engineErrorHint(tr.out)}
	}
	if !slices.Contains(info.Capabilities, "reference") {
		return nil, fmt.Errorf("policy %q: kl_coef %g needs the log-probs of the KL reference, "+
			"which its engine (%s) cannot score (no \"reference\" capability)", p.name, tc.KLCoef, info.Model)
	}
	reqs := make([]engines.ScoreRequest, len(ss))
	for i, s := range ss {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.C.PromptTokens(), Tokens: s.C.Tokens(), Reference: true}
	}
	scores, err := p.eng.Score(ctx, reqs)
	if err != nil {
		return nil, &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("scoring %d samples with the KL reference: %w", len(ss), err),
			Hint: engineErrorHint(tr.out)}
	}
	out := make([][]float64, len(ss))
	for i, s := range ss {
		if len(scores[i].Logprobs) != len(s.C.Tokens()) || len(s.C.Logprobs()) != len(s.C.Tokens()) {
			return nil, fmt.Errorf("policy %q: the KL reference returned %d log-probs for %d tokens (%d rollout log-probs)", p.name, len(scores[i].Logprobs),
				len(s.C.Tokens()), len(s.C.Logprobs()))
		}
		out[i] = tokenKL(s.C.Logprobs(), scores[i].Logprobs, tc.KLLossType)
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

// warnSingletons warns once per policy when a group estimator sees only groups of one sample.
// Every advantage is then 0, loss and grad_norm are 0, and nothing trains — the simplest script
// (one generate, reward and train a task) does this under the default grpo.
func (tr *trainer) warnSingletons(step int, names []string, tc config.TrainConfig, in []advantage.Input) {
	est := tc.AdvantageEstimator
	if est == "" {
		est = "grpo"
	}
	if !advantage.Grouped(est) || !advantage.Singletons(in) {
		return
	}
	if _, seen := tr.warned.LoadOrStore("singletons/"+names[0], true); seen {
		return
	}
	tr.events.printf("warning: policy %s: every %s group of step %d holds one sample, "+
		"so every advantage is 0 and the policy does not learn. Sample several answers a task "+
		"(generate(..., n=4) trains them as one group), run each task several times "+
		"(n_samples_per_prompt: 4), or use an estimator that needs no group (advantage_estimator: reinforce_plus_plus)",
		config.QuotePolicyNames(names), est, step)
}

// warnNothingTrained warns once a run when a step's successful rollouts queued no sample for any
// policy: the script rewards (reward_mean looks fine) but never calls train(), so the weights
// never move and every checkpoint holds the start model.
func (tr *trainer) warnNothingTrained(step int, ros []*script.Rollout, pm []Metrics) {
	ok := 0
	for _, ro := range ros {
		if ro.Err == nil {
			ok++
		}
	}
	for _, m := range pm {
		if m.Float("samples") > 0 {
			return
		}
	}
	if ok == 0 {
		return
	}
	if _, seen := tr.warned.LoadOrStore("nothing-trained", true); seen {
		return
	}
	tr.events.printf("warning: step %d trained nothing: none of its %d successful rollouts called train(), "+
		"so no policy learns (rewards alone do not train); queue what you reward with train(c)", step, ok)
}

// advantages computes the per-token advantages of every policy's samples: ppo actors' from the
// critic's values (their targets for the critic's training are returned too), the others' by the
// estimator of their pool (shared-buffer policies normalised together, split ones alone), then
// the teacher terms of on-policy distillation.
func (tr *trainer) advantages(ctx context.Context, step int, pols []*policy, byPolicy map[string][]trainSample) (map[string][][]float32, map[string][]ppoTargets, error) {
	out := map[string][][]float32{}
	targets := map[string][]ppoTargets{}
	var pools []advPool
	kls := map[string][][]float64{} // the reward-side KL of each policy's samples (kl_coef)
	for _, p := range pols {
		if !p.cfg.Trainable || p.cfg.IsCritic() {
			continue
		}
		kl, err := tr.rewardKL(ctx, step, p, byPolicy[p.name])
		if err != nil {
			return nil, nil, err
		}
		kls[p.name] = kl
		if p.cfg.Train.AdvantageEstimator != "ppo" {
			pools = addToPool(pools, p)
			continue
		}
		adv, t, err := tr.ppoAdvantages(ctx, step, p, byPolicy[p.name], kl)
		if err != nil {
			return nil, nil, err
		}
		out[p.name], targets[p.name] = adv, t
	}
	for _, pl := range pools {
		if err := tr.poolAdvantages(step, pl, byPolicy, kls, out); err != nil {
			return nil, nil, err
		}
	}
	for _, p := range pols {
		if err := tr.applyTeacher(ctx, step, p, byPolicy[p.name], out[p.name]); err != nil {
			return nil, nil, err
		}
	}
	return out, targets, nil
}

// advPool is the policies whose samples' advantages are computed together: the shared-buffer
// policies (which config validation makes agree on the estimator), or one split policy. tc is
// the train: settings of its first policy.
type advPool struct {
	names  []string
	tc     config.TrainConfig
	shared bool
}

// addToPool puts p into its pool: the shared-buffer policies', where the first of them comes, or
// a pool of its own.
func addToPool(pools []advPool, p *policy) []advPool {
	if p.cfg.BufferMode == "shared" {
		for i := range pools {
			if pools[i].shared {
				pools[i].names = append(pools[i].names, p.name)
				return pools
			}
		}
	}
	return append(pools, advPool{names: []string{p.name}, tc: p.cfg.Train, shared: p.cfg.BufferMode == "shared"})
}

// poolAdvantages computes the advantages of a pool's samples by its estimator, over all of them
// at once, into out by policy; kls holds the reward-side KL of each policy's samples.
func (tr *trainer) poolAdvantages(step int, pl advPool, byPolicy map[string][]trainSample, kls map[string][][]float64, out map[string][][]float32) error {
	in := advantageInputs(pl.names, byPolicy, kls)
	tr.warnSingletons(step, pl.names, pl.tc, in)
	adv, err := advantage.Compute(estimatorOf(pl.tc), in)
	if err != nil {
		return err
	}
	k := 0
	for _, n := range pl.names {
		m := len(byPolicy[n])
		out[n] = adv[k : k+m]
		k += m
	}
	return nil
}

// advantageInputs are the estimators' inputs of the named policies' samples, in order: reward,
// group, tokens and loss mask, the reward-side KL where kls has it, and a script's own advantage,
// which wins.
func advantageInputs(names []string, byPolicy map[string][]trainSample, kls map[string][][]float64) []advantage.Input {
	var in []advantage.Input
	for _, n := range names {
		for i, s := range byPolicy[n] {
			a := advantage.Input{Reward: s.reward, Group: s.Group, Tokens: len(s.C.Tokens()), Mask: maskOf(s.C)}
			if kls[n] != nil {
				a.KL = kls[n][i]
			}
			if s.HasAdv {
				a.Override = s.Advantage
			}
			in = append(in, a)
		}
	}
	return in
}

// applyTeacher subtracts opd_kl_coef·(logp_student − logp_teacher) per token for samples trained
// with teacher=.
func (tr *trainer) applyTeacher(ctx context.Context, step int, p *policy, ss []trainSample, adv [][]float32) error {
	byTeacher := map[string][]int{}
	for i, s := range ss {
		if s.Teacher != "" {
			byTeacher[s.Teacher] = append(byTeacher[s.Teacher], i)
		}
	}
	teachers := make([]string, 0, len(byTeacher))
	for t := range byTeacher {
		teachers = append(teachers, t)
	}
	sort.Strings(teachers)
	coef := p.cfg.Train.OPDKLCoef
	for _, t := range teachers {
		tp, err := tr.pols.policyFor(t)
		if err != nil {
			return err
		}
		idx := byTeacher[t]
		reqs := make([]engines.ScoreRequest, len(idx))
		for k, i := range idx {
			c := ss[i].C
			reqs[k] = engines.ScoreRequest{Messages: c.Messages(), Tokens: c.Tokens()}
		}
		scores, err := tp.eng.Score(ctx, reqs)
		if err != nil {
			return &EngineError{Step: step, Policy: t, Err: fmt.Errorf("scoring %d samples of policy %q as their teacher: %w", len(idx), p.name, err),
				Hint: engineErrorHint(tr.out)}
		}
		for k, i := range idx {
			c := ss[i].C
			lp := scores[k].Logprobs
			if len(lp) != len(c.Tokens()) {
				return fmt.Errorf("teacher %q returned %d log-probs for %d tokens", t, len(lp), len(c.Tokens()))
			}
			for j := range adv[i] {
				adv[i][j] -= float32(coef * float64(c.Logprobs()[j]-lp[j]))
			}
		}
	}
	return nil
}

// maskOf is a sample's loss mask for the advantage estimators: nil when every token is trained
// (a generate call's completion), else the conversation's mask (chat).
func maskOf(c *script.Completion) []float64 {
	m := c.LossMask()
	out := make([]float64, len(m))
	all := true
	for i, x := range m {
		out[i] = float64(x)
		all = all && x == 1
	}
	if all {
		return nil
	}
	return out
}
