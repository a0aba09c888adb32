package plot

import (
	"math"
	"strconv"

	gplot "gonum.org/v1/plot"
)

// niceTicks puts about six labelled ticks on round numbers (1, 2, 2.5 or 5 times a power of ten),
// with as many decimals as the spacing needs; steps get whole numbers only.
type niceTicks struct{ integer bool }

func (t niceTicks) Ticks(lo, hi float64) []gplot.Tick {
	if !(hi > lo) {
		return []gplot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'g', 4, 64)}}
	}
	raw := (hi - lo) / 6
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	step, decimals := 10*mag, 0
	for _, m := range []float64{1, 2, 2.5, 5} {
		if t.integer && m == 2.5 && mag < 10 {
			continue // 2.5 steps would put ticks between whole steps
		}
		if m*mag >= raw {
			step = m * mag
			if m == 2.5 {
				decimals = 1
			}
			break
		}
	}
	if t.integer {
		step = math.Max(step, 1)
	}
	decimals = max(0, decimals-int(math.Floor(math.Log10(step))))
	var ticks []gplot.Tick
	for i := math.Ceil(lo / step); i*step <= hi+step*1e-9; i++ {
		v := i * step
		label := strconv.FormatFloat(v, 'f', decimals, 64)
		if v == 0 {
			label = "0" // not "-0" from rounding
		}
		ticks = append(ticks, gplot.Tick{Value: v, Label: label})
	}
	return ticks
}
