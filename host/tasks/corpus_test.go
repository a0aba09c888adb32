package tasks

import (
	"strings"
	"testing"
)

func TestArithExample(t *testing.T) {
	a := Arith{Seed: 1, Difficulty: 2}
	withAnswers, right, shown := 0, 0, 0
	for i := range 400 {
		prompt, response := a.Example(i)
		p := a.Problem(i)
		if response != p.Answer() || !strings.HasPrefix(prompt, p.Prompt) {
			t.Fatalf("example %d: %q → %q for problem %+v", i, prompt, response, p)
		}
		if rest, ok := strings.CutPrefix(prompt, p.Prompt+" Answers: "); ok {
			withAnswers++
			for _, c := range strings.Split(strings.TrimSuffix(rest, "."), ", ") {
				shown++
				if c == p.Label {
					right++
				}
			}
		}
		if p2, r2 := a.Example(i); p2 != prompt || r2 != response {
			t.Fatal("examples are not a function of (seed, index)")
		}
	}
	if withAnswers < 160 || withAnswers > 240 || right < shown*4/10 || right > shown*6/10 {
		t.Fatalf("%d of 400 prompts carry answers, %d of %d answers right; want about half and half", withAnswers, right, shown)
	}
	if got, ok := lastBoxed(`x \boxed{3} then \boxed{ 12 }`); !ok || got != "12" {
		t.Fatalf("lastBoxed = %q, %v", got, ok)
	}
	if _, ok := lastBoxed(`\boxed{12`); ok {
		t.Fatal("unterminated box accepted")
	}
	p := a.Problem(3)
	if !a.Correct(3, "so "+p.Answer()) || a.Correct(3, p.Answer()+" or \\boxed{x}") {
		t.Fatal("Correct does not judge by the last \\boxed{} against the label")
	}
}
