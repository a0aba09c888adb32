package tiny

import (
	"math"
	"testing"

	"github.com/slimen/slimen/engines"
)

// The rollout/trainer log-prob mismatch of a step: ~0 on the embedded engine (its training
// forward reads what its sampler read, in the same arithmetic), and what the log-probs sent say
// when they are off: the mean and largest |trainer − rollout| over trained tokens, and slime's
// train_rollout_logprob_abs_diff reduced as the loss is (sample_mean by default).
func TestTrainLogprobMismatch(t *testing.T) {
	e := newSmall(t, 2)
	b := rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%2) - 0.5 })
	st, err := e.Train(ctx, b)
	if err != nil || st.Skipped {
		t.Fatal(st, err)
	}
	if st.Tokens == 0 || st.LogprobDiffMax > 1e-6 || st.LogprobDiffMean > st.LogprobDiffMax || st.LogprobAbsDiff > 1e-6 {
		t.Errorf("on-policy step: mismatch mean %g max %g abs_diff %g over %d tokens; want ~0", st.LogprobDiffMean, st.LogprobDiffMax, st.LogprobAbsDiff, st.Tokens)
	}

	// Rollout log-probs off by 0.25 nats on every other token (and by 3 on an untrained token,
	// which must not count).
	e = newSmall(t, 2)
	b = rolloutBatch(t, e, func(i int, _ engines.Completion) float32 { return float32(i%2) - 0.5 })
	off, tokens := 0, 0
	var sampleMean float64
	for i := range b.Samples {
		s := &b.Samples[i]
		s.LossMask[0] = 0
		s.OldLogprobs[0] += 3
		n, k := 0, 0
		for j := 1; j < len(s.OldLogprobs); j++ {
			n++
			if j%2 == 1 {
				s.OldLogprobs[j] -= 0.25
				k++
			}
		}
		off += k
		tokens += n
		if n > 0 {
			sampleMean += 0.25 * float64(k) / float64(n)
		}
	}
	sampleMean /= float64(len(b.Samples))
	st, err = e.Train(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	if st.Tokens != tokens || math.Abs(st.LogprobDiffMax-0.25) > 1e-5 ||
		math.Abs(st.LogprobDiffMean-0.25*float64(off)/float64(tokens)) > 1e-5 ||
		math.Abs(st.LogprobAbsDiff-sampleMean) > 1e-5 {
		t.Errorf("rollout off by 0.25 on %d of %d trained tokens: mean %g max %g abs_diff %g; want %g, 0.25, %g",
			off, tokens, st.LogprobDiffMean, st.LogprobDiffMax, st.LogprobAbsDiff, 0.25*float64(off)/float64(tokens), sampleMean)
	}

	// With use_tis the trainer's side is the trainer's old log-probs the host sent.
	e = newSmall(t, 2)
	b = rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })
	b.Loss.UseTIS = true
	for i := range b.Samples {
		for _, x := range b.Samples[i].OldLogprobs {
			b.Samples[i].TrainLogprobs = append(b.Samples[i].TrainLogprobs, x-0.5)
		}
	}
	if st, err := e.Train(ctx, b); err != nil || math.Abs(st.LogprobDiffMax-0.5) > 1e-5 || math.Abs(st.LogprobDiffMean-0.5) > 1e-5 {
		t.Errorf("use_tis, train_logprobs 0.5 below the rollout's: %+v, %v; want mean and max 0.5", st, err)
	}
}
