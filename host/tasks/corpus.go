package tasks

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines"
)

// Example is example i of the pretraining corpus of builtin:tiny-arith, drawn from problem i of
// a: the CLI's `slimen pretrain` hands these to the tiny engine's Pretrain. Half the prompts are the bare problem; the other half append candidate answers, as the
// multi-agent topologies do when they show one agent the others' answers:
//
//	Ann has 12 pens and gets 7 more. How many pens? Answers: 19, 17.
//
// Each candidate is right with probability 1/2. The response is always the correct \boxed{N}, so
// the model learns to use agreeing context without trusting it blindly. Formats are terse: every
// character is a token.
func (a Arith) Example(i int) (prompt, response string) {
	p := a.Problem(i)
	r := rand.New(rand.NewPCG(a.Seed^0x636f_7270_7573, uint64(i))) // "corpus"
	prompt = p.Prompt
	if r.IntN(2) == 1 {
		prompt += " Answers: " + strings.Join(candidates(r, p.Label, 1+r.IntN(3)), ", ") + "."
	}
	return prompt, p.Answer()
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
func ArithAccuracy(ctx context.Context, e engines.Engine, a Arith, n int, temperature float64, seed uint64) (float64, error) {
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
		if a.Correct(i, c.Text) {
			right++
		}
	}
	return float64(right) / float64(n), nil
}

// Correct says whether text answers problem i: its last \boxed{…} holds the label exactly.
func (a Arith) Correct(i int, text string) bool {
	got, ok := lastBoxed(text)
	return ok && got == a.Problem(i).Label
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

// String names the source of a for logs, as a data path would.
func (a Arith) String() string {
	return fmt.Sprintf("synthetic:arith?difficulty=%d&seed=%d", a.Difficulty, a.Seed)
}
