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

// exp2Bits[j] holds the bits of 2^(j/32), correctly rounded.
var exp2Bits = [32]uint64{
	0x3ff0000000000000, // 2^(0/32)
	0x3ff059b0d3158574, // 2^(1/32)
	0x3ff0b5586cf9890f, // 2^(2/32)
	0x3ff11301d0125b51, // 2^(3/32)
	0x3ff172b83c7d517b, // 2^(4/32)
	0x3ff1d4873168b9aa, // 2^(5/32)
	0x3ff2387a6e756238, // 2^(6/32)
	0x3ff29e9df51fdee1, // 2^(7/32)
	0x3ff306fe0a31b715, // 2^(8/32)
	0x3ff371a7373aa9cb, // 2^(9/32)
	0x3ff3dea64c123422, // 2^(10/32)
	0x3ff44e086061892d, // 2^(11/32)
	0x3ff4bfdad5362a27, // 2^(12/32)
	0x3ff5342b569d4f82, // 2^(13/32)
	0x3ff5ab07dd485429, // 2^(14/32)
	0x3ff6247eb03a5585, // 2^(15/32)
	0x3ff6a09e667f3bcd, // 2^(16/32)
	0x3ff71f75e8ec5f74, // 2^(17/32)
	0x3ff7a11473eb0187, // 2^(18/32)
	0x3ff82589994cce13, // 2^(19/32)
	0x3ff8ace5422aa0db, // 2^(20/32)
	0x3ff93737b0cdc5e5, // 2^(21/32)
	0x3ff9c49182a3f090, // 2^(22/32)
	0x3ffa5503b23e255d, // 2^(23/32)
	0x3ffae89f995ad3ad, // 2^(24/32)
	0x3ffb7f76f2fb5e47, // 2^(25/32)
	0x3ffc199bdd85529c, // 2^(26/32)
	0x3ffcb720dcef9069, // 2^(27/32)
	0x3ffd5818dcfba487, // 2^(28/32)
	0x3ffdfc97337b9b5f, // 2^(29/32)
	0x3ffea4afa2a490da, // 2^(30/32)
	0x3fff50765b6e4540, // 2^(31/32)
}

// exp64 returns e^x to within a few ulps.
func exp64(x float64) float64 {
	switch {
	case x != x:
		return x
	case x > 709.78:
		return math.Inf(1)
	case x < -745.2:
		return 0
	}
	// x = (32k + j)·ln2/32 + r with |r| ≤ ln2/64, so e^x = 2^k · 2^(j/32) · e^r, and e^r is its
	// Taylor polynomial of degree 6 (the next term is below 1e-17). ln2Hi has enough trailing zero
	// bits that n·ln2Hi/32 is exact.
	n := math.Floor(float64(x*(32*log2e)) + 0.5)
	r := float64(x-float64(n*(ln2Hi/32))) - float64(n*(ln2Lo/32))
	p := float64(r * (1.0 / 720))
	p = float64(r * float64(p+1.0/120))
	p = float64(r * float64(p+1.0/24))
	p = float64(r * float64(p+1.0/6))
	p = float64(r * float64(p+0.5))
	p = float64(r * float64(p+1))
	ni := int(n)
	y := math.Float64frombits(exp2Bits[ni&31]) * (p + 1)
	k := ni >> 5 // floor division: ni&31 is the matching non-negative remainder
	if k >= -1021 && k <= 1023 {
		return y * math.Float64frombits(uint64(k+1023)<<52)
	}
	return math.Ldexp(y, k)
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
func sigmoid64(x float64) float64 { return sigmoidExp(x, exp64(-math.Abs(x))) }

// sigmoidExp is sigmoid64(x) given e = exp64(−|x|), for callers that compute their exponentials
// with expSlice.
func sigmoidExp(x, e float64) float64 {
	if x >= 0 {
		return 1 / (1 + e)
	}
	return e / (1 + e)
}

// expBuf returns a slice of n float64s, buf's when it is long enough.
func expBuf(buf []float64, n int) []float64 {
	if n <= len(buf) {
		return buf[:n]
	}
	return make([]float64, n)
}
