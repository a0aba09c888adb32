package starlib

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestStdDev(t *testing.T) {
	xs := []float64{1, 2, 3, 4}
	if got := mean(xs); got != 2.5 {
		t.Errorf("mean = %v, want 2.5", got)
	}
	cases := []struct {
		xs   []float64
		ddof int
		want float64
	}{
		{xs, 1, math.Sqrt(5.0 / 3)},
		{xs, 0, math.Sqrt(1.25)},
		{[]float64{7}, 1, 0},
		{[]float64{7}, 0, 0},
		{[]float64{3, 3, 3}, 1, 0},
	}
	for _, c := range cases {
		if got := stdDev(c.xs, c.ddof); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("stdDev(%v, %d) = %v, want %v", c.xs, c.ddof, got, c.want)
		}
	}
}

func TestZscores(t *testing.T) {
	approx := cmpopts.EquateApprox(0, 1e-9)
	// GRPO form: unbiased std of [0, 1] is √0.5.
	s := math.Sqrt(0.5) + 1e-6
	if diff := cmp.Diff([]float64{-0.5 / s, 0.5 / s}, zscores([]float64{0, 1}, 1e-6, 1), approx); diff != "" {
		t.Errorf("zscores unbiased (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]float64{-1, 1}, zscores([]float64{0, 1}, 0, 0), approx); diff != "" {
		t.Errorf("zscores population (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]float64{0, 0, 0}, zscores([]float64{2, 2, 2}, 1e-6, 1)); diff != "" {
		t.Errorf("zscores of equal values (-want +got):\n%s", diff)
	}
}

func TestRanks(t *testing.T) {
	cases := []struct {
		xs   []float64
		desc bool
		want []float64
	}{
		{[]float64{5, 7, 7}, false, []float64{1, 2.5, 2.5}},
		{[]float64{30, 10, 20}, false, []float64{3, 1, 2}},
		{[]float64{30, 10, 20}, true, []float64{1, 3, 2}},
		{[]float64{1, 1, 1, 1}, false, []float64{2.5, 2.5, 2.5, 2.5}},
		{[]float64{4, 2, 4, 2, 9}, true, []float64{2.5, 4.5, 2.5, 4.5, 1}},
		{nil, false, []float64{}},
	}
	for _, c := range cases {
		if diff := cmp.Diff(c.want, ranks(c.xs, c.desc)); diff != "" {
			t.Errorf("ranks(%v, %v) (-want +got):\n%s", c.xs, c.desc, diff)
		}
	}
}

func TestStatsScript(t *testing.T) {
	header := `load("@slimen//stats.star", "mean", "std", "pstd", "zscore", "rank", "clip", "ema")`
	runScriptCases(t, header, []scriptCase{
		{src: `got = mean([1, 2, 3.5, 5.5])`, want: "3.0"},
		{src: `got = mean((1, 2))`, want: "1.5"},
		{src: `got = [std([1]), std([2, 4]), pstd([2, 4])]`, want: "[0.0, 1.4142135623730951, 1.0]"},
		{src: `got = zscore([1, 3], eps = 0, population = True)`, want: "[-1.0, 1.0]"},
		{src: `got = zscore([])`, want: "[]"},
		{src: `got = rank([0.5, 0.9, 0.5])`, want: "[1.5, 3.0, 1.5]"},
		{src: `got = rank([0.5, 0.9, 0.5], reverse = True)`, want: "[2.5, 1.0, 2.5]"},
		{src: `got = [clip(7, -5, 5), clip(-7, -5, 5), clip(0.5, 0, 1)]`, want: "[5.0, -5.0, 0.5]"},
		{src: `got = ema(0.0, 1.0, 0.95)`, want: "0.050000000000000044"},
		{src: `got = ema(2, 4, 1)`, want: "2.0"},
		{src: `got = mean([])`, wantErr: "stats.mean: the mean of no values is undefined"},
		{src: `got = std([])`, wantErr: "stats.std: the deviation of no values is undefined"},
		{src: `got = pstd([])`, wantErr: "stats.pstd: the deviation of no values is undefined"},
		{src: `got = mean([1, "2"])`, wantErr: "stats.mean: element 1 is string, want int or float"},
		{src: `got = rank([1, float("nan")])`, wantErr: "stats.rank: element 1 is NaN, want a finite number"},
		{src: `got = mean(3)`, wantErr: "stats.mean: for parameter xs: got int, want iterable"},
		{src: `got = clip(1, 2, 0)`, wantErr: "stats.clip: lo=2 is greater than hi=0"},
		{src: `got = clip("1", 0, 2)`, wantErr: "stats.clip: for parameter x: got string, want int or float"},
		{src: `got = ema(0, 1, 1.5)`, wantErr: "stats.ema: for parameter momentum: got 1.5, want a weight in [0, 1]"},
		{src: `got = zscore([1], eps = -1)`, wantErr: "stats.zscore: for parameter eps: got -1, want ≥ 0"},
	})
}
