//go:build !purego

package tiny

// expBlocks computes exp64 of 4 values at a time (exp_amd64.s) and returns how many it did: it
// stops at the first block of 4 with a value outside its range, which the caller does with exp64.
//
//go:noescape
func expBlocks(dst, src *float64, n int, c *[12]float64, tbl *[32]uint64) int

// swigluBlocks computes SwiGLU 4 values at a time as swiglu does (exp_amd64.s) and returns how
// many it did: it stops at the first block with a gate outside expBlocks' range.
//
//go:noescape
func swigluBlocks(act, sig, gate, up *float32, n int, c *[12]float64, tbl *[32]uint64) int

// swigluSIMD does what it can of swiglu on float32 slices of equal length with AVX2 and returns how
// many elements it did from the start; swiglu does the rest. sig receives σ(gate).
func swigluSIMD(act, sig, gate, up []float32) int {
	n := len(act) &^ 3
	if !haveSIMD || n == 0 {
		return 0
	}
	_, _, _ = sig[n-1], gate[n-1], up[n-1]
	return swigluBlocks(&act[0], &sig[0], &gate[0], &up[0], n, &expConsts, &exp2Bits)
}

// expConsts are exp64's constants for expBlocks, rounded as exp64's expressions round them, and
// the range it handles: there k = n>>5 stays within [−1021, 1023], so 2^k is a plain exponent.
var expConsts = [12]float64{32 * log2e, 0.5, ln2Hi / 32, ln2Lo / 32, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1, -707, 709}

// expSlice sets dst[i] = exp64(src[i]), four at a time with AVX2 where the CPU has it.
func expSlice(dst, src []float64) {
	n := len(src)
	dst = dst[:n]
	i := 0
	if haveSIMD {
		for i+4 <= n {
			i += expBlocks(&dst[i], &src[i], (n-i)&^3, &expConsts, &exp2Bits)
			if i+4 > n {
				break
			}
			for j := i; j < i+4; j++ { // a block expBlocks left: a value outside its range
				dst[j] = exp64(src[j])
			}
			i += 4
		}
	}
	for ; i < n; i++ {
		dst[i] = exp64(src[i])
	}
}
