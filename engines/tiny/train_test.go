package tiny

import (
	"math"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/slimen/slimen/engines"
)

// rolloutBatch generates completions and turns them into a training batch with the given
// advantage per completion (in order).
func rolloutBatch(t testing.TB, e *Engine, adv func(i int, c engines.Completion) float32) engines.Batch {
	t.Helper()
	cs, err := e.Generate(ctx, []engines.GenerateRequest{userReq("a", "Ed has 2 books.", 4, 5), userReq("b", "Flo has 9 coins.", 3, 6)})
	if err != nil {
		t.Fatal(err)
	}
	b := engines.Batch{ID: "s1", Loss: engines.LossConfig{LR: 1e-2, EpsClip: 0.2, EpsClipHigh: 0.28, MaxGradNorm: 1,
		KLLossCoef: 0.01, EntropyCoef: 0.001, WeightDecay: 0.01}}
	for i, c := range cs {
		s := engines.Sample{Prompt: c.PromptTokens, Response: c.Tokens, OldLogprobs: c.Logprobs, Group: c.RequestID}
		for range c.Tokens {
			s.LossMask = append(s.LossMask, 1)
			s.Advantages = append(s.Advantages, adv(i, c))
		}
		b.Samples = append(b.Samples, s)
	}
	return b
}

func snapshot(e *Engine) [][]float32 {
	var out [][]float32
	for _, t := range e.m.w.tensors() {
		out = append(out, slices.Clone(t.data))
	}
	for i := range e.opt.m {
		out = append(out, slices.Clone(e.opt.m[i]), slices.Clone(e.opt.v[i]))
	}
	return out
}

// Training is deterministic and independent of the thread count, and on-policy the ratio is 1.
func TestTrainDeterministic(t *testing.T) {
	var results [][][]float32
	var stats []engines.TrainStats
	for _, threads := range []int{1, 3} {
		e := newSmall(t, threads)
		b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%3) - 1 })
		for range 2 {
			st, err := e.Train(ctx, b)
			if err != nil {
				t.Fatal(err)
			}
			if st.Skipped {
				t.Fatalf("step skipped: %s", st.Reason)
			}
			stats = append(stats, st)
		}
		results = append(results, snapshot(e))
	}
	if !cmp.Equal(results[0], results[1]) {
		t.Fatal("1 and 3 threads trained to different weights")
	}
	if stats[0] != stats[2] || stats[1] != stats[3] {
		t.Fatalf("stats differ between thread counts: %+v vs %+v", stats[:2], stats[2:])
	}
	// First step: logp equals the rollout's up to float32 rounding of old_logprobs, so no clipping
	// and KL 0; the second step, after an update, moved away.
	if st := stats[0]; st.ClipFrac != 0 || math.Abs(st.KL) > 1e-12 || st.Entropy <= 0 || st.GradNorm <= 0 || st.Tokens == 0 {
		t.Fatalf("first step stats %+v", st)
	}
	if st := stats[1]; st.KL <= 0 {
		t.Fatalf("second step KL %v, want > 0", st.KL)
	}
	if want := stats[1].PGLoss + 0.01*stats[1].KL - 0.001*stats[1].Entropy; math.Abs(stats[1].Loss-want) > 1e-12 {
		t.Fatalf("loss %v ≠ pg + kl_coef·kl − entropy_coef·entropy = %v", stats[1].Loss, want)
	}
}

// Positive advantages make the sampled responses more likely.
func TestTrainRaisesRewardedLogprobs(t *testing.T) {
	e := newSmall(t, 2)
	b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 {
		if i == 0 {
			return 1
		}
		return 0
	})
	b.Loss.KLLossCoef, b.Loss.EntropyCoef = 0, 0
	score := func() float64 {
		sc, err := e.Score(ctx, []engines.ScoreRequest{{PromptTokens: b.Samples[0].Prompt, Tokens: b.Samples[0].Response}})
		if err != nil {
			t.Fatal(err)
		}
		s := 0.0
		for _, v := range sc[0].Logprobs {
			s += float64(v)
		}
		return s
	}
	before := score()
	for range 5 {
		if _, err := e.Train(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	if after := score(); after <= before+0.5 {
		t.Fatalf("log-probability of the rewarded response went from %.3f to %.3f", before, after)
	}
}

// A non-finite loss skips the step without touching weights or optimizer state.
func TestTrainSkipsNonFinite(t *testing.T) {
	e := newSmall(t, 2)
	b := rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })
	if _, err := e.Train(ctx, b); err != nil { // a real step first, so the optimizer has state
		t.Fatal(err)
	}
	before, step := snapshot(e), e.opt.step
	for name, poison := range map[string]func(*engines.Batch){
		"NaN advantage":      func(b *engines.Batch) { b.Samples[1].Advantages[0] = float32(math.NaN()) },
		"infinite advantage": func(b *engines.Batch) { b.Samples[0].Advantages[0] = float32(math.Inf(1)) },
		"-inf old logprob":   func(b *engines.Batch) { b.Samples[2].OldLogprobs[0] = float32(math.Inf(-1)) },
		"all tokens masked":  func(b *engines.Batch) { clearMasks(b) },
	} {
		pb := rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })
		poison(&pb)
		st, err := e.Train(ctx, pb)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !st.Skipped || st.Reason == "" {
			t.Fatalf("%s: step not skipped: %+v", name, st)
		}
		if !cmp.Equal(before, snapshot(e)) || e.opt.step != step {
			t.Fatalf("%s: weights or optimizer changed by a skipped step", name)
		}
	}
}

func clearMasks(b *engines.Batch) {
	for i := range b.Samples {
		for j := range b.Samples[i].LossMask {
			b.Samples[i].LossMask[j] = 0
		}
	}
}

func TestTrainRejectsBadBatches(t *testing.T) {
	e := newSmall(t, 1)
	good := rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })
	for name, mutate := range map[string]func(*engines.Batch){
		"short mask":   func(b *engines.Batch) { b.Samples[0].LossMask = b.Samples[0].LossMask[1:] },
		"bad token":    func(b *engines.Batch) { b.Samples[0].Response[0] = -3 },
		"kl type":      func(b *engines.Batch) { b.Loss.KLLossType = "k9" },
		"aggregation":  func(b *engines.Batch) { b.Loss.Aggregation = "mean" },
		"policy loss":  func(b *engines.Batch) { b.Loss.PolicyLoss = "trpo" },
		"beta":         func(b *engines.Batch) { b.Loss.Beta2 = 1.5 },
		"empty prompt": func(b *engines.Batch) { b.Samples[0].Prompt = nil },
	} {
		b := good
		b.Samples = slices.Clone(good.Samples)
		b.Samples[0].Response = slices.Clone(good.Samples[0].Response)
		mutate(&b)
		if _, err := e.Train(ctx, b); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// Reference scoring: after a step a Reference request still gets the starting log-probs (the
// frozen KL copy), a plain one the trained model's, in one mixed call.
func TestScoreWithTheReference(t *testing.T) {
	e := newSmall(t, 1)
	if info, _ := e.Info(ctx); !slices.Contains(info.Capabilities, "reference") {
		t.Fatalf("capabilities %v lack reference", info.Capabilities)
	}
	b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%3) - 1 })
	reqs := make([]engines.ScoreRequest, len(b.Samples))
	for i, s := range b.Samples {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.Prompt, Tokens: s.Response}
	}
	before, err := e.Score(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := e.Train(ctx, b); err != nil || st.Skipped {
		t.Fatalf("%v %+v", err, st)
	}
	now, err := e.Score(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		reqs[i].Reference = i%2 == 0
	}
	got, err := e.Score(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		want := now[i]
		if i%2 == 0 {
			want = before[i]
		}
		if !cmp.Equal(got[i], want) {
			t.Errorf("request %d (reference %v): %v, want %v", i, reqs[i].Reference, got[i].Logprobs, want.Logprobs)
		}
		if cmp.Equal(before[i], now[i]) {
			t.Errorf("request %d: the step did not change the log-probs", i)
		}
	}
}

// With TIS the rollout's log-probs only weight the step: rollout log-probs off by log 3, 0 and
// −log 3 in turn give ratios of 3, 1 and 1/3 against the band [0.5, 2], so a third of the tokens
// keep their weight and the rest are clipped to 2 and 0.5 (tis) or masked (icepop). The
// trainer's old log-probs computed by the engine and the same numbers sent as TrainLogprobs give
// the same step.
func TestTrainTIS(t *testing.T) {
	d := []float32{float32(math.Log(3)), 0, -float32(math.Log(3))}
	for mode, w := range map[string][3]float64{"tis": {2, 1, 0.5}, "icepop": {0, 1, 0}} {
		var results [][][]float32
		var stats []engines.TrainStats
		var count [3]float64 // tokens by position mod 3
		for _, send := range []bool{false, true} {
			e := newSmall(t, 2)
			b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%3) - 1 })
			b.Loss.UseTIS, b.Loss.TISMode, b.Loss.TISClip, b.Loss.TISClipLow = true, mode, 2, 0.5
			count = [3]float64{}
			for i := range b.Samples {
				s := &b.Samples[i]
				if send {
					// The rollout's log-probs are the engine's own (the first step's weights).
					s.TrainLogprobs = slices.Clone(s.OldLogprobs)
				}
				for j := range s.OldLogprobs {
					s.OldLogprobs[j] -= d[j%3]
					count[j%3]++
				}
			}
			st, err := e.Train(ctx, b)
			if err != nil {
				t.Fatal(err)
			}
			stats = append(stats, st)
			results = append(results, snapshot(e))
		}
		n := count[0] + count[1] + count[2]
		wantFrac, wantW := (count[0]+count[2])/n, (w[0]*count[0]+w[1]*count[1]+w[2]*count[2])/n
		if st := stats[0]; st.Skipped || st.ClipFrac != 0 || math.Abs(st.TISClipFrac-wantFrac) > 1e-12 || math.Abs(st.TISWeight-wantW) > 1e-6 {
			t.Errorf("%s: stats %+v, want no PPO clipping, tis_clip_frac %v, tis_weight %v", mode, st, wantFrac, wantW)
		}
		if math.Abs(stats[0].Loss-stats[1].Loss) > 1e-6 || !cmp.Equal(results[0], results[1], cmpopts.EquateApprox(0, 1e-5)) {
			t.Errorf("%s: own old log-probs and sent ones differ: %+v vs %+v", mode, stats[0], stats[1])
		}
	}
	// Sent old log-probs are the PPO ratio's: one nat below the current ones, every ratio is e,
	// outside the clip range.
	e := newSmall(t, 2)
	b := rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })
	b.Loss.UseTIS = true
	for i := range b.Samples {
		for _, x := range b.Samples[i].OldLogprobs {
			b.Samples[i].TrainLogprobs = append(b.Samples[i].TrainLogprobs, x-1)
		}
	}
	if st, err := e.Train(ctx, b); err != nil || st.ClipFrac != 1 || st.TISClipFrac != 0 {
		t.Errorf("train_logprobs one nat low: %+v, %v; want every token clipped by PPO, none by TIS", st, err)
	}
}
