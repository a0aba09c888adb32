package host

// This file defines the trainer: the part of a run that trains its policies on a step's
// samples, in optimizer steps of global_batch_size, with the loss settings of their config. Its
// advantages and PPO's critic have files of their own.

import (
	"context"
	"fmt"
	"math"
	"reflect"
	"sort"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// trainer trains a run's policies on the samples of a step: their advantages (the estimators,
// the reward-side KL, PPO's critic, the teacher terms), each policy's optimizer steps and their
// metrics, and the warnings given once about samples that do not train. The run owns one
// (Run.trainer) and gives it, when it is made, the few things of the run it uses; the step
// itself comes as arguments.
type trainer struct {
	id      string        // the run's id: part of optimizer step ids
	pols    *policyTable  // the run's policies
	events  *eventLog     // the run's events.log
	rec     *recorder     // keeps a step's advantages for rollouts.jsonl
	restart *restartGuard // notes each optimizer step applied, for an engine that restarts
	out     string        // the run folder, which an EngineError's hint resumes from; "" without one
	warned  sync.Map      // warnings given once per run, by key
}

// trainSample is a queued sample of a successful rollout, in deterministic order.
type trainSample struct {
	script.Queued
	task    int
	reward  float64
	version int // the weights version it was generated from; -1: the current one (K = 0)
}

// train trains the policies on the rollouts ros of step (trainPolicies) and warns when they
// queued no sample to train. A cancelled ctx does not cut it short: an abandoned step stops in
// its rollouts, never between two optimizer steps of a policy. An error is the restart the run
// could not recover from, if one caused it.
func (tr *trainer) train(ctx context.Context, step int, cfg *config.Config, ros []*script.Rollout, rolloutS float64, version int) ([]Metrics, error) {
	pm, err := tr.trainPolicies(context.WithoutCancel(ctx), step, cfg, ros, rolloutS, version)
	if err != nil {
		return nil, tr.restart.cause(err)
	}
	tr.warnNothingTrained(step, ros, pm)
	return pm, nil
}

// trainPolicies computes advantages and trains every trainable policy on its samples: the
// policies first, at once where their engines differ, then PPO's critic on the targets of the ppo
// actors' samples. It returns a step's metrics of each policy, sorted by name.
func (tr *trainer) trainPolicies(ctx context.Context, step int, cfg *config.Config, ros []*script.Rollout, rolloutS float64, version int) ([]Metrics, error) {
	byPolicy, gens := gather(ros, version)
	pols := tr.pols.list()
	advs, targets, err := tr.advantages(ctx, step, pols, byPolicy)
	if err != nil {
		return nil, err
	}
	tr.rec.keepAdvantages(byPolicy, advs)
	crit := tr.critic() // trained last, on the targets of the ppo actors' samples
	out := rolloutMetrics(step, cfg, pols, crit, byPolicy, gens, rolloutS)
	byName := metricsByPolicy(out)
	if err := tr.trainLanes(ctx, step, trainingLanes(pols, crit, byPolicy), byPolicy, advs, byName); err != nil {
		return nil, err
	}
	for _, p := range pols {
		if m := byName[p.name]; m != nil { // the critic's come with its training
			addDeviceMetrics(m, p.eng)
		}
	}
	if crit != nil {
		m, err := tr.stepCritic(ctx, step, crit, pols, byPolicy, targets, rolloutS)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Policy() < out[j].Policy() })
	return out, nil
}

// trains says whether a policy trains this step: it is trainable and has samples.
func trains(p *policy, ss []trainSample) bool { return p.cfg.Trainable && len(ss) > 0 }

// rolloutMetrics starts a step's metrics of each policy but the critic with what its rollouts
// did (rewards, rollout_s, with rollout.max_staleness the staleness of its samples); a policy
// that does not train gets train_s 0 and no loss: it has none, not 0.
func rolloutMetrics(step int, cfg *config.Config, pols []*policy, crit *policy, byPolicy map[string][]trainSample, gens map[string][]*script.Completion,
	rolloutS float64) []Metrics {
	var out []Metrics
	for _, p := range pols {
		if p == crit {
			continue
		}
		m := newMetrics(step, p.name)
		ss := byPolicy[p.name]
		fillRewardMetrics(m, gens[p.name], ss)
		m.set("rollout_s", rolloutS)
		if cfg.Rollout.MaxStaleness > 0 && p.cfg.Trainable {
			stalenessMetrics(m, step, ss, cfg.Rollout.Partial)
		}
		if !trains(p, ss) {
			m.set("train_s", 0.0)
		}
		out = append(out, m)
	}
	return out
}

// metricsByPolicy indexes a step's metrics by their policy.
func metricsByPolicy(ms []Metrics) map[string]Metrics {
	byName := map[string]Metrics{}
	for _, m := range ms {
		byName[m.Policy()] = m
	}
	return byName
}

// trainingLanes puts the policies that train this step, the critic aside, into lanes of the
// policies whose training shares an engine, in config order.
func trainingLanes(pols []*policy, crit *policy, byPolicy map[string][]trainSample) [][]*policy {
	var lanes [][]*policy
	for _, p := range pols {
		if p != crit && trains(p, byPolicy[p.name]) {
			lanes = addToLane(lanes, p)
		}
	}
	return lanes
}

// trainLanes trains the policies of each lane one after another, the lanes at the same time:
// policies on different engines (workers, GPUs) train together; those that share an engine (LoRA
// adapters on one base, or one engine given for several policies) in turn. Each policy's
// optimizer steps depend only on its own samples, so the metrics do not depend on the order. It
// returns the first lane's error.
func (tr *trainer) trainLanes(ctx context.Context, step int, lanes [][]*policy, byPolicy map[string][]trainSample, advs map[string][][]float32,
	byName map[string]Metrics) error {
	errs := atOnce(len(lanes), func(i int) error {
		for _, p := range lanes[i] {
			m, t := byName[p.name], time.Now()
			ss, adv := tr.withinContext(ctx, step, p, byPolicy[p.name], advs[p.name], m)
			if len(ss) == 0 {
				m.set("train_s", 0.0)
				continue
			}
			if err := tr.trainOne(ctx, step, p, ss, adv, m); err != nil {
				return err
			}
			m.set("train_s", time.Since(t).Seconds())
		}
		return nil
	})
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// withinContext leaves out of training the samples longer than the policy's model takes (a chat
// whose history outgrew the context: its last turn sampled nothing): the engine would refuse the
// whole batch, and the run would stop as if the engine had failed. They keep their rewards and
// their part in their groups' advantages; overflow counts them, and the run says
// so once a policy.
func (tr *trainer) withinContext(ctx context.Context, step int, p *policy, ss []trainSample, adv [][]float32, m Metrics) ([]trainSample, [][]float32) {
	info, err := p.chatInfo(ctx)
	if err != nil || info.MaxSeqLen <= 0 {
		return ss, adv // the engine checks, as before
	}
	var keep []trainSample
	var keepAdv [][]float32
	dropped, longest := 0, 0
	for i, s := range ss {
		if n := len(s.C.PromptTokens()) + len(s.C.Tokens()); n > info.MaxSeqLen {
			dropped++
			longest = max(longest, n)
			continue
		}
		keep, keepAdv = append(keep, s), append(keepAdv, adv[i])
	}
	if dropped == 0 {
		return ss, adv
	}
	m.set("overflow", float64(dropped))
	if _, seen := tr.warned.LoadOrStore("past-context/"+p.name, true); !seen {
		tr.events.printf("warning: step %d: policy %q: %d of %d samples (up to %d tokens) are longer than its model's context "+
			"of %d tokens and are not trained (overflow counts them each step); "+
			"keep conversations shorter (fewer turns, a smaller max_tokens, "+
			"shorter tool results) or use a model with more positions",
			step, p.name, dropped, len(ss), longest, info.MaxSeqLen)
	}
	return keep, keepAdv
}

// addToLane puts p into the lane of the policies whose training shares its engine, or a new one:
// LoRA policies share one lane (their adapters usually sit on one base, which trains one adapter
// at a time), and so do policies given the same engine.
func addToLane(lanes [][]*policy, p *policy) [][]*policy {
	for i, lane := range lanes {
		q := lane[0]
		if (p.cfg.LoRA != nil && q.cfg.LoRA != nil) || sameEngine(p.eng, q.eng) {
			lanes[i] = append(lane, p)
			return lanes
		}
	}
	return append(lanes, []*policy{p})
}

// sameEngine says whether a and b are one engine (false where the engines' type cannot be
// compared).
func sameEngine(a, b engines.Engine) bool {
	ta, tb := reflect.TypeOf(a), reflect.TypeOf(b)
	return ta == tb && ta != nil && ta.Comparable() && a == b
}

// gather collects the samples and completions of the successful rollouts, per policy, in an order
// that does not depend on scheduling: task, then position in the rollout's call tree.
func gather(ros []*script.Rollout, version int) (map[string][]trainSample, map[string][]*script.Completion) {
	byPolicy := map[string][]trainSample{}
	gens := map[string][]*script.Completion{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		for _, q := range ro.Queued() {
			if q.Group == "" {
				q.Group = ro.Group
			}
			rw, _ := q.C.Reward()
			byPolicy[q.C.Policy()] = append(byPolicy[q.C.Policy()], trainSample{Queued: q, task: ro.Index, reward: rw, version: version})
		}
		for _, c := range ro.Generated() {
			gens[c.Policy()] = append(gens[c.Policy()], c)
		}
	}
	for _, ss := range byPolicy {
		sort.SliceStable(ss, func(i, j int) bool {
			if ss[i].task != ss[j].task {
				return ss[i].task < ss[j].task
			}
			return ss[i].C.Before(ss[j].C)
		})
	}
	for _, cs := range gens {
		sort.SliceStable(cs, func(i, j int) bool { return cs[i].Before(cs[j]) })
	}
	return byPolicy, gens
}

// trainOne splits a policy's samples into optimizer steps of global_batch_size and trains, setting
// the policy's training metrics of the step.
func (tr *trainer) trainOne(ctx context.Context, step int, p *policy, ss []trainSample, adv [][]float32, m Metrics) error {
	lc := lossConfig(p.cfg.Train)
	size := batchSize(p.cfg.Train.GlobalBatchSize, len(ss))
	trainLogp, err := tr.trainLogprobs(ctx, step, p, ss, size)
	if err != nil {
		return err
	}
	var sums trainSums
	var mis mismatch
	for k := 0; k < len(ss); k += size {
		b := engines.Batch{ID: tr.batchID(p.name, step, k/size), Loss: lc, Samples: samplesOf(ss, adv, trainLogp, k, min(k+size, len(ss)))}
		st, err := tr.optimizerStep(ctx, step, p, b)
		if err != nil {
			return err
		}
		if st.Skipped {
			sums.skipped++
			tr.events.printf("step %d: policy %q: optimizer step %s skipped: %s", step, p.name, b.ID, st.Reason)
			continue
		}
		sums.add(st)
		if k == 0 || trainLogp != nil {
			mis.add(st)
		}
	}
	mis.report(m)
	sums.report(m, lc.UseTIS)
	return nil
}

// batchSize is the number of samples of an optimizer step: global_batch_size, or all n samples
// when it is 0 or more than n.
func batchSize(global, n int) int {
	if global <= 0 || global > n {
		return n
	}
	return global
}

// batchID is the id of a policy's i-th optimizer step of a step. The run id keeps a server that
// outlived a crashed host from taking a resumed run's steps for ones it has already applied.
func (tr *trainer) batchID(policy string, step, i int) string {
	return fmt.Sprintf("%s/%s/step%d/%d", tr.id, policy, step, i)
}

// samplesOf are the engine's samples of ss[from:to], with their advantages and, when trainLogp
// is not nil (use_tis over several optimizer steps), the trainer's log-probs from before the
// first.
func samplesOf(ss []trainSample, adv, trainLogp [][]float32, from, to int) []engines.Sample {
	var out []engines.Sample
	for i := from; i < to; i++ {
		c := ss[i].C
		out = append(out, engines.Sample{
			Prompt: c.PromptTokens(), Response: c.Tokens(), LossMask: c.LossMask(), OldLogprobs: c.Logprobs(),
			Advantages: adv[i], Group: ss[i].Group,
		})
		if trainLogp != nil {
			out[len(out)-1].TrainLogprobs = trainLogp[i]
		}
	}
	return out
}

// optimizerStep has p's engine run one optimizer step on b (its engine counted busy meanwhile)
// and notes it for an engine that restarts; a failure is the step's EngineError.
func (tr *trainer) optimizerStep(ctx context.Context, step int, p *policy, b engines.Batch) (engines.TrainStats, error) {
	p.busy.begin()
	st, err := p.eng.Train(ctx, b)
	p.busy.end()
	if err != nil {
		return st, &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("train: %w", err), Hint: engineErrorHint(tr.out)}
	}
	tr.restart.trained(p.name, b)
	return st, nil
}

// trainSums adds up the stats of a policy's optimizer steps of a step.
type trainSums struct {
	loss, pg, kl, clip, ent, gn, tisClip, tisW float64
	steps, skipped, tokens                     int
}

// add counts an optimizer step taken (not skipped).
func (s *trainSums) add(st engines.TrainStats) {
	s.steps++
	s.tokens += st.Tokens
	s.loss += st.Loss
	s.pg += st.PGLoss
	s.kl += st.KL
	s.clip += st.ClipFrac
	s.ent += st.Entropy
	s.gn += st.GradNorm
	s.tisClip += st.TISClipFrac
	s.tisW += st.TISWeight
}

// report sets the means of the optimizer steps taken (none taken, every one skipped: no loss, not
// 0), tis_clip_frac and tis_weight with use_tis, and the counts of steps and trained tokens.
func (s *trainSums) report(m Metrics, useTIS bool) {
	if d := float64(s.steps); s.steps > 0 {
		m.set("loss", s.loss/d)
		m.set("pg_loss", s.pg/d)
		m.set("kl", s.kl/d)
		m.set("clip_frac", s.clip/d)
		m.set("entropy", s.ent/d)
		m.set("grad_norm", s.gn/d)
		if useTIS {
			m.set("tis_clip_frac", s.tisClip/d)
			m.set("tis_weight", s.tisW/d)
		}
	}
	m.set("optimizer_steps", s.steps)
	m.set("skipped_steps", s.skipped)
	m.set("trained_tokens", s.tokens)
}

// mismatch sums the rollout/trainer log-prob mismatch of a policy's optimizer steps whose
// trainer side is the weights the rollouts were sampled from. Those are the first optimizer step
// of the step, or every one with use_tis's trainer log-probs, scored before the first: a later
// step's own forward comes after an update and would measure that too.
type mismatch struct {
	sum, weighted, max float64
	tokens, steps      int
}

// add counts an optimizer step whose trainer side is the rollouts' weights.
func (d *mismatch) add(st engines.TrainStats) {
	d.sum += st.LogprobDiffMean * float64(st.Tokens)
	d.weighted += st.LogprobAbsDiff
	if st.LogprobDiffMax > d.max || math.IsNaN(st.LogprobDiffMax) {
		d.max = st.LogprobDiffMax
	}
	d.tokens += st.Tokens
	d.steps++
}

// report sets logprob_diff_mean (over trained tokens), logprob_diff_max and slime's
// train_rollout_logprob_abs_diff (reduced like the loss, the mean over optimizer steps).
func (d *mismatch) report(m Metrics) {
	if d.steps == 0 {
		return
	}
	if d.tokens > 0 {
		m.set("logprob_diff_mean", d.sum/float64(d.tokens))
	}
	m.set("logprob_diff_max", d.max)
	m.set("train_rollout_logprob_abs_diff", d.weighted/float64(d.steps))
}

// lossConfig is the engine's loss of a policy's train: settings (kl_loss_coef counts only with
// use_kl_loss; gspo's sequence ratio for advantage_estimator gspo).
func lossConfig(tc config.TrainConfig) engines.LossConfig {
	kl := tc.KLLossCoef
	if !tc.UseKLLoss {
		kl = 0
	}
	pl := "ppo"
	if tc.AdvantageEstimator == "gspo" {
		pl = "gspo"
	}
	return engines.LossConfig{
		LR: tc.LR, Beta1: tc.AdamBeta1, Beta2: tc.AdamBeta2, WeightDecay: tc.WeightDecay,
		MaxGradNorm: tc.ClipGrad, EpsClip: tc.EpsClip, EpsClipHigh: tc.EpsClipHigh,
		KLLossCoef: kl, KLLossType: tc.KLLossType, EntropyCoef: tc.EntropyCoef,
		Aggregation: tc.LossAggregation, PolicyLoss: pl,
		UseTIS: tc.UseTIS, TISMode: tc.TISMode, TISClip: tc.TISClip, TISClipLow: tc.TISClipLow,
	}
}

// trainLogprobs returns the trainer's log-probs of every sample before the first optimizer step,
// when use_tis is on and a policy's step is cut into several optimizer steps of size samples, as
// slime recomputes its old log_probs once per rollout: the later optimizer steps then measure
// their PPO ratio from the same weights as the first. It returns nil otherwise: with one optimizer
// step the engine's own log-probs before the step are those.
func (tr *trainer) trainLogprobs(ctx context.Context, step int, p *policy, ss []trainSample, size int) ([][]float32, error) {
	if !p.cfg.Train.UseTIS || size >= len(ss) {
		return nil, nil
	}
	reqs := make([]engines.ScoreRequest, len(ss))
	for i, s := range ss {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.C.PromptTokens(), Tokens: s.C.Tokens()}
	}
	scores, err := p.eng.Score(ctx, reqs)
	if err != nil {
		return nil, &EngineError{Step: step, Policy: p.name, Err: fmt.Errorf("scoring %d samples for use_tis's old log-probs: %w", len(ss), err),
			Hint: engineErrorHint(tr.out)}
	}
	out := make([][]float32, len(ss))
	for i, s := range ss {
		if len(scores[i].Logprobs) != len(s.C.Tokens()) {
			return nil, fmt.Errorf("policy %q: scoring for use_tis returned %d log-probs for %d tokens", p.name, len(scores[i].Logprobs), len(s.C.Tokens()))
		}
		out[i] = scores[i].Logprobs
	}
	return out, nil
}
