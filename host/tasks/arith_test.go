package tasks

import (
	"fmt"
	"strconv"
	"testing"
)

func TestArithDeterministicAndValid(t *testing.T) {
	for d := 1; d <= MaxDifficulty; d++ {
		a := Arith{Seed: 3, Difficulty: d}
		seen := map[string]bool{}
		for i := 0; i < 500; i++ {
			p, q := a.Problem(i), a.Problem(i)
			if p != q {
				t.Fatalf("problem %d not deterministic: %+v vs %+v", i, p, q)
			}
			n, err := strconv.Atoi(p.Label)
			if err != nil || n < 0 {
				t.Fatalf("d%d problem %d: label %q is not a non-negative integer", d, i, p.Label)
			}
			seen[p.Prompt] = true
		}
		if len(seen) < 100 {
			t.Errorf("difficulty %d: only %d distinct prompts in 500", d, len(seen))
		}
	}
	if (Arith{Seed: 1, Difficulty: 2}).Problem(0) == (Arith{Seed: 2, Difficulty: 2}).Problem(0) {
		t.Error("different seeds gave the same problem")
	}
}

func TestArithAnswers(t *testing.T) {
	// Spot-check that labels are the arithmetic the prompt describes.
	a := Arith{Seed: 1, Difficulty: 3}
	for i := 0; i < 50; i++ {
		p := a.Problem(i)
		var name, item string
		var x, y int
		if n, _ := fmt.Sscanf(p.Prompt, "%s has %d %s and gets %d more.", &name, &x, &item, &y); n == 4 {
			if strconv.Itoa(x+y) != p.Label {
				t.Fatalf("%q: label %s", p.Prompt, p.Label)
			}
		}
	}
}

func TestParseSpec(t *testing.T) {
	a, ok, err := ParseSpec("synthetic:arith?difficulty=3&seed=7", 1)
	if !ok || err != nil || a.Difficulty != 3 || a.Seed != 7 {
		t.Fatalf("got %+v %v %v", a, ok, err)
	}
	if _, ok, _ := ParseSpec("data.jsonl", 1); ok {
		t.Fatal("a file path was taken as synthetic")
	}
	for _, bad := range []string{"synthetic:nope", "synthetic:arith?difficulty=9", "synthetic:arith?x=1", "synthetic:arith?seed=-1"} {
		if _, _, err := ParseSpec(bad, 1); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
}
