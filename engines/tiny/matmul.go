package tiny

// The model's matrix products all have the form c = a·bᵀ with a and b row-major and sharing their
// inner dimension k, the layout of a PyTorch Linear weight (out×in). Backward products are brought
// to the same form by transposing (dx = dy·W = dy·(Wᵀ)ᵀ, dW = dyᵀ·x = (dyᵀ)·(xᵀ)ᵀ), so one kernel
// serves them all.
//
// Every element of c is a single sequential sum over k, c[i][j] = ((0 + a₀b₀) + a₁b₁) + …, with
// each product rounded before it is added (the explicit conversion forbids fused multiply-add).
// Whatever the tiling, the edge handling and the split across goroutines, a row of c therefore
// depends on nothing but its own row of a: a sequence's numbers do not change with the other
// sequences of its batch, with the number of threads, or between the full forward pass and the
// one-token decode step.
//
// This file is the portable kernel: the float64 gradient checks use it, and so does float32 where
// the CPU has no AVX2 or the build has the purego tag. Otherwise float32 products go through the
// packed kernels of matmul_panels.go and matmul_amd64.s, which compute the same sums in the same
// order, vectorised across elements of c rather than along k, and so give identical bits.

const (
	mmRowBlock = 16 // rows of a per task
	mmColBlock = 64 // rows of b per task; 64×k floats stay in L1/L2 while 16 rows of a stream by
	// mmPackRows is the least m for which matMulT packs b for the SIMD kernels (matmul_panels.go):
	// packing costs about as much as a few rows of the product.
	mmPackRows = 4
)

// matMulT sets c = a·bᵀ, or adds a·bᵀ to c when acc is true (continuing each element's sum from
// its current value, so accumulation over chunks is as deterministic as one product). a is m×k, b
// is n×k and c is m×n.
func matMulT[T Float](threads int, c, a, b []T, m, n, k int, acc bool) {
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if !acc {
			clear(c[:m*n])
		}
		return
	}
	_, _, _ = c[m*n-1], a[m*k-1], b[n*k-1]
	if cf, ok := any(c).([]float32); ok && haveSIMD && m >= mmPackRows {
		af, bf := any(a).([]float32), any(b).([]float32)
		mmPanels(threads, cf, af, k, 1, packRows(threads, bf, n, k), m, acc)
		return
	}
	rb := (m + mmRowBlock - 1) / mmRowBlock
	cb := (n + mmColBlock - 1) / mmColBlock
	if m*n*k < 1<<14 {
		threads = 1 // not worth a goroutine
	}
	parallelFor(threads, rb*cb, 1, func(lo, hi int) {
		for t := lo; t < hi; t++ {
			i0, j0 := (t/cb)*mmRowBlock, (t%cb)*mmColBlock
			mmBlock(c, a, b, n, k, i0, min(i0+mmRowBlock, m), j0, min(j0+mmColBlock, n), acc)
		}
	})
}

// mmBlock computes the block [i0,i1)×[j0,j1) of c with register tiles of 4×2 elements (8
// accumulators, 4+2 operands: what fits the 15 vector registers Go allocates on amd64 without
// spilling), then 1×4 and 1×1 tiles at the edges.
func mmBlock[T Float](c, a, b []T, n, k, i0, i1, j0, j1 int, acc bool) {
	i := i0
	for ; i+4 <= i1; i += 4 {
		a0 := a[i*k : i*k+k]
		a1 := a[(i+1)*k : (i+1)*k+k]
		a2 := a[(i+2)*k : (i+2)*k+k]
		a3 := a[(i+3)*k : (i+3)*k+k]
		c0 := c[i*n : i*n+n]
		c1 := c[(i+1)*n : (i+1)*n+n]
		c2 := c[(i+2)*n : (i+2)*n+n]
		c3 := c[(i+3)*n : (i+3)*n+n]
		j := j0
		for ; j+2 <= j1; j += 2 {
			b0 := b[j*k : j*k+k]
			b1 := b[(j+1)*k : (j+1)*k+k]
			a1, a2, a3 := a1[:len(a0)], a2[:len(a0)], a3[:len(a0)]
			b0, b1 = b0[:len(a0)], b1[:len(a0)]
			var s00, s01, s10, s11, s20, s21, s30, s31 T
			if acc {
				s00, s01, s10, s11 = c0[j], c0[j+1], c1[j], c1[j+1]
				s20, s21, s30, s31 = c2[j], c2[j+1], c3[j], c3[j+1]
			}
			for x := range a0 {
				x0, x1, x2, x3 := a0[x], a1[x], a2[x], a3[x]
				y0, y1 := b0[x], b1[x]
				s00 += T(x0 * y0)
				s01 += T(x0 * y1)
				s10 += T(x1 * y0)
				s11 += T(x1 * y1)
				s20 += T(x2 * y0)
				s21 += T(x2 * y1)
				s30 += T(x3 * y0)
				s31 += T(x3 * y1)
			}
			c0[j], c0[j+1], c1[j], c1[j+1] = s00, s01, s10, s11
			c2[j], c2[j+1], c3[j], c3[j+1] = s20, s21, s30, s31
		}
		for ; j < j1; j++ {
			b0 := b[j*k : j*k+k]
			a1, a2, a3 := a1[:len(a0)], a2[:len(a0)], a3[:len(a0)]
			b0 = b0[:len(a0)]
			var s0, s1, s2, s3 T
			if acc {
				s0, s1, s2, s3 = c0[j], c1[j], c2[j], c3[j]
			}
			for x := range a0 {
				y := b0[x]
				s0 += T(a0[x] * y)
				s1 += T(a1[x] * y)
				s2 += T(a2[x] * y)
				s3 += T(a3[x] * y)
			}
			c0[j], c1[j], c2[j], c3[j] = s0, s1, s2, s3
		}
	}
	for ; i < i1; i++ {
		a0 := a[i*k : i*k+k]
		c0 := c[i*n : i*n+n]
		j := j0
		for ; j+4 <= j1; j += 4 {
			b0 := b[j*k : j*k+k]
			b1 := b[(j+1)*k : (j+1)*k+k]
			b2 := b[(j+2)*k : (j+2)*k+k]
			b3 := b[(j+3)*k : (j+3)*k+k]
			b0, b1, b2, b3 = b0[:len(a0)], b1[:len(a0)], b2[:len(a0)], b3[:len(a0)]
			var s0, s1, s2, s3 T
			if acc {
				s0, s1, s2, s3 = c0[j], c0[j+1], c0[j+2], c0[j+3]
			}
			for x, v := range a0 {
				s0 += T(v * b0[x])
				s1 += T(v * b1[x])
				s2 += T(v * b2[x])
				s3 += T(v * b3[x])
			}
			c0[j], c0[j+1], c0[j+2], c0[j+3] = s0, s1, s2, s3
		}
		for ; j < j1; j++ {
			b0 := b[j*k : j*k+k]
			b0 = b0[:len(a0)]
			var s T
			if acc {
				s = c0[j]
			}
			for x, v := range a0 {
				s += T(v * b0[x])
			}
			c0[j] = s
		}
	}
}

// transpose writes the cols×rows transpose of the rows×cols matrix src into dst.
func transpose[T Float](threads int, dst, src []T, rows, cols int) {
	const tile = 32
	if rows == 0 || cols == 0 {
		return
	}
	_, _ = dst[rows*cols-1], src[rows*cols-1]
	tr := (cols + tile - 1) / tile
	if rows*cols < 1<<15 {
		threads = 1
	}
	parallelFor(threads, tr, 1, func(lo, hi int) {
		for t := lo; t < hi; t++ {
			j0, j1 := t*tile, min(t*tile+tile, cols)
			for i0 := 0; i0 < rows; i0 += tile {
				i1 := min(i0+tile, rows)
				for j := j0; j < j1; j++ {
					d := dst[j*rows : j*rows+rows]
					for i := i0; i < i1; i++ {
						d[i] = src[i*cols+j]
					}
				}
			}
		}
	})
}
