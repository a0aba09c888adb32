package tiny

import "math"

// logSumExp returns log Σ exp(z).
func logSumExp[T Float](z []T) float64 {
	mx := math.Inf(-1)
	for _, v := range z {
		mx = max(mx, float64(v))
	}
	if math.IsInf(mx, 0) || mx != mx {
		return mx
	}
	var buf [256]float64
	e := expShifted(buf[:], z, mx)
	s := 0.0
	for _, v := range e {
		s += v
	}
	return mx + log64(s)
}

// expShifted returns exp64(z[i] − shift) for each i, in buf when it is long enough.
func expShifted[T Float](buf []float64, z []T, shift float64) []float64 {
	e := expBuf(buf, len(z))
	for i, v := range z {
		e[i] = float64(v) - shift
	}
	expSlice(e, e)
	return e
}

// tokenLogprobs returns, for each row of logits (rows×vocab), the log-probability of its target
// token and the entropy of the row's distribution, both at temperature 1.
func tokenLogprobs[T Float](threads int, logits []T, targets []int32, vocab int) (logp, ent []float64) {
	rows := len(targets)
	logp, ent = make([]float64, rows), make([]float64, rows)
	parallelFor(threads, rows, 16, func(lo, hi int) {
		var buf [256]float64
		for r := lo; r < hi; r++ {
			z := logits[r*vocab : (r+1)*vocab]
			lse := logSumExp(z)
			logp[r] = float64(z[targets[r]]) - lse
			p := expShifted(buf[:], z, lse)
			h := 0.0
			for i, v := range z {
				lp := float64(v) - lse
				h -= float64(p[i] * lp)
			}
			ent[r] = h
		}
	})
	return logp, ent
}

// logitsGrad sets dlogits to the gradient of Σ_r dlogp[r]·logp[r] + dent[r]·H[r]:
// ∂logp/∂z = onehot − p and ∂H/∂z = −p(log p + H).
func logitsGrad[T Float](threads int, dlogits, logits []T, targets []int32, vocab int, dlogp, dent []float64) {
	parallelFor(threads, len(targets), 16, func(lo, hi int) {
		var buf [256]float64
		for r := lo; r < hi; r++ {
			z, dz := logits[r*vocab:(r+1)*vocab], dlogits[r*vocab:(r+1)*vocab]
			lse := logSumExp(z)
			ps := expShifted(buf[:], z, lse)
			h := 0.0
			if dent[r] != 0 {
				for i, v := range z {
					lp := float64(v) - lse
					h -= float64(ps[i] * lp)
				}
			}
			for i, v := range z {
				lp := float64(v) - lse
				p := ps[i]
				g := -dlogp[r] * p
				if dent[r] != 0 {
					g -= dent[r] * float64(p*float64(lp+h))
				}
				dz[i] = T(g)
			}
			dz[targets[r]] += T(dlogp[r])
		}
	})
}
