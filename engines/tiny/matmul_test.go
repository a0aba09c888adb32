package tiny

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func randSlice[T Float](r *rand.Rand, n int) []T {
	s := make([]T, n)
	for i := range s {
		s[i] = T(r.NormFloat64())
	}
	return s
}

// naiveMatMulT is the definition the kernel must reproduce bit for bit: one sequential sum per
// element.
func naiveMatMulT(c, a, b []float32, m, n, k int, acc bool) {
	for i := range m {
		for j := range n {
			var s float32
			if acc {
				s = c[i*n+j]
			}
			for x := range k {
				s += float32(a[i*k+x] * b[j*k+x])
			}
			c[i*n+j] = s
		}
	}
}

// withSIMD runs fn with the SIMD kernels on and, where the CPU has them, off.
func withSIMD(t *testing.T, fn func(t *testing.T)) {
	saved := haveSIMD
	defer func() { haveSIMD = saved }()
	for _, on := range []bool{false, true} {
		if on && !saved {
			continue
		}
		haveSIMD = on
		t.Run(map[bool]string{false: "portable", true: "simd"}[on], fn)
	}
}

// Shapes with every kind of edge: rows that fill no register tile or leave a tail of 1..5, column
// counts off the 16-wide panels and the 64-wide tasks, k of 1 and odd k.
var mmShapes = [][3]int{{1, 1, 1}, {1, 7, 5}, {5, 3, 9}, {17, 65, 13}, {33, 130, 64}, {4, 2, 1},
	{6, 16, 1}, {7, 17, 3}, {12, 64, 64}, {13, 80, 31}, {49, 129, 17}, {100, 192, 64}, {64, 64, 193},
	{3, 64, 64}, {5, 200, 7}, {97, 33, 100}}

func TestMatMulTMatchesSequentialSum(t *testing.T) {
	withSIMD(t, func(t *testing.T) {
		r := rand.New(rand.NewPCG(1, 2))
		for _, sz := range mmShapes {
			m, n, k := sz[0], sz[1], sz[2]
			a, b := randSlice[float32](r, m*k), randSlice[float32](r, n*k)
			for _, acc := range []bool{false, true} {
				for _, threads := range []int{1, 3} {
					init := randSlice[float32](r, m*n)
					got, want := append([]float32(nil), init...), append([]float32(nil), init...)
					matMulT(threads, got, a, b, m, n, k, acc)
					naiveMatMulT(want, a, b, m, n, k, acc)
					for i := range got {
						if got[i] != want[i] {
							t.Fatalf("%v acc=%v threads=%d: c[%d] = %v, want %v", sz, acc, threads, i, got[i], want[i])
						}
					}
				}
			}
		}
	})
}

// The panel path with every operand layout: a row-major or read through its transpose, B packed
// from its rows or from its transpose, into a c whose surroundings must stay untouched.
func TestMMPanelsLayouts(t *testing.T) {
	if !haveSIMD {
		t.Log("no SIMD kernels on this CPU: testing the Go panel kernels")
	}
	r := rand.New(rand.NewPCG(7, 8))
	for _, sz := range mmShapes {
		m, n, k := sz[0], sz[1], sz[2]
		a, b := randSlice[float32](r, m*k), randSlice[float32](r, n*k)
		aT, bT := make([]float32, m*k), make([]float32, n*k)
		transpose(1, aT, a, m, k)
		transpose(1, bT, b, n, k)
		for _, acc := range []bool{false, true} {
			init := randSlice[float32](r, m*n)
			want := append([]float32(nil), init...)
			naiveMatMulT(want, a, b, m, n, k, acc)
			for _, transA := range []bool{false, true} {
				for _, fromCols := range []bool{false, true} {
					for _, threads := range []int{1, 2} {
						p := packRows(threads, b, n, k)
						if fromCols {
							p = packCols(threads, bT, k, n)
						}
						// c sits inside a larger buffer whose guard cells must keep their value.
						buf := make([]float32, m*n+32)
						for i := range buf {
							buf[i] = -7
						}
						c := buf[16 : 16+m*n]
						copy(c, init)
						if transA {
							mmPanels(threads, c, aT, 1, m, p, m, acc)
						} else {
							mmPanels(threads, c, a, k, 1, p, m, acc)
						}
						for i := range want {
							if c[i] != want[i] {
								t.Fatalf("%v acc=%v transA=%v fromCols=%v threads=%d: c[%d] = %v, want %v", sz, acc, transA, fromCols, threads, i, c[i], want[i])
							}
						}
						for i := range 16 {
							if buf[i] != -7 || buf[16+m*n+i] != -7 {
								t.Fatalf("%v: wrote outside c", sz)
							}
						}
					}
				}
			}
		}
	}
}

// Infinities, NaNs, signed zeros and subnormals go through the same rounding in both kernels.
func TestMatMulTSpecialValues(t *testing.T) {
	specials := []float32{0, float32(math.Copysign(0, -1)), 1e-40, -3e-39, float32(math.Inf(1)), float32(math.NaN()), 3e38, -3e38, 1}
	r := rand.New(rand.NewPCG(9, 10))
	const m, n, k = 13, 37, 11
	a, b := randSlice[float32](r, m*k), randSlice[float32](r, n*k)
	for i := range a {
		if r.IntN(3) == 0 {
			a[i] = specials[r.IntN(len(specials))]
		}
	}
	for i := range b {
		if r.IntN(3) == 0 {
			b[i] = specials[r.IntN(len(specials))]
		}
	}
	want := make([]float32, m*n)
	naiveMatMulT(want, a, b, m, n, k, false)
	withSIMD(t, func(t *testing.T) {
		got := make([]float32, m*n)
		matMulT(2, got, a, b, m, n, k, false)
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) && !(got[i] != got[i] && want[i] != want[i]) {
				t.Fatalf("c[%d] = %v, want %v", i, got[i], want[i])
			}
		}
	})
}

// A row's result must not depend on which rows surround it: generation relies on it.
func TestMatMulTRowInvariant(t *testing.T) { withSIMD(t, testMatMulTRowInvariant) }

func testMatMulTRowInvariant(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const n, k = 70, 24
	b := randSlice[float32](r, n*k)
	row := randSlice[float32](r, k)
	alone := make([]float32, n)
	matMulT(1, alone, row, b, 1, n, k, false)
	for _, m := range []int{2, 5, 19, 40} {
		a := randSlice[float32](r, m*k)
		pos := m / 2
		copy(a[pos*k:], row)
		c := make([]float32, m*n)
		matMulT(2, c, a, b, m, n, k, false)
		for j := range n {
			if c[pos*n+j] != alone[j] {
				t.Fatalf("m=%d: row differs at column %d: %v vs %v", m, j, c[pos*n+j], alone[j])
			}
		}
	}
}

func TestTranspose(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, sz := range [][2]int{{1, 1}, {3, 70}, {65, 33}, {200, 190}} {
		rows, cols := sz[0], sz[1]
		src := randSlice[float32](r, rows*cols)
		dst := make([]float32, rows*cols)
		transpose(2, dst, src, rows, cols)
		for i := range rows {
			for j := range cols {
				if dst[j*rows+i] != src[i*cols+j] {
					t.Fatalf("%v: (%d,%d) wrong", sz, i, j)
				}
			}
		}
	}
}

func benchMatMul(b *testing.B, threads, m, n, k int) {
	r := rand.New(rand.NewPCG(1, 1))
	x, w, c := randSlice[float32](r, m*k), randSlice[float32](r, n*k), make([]float32, m*n)
	for b.Loop() {
		matMulT(threads, c, x, w, m, n, k, false)
	}
	b.ReportMetric(2*float64(m*n*k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}

// The shapes of a d_model 64 model's MLP on a 4096-token training chunk and of a 64-row decode step.
func BenchmarkMatMulT1Thread(b *testing.B)    { benchMatMul(b, 1, 4096, 192, 64) }
func BenchmarkMatMulTAllThreads(b *testing.B) { benchMatMul(b, defaultThreads(), 4096, 192, 64) }
func BenchmarkMatMulTDecode(b *testing.B)     { benchMatMul(b, defaultThreads(), 64, 192, 64) }

// BenchmarkMatMulShapes: the products of builtin:tiny-arith (bench/numpy_matmul.py has the same
// list, for numpy's numbers), with the portable and the SIMD kernel, on one thread and on all.
func BenchmarkMatMulShapes(b *testing.B) {
	shapes := []struct {
		name    string
		m, n, k int
	}{{"mlp-up 4096x192x64", 4096, 192, 64}, {"mlp-down 4096x64x192", 4096, 64, 192},
		{"attn 4096x64x64", 4096, 64, 64}, {"decode 64x192x64", 64, 192, 64},
		{"grad 192x64x4096", 192, 64, 4096}, {"head 4096x102x64", 4096, 102, 64}}
	saved := haveSIMD
	defer func() { haveSIMD = saved }()
	for _, on := range []bool{false, true} {
		if on && !saved {
			continue
		}
		for _, threads := range []int{1, defaultThreads()} {
			for _, s := range shapes {
				name := fmt.Sprintf("%s/threads=%d/%s", map[bool]string{false: "portable", true: "simd"}[on], threads, s.name)
				b.Run(strings.ReplaceAll(name, " ", "_"), func(b *testing.B) {
					haveSIMD = on
					benchMatMul(b, threads, s.m, s.n, s.k)
				})
			}
		}
	}
}

func naive(c, a, b []float32, m, n, k int) {
	for i := range m {
		for j := range n {
			var s float32
			for x := range k {
				s += a[i*k+x] * b[j*k+x]
			}
			c[i*n+j] = s
		}
	}
}

// BenchmarkMatMulNaive is the triple loop, for comparison with the blocked kernel.
func BenchmarkMatMulNaive(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	const m, n, k = 4096, 192, 64
	x, w, c := randSlice[float32](r, m*k), randSlice[float32](r, n*k), make([]float32, m*n)
	for b.Loop() {
		naive(c, x, w, m, n, k)
	}
	b.ReportMetric(2*float64(m*n*k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}
