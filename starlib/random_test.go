package starlib

import (
	"strings"
	"testing"

	"go.starlark.net/starlark"
)

const drawAll = `
load("@slimen//random.star", "random", "uniform", "gauss", "randint", "choice", "shuffle", "sample")
got = [random(), uniform(-2, 2), gauss(), gauss(10, 0.5), randint(1, 1000000), choice(["a", "b", "c", "d"]),
       shuffle(range(10)), sample(("p", "q", "r", "s", "t"), 3)]
`

func TestRandomDeterministic(t *testing.T) {
	draw := func(seed int64) string {
		g, err := exec(t, drawAll, seed)
		if err != nil {
			t.Fatal(err)
		}
		return g["got"].String()
	}
	a, b, c := draw(7), draw(7), draw(8)
	if a != b {
		t.Errorf("same seed, different draws:\n%s\n%s", a, b)
	}
	if a == c {
		t.Errorf("seeds 7 and 8 drew the same: %s", a)
	}
}

func TestRandomRanges(t *testing.T) {
	src := `
load("@slimen//random.star", "random", "uniform", "randint", "sample", "shuffle")
ints = [randint(-1, 1) for _ in range(3000)]
floats = [random() for _ in range(1000)]
uni = [uniform(5, 6) for _ in range(1000)]
ok_ints = sorted(set(ints)) == [-1, 0, 1]
ok_floats = min(floats) >= 0 and max(floats) < 1
ok_uni = min(uni) >= 5 and max(uni) <= 6
s = sample(range(100), 100)
ok_sample = sorted(s) == list(range(100))
frozen = (3, 1, 2)
ok_shuffle = sorted(shuffle(frozen)) == [1, 2, 3] and frozen == (3, 1, 2)
got = [ok_ints, ok_floats, ok_uni, ok_sample, ok_shuffle, randint(4, 4), sample([1, 2], 0)]
`
	if got := mustExec(t, src, "got"); got != "[True, True, True, True, True, 4, []]" {
		t.Errorf("got %s", got)
	}
}

func TestRandomErrors(t *testing.T) {
	header := `load("@slimen//random.star", "random", "gauss", "randint", "choice", "sample", "shuffle")`
	runScriptCases(t, header, []scriptCase{
		{src: `got = randint(3, 1)`, wantErr: "random.randint: empty range: a=3 is greater than b=1"},
		{src: `got = randint(1, 2.5)`, wantErr: "random.randint: for parameter b: got float, want int"},
		{src: `got = choice([])`, wantErr: "random.choice: cannot choose from an empty list"},
		{src: `got = choice(3)`, wantErr: "random.choice: for parameter seq: got int, want list, tuple or string"},
		{src: `got = sample([1], 2)`, wantErr: "random.sample: for parameter k: got 2, want 0 ≤ k ≤ 1"},
		{src: `got = gauss(0, -1)`, wantErr: "random.gauss: for parameter sigma: got -1, want ≥ 0"},
		{src: `got = random(1)`, wantErr: "random.random: got 1 arguments, want at most 0"},
		{src: `got = shuffle(None)`, wantErr: "random.shuffle: for parameter xs: got NoneType, want iterable"},
	})

	_, err := exec(t, `load("@slimen//random.star", "random")`+"\nx = random()", -1)
	want := "random.random: this thread has no random generator; random numbers are seeded per rollout"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("random() without a generator: error = %v, want one containing %q", err, want)
	}
}

func TestForkRandom(t *testing.T) {
	first := func(th *starlark.Thread) float64 {
		r, err := threadRandom(th, "test")
		if err != nil {
			t.Fatal(err)
		}
		return r.float64()
	}
	newParent := func() *starlark.Thread {
		p := new(starlark.Thread)
		SetRandom(p, 42)
		return p
	}
	child := func(p *starlark.Thread, i int) *starlark.Thread {
		c := new(starlark.Thread)
		ForkRandom(p, c, i)
		return c
	}

	p1, p2 := newParent(), newParent()
	c0, c1 := child(p1, 0), child(p1, 1)
	a0, a1 := first(c0), first(c1)
	if a0 == a1 {
		t.Error("children 0 and 1 drew the same number")
	}
	// The other parent forks child 1 first: children depend on their index, not on the order.
	if b1, b0 := first(child(p2, 1)), first(child(p2, 0)); a0 != b0 || a1 != b1 {
		t.Errorf("forked children are not reproducible: %v %v vs %v %v", a0, a1, b0, b1)
	}
	// Forking does not consume the parent's sequence.
	if first(p1) != first(newParent()) {
		t.Error("forking changed the parent's draws")
	}

	orphan := new(starlark.Thread)
	ForkRandom(new(starlark.Thread), orphan, 0)
	if _, err := threadRandom(orphan, "test"); err == nil {
		t.Error("a child of a parent without a generator got one")
	}
}

func TestTaskSeed(t *testing.T) {
	base := TaskSeed(1, 3, "task-7")
	// A golden value: a change here changes every seeded run, so make it on purpose only.
	if base != TaskSeed(1, 3, "task-7") {
		t.Fatal("TaskSeed is not a function of its inputs")
	}
	if golden := uint64(0x19fb2ce38fdb1637); base != golden {
		t.Errorf("TaskSeed(1, 3, task-7) = %#x, want %#x", base, golden)
	}
	for _, other := range []uint64{TaskSeed(2, 3, "task-7"), TaskSeed(1, 4, "task-7"), TaskSeed(1, 3, "task-8"), TaskSeed(1, 3, "")} {
		if other == base {
			t.Errorf("TaskSeed ignores an input: %#x", other)
		}
	}
}
