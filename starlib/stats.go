package starlib

import (
	"fmt"
	"math"
	"sort"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// Stats is @slimen//stats.star: the small statistics reward shaping needs (group baselines,
// z-scores, ranks, running averages).
var Stats = &starlarkstruct.Module{
	Name: "stats",
	Members: starlark.StringDict{
		"mean":   starlark.NewBuiltin("stats.mean", statsMean),
		"std":    starlark.NewBuiltin("stats.std", statsStd),
		"pstd":   starlark.NewBuiltin("stats.pstd", statsPstd),
		"zscore": starlark.NewBuiltin("stats.zscore", statsZscore),
		"rank":   starlark.NewBuiltin("stats.rank", statsRank),
		"clip":   starlark.NewBuiltin("stats.clip", statsClip),
		"ema":    starlark.NewBuiltin("stats.ema", statsEma),
	},
}

func mean(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// stdDev is the standard deviation with ddof subtracted from the count (1: unbiased, as GRPO's
// group normalisation uses; 0: population). Fewer than ddof+1 values give 0, not NaN, so a group
// of one sample normalises to zero advantage.
func stdDev(xs []float64, ddof int) float64 {
	if len(xs) <= ddof {
		return 0
	}
	m := mean(xs)
	ss := 0.0
	for _, x := range xs {
		ss += (x - m) * (x - m)
	}
	return math.Sqrt(ss / float64(len(xs)-ddof))
}

// zscores returns (x − mean)/(std + eps) for each x, the GRPO advantage form.
func zscores(xs []float64, eps float64, ddof int) []float64 {
	out := make([]float64, len(xs))
	if len(xs) == 0 {
		return out
	}
	m, sd := mean(xs), stdDev(xs, ddof)
	for i, x := range xs {
		out[i] = (x - m) / (sd + eps)
	}
	return out
}

// ranks returns 1-based ranks, smallest first (largest first when descending); tied values share
// the average of the ranks they span, so [5, 7, 7] ranks [1, 2.5, 2.5].
func ranks(xs []float64, descending bool) []float64 {
	order := make([]int, len(xs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		if descending {
			return xs[order[a]] > xs[order[b]]
		}
		return xs[order[a]] < xs[order[b]]
	})
	out := make([]float64, len(xs))
	for i := 0; i < len(order); {
		j := i
		for j+1 < len(order) && xs[order[j+1]] == xs[order[i]] {
			j++
		}
		avg := float64(i+j)/2 + 1
		for k := i; k <= j; k++ {
			out[order[k]] = avg
		}
		i = j + 1
	}
	return out
}

func statsList(b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) ([]float64, error) {
	var xs starlark.Iterable
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "xs", &xs); err != nil {
		return nil, err
	}
	return floats(b.Name(), xs)
}

func statsMean(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	xs, err := statsList(b, args, kwargs)
	if err != nil {
		return nil, err
	}
	if len(xs) == 0 {
		return nil, fmt.Errorf("%s: the mean of no values is undefined; check the list is not empty first", b.Name())
	}
	return starlark.Float(mean(xs)), nil
}

func statsStd(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	return statsDeviation(b, args, kwargs, 1)
}

func statsPstd(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	return statsDeviation(b, args, kwargs, 0)
}

func statsDeviation(b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple, ddof int) (starlark.Value, error) {
	xs, err := statsList(b, args, kwargs)
	if err != nil {
		return nil, err
	}
	if len(xs) == 0 {
		return nil, fmt.Errorf("%s: the deviation of no values is undefined; check the list is not empty first", b.Name())
	}
	return starlark.Float(stdDev(xs, ddof)), nil
}

// statsZscore uses the unbiased std by default, like the host's GRPO normalisation;
// population=True gives the population form some reward recipes use.
func statsZscore(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		xs         starlark.Iterable
		eps        = number(1e-6)
		population bool
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "xs", &xs, "eps?", &eps, "population?", &population); err != nil {
		return nil, err
	}
	if eps < 0 {
		return nil, fmt.Errorf("%s: for parameter eps: got %g, want ≥ 0", b.Name(), float64(eps))
	}
	vals, err := floats(b.Name(), xs)
	if err != nil {
		return nil, err
	}
	ddof := 1
	if population {
		ddof = 0
	}
	return floatList(zscores(vals, float64(eps), ddof)), nil
}

func statsRank(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		xs      starlark.Iterable
		reverse bool
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "xs", &xs, "reverse?", &reverse); err != nil {
		return nil, err
	}
	vals, err := floats(b.Name(), xs)
	if err != nil {
		return nil, err
	}
	return floatList(ranks(vals, reverse)), nil
}

func statsClip(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x, lo, hi number
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "x", &x, "lo", &lo, "hi", &hi); err != nil {
		return nil, err
	}
	if lo > hi {
		return nil, fmt.Errorf("%s: lo=%g is greater than hi=%g", b.Name(), float64(lo), float64(hi))
	}
	return starlark.Float(math.Min(math.Max(float64(x), float64(lo)), float64(hi))), nil
}

// statsEma returns momentum·prev + (1 − momentum)·x: momentum is the weight of the past.
func statsEma(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var prev, x, momentum number
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "prev", &prev, "x", &x, "momentum", &momentum); err != nil {
		return nil, err
	}
	if momentum < 0 || momentum > 1 {
		return nil, fmt.Errorf("%s: for parameter momentum: got %g, want a weight in [0, 1]", b.Name(), float64(momentum))
	}
	return starlark.Float(float64(momentum)*float64(prev) + (1-float64(momentum))*float64(x)), nil
}
