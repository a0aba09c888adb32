package tiny

// The packed path of the float32 products. B (n×k) is laid out in panels of 16 of its rows (16
// columns of c): panel p holds, for each x < k, the 16 values B[16p..16p+15][x] side by side, the
// last panel padded with zeros. A kernel keeps a tile of c in vector registers, one element per
// lane, and walks x in order, adding each rounded product a[i][x]·B[j][x] to its lane: the same
// sequential sum per element as the portable kernel of matmul.go, so the two give identical bits.

const (
	mmPanel = 16         // columns of c per panel
	mmRows  = 6          // rows of a per register tile
	mmTaskR = 8 * 6      // rows of c per task
	mmTaskC = 4 * 16     // columns of c per task
	f32     = uintptr(4) // bytes per float32
)

// panels is a matrix B (n×k) packed for the kernels.
type panels struct {
	n, k int
	data []float32 // ceil(n/16) panels of k×16
}

func (p *panels) count() int { return (p.n + mmPanel - 1) / mmPanel }

// packRows packs the n×k row-major matrix b.
func packRows(threads int, b []float32, n, k int) panels { return packStrided(threads, b, n, k, k) }

// packStrided packs the n×k matrix whose row j is b[j·stride : j·stride+k].
func packStrided(threads int, b []float32, n, k, stride int) panels {
	p := panels{n: n, k: k}
	p.data = make([]float32, p.count()*k*mmPanel)
	if k == 0 || n == 0 {
		return p
	}
	_ = b[(n-1)*stride+k-1]
	parallelFor(threads, p.count(), 1, func(lo, hi int) {
		for q := lo; q < hi; q++ {
			dst := p.data[q*k*mmPanel : (q+1)*k*mmPanel]
			for j := q * mmPanel; j < min(q*mmPanel+mmPanel, n); j++ {
				row := b[j*stride : j*stride+k]
				jj := j - q*mmPanel
				for x, v := range row {
					dst[x*mmPanel+jj] = v
				}
			}
		}
	})
	return p
}

// packCols packs B = btᵀ, given the k×n row-major matrix bt: a panel's rows are slices of bt's
// rows, so this is a copy.
func packCols(threads int, bt []float32, k, n int) panels {
	p := panels{n: n, k: k}
	p.data = make([]float32, p.count()*k*mmPanel)
	if k == 0 {
		return p
	}
	_ = bt[n*k-1]
	parallelFor(threads, p.count(), 1, func(lo, hi int) {
		for q := lo; q < hi; q++ {
			dst := p.data[q*k*mmPanel : (q+1)*k*mmPanel]
			j0, j1 := q*mmPanel, min(q*mmPanel+mmPanel, n)
			for x := range k {
				copy(dst[x*mmPanel:x*mmPanel+j1-j0], bt[x*n+j0:x*n+j1])
			}
		}
	})
	return p
}

// mmPanels sets c = a·Bᵀ (acc: adds it to c, continuing each element's sum), c m×n row-major,
// with element (i, x) of a at a[i·rsa + x·csa]: a row-major m×k matrix has rsa = k, csa = 1, and
// the transpose of a row-major k×m matrix has rsa = 1, csa = m, so a transposed operand needs no
// copy.
func mmPanels(threads int, c, a []float32, rsa, csa int, b panels, m int, acc bool) {
	n, k := b.n, b.k
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if !acc {
			clear(c[:m*n])
		}
		return
	}
	_ = c[m*n-1]
	_ = a[(m-1)*rsa+(k-1)*csa]
	rt := (m + mmTaskR - 1) / mmTaskR
	ct := (n + mmTaskC - 1) / mmTaskC
	if m*n*k < 1<<16 {
		threads = 1 // not worth a goroutine
	}
	ldc := uintptr(n) * f32
	ps := k * mmPanel
	parallelFor(threads, rt*ct, 1, func(lo, hi int) {
		var tmp [mmRows * mmPanel]float32 // an edge tile of c
		for t := lo; t < hi; t++ {
			i0, j0 := (t/ct)*mmTaskR, (t%ct)*mmTaskC
			i1, j1 := min(i0+mmTaskR, m), min(j0+mmTaskC, n)
			for j := j0; j < j1; j += mmPanel {
				bp := &b.data[(j/mmPanel)*ps]
				w := min(mmPanel, n-j)
				i := i0
				for ; i+mmRows <= i1; i += mmRows {
					ap := &a[i*rsa]
					if w == mmPanel {
						mmKernel6x16(k, ap, uintptr(rsa)*f32, uintptr(csa)*f32, bp, &c[i*n+j], ldc, acc)
						continue
					}
					if acc {
						for r := range mmRows {
							copy(tmp[r*mmPanel:r*mmPanel+w], c[(i+r)*n+j:(i+r)*n+j+w])
						}
					}
					mmKernel6x16(k, ap, uintptr(rsa)*f32, uintptr(csa)*f32, bp, &tmp[0], mmPanel*f32, acc)
					for r := range mmRows {
						copy(c[(i+r)*n+j:(i+r)*n+j+w], tmp[r*mmPanel:r*mmPanel+w])
					}
				}
				if i < i1 && j == j0 {
					mmRowsTail(c, a, rsa, csa, b, i, i1, j0, j1, tmp[:mmPanel], acc)
				}
			}
		}
	})
}

// mmRowsTail computes rows i0..i1−1 (fewer than a register tile) of c over columns j0..j1−1, a
// task's column range: four panels at a time where they are whole, then one.
func mmRowsTail(c, a []float32, rsa, csa int, b panels, i0, i1, j0, j1 int, tmp []float32, acc bool) {
	n, k := b.n, b.k
	ps := k * mmPanel
	for i := i0; i < i1; i++ {
		ap := &a[i*rsa]
		j := j0
		for ; j+4*mmPanel <= j1; j += 4 * mmPanel {
			mmKernel1x64(k, ap, uintptr(csa)*f32, &b.data[(j/mmPanel)*ps], uintptr(ps)*f32, &c[i*n+j], acc)
		}
		for ; j < j1; j += mmPanel {
			w := min(mmPanel, n-j)
			if w == mmPanel {
				mmKernel1x16(k, ap, uintptr(csa)*f32, &b.data[(j/mmPanel)*ps], &c[i*n+j], acc)
				continue
			}
			if acc {
				copy(tmp[:w], c[i*n+j:i*n+j+w])
			}
			mmKernel1x16(k, ap, uintptr(csa)*f32, &b.data[(j/mmPanel)*ps], &tmp[0], acc)
			copy(c[i*n+j:i*n+j+w], tmp[:w])
		}
	}
}

// dotsMatrix returns D (rows×cols, row-major, in *buf) with D[t][s] = Σ_i a[t·lda+i]·b[s·ldb+i]
// over i < k, each sum in order of i as attention's Go loops compute a dot product, through the
// SIMD kernels on one thread (attention already runs a task per goroutine). It returns nil where
// there are no such kernels, or for fewer than 8 rows, where packing b would cost more than it
// saves; the caller computes the dot products itself then.
func dotsMatrix[T Float](buf *[]float32, a []T, lda int, b []T, ldb int, rows, cols, k int) []T {
	af, ok := any(a).([]float32)
	if !ok || !haveSIMD || rows < 8 {
		return nil
	}
	p := packStrided(1, any(b).([]float32), cols, k, ldb)
	if cap(*buf) < rows*cols {
		*buf = make([]float32, rows*cols)
	}
	d := (*buf)[:rows*cols]
	mmPanels(1, d, af, lda, 1, p, rows, false)
	return any(d).([]T)
}
