package tiny

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/slimen/slimen/host/synthetic"
)

// Pretraining is deterministic across runs and thread counts, learns, and leaves no optimizer
// state behind.
func TestPretrainDeterministic(t *testing.T) {
	a := synthetic.Arith{Seed: 3, Difficulty: 1}
	var snaps [][][]float32
	for _, threads := range []int{1, 2} {
		e := newSmall(t, threads)
		var losses []float64
		err := Pretrain(ctx, e, func(i int) Example { return ArithExample(a, i) }, PretrainOptions{
			Steps: 12, BatchSize: 8, LR: 1e-2, WarmupSteps: 2,
			OnStep: func(_ int, loss float64) error { losses = append(losses, loss); return nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		if losses[len(losses)-1] > losses[0]-0.5 {
			t.Fatalf("loss went from %.3f to %.3f", losses[0], losses[len(losses)-1])
		}
		if e.opt.step != 0 {
			t.Fatal("optimizer state survived pretraining")
		}
		snaps = append(snaps, snapshot(e))
	}
	if !cmp.Equal(snaps[0], snaps[1]) {
		t.Fatal("pretraining with 1 and 2 threads gave different weights")
	}
}

func TestArithExample(t *testing.T) {
	a := synthetic.Arith{Seed: 1, Difficulty: 2}
	withAnswers, right, shown := 0, 0, 0
	for i := range 400 {
		ex := ArithExample(a, i)
		p := a.Problem(i)
		if ex.Response != p.Answer() || !strings.HasPrefix(ex.Prompt, p.Prompt) {
			t.Fatalf("example %d: %+v for problem %+v", i, ex, p)
		}
		if rest, ok := strings.CutPrefix(ex.Prompt, p.Prompt+" Answers: "); ok {
			withAnswers++
			for _, c := range strings.Split(strings.TrimSuffix(rest, "."), ", ") {
				shown++
				if c == p.Label {
					right++
				}
			}
		}
		if ex != ArithExample(a, i) {
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
}
