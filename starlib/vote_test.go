package starlib

import (
	"errors"
	"strings"
	"testing"

	"go.starlark.net/starlark"
)

func TestWinner(t *testing.T) {
	ballots := func(votes ...int) []ballot {
		out := make([]ballot, len(votes))
		for i, v := range votes {
			out[i] = ballot{key: starlark.MakeInt(i), votes: v}
		}
		return out
	}
	noPick := func(int) (int, error) { return 0, errors.New("pick called without a tie") }
	last := func(n int) (int, error) { return n - 1, nil }
	cases := []struct {
		votes []int
		pick  func(int) (int, error)
		want  int
	}{
		{[]int{1, 3, 2}, noPick, 1},
		{[]int{5}, noPick, 0},
		{[]int{2, 1, 2, 2}, last, 3}, // ties among 0, 2, 3: pick chooses among them in order
		{[]int{1, 1}, func(int) (int, error) { return 0, nil }, 0},
	}
	for _, c := range cases {
		got, err := winner(ballots(c.votes...), c.pick)
		if err != nil || got != c.want {
			t.Errorf("winner(%v) = %d, %v; want %d", c.votes, got, err, c.want)
		}
	}
}

func TestVoteScript(t *testing.T) {
	header := `
load("@slimen//vote.star", "majority", "counts")
load("@slimen//answers.star", "normalize")`
	runScriptCases(t, header, []scriptCase{
		{src: `got = majority(["4", "5", "4", None, None, None])`, want: `"4"`},
		{src: `got = majority([None, None])`, want: "None"},
		{src: `got = majority([])`, want: "None"},
		{src: `got = majority((3, 3, 1))`, want: "3"},
		{src: `got = majority(["0.50", "0.5", "7"], key = normalize)`, want: `"0.50"`},
		{src: `got = majority(["1.5", "1.50", "2", "2"], key = None)`, want: `"2"`},
		{src: `got = counts(["b", "a", "b", None])`, want: `{"b": 2, "a": 1}`},
		{src: `got = counts(["1.0", "1", "2"], key = normalize)`, want: `{"1": 2, "2": 1}`},
		{src: `got = majority([[1], [1]])`, wantErr: "vote.majority: element 0: unhashable type: list"},
		{src: `got = majority([1, 2], key = lambda x: 1 // 0)`, wantErr: "vote.majority: key of element 0:"},
		{src: `got = majority(5)`, wantErr: "vote.majority: for parameter values: got int, want iterable"},
		{src: `got = counts(["a"], key = 3)`, wantErr: `vote.counts: for parameter "key": got int, want callable`},
	})
}

// A tie is broken by the thread's generator: the same seed picks the same answer, and across
// seeds every tied answer wins sometimes.
func TestMajorityTieBreak(t *testing.T) {
	src := `
load("@slimen//vote.star", "majority")
got = [majority(["a", "b", "c", "a", "b", "c"]) for _ in range(8)]
`
	winners := map[string]bool{}
	for seed := int64(0); seed < 16; seed++ {
		g1, err := exec(t, src, seed)
		if err != nil {
			t.Fatal(err)
		}
		g2, _ := exec(t, src, seed)
		if g1["got"].String() != g2["got"].String() {
			t.Errorf("seed %d: %s then %s", seed, g1["got"], g2["got"])
		}
		for v := range starlark.Elements(g1["got"].(*starlark.List)) {
			winners[v.String()] = true
		}
	}
	if len(winners) != 3 {
		t.Errorf("tie winners over 16 seeds: %v, want all of a, b, c", winners)
	}

	if _, err := exec(t, `load("@slimen//vote.star", "majority")`+"\nx = majority([1, 1, 2])", -1); err != nil {
		t.Errorf("majority without a tie needs no generator, but: %v", err)
	}
	_, err := exec(t, `load("@slimen//vote.star", "majority")`+"\nx = majority([1, 2])", -1)
	want := "vote.majority: 2 answers tie and this thread has no random generator"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("tie without a generator: error = %v, want one containing %q", err, want)
	}
}
