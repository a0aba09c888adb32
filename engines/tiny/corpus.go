package tiny

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/synthetic"
)

// ArithExample is example i of the pretraining corpus of builtin:tiny-arith, drawn from problem i
// of a. Half the prompts are the bare problem; the other half append candidate answers, as the
// multi-agent topologies do when they show one agent the others' answers:
//
//	Ann has 12 pens and gets 7 more. How many pens? Answers: 19, 17.
//
// Each candidate is right with probability 1/2. The response is always the correct \boxed{N}, so
// the model learns to use agreeing context without trusting it blindly. Formats are terse: every
// character is a token.
func ArithExample(a synthetic.Arith, i int) Example {
	p := a.Problem(i)
	r := rand.New(rand.NewPCG(a.Seed^0x636f_7270_7573, uint64(i))) // "corpus"
	prompt := p.Prompt
	if r.IntN(2) == 1 {
		prompt += " Answers: " + strings.Join(candidates(r, p.Label, 1+r.IntN(3)), ", ") + "."
	}
	return Example{Prompt: prompt, Response: p.Answer()}
}

// candidates returns n answers to show with a problem, each the label with probability 1/2 and
// otherwise a nearby wrong non-negative number.
func candidates(r *rand.Rand, label string, n int) []string {
	want, _ := strconv.Atoi(label)
	out := make([]string, n)
	for k := range out {
		v := want
		if r.IntN(2) == 0 {
			for v == want || v < 0 {
				v = want + r.IntN(21) - 10
			}
		}
		out[k] = strconv.Itoa(v)
	}
	return out
}

// ArithAccuracy generates one answer to each of problems 0..n−1 of a at the given temperature and
// returns the fraction whose last \boxed{…} equals the label exactly.
func ArithAccuracy(ctx context.Context, e engines.Engine, a synthetic.Arith, n int, temperature float64, seed uint64) (float64, error) {
	reqs := make([]engines.GenerateRequest, n)
	for i := range reqs {
		p := a.Problem(i)
		reqs[i] = engines.GenerateRequest{ID: p.ID, Messages: []engines.Message{{Role: "user", Content: p.Prompt}},
			Sampling: engines.Sampling{MaxTokens: 16, Temperature: temperature, Seed: seed}}
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		return 0, err
	}
	right := 0
	for i, c := range cs {
		if got, ok := lastBoxed(c.Text); ok && got == a.Problem(i).Label {
			right++
		}
	}
	return float64(right) / float64(n), nil
}

// lastBoxed returns the content of the last \boxed{…} in s (no nesting: the answers are integers).
func lastBoxed(s string) (string, bool) {
	i := strings.LastIndex(s, `\boxed{`)
	if i < 0 {
		return "", false
	}
	rest := s[i+len(`\boxed{`):]
	j := strings.IndexByte(rest, '}')
	if j < 0 {
		return "", false
	}
	return strings.TrimSpace(rest[:j]), true
}

// ArithDescribe names the corpus of a for logs.
func ArithDescribe(a synthetic.Arith) string {
	return fmt.Sprintf("synthetic:arith?difficulty=%d&seed=%d", a.Difficulty, a.Seed)
}
