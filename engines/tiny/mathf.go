package tiny

import "math"

// Float is the element type of the model's arithmetic: float32 in the engine, float64 in the
// gradient checks, which instantiate the same code at higher precision.
type Float interface{ ~float32 | ~float64 }

// The model uses its own exp and log instead of package math's: math.Exp takes an FMA path on
// amd64 CPUs that have one, so a checkpoint trained on one machine would differ in its last bits
// from the same run on another. These are written with explicit float64 conversions, which the Go
// spec guarantees are not fused, so they round the same way on every platform.

const (
	ln2Hi = 6.93147180369123816490e-01
	ln2Lo = 1.90821492927058770002e-10
	log2e = 1.44269504088896338700e+00
)

// invFact[i] = 1/i!, the Taylor coefficients of exp.
var invFact = func() [14]float64 {
	var f [14]float64
	f[0] = 1
	for i := 1; i < len(f); i++ {
		f[i] = f[i-1] / float64(i)
	}
	return f
}()

// exp64 returns e^x to within a couple of ulps.
func exp64(x float64) float64 {
	switch {
	case x != x:
		return x
	case x > 709.78:
		return math.Inf(1)
	case x < -745.2:
		return 0
	}
	// x = k·ln2 + r with |r| ≤ ln2/2; e^r by its Taylor series (the degree-13 term is ~1e-17).
	k := math.Floor(float64(x*log2e) + 0.5)
	r := float64(x-float64(k*ln2Hi)) - float64(k*ln2Lo)
	p := invFact[13]
	for i := 12; i >= 0; i-- {
		p = float64(p*r) + invFact[i]
	}
	return math.Ldexp(p, int(k))
}

// log64 returns the natural logarithm of x to within a couple of ulps.
func log64(x float64) float64 {
	switch {
	case x != x || x < 0:
		return math.NaN()
	case x == 0:
		return math.Inf(-1)
	case math.IsInf(x, 1):
		return x
	}
	f, e := math.Frexp(x) // x = f·2^e, f in [0.5, 1)
	if f < math.Sqrt2/2 {
		f *= 2
		e--
	}
	// log f = 2·atanh(s) = 2(s + s³/3 + s⁵/5 + …) with s = (f−1)/(f+1), |s| ≤ 0.172.
	s := (f - 1) / (f + 1)
	s2 := float64(s * s)
	p := 1.0 / 23
	for i := 21; i >= 1; i -= 2 {
		p = float64(p*s2) + 1/float64(i)
	}
	fe := float64(e)
	return float64(fe*ln2Hi) + (float64(2*s*p) + float64(fe*ln2Lo))
}

// sigmoid64 is the logistic function, written so it never overflows.
func sigmoid64(x float64) float64 {
	if x >= 0 {
		return 1 / (1 + exp64(-x))
	}
	z := exp64(x)
	return z / (1 + z)
}
