package tiny

import (
	"slices"
	"testing"

	"github.com/slimen/slimen/host/tasks"
)

// builtin:tiny-arith is embedded, has the documented architecture and is the imperfect base model
// reinforcement learning starts from: 20–50% exact match at temperature 1 on held-out problems
// (docs/tiny.md; the full 500-problem figure is 36.0%).
func TestBuiltinTinyArith(t *testing.T) {
	if !slices.Contains(Builtins(), "tiny-arith") {
		t.Fatalf("builtins %v lack tiny-arith", Builtins())
	}
	e, err := Open("builtin:tiny-arith", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := e.Config(), DefaultConfig().withDefaults(newCharTokenizer().VocabSize()); got != want {
		t.Fatalf("config %+v, want DefaultConfig %+v", got, want)
	}
	if e.opt.step != 0 {
		t.Fatal("the base model carries optimizer state")
	}
	acc, err := tasks.ArithAccuracy(ctx, e, tasks.Arith{Seed: 1001, Difficulty: 2}, 200, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	if acc < 0.2 || acc > 0.5 {
		t.Fatalf("held-out accuracy at temperature 1 is %.1f%%, want 20–50%%", 100*acc)
	}
	t.Logf("held-out accuracy at temperature 1 on 200 problems: %.1f%%", 100*acc)
}
