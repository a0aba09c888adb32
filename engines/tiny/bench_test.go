package tiny

import (
	"fmt"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/tasks"
)

// The benchmarks measure builtin:tiny-arith on the workloads of the examples (docs/tiny.md has the
// numbers). Run them alone, they are not unit tests:
//
//	go test ./engines/tiny -run '^$' -bench . -benchtime 3x

func openBuiltin(b *testing.B) *Engine {
	b.Helper()
	e, err := Open("builtin:tiny-arith", Options{})
	if err != nil {
		b.Fatal(err)
	}
	return e
}

// grpoRequests is one step of single-policy GRPO: 32 problems, 8 samples each.
func grpoRequests(step int) []engines.GenerateRequest {
	a := tasks.Arith{Seed: 7, Difficulty: 2}
	var reqs []engines.GenerateRequest
	for i := range 32 {
		p := a.Problem(step*32 + i)
		reqs = append(reqs, engines.GenerateRequest{ID: p.ID, Messages: []engines.Message{{Role: "user", Content: p.Prompt}}, N: 8,
			Sampling: engines.Sampling{MaxTokens: 16, Temperature: 1, Seed: uint64(step)}})
	}
	return reqs
}

// debateRequests is one step of the debate example: 32 tasks, 3 generator answers on the problem,
// then 2 critic rounds of 3 whose prompts carry the other answers.
func debateRequests(step int) (generators, critics []engines.GenerateRequest) {
	a := tasks.Arith{Seed: 7, Difficulty: 2}
	for i := range 32 {
		p := a.Problem(step*32 + i)
		s := engines.Sampling{MaxTokens: 16, Temperature: 1, Seed: uint64(step)}
		generators = append(generators, engines.GenerateRequest{ID: p.ID, Messages: []engines.Message{{Role: "user", Content: p.Prompt}}, N: 3, Sampling: s})
		for round := range 2 {
			for agent := range 3 {
				prompt := fmt.Sprintf("%s Answers: %d, %d, %d.", p.Prompt, i+agent, i+round, 2*i)
				critics = append(critics, engines.GenerateRequest{ID: fmt.Sprintf("%s-r%d-a%d", p.ID, round, agent),
					Messages: []engines.Message{{Role: "user", Content: prompt}}, Sampling: s})
			}
		}
	}
	return generators, critics
}

func countTokens(cs []engines.Completion) (prompt, response int) {
	for _, c := range cs {
		prompt += len(c.PromptTokens)
		response += len(c.Tokens)
	}
	return prompt, response
}

func batchOf(cs []engines.Completion) engines.Batch {
	b := engines.Batch{Loss: engines.LossConfig{LR: 1e-3, EpsClip: 0.2, EpsClipHigh: 0.28, MaxGradNorm: 1}}
	for i, c := range cs {
		s := engines.Sample{Prompt: c.PromptTokens, Response: c.Tokens, OldLogprobs: c.Logprobs, Group: c.RequestID}
		for range c.Tokens {
			s.LossMask = append(s.LossMask, 1)
			s.Advantages = append(s.Advantages, float32(i%3-1))
		}
		b.Samples = append(b.Samples, s)
	}
	return b
}

// BenchmarkGenerateGRPO: 256 completions of 32 prompts; gen_tok/s counts sampled tokens.
func BenchmarkGenerateGRPO(b *testing.B) {
	e := openBuiltin(b)
	var resp, prompt int
	for i := 0; b.Loop(); i++ {
		cs, err := e.Generate(ctx, grpoRequests(i))
		if err != nil {
			b.Fatal(err)
		}
		p, r := countTokens(cs)
		prompt, resp = prompt+p, resp+r
	}
	b.ReportMetric(float64(resp)/b.Elapsed().Seconds(), "gen_tok/s")
	b.ReportMetric(float64(prompt+resp)/b.Elapsed().Seconds(), "total_tok/s")
}

// BenchmarkTrainGRPO: one optimizer step on 256 samples; train_tok/s counts every token the
// forward and backward passes process (prompt and response).
func BenchmarkTrainGRPO(b *testing.B) {
	e := openBuiltin(b)
	cs, err := e.Generate(ctx, grpoRequests(0))
	if err != nil {
		b.Fatal(err)
	}
	batch := batchOf(cs)
	p, r := countTokens(cs)
	for b.Loop() {
		if _, err := e.Train(ctx, batch); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*(p+r))/b.Elapsed().Seconds(), "train_tok/s")
	b.ReportMetric(float64(b.N*r)/b.Elapsed().Seconds(), "trained_tok/s")
}

// BenchmarkDebateStep: the engine work of one step of the debate example (32 tasks: 96 generator
// and 192 critic completions, then one optimizer step on all 288); s/step is what 40 steps cost.
func BenchmarkDebateStep(b *testing.B) {
	e := openBuiltin(b)
	var total int
	for i := 0; b.Loop(); i++ {
		gens, critics := debateRequests(i)
		g, err := e.Generate(ctx, gens)
		if err != nil {
			b.Fatal(err)
		}
		var all []engines.Completion
		all = append(all, g...)
		for round := range 2 {
			c, err := e.Generate(ctx, critics[round*96:(round+1)*96])
			if err != nil {
				b.Fatal(err)
			}
			all = append(all, c...)
		}
		p, r := countTokens(all)
		total += p + r
		if _, err := e.Train(ctx, batchOf(all)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/step")
	b.ReportMetric(float64(total)/b.Elapsed().Seconds(), "tok/s")
}
