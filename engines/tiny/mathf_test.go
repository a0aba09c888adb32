package tiny

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestExpLogAccuracy(t *testing.T) {
	for x := -740.0; x < 709; x += 0.37 {
		got, want := exp64(x), math.Exp(x)
		if math.Abs(got-want) > 1e-15*want {
			t.Fatalf("exp64(%v) = %v, want %v", x, got, want)
		}
	}
	for _, x := range []float64{1e-300, 1e-10, 0.3, 0.7071, 0.99999, 1, 1.00001, 2, 3.5, 1e10, 1e300} {
		got, want := log64(x), math.Log(x)
		if math.Abs(got-want) > 4e-16*math.Max(1, math.Abs(want)) {
			t.Fatalf("log64(%v) = %v, want %v", x, got, want)
		}
	}
	if !math.IsNaN(exp64(math.NaN())) || exp64(1000) != math.Inf(1) || exp64(-1000) != 0 {
		t.Fatal("exp64 special values")
	}
	if !math.IsNaN(log64(-1)) || log64(0) != math.Inf(-1) {
		t.Fatal("log64 special values")
	}
	if s := sigmoid64(-800); s != 0 || sigmoid64(800) != 1 || sigmoid64(0) != 0.5 {
		t.Fatal("sigmoid64 limits")
	}
}

// expSlice must give exp64's bits for every input: the vector blocks, the blocks it hands back
// (NaN, infinities, values beyond its range) and the tail.
func TestExpSliceMatchesExp64(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	var src []float64
	for range 200000 {
		switch r.IntN(4) {
		case 0:
			src = append(src, r.NormFloat64())
		case 1:
			src = append(src, -30*r.Float64())
		case 2:
			src = append(src, 1460*r.Float64()-745)
		default:
			src = append(src, math.Float64frombits(r.Uint64()))
		}
	}
	src = append(src, -707, 709, -707.0000001, 709.0000001, -745.2, 709.78, 0, math.Copysign(0, -1),
		math.NaN(), math.Inf(1), math.Inf(-1), 5e-324, -5e-324, 1e-300, -708.39, -707.5, 708.5)
	for _, n := range []int{len(src), len(src) - 1, 7, 3, 0} {
		dst := make([]float64, n)
		expSlice(dst, src[:n])
		for i, x := range src[:n] {
			want := exp64(x)
			if math.Float64bits(dst[i]) != math.Float64bits(want) && !(dst[i] != dst[i] && want != want) {
				t.Fatalf("n=%d: expSlice(%v) = %v, exp64 = %v", n, x, dst[i], want)
			}
		}
	}
}
