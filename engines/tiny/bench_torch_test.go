package tiny

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
)

// BenchmarkVsTorch measures the engine and PyTorch CPU (transformers, bench/torch_cpu.py) side by
// side on the same model folder (builtin:tiny-arith saved by Save), the same prompt tokens and
// shapes, each case alternating between the two three times, and prints the table of docs/tiny.md
// with the ratios. It needs a Python with torch and transformers:
//
//	SLIMEN_BENCH_PYTHON=$(scripts/pyenv.sh)/bin/python go test ./engines/tiny -run '^$' -bench VsTorch -benchtime 1x -timeout 30m
//
// Both sides use every core (SLIMEN_BENCH_THREADS sets another count for both). Generation samples
// at temperature 1 with EOS off, so every row yields exactly the asked tokens; tok/s counts sampled
// tokens over the wall time of the call (prefill included). Training is one optimizer step of the
// policy loss at ratio 1 (old log-probs from Score) and AdamW; tok/s counts the tokens forward and
// backward process.
func BenchmarkVsTorch(b *testing.B) {
	python := os.Getenv("SLIMEN_BENCH_PYTHON")
	if python == "" {
		b.Skip("set SLIMEN_BENCH_PYTHON to a Python with torch and transformers (scripts/pyenv.sh prints the venv)")
	}
	threads := defaultThreads()
	if s := os.Getenv("SLIMEN_BENCH_THREADS"); s != "" {
		fmt.Sscan(s, &threads)
	}
	e, err := Open("builtin:tiny-arith", Options{Threads: threads})
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	if err := e.Save(ctx, dir); err != nil {
		b.Fatal(err)
	}
	e.eos = nil // every row generates its full length, as with min_new_tokens on the PyTorch side
	vocab := e.Config().VocabSize
	type bcase struct {
		name          string
		train         bool
		batch, a, b   int       // generation: prompt and new tokens; training: prompt and response tokens
		tinyS, torchS []float64 // tok/s of each repetition
	}
	cases := []*bcase{
		{name: "generation, batch 1, tok/s", batch: 1, a: 16, b: 256},
		{name: "generation, batch 16", batch: 16, a: 16, b: 64},
		{name: "generation, batch 64", batch: 64, a: 16, b: 64},
		{name: "generation, batch 256", batch: 256, a: 16, b: 64},
		{name: "training 64×(64+64) tokens, tok/s", train: true, batch: 64, a: 64, b: 64},
		{name: "training 256×(64+16)", train: true, batch: 256, a: 64, b: 16},
	}
	script := filepath.Join("bench", "torch_cpu.py")
	for b.Loop() {
		for rep := range 3 {
			for _, c := range cases {
				seed := 100*rep + c.batch
				var tiny float64
				if c.train {
					tiny = benchTinyTrain(b, e, c.batch, c.a, c.b, seed, vocab)
				} else {
					tiny = benchTinyGen(b, e, c.batch, c.a, c.b, seed, vocab)
				}
				mode := map[bool]string{false: "gen", true: "train"}[c.train]
				cmd := exec.Command(python, script, dir, mode, fmt.Sprint(c.batch), fmt.Sprint(c.a), fmt.Sprint(c.b), fmt.Sprint(seed))
				cmd.Env = append(os.Environ(), fmt.Sprintf("SLIMEN_BENCH_THREADS=%d", threads))
				cmd.Stderr = os.Stderr
				out, err := cmd.Output()
				if err != nil {
					b.Fatalf("%s %s: %v", script, mode, err)
				}
				var r struct {
					TokS float64 `json:"tok_s"`
				}
				lines := strings.Split(strings.TrimSpace(string(out)), "\n")
				if err := json.Unmarshal([]byte(lines[len(lines)-1]), &r); err != nil {
					b.Fatalf("%s %s: %v in %q", script, mode, err, out)
				}
				c.tinyS, c.torchS = append(c.tinyS, tiny), append(c.torchS, r.TokS)
				b.Logf("rep %d %s: tiny %.0f tok/s, torch %.0f tok/s, ratio %.2f", rep+1, c.name, tiny, r.TokS, tiny/r.TokS)
			}
		}
	}
	var t strings.Builder
	fmt.Fprintf(&t, "\n%d threads; median of 3 pairs (each pair back to back); ratio = median of the 3 pair ratios\n\n", threads)
	fmt.Fprintf(&t, "| | tiny | PyTorch CPU (transformers) | ratio |\n|---|---:|---:|---:|\n")
	for _, c := range cases {
		ratios := make([]float64, len(c.tinyS))
		for i := range ratios {
			ratios[i] = c.tinyS[i] / c.torchS[i]
		}
		fmt.Fprintf(&t, "| %s | %.0f | %.0f | %.2f× |\n", c.name, median(c.tinyS), median(c.torchS), median(ratios))
	}
	b.Log(t.String())
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// benchPrompt is the prompt of row i, the same tokens as prompts() in bench/torch_cpu.py.
func benchPrompt(i, length, seed, vocab int) []int32 {
	p := make([]int32, length)
	for j := range p {
		p[j] = int32(2 + (i*7+j*13+seed)%(vocab-2))
	}
	return p
}

func benchTinyGen(b *testing.B, e *Engine, batch, plen, newTok, seed, vocab int) float64 {
	reqs := make([]engines.GenerateRequest, batch)
	for i := range reqs {
		reqs[i] = engines.GenerateRequest{ID: fmt.Sprint(i), PromptTokens: benchPrompt(i, plen, seed, vocab),
			Sampling: engines.Sampling{MaxTokens: newTok, Temperature: 1, Seed: uint64(seed)}}
	}
	t := time.Now()
	cs, err := e.Generate(ctx, reqs)
	dt := time.Since(t).Seconds()
	if err != nil {
		b.Fatal(err)
	}
	_, n := countTokens(cs)
	if n != batch*newTok {
		b.Fatalf("generated %d tokens, want %d", n, batch*newTok)
	}
	return float64(n) / dt
}

func benchTinyTrain(b *testing.B, e *Engine, batch, plen, rlen, seed, vocab int) float64 {
	var reqs []engines.ScoreRequest
	for i := range batch {
		s := benchPrompt(i, plen+rlen, seed, vocab)
		reqs = append(reqs, engines.ScoreRequest{PromptTokens: s[:plen], Tokens: s[plen:]})
	}
	scores, err := e.Score(ctx, reqs)
	if err != nil {
		b.Fatal(err)
	}
	batchT := engines.Batch{Loss: engines.LossConfig{LR: 1e-3, WeightDecay: 0.01, MaxGradNorm: 1, EpsClip: 0.2}}
	for i, r := range reqs {
		s := engines.Sample{Prompt: r.PromptTokens, Response: r.Tokens, OldLogprobs: scores[i].Logprobs, Group: fmt.Sprint(i)}
		for range r.Tokens {
			s.LossMask = append(s.LossMask, 1)
			s.Advantages = append(s.Advantages, float32(i%3-1))
		}
		batchT.Samples = append(batchT.Samples, s)
	}
	t := time.Now()
	if _, err := e.Train(ctx, batchT); err != nil {
		b.Fatal(err)
	}
	return float64(batch*(plen+rlen-1)) / time.Since(t).Seconds()
}
