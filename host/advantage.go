package host

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/advantage"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// The host's side of the advantages: which estimator a policy's config names, and the reward-side
// KL some of them take, scored by the policy's engine. The estimators themselves are
// host/advantage's.

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
		reqs[i] = engines.ScoreRequest{PromptTokens: s.C.PromptTokens(), Tokens: s.C.Tokens(), Reference: true}
	}
	scores, err := p.eng.Score(ctx, reqs)
	if err != nil {
		return nil, &EngineError{Step: r.step + 1, Policy: p.name, Err: fmt.Errorf("scoring %d samples with the KL reference: %w", len(ss), err), Hint: r.engineErrorHint()}
	}
	out := make([][]float64, len(ss))
	for i, s := range ss {
		if len(scores[i].Logprobs) != len(s.C.Tokens()) || len(s.C.Logprobs()) != len(s.C.Tokens()) {
			return nil, fmt.Errorf("policy %q: the KL reference returned %d log-probs for %d tokens (%d rollout log-probs)", p.name, len(scores[i].Logprobs), len(s.C.Tokens()), len(s.C.Logprobs()))
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

// warnSingletons warns once per policy when a group estimator sees only groups of one sample:
// every advantage is then 0, loss and grad_norm are 0, and nothing trains — the simplest script
// (one generate, reward and train a task) does this under the default grpo.
func (r *Run) warnSingletons(names []string, tc config.TrainConfig, in []advantage.Input) {
	est := tc.AdvantageEstimator
	if est == "" {
		est = "grpo"
	}
	if !advantage.Grouped(est) || !advantage.Singletons(in) {
		return
	}
	if _, seen := r.warned.LoadOrStore("singletons/"+names[0], true); seen {
		return
	}
	r.events.printf("warning: policy %s: every %s group of step %d holds one sample, so every advantage is 0 and the policy does not learn. Sample several answers a task (generate(..., n=4) trains them as one group), run each task several times (n_samples_per_prompt: 4), or use an estimator that needs no group (advantage_estimator: reinforce_plus_plus)",
		config.QuotePolicyNames(names), est, r.step+1)
}

// warnNothingTrained warns once a run when a step's successful rollouts queued no sample for any
// policy: the script rewards (reward_mean looks fine) but never calls train(), so the weights
// never move and every checkpoint holds the start model.
func (r *Run) warnNothingTrained(step int, ros []*script.Rollout, pm []Metrics) {
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
	if _, seen := r.warned.LoadOrStore("nothing-trained", true); seen {
		return
	}
	r.events.printf("warning: step %d trained nothing: none of its %d successful rollouts called train(), so no policy learns (rewards alone do not train); queue what you reward with train(c)", step, ok)
}
