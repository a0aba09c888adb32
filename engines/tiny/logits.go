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
	s := 0.0
	for _, v := range z {
		s += exp64(float64(v) - mx)
	}
	return mx + log64(s)
}

// tokenLogprobs returns, for each row of logits (rows×vocab), the log-probability of its target
// token and the entropy of the row's distribution, both at temperature 1.
func tokenLogprobs[T Float](threads int, logits []T, targets []int32, vocab int) (logp, ent []float64) {
	rows := len(targets)
	logp, ent = make([]float64, rows), make([]float64, rows)
	parallelFor(threads, rows, 16, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			z := logits[r*vocab : (r+1)*vocab]
			lse := logSumExp(z)
			logp[r] = float64(z[targets[r]]) - lse
			h := 0.0
			for _, v := range z {
				lp := float64(v) - lse
				h -= float64(exp64(lp) * lp)
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
		for r := lo; r < hi; r++ {
			z, dz := logits[r*vocab:(r+1)*vocab], dlogits[r*vocab:(r+1)*vocab]
			lse := logSumExp(z)
			h := 0.0
			if dent[r] != 0 {
				for _, v := range z {
					lp := float64(v) - lse
					h -= float64(exp64(lp) * lp)
				}
			}
			for i, v := range z {
				lp := float64(v) - lse
				p := exp64(lp)
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
