package tiny

import (
	"fmt"
	"math"
	"testing"

	"github.com/slimen/slimen/engines"
)

// grpoStep is plain single-policy GRPO as the host runs it: n samples per prompt, a reward per
// sample, advantages normalised within each prompt's group ((r − mean)/(std + 1e-6), unbiased
// std), one Train call. It returns the mean reward of the step's samples.
func grpoStep(t testing.TB, e *Engine, prompts []string, n int, temperature float64, seed uint64, reward func(prompt int, c engines.Completion) float64, loss engines.LossConfig) (float64, engines.TrainStats) {
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
	st, err := e.Train(ctx, b)
	if err != nil {
		t.Fatal(err)
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
		r, st := grpoStep(t, e, prompts, 16, 1, uint64(step), isDigit, loss)
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
