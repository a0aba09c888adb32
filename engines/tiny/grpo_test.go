package tiny

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/tasks"
)

// grpoStep is plain single-policy GRPO as the host runs it: n samples per prompt, a reward per
// sample, advantages normalised within each prompt's group ((r − mean)/(std + 1e-6), unbiased
// std), one Train call. It returns the mean reward of the step's samples.
func grpoStep(t testing.TB, e *Engine, prompts []string, n, minibatches int, temperature float64, seed uint64, reward func(prompt int, c engines.Completion) float64, loss engines.LossConfig) (float64, engines.TrainStats) {
	t.Helper()
	reqs := make([]engines.GenerateRequest, len(prompts))
	for i, p := range prompts {
		reqs[i] = engines.GenerateRequest{ID: fmt.Sprint(i), Messages: []engines.Message{{Role: "user", Content: p}}, N: n,
			Sampling: engines.Sampling{MaxTokens: 16, Temperature: temperature, Seed: seed}}
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	b := engines.Batch{ID: fmt.Sprint(seed), Loss: loss}
	total := 0.0
	for i := range prompts {
		group := cs[i*n : (i+1)*n]
		rs := make([]float64, n)
		mean := 0.0
		for j, c := range group {
			rs[j] = reward(i, c)
			mean += rs[j] / float64(n)
		}
		std := 0.0
		for _, r := range rs {
			std += (r - mean) * (r - mean) / float64(n-1)
		}
		std = math.Sqrt(std)
		for j, c := range group {
			total += rs[j]
			adv := float32((rs[j] - mean) / (std + 1e-6))
			s := engines.Sample{Prompt: c.PromptTokens, Response: c.Tokens, OldLogprobs: c.Logprobs, Group: c.RequestID}
			for range c.Tokens {
				s.LossMask = append(s.LossMask, 1)
				s.Advantages = append(s.Advantages, adv)
			}
			b.Samples = append(b.Samples, s)
		}
	}
	// global_batch_size: the samples are split, by whole groups, into optimizer steps of
	// len(prompts)/minibatches groups each, the later ones slightly off-policy (the ratio clip's job).
	var st engines.TrainStats
	per := len(prompts) / minibatches * n
	for lo := 0; lo < len(b.Samples); lo += per {
		mb := b
		mb.ID = fmt.Sprint(seed, "/", lo)
		mb.Samples = b.Samples[lo:min(lo+per, len(b.Samples))]
		var err error
		if st, err = e.Train(ctx, mb); err != nil {
			t.Fatal(err)
		}
	}
	return total / float64(len(cs)), st
}

// The RL loop moves a random model towards the rewarded behaviour: here, responses that start
// with a digit.
func TestGRPOToyLearns(t *testing.T) {
	e := newSmall(t, 0)
	prompts := []string{"a", "bb", "ccc", "dd"}
	isDigit := func(_ int, c engines.Completion) float64 {
		if c.Text != "" && c.Text[0] >= '0' && c.Text[0] <= '9' {
			return 1
		}
		return 0
	}
	loss := engines.LossConfig{LR: 3e-2, EpsClip: 0.2, EpsClipHigh: 0.28, MaxGradNorm: 1}
	var first, last float64
	for step := range 30 {
		r, st := grpoStep(t, e, prompts, 16, 1, 1, uint64(step), isDigit, loss)
		if st.Skipped {
			t.Fatalf("step %d skipped: %s", step, st.Reason)
		}
		switch {
		case step < 3:
			first += r / 3
		case step >= 27:
			last += r / 3
		}
	}
	// 10 of 102 tokens are digits: about 0.1 at the start.
	if first > 0.3 || last < first+0.4 {
		t.Fatalf("mean reward went from %.2f (first 3 steps) to %.2f (last 3): the policy did not learn", first, last)
	}
	t.Logf("mean reward %.2f → %.2f", first, last)
}

// BenchmarkGRPOArith is the learning check of docs/tiny.md: plain single-policy GRPO from
// builtin:tiny-arith on synthetic:arith (difficulty 2) for five minutes of engine time — 32
// problems a step, 8 samples each at temperature 1, reward 1 for an exact \boxed{} answer, group-
// normalised advantages, one Train call a step — with the held-out exact-match accuracy at
// temperature 1 (500 problems of another seed) logged along the way. It fails unless the accuracy
// rises by 15 points. Run it alone:
//
//	go test ./engines/tiny -run '^$' -bench GRPOArith -benchtime 1x -timeout 30m
func BenchmarkGRPOArith(b *testing.B) {
	const budget = 5 * time.Minute
	for b.Loop() {
		e := openBuiltin(b)
		train := tasks.Arith{Seed: 777, Difficulty: 2}
		heldOut := tasks.Arith{Seed: 4242, Difficulty: 2}
		eval := func() float64 {
			acc, err := tasks.ArithAccuracy(ctx, e, heldOut, 500, 1, 99)
			if err != nil {
				b.Fatal(err)
			}
			return acc
		}
		loss := engines.LossConfig{LR: grpoLR, EpsClip: 0.2, EpsClipHigh: 0.28, MaxGradNorm: 1}
		start := eval()
		b.Logf("step 0 (0s): held-out accuracy %.1f%%", 100*start)
		var spent time.Duration
		acc := start
		for step := 0; spent < budget; step++ {
			t0 := time.Now()
			prompts := make([]string, 32)
			for i := range prompts {
				p := train.Problem(step*32 + i)
				prompts[i] = p.Prompt
			}
			exact := func(i int, c engines.Completion) float64 {
				if train.Correct(step*32+i, c.Text) {
					return 1
				}
				return 0
			}
			reward, st := grpoStep(b, e, prompts, 8, grpoMinibatches, 1, uint64(step), exact, loss)
			spent += time.Since(t0)
			if (step+1)%10 == 0 || spent >= budget {
				acc = eval()
				b.Logf("step %d (%.0fs): train reward %.2f, clip %.3f, held-out accuracy %.1f%%", step+1, spent.Seconds(), reward, st.ClipFrac, 100*acc)
			}
		}
		b.ReportMetric(100*start, "start_acc_%")
		b.ReportMetric(100*acc, "end_acc_%")
		if acc < start+0.15 {
			b.Errorf("held-out accuracy went from %.1f%% to %.1f%% in %v: less than 15 points", 100*start, 100*acc, budget)
		}
	}
}

// The settings docs/tiny.md recommends for RL on builtin:tiny-arith: the learning rate, and
// optimizer steps per rollout step (32 tasks × 8 samples with global_batch_size 32 gives 8).
const (
	grpoLR          = 3e-4
	grpoMinibatches = 8
)
