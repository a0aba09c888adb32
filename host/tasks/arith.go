package tasks

// The built-in task source synthetic:arith: short arithmetic word problems whose answers are
// integers, written as \boxed{N}. Problem i of a seed is a pure function of (seed, difficulty, i),
// so runs and pretraining corpora are reproducible and an eval split is just another seed.

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// Problem is one task: a prompt, its integer answer as a string, and a stable id.
type Problem struct {
	ID     string
	Prompt string
	Label  string
}

// Answer is the response a perfect model gives to a problem: the label in \boxed{}.
func (p Problem) Answer() string { return `\boxed{` + p.Label + `}` }

// Arith generates arithmetic word problems. Difficulty (1..4) sets the size of the numbers and the
// operations: 1: a+b with one-digit numbers; 2: + and − up to 20; 3: + and − up to 99 and × of
// one-digit numbers; 4: as 3 with a third operand.
type Arith struct {
	Seed       uint64
	Difficulty int
}

// MaxDifficulty is the highest difficulty Arith knows.
const MaxDifficulty = 4

var (
	names = []string{"Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal"}
	items = []string{"pens", "eggs", "cats", "cards", "coins", "books"}
)

// Problem returns problem i.
func (a Arith) Problem(i int) Problem {
	p, _ := a.ProblemExpr(i)
	return p
}

// ProblemExpr returns problem i and the calculator expression of its answer ("19+11"), as
// Calc.Problem does.
func (a Arith) ProblemExpr(i int) (Problem, string) {
	d := min(max(a.Difficulty, 1), MaxDifficulty)
	r := rand.New(rand.NewPCG(a.Seed, uint64(i)*0x9E3779B97F4A7C15+uint64(d)))
	name, item := names[r.IntN(len(names))], items[r.IntN(len(items))]
	hi := map[int]int{1: 9, 2: 20, 3: 99, 4: 99}[d]
	x, y := r.IntN(hi+1), r.IntN(hi+1)
	op := '+'
	switch {
	case d >= 3 && r.IntN(3) == 0:
		op = '*'
		x, y = 2+r.IntN(8), 2+r.IntN(8)
	case d >= 2 && r.IntN(2) == 0:
		op = '-'
		if y > x {
			x, y = y, x
		}
	}
	var prompt string
	var ans int
	expr := fmt.Sprintf("%d%c%d", x, op, y)
	switch op {
	case '+':
		prompt, ans = fmt.Sprintf("%s has %d %s and gets %d more.", name, x, item, y), x+y
	case '-':
		prompt, ans = fmt.Sprintf("%s has %d %s and gives away %d.", name, x, item, y), x-y
	case '*':
		prompt, ans = fmt.Sprintf("%s has %d bags of %d %s.", name, x, y, item), x*y
	}
	if d >= 4 {
		z := r.IntN(10)
		if r.IntN(2) == 0 || z > ans {
			prompt, ans, expr = prompt+fmt.Sprintf(" Then gets %d.", z), ans+z, fmt.Sprintf("%s+%d", expr, z)
		} else {
			prompt, ans, expr = prompt+fmt.Sprintf(" Then loses %d.", z), ans-z, fmt.Sprintf("%s-%d", expr, z)
		}
	}
	prompt += " How many " + item + "?"
	return Problem{
		ID:     fmt.Sprintf("arith-d%d-s%d-%d", d, a.Seed, i),
		Prompt: prompt,
		Label:  strconv.Itoa(ans),
	}, expr
}

// ParseSpec reads a data path of the form "synthetic:arith" or
// "synthetic:arith?difficulty=3&seed=7". ok is false when path is not a synthetic source. The
// seed defaults to def.
func ParseSpec(path string, def uint64) (a Arith, ok bool, err error) {
	rest, found := strings.CutPrefix(path, "synthetic:")
	if !found {
		return Arith{}, false, nil
	}
	name, query, _ := strings.Cut(rest, "?")
	if name != "arith" {
		if slices.Contains(SyntheticNames, name) {
			// A family this does not read (the callers that take arith only: pretrain, export's
			// sft), not an unknown one.
			return Arith{}, true, fmt.Errorf("synthetic:%s is not read here: this takes synthetic:arith[?difficulty=N&seed=S]", name)
		}
		return Arith{}, true, fmt.Errorf("unknown synthetic task %q (known: %s)", name, strings.Join(SyntheticNames, ", "))
	}
	a = Arith{Seed: def, Difficulty: 2}
	if query == "" {
		return a, true, nil
	}
	for _, kv := range strings.Split(query, "&") {
		k, v, _ := strings.Cut(kv, "=")
		n, perr := strconv.ParseUint(v, 10, 64)
		if perr != nil {
			return Arith{}, true, fmt.Errorf("%s: %s=%q is not a non-negative integer", path, k, v)
		}
		switch k {
		case "difficulty":
			if n < 1 || n > MaxDifficulty {
				return Arith{}, true, fmt.Errorf("%s: difficulty must be 1..%d", path, MaxDifficulty)
			}
			a.Difficulty = int(n)
		case "seed":
			a.Seed = n
		default:
			return Arith{}, true, fmt.Errorf("%s: unknown parameter %q (known: difficulty, seed)", path, k)
		}
	}
	return a, true, nil
}
