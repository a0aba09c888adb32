package host

import (
	"context"
	"fmt"
	"time"

	"github.com/slimen/slimen/engines"
)

// Asymmetric PPO: an actor trained with advantage_estimator: ppo and a critic policy
// (role: critic) — its own model with a value head and its own optimizer. The critic values every
// response token of the actor's samples; GAE turns rewards and values into advantages for the
// actor and returns for the critic, which then trains with the clipped value loss.

// valueClip is slime's value clipping for the critic: V within V_old ± 0.2.
const valueClip = 0.2

// critic returns the run's critic policy, if any.
func (tr *trainer) critic() *policy {
	for _, p := range tr.pols.list() {
		if p.cfg.IsCritic() {
			return p
		}
	}
	return nil
}

// ppoTargets holds what the critic computed for one actor sample.
type ppoTargets struct {
	values, returns []float32
}

// gae computes per-token advantages and returns for one sample from its per-token rewards (see
// ppoRewards): δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, returns = A + V.
func gae(rewards []float64, values []float32, gamma, lambda float64) (adv, ret []float32) {
	n := len(values)
	adv, ret = make([]float32, n), make([]float32, n)
	next, last := 0.0, 0.0 // V_{t+1} and A_{t+1}; zero past the end of the response
	for t := n - 1; t >= 0; t-- {
		r := rewards[t]
		v := float64(values[t])
		delta := r + gamma*next - v
		last = delta + gamma*lambda*last
		adv[t], ret[t] = float32(last), float32(last+v)
		next = v
	}
	return adv, ret
}

// ppoAdvantages values an actor's samples with the critic and returns their advantages, keeping
// the targets for the critic's own training step. kl holds each sample's per-token KL for
// kl_coef (nil: none).
func (tr *trainer) ppoAdvantages(ctx context.Context, step int, actor *policy, ss []trainSample, kl [][]float64) ([][]float32, []ppoTargets, error) {
	crit := tr.critic()
	if crit == nil {
		return nil, nil, fmt.Errorf("policy %q trains with ppo but the run has no critic policy (role: critic)", actor.name)
	}
	valuer, ok := crit.eng.(engines.Valuer)
	if !ok {
		return nil, nil, fmt.Errorf("policy %q is the critic but its engine has no value head", crit.name)
	}
	reqs := make([]engines.ScoreRequest, len(ss))
	for i, s := range ss {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.C.PromptTokens(), Tokens: s.C.Tokens()}
	}
	vals, err := valuer.Values(ctx, reqs)
	if err != nil {
		return nil, nil, &EngineError{Step: step, Policy: crit.name, Err: fmt.Errorf("values: %w", err), Hint: engineErrorHint(tr.out)}
	}
	tc := actor.cfg.Train
	adv := make([][]float32, len(ss))
	targets := make([]ppoTargets, len(ss))
	for i, s := range ss {
		if len(vals[i]) != len(s.C.Tokens()) {
			return nil, nil, fmt.Errorf("critic %q returned %d values for %d tokens", crit.name, len(vals[i]), len(s.C.Tokens()))
		}
		var k []float64
		if kl != nil {
			k = kl[i]
		}
		a, ret := gae(ppoRewards(s.reward, tc.KLCoef, k, len(s.C.Tokens())), vals[i], tc.Gamma, tc.Lambda)
		if s.HasAdv { // the script's own advantage wins, as with every estimator
			a = broadcast(s.Advantage, len(s.C.Tokens()))
		}
		adv[i] = a
		targets[i] = ppoTargets{values: vals[i], returns: ret}
	}
	return adv, targets, nil
}

func broadcast(a []float64, n int) []float32 {
	out := make([]float32, n)
	for t := range out {
		if len(a) == n {
			out[t] = float32(a[t])
		} else {
			out[t] = float32(a[0])
		}
	}
	return out
}

// stepCritic trains the critic (when it is trainable) on the targets of every ppo actor's
// samples and returns its metrics of the step.
func (tr *trainer) stepCritic(ctx context.Context, step int, crit *policy, pols []*policy, byPolicy map[string][]trainSample, targets map[string][]ppoTargets,
	rolloutS float64) (Metrics, error) {
	m := newMetrics(step, crit.name)
	fillRewardMetrics(m, nil, nil)
	m.set("rollout_s", rolloutS)
	if samples := criticSamples(pols, byPolicy, targets); len(samples) > 0 && crit.cfg.Trainable {
		if err := tr.trainCritic(ctx, step, crit, samples, m); err != nil {
			return nil, err
		}
	}
	addDeviceMetrics(m, crit.eng)
	return m, nil
}

// criticSamples are the critic's samples of a step: every ppo actor's samples, in config order,
// with the returns and old values the critic computed for them.
func criticSamples(pols []*policy, byPolicy map[string][]trainSample, targets map[string][]ppoTargets) []engines.Sample {
	var samples []engines.Sample
	for _, p := range pols {
		for i, t := range targets[p.name] {
			c := byPolicy[p.name][i].C
			samples = append(samples, engines.Sample{Prompt: c.PromptTokens(), Response: c.Tokens(), LossMask: c.LossMask(),
				Returns: t.returns, OldValues: t.values, Group: byPolicy[p.name][i].Group})
		}
	}
	return samples
}

// trainCritic runs the critic's optimizer steps on the targets of every ppo actor's samples.
func (tr *trainer) trainCritic(ctx context.Context, step int, crit *policy, samples []engines.Sample, m Metrics) error {
	t0 := time.Now()
	lc := lossConfig(crit.cfg.Train)
	lc.ValueClip = valueClip
	size := batchSize(crit.cfg.Train.GlobalBatchSize, len(samples))
	var loss, clip, gn float64
	steps, skipped, tokens := 0, 0, 0
	for k := 0; k < len(samples); k += size {
		b := engines.Batch{ID: tr.batchID(crit.name, step, k/size), Loss: lc,
			Samples: samples[k:min(k+size, len(samples))]}
		st, err := crit.eng.Train(ctx, b)
		if err != nil {
			return &EngineError{Step: step, Policy: crit.name, Err: fmt.Errorf("train: %w", err), Hint: engineErrorHint(tr.out)}
		}
		tr.restart.trained(crit.name, b)
		if st.Skipped {
			skipped++
			tr.events.printf("step %d: critic %q: optimizer step %s skipped: %s", step, crit.name, b.ID, st.Reason)
			continue
		}
		loss += st.ValueLoss
		clip += st.ClipFrac
		gn += st.GradNorm
		tokens += st.Tokens
		steps++
	}
	m.set("samples", len(samples))
	if d := float64(steps); steps > 0 { // every step skipped: no loss, not 0
		m.set("value_loss", loss/d)
		m.set("loss", loss/d)
		m.set("clip_frac", clip/d) // tokens whose value was clipped
		m.set("grad_norm", gn/d)
	}
	m.set("optimizer_steps", steps)
	m.set("skipped_steps", skipped)
	m.set("trained_tokens", tokens)
	m.set("train_s", time.Since(t0).Seconds())
	return nil
}
