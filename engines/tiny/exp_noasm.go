//go:build !amd64 || purego

package tiny

// expSlice sets dst[i] = exp64(src[i]).
func expSlice(dst, src []float64) {
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = exp64(v)
	}
}

// swigluSIMD does nothing without assembly: swiglu computes every element.
func swigluSIMD(act, sig, gate, up []float32) int { return 0 }
