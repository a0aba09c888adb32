package tiny

import (
	"math"
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
