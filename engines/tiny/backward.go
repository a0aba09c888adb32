package tiny

import "math"

// transposedWeights holds the transposes of the weight matrices, which the backward pass
// multiplies by (dx = dy·W is computed as dy·(Wᵀ)ᵀ). They are made once per optimizer step: for
// the SIMD kernels as panels of Wᵀ (pl, headP; a copy of W's rows), otherwise as matrices.
type transposedWeights[T Float] struct {
	layers []layerWeights[T] // q, k, v, o, gate, up, d transposed; norms unused
	head   []T
	pl     []layerPanels
	headP  panels
}

func (m *model[T]) transposed(threads int) *transposedWeights[T] {
	c := m.w.cfg
	d, qd, kvd, in, v := c.Hidden, c.qDim(), c.kvDim(), c.Intermediate, c.VocabSize
	if w, ok := any(m.w).(*weights[float32]); ok && haveSIMD {
		t := &transposedWeights[T]{pl: make([]layerPanels, c.Layers), headP: packCols(threads, w.head(), v, d)}
		for l := range c.Layers {
			lw := &w.layers[l]
			t.pl[l] = layerPanels{
				q: packCols(threads, lw.q, qd, d), k: packCols(threads, lw.k, kvd, d), v: packCols(threads, lw.v, kvd, d),
				o: packCols(threads, lw.o, d, qd), gate: packCols(threads, lw.gate, in, d), up: packCols(threads, lw.up, in, d),
				d: packCols(threads, lw.d, d, in),
			}
		}
		return t
	}
	t := &transposedWeights[T]{layers: make([]layerWeights[T], c.Layers)}
	tr := func(src []T, rows, cols int) []T { return transposeOf(threads, src, rows, cols) }
	for l := range c.Layers {
		w := &m.w.layers[l]
		t.layers[l] = layerWeights[T]{
			q: tr(w.q, qd, d), k: tr(w.k, kvd, d), v: tr(w.v, kvd, d), o: tr(w.o, d, qd),
			gate: tr(w.gate, in, d), up: tr(w.up, in, d), d: tr(w.d, d, in),
		}
	}
	t.head = tr(m.w.head(), v, d)
	return t
}

// mulT sets (acc: adds to) c = x·wtᵀ for x rows×k, wt n×k a transposed weight whose panels are
// p when the transposes are panels.
func (t *transposedWeights[T]) mulT(threads int, c, x, wt []T, p panels, rows, n, k int, acc bool) {
	if t.pl != nil {
		mmPanels(threads, any(c).([]float32), any(x).([]float32), k, 1, p, rows, acc)
		return
	}
	matMulT(threads, c, x, wt, rows, n, k, acc)
}

// layer returns the panels of layer l's transposes, or none.
func (t *transposedWeights[T]) layer(l int) layerPanels {
	if t.pl == nil {
		return layerPanels{}
	}
	return t.pl[l]
}

// matMulTN adds xᵀ·y to c (p×q), for x rows×p and y rows×q: the weight gradients, sums over the
// rows in row order. The SIMD kernels read x through its transpose and pack y's rows; otherwise
// both are transposed for matMulT.
func matMulTN[T Float](threads int, c, x, y []T, rows, p, q int) {
	if cf, ok := any(c).([]float32); ok && haveSIMD {
		mmPanels(threads, cf, any(x).([]float32), 1, p, packCols(threads, any(y).([]float32), rows, q), p, true)
		return
	}
	matMulT(threads, c, transposeOf(threads, x, rows, p), transposeOf(threads, y, rows, q), p, q, rows, true)
}

// transposeOf returns the transpose of the rows×cols matrix src.
func transposeOf[T Float](threads int, src []T, rows, cols int) []T {
	dst := make([]T, rows*cols)
	transpose(threads, dst, src, rows, cols)
	return dst
}

// backward adds to g the gradient of a loss whose derivative with respect to the logits at
// outRows is dlogits, given the activations a of forward(…, keep=true) on the same batch. Weight
// gradients are sums over the batch rows in row order, one sequential sum per element, so they do
// not depend on the number of threads.
func (m *model[T]) backward(threads int, tokens []int32, seqs []seqView[T], outRows []int, a *acts[T], dlogits []T, g *weights[T], wt *transposedWeights[T]) {
	m.backwardG(threads, tokens, seqs, outRows, a, dlogits, grads[T]{w: g}, wt)
}

// grads are where a backward pass adds its gradients: the model's weights (w) or, when the model
// trains a LoRA adapter (model.ad), that adapter (ad) with the base left out.
type grads[T Float] struct {
	w  *weights[T]
	ad *loraWeights[T]
}

// backwardG is backward with the gradients going to g.
func (m *model[T]) backwardG(threads int, tokens []int32, seqs []seqView[T], outRows []int, a *acts[T], dlogits []T, g grads[T], wt *transposedWeights[T]) {
	c := m.w.cfg
	d, vocab, nout := c.Hidden, c.VocabSize, len(outRows)
	dOut := make([]T, nout*d)
	wt.mulT(threads, dOut, dlogits, wt.head, wt.headP, nout, d, vocab, false)
	if g.w != nil {
		gHead := g.w.lmHead
		if c.TieEmbeddings {
			gHead = g.w.embed
		}
		matMulTN(threads, gHead, dlogits, a.xnfOut, nout, vocab, d)
	}
	m.backwardTrunk(threads, tokens, seqs, outRows, a, dOut, g, wt)
}

// valueBackward is backward for a loss whose derivative with respect to the values at outRows
// (model.values) is dv.
func (m *model[T]) valueBackward(threads int, tokens []int32, seqs []seqView[T], outRows []int, a *acts[T], dv []T, g *weights[T], wt *transposedWeights[T]) {
	d, nout := m.w.cfg.Hidden, len(outRows)
	dOut := make([]T, nout*d)
	matMulT(threads, dOut, dv, m.w.score, nout, d, 1, false) // dv ⊗ score
	matMulT(threads, g.score, dv, transposeOf(threads, a.xnfOut, nout, d), 1, d, nout, true)
	matMulT(threads, g.scoreBias, dv, ones[T](nout), 1, 1, nout, true)
	m.backwardTrunk(threads, tokens, seqs, outRows, a, dOut, grads[T]{w: g}, wt)
}

func ones[T Float](n int) []T {
	v := make([]T, n)
	for i := range v {
		v[i] = 1
	}
	return v
}

// backwardTrunk adds to g the gradient through the final norm, the layers and the embeddings of
// a loss whose derivative with respect to the normalised hidden states at outRows (a.xnfOut) is
// dOut.
func (m *model[T]) backwardTrunk(threads int, tokens []int32, seqs []seqView[T], outRows []int, a *acts[T], dOut []T, gr grads[T], wt *transposedWeights[T]) {
	g, ga := gr.w, gr.ad
	// Without g (only an adapter trains) no base gradient is computed: the norms' go nowhere.
	var gNormF []T
	gLayer := func(l int) *layerWeights[T] { return &layerWeights[T]{} }
	if g != nil {
		gNormF = g.norm
		gLayer = func(l int) *layerWeights[T] { return &g.layers[l] }
	}
	c := m.w.cfg
	d, qd, kvd, in := c.Hidden, c.qDim(), c.kvDim(), c.Intermediate
	rows := a.rows
	pos := make([]int, rows)
	for _, s := range seqs {
		if s.cache != nil || s.pos0 != 0 {
			panic("tiny: backward through a cached sequence")
		}
		for i := range s.n {
			pos[s.start+i] = i
		}
	}
	dxnf := make([]T, rows*d)
	for i, r := range outRows {
		copy(dxnf[r*d:(r+1)*d], dOut[i*d:(i+1)*d])
	}
	dx := make([]T, rows*d)
	rmsNormBackward(threads, dx, gNormF, dxnf, a.xf, a.invf, m.w.norm, rows, d, false)

	dact, dgate, dup := make([]T, rows*in), make([]T, rows*in), make([]T, rows*in)
	dxn := make([]T, rows*d)
	dx2 := make([]T, rows*d)
	datt, dq := make([]T, rows*qd), make([]T, rows*qd)
	dk, dv := make([]T, rows*kvd), make([]T, rows*kvd)
	for l := c.Layers - 1; l >= 0; l-- {
		la, w, gl := &a.layers[l], &m.w.layers[l], gLayer(l)
		var wtl layerWeights[T]
		if wt.layers != nil {
			wtl = wt.layers[l]
		}
		pl := wt.layer(l)

		// MLP: x_next = x2 + down(silu(gate)·up).
		wt.mulT(threads, dact, dx, wtl.d, pl.d, rows, in, d, false)
		m.loraBackward(threads, seqs, l, tDown, dx, la.act, dact, d, in, ga)
		if g != nil {
			matMulTN(threads, gl.d, dx, la.act, rows, d, in)
		}
		swigluBackward(threads, dgate, dup, dact, la.gate, la.sig, la.up)
		wt.mulT(threads, dxn, dgate, wtl.gate, pl.gate, rows, d, in, false)
		wt.mulT(threads, dxn, dup, wtl.up, pl.up, rows, d, in, true)
		m.loraBackward(threads, seqs, l, tGate, dgate, la.xn2, dxn, in, d, ga)
		m.loraBackward(threads, seqs, l, tUp, dup, la.xn2, dxn, in, d, ga)
		if g != nil {
			matMulTN(threads, gl.gate, dgate, la.xn2, rows, in, d)
			matMulTN(threads, gl.up, dup, la.xn2, rows, in, d)
		}
		copy(dx2, dx)
		rmsNormBackward(threads, dx2, gl.mlpNorm, dxn, la.x2, la.inv2, w.mlpNorm, rows, d, true)

		// Attention: x2 = x + o(attn(rope(q), rope(k), v)).
		wt.mulT(threads, datt, dx2, wtl.o, pl.o, rows, qd, d, false)
		m.loraBackward(threads, seqs, l, tO, dx2, la.att, datt, d, qd, ga)
		if g != nil {
			matMulTN(threads, gl.o, dx2, la.att, rows, d, qd)
		}
		clear(dk)
		clear(dv)
		m.attentionBackward(threads, la, seqs, a.probOff, datt, dq, dk, dv)
		m.ropeRows(threads, dq, pos, c.Heads, true)
		m.ropeRows(threads, dk, pos, c.KVHeads, true)
		wt.mulT(threads, dxn, dq, wtl.q, pl.q, rows, d, qd, false)
		wt.mulT(threads, dxn, dk, wtl.k, pl.k, rows, d, kvd, true)
		wt.mulT(threads, dxn, dv, wtl.v, pl.v, rows, d, kvd, true)
		m.loraBackward(threads, seqs, l, tQ, dq, la.xn1, dxn, qd, d, ga)
		m.loraBackward(threads, seqs, l, tK, dk, la.xn1, dxn, kvd, d, ga)
		m.loraBackward(threads, seqs, l, tV, dv, la.xn1, dxn, kvd, d, ga)
		if g != nil {
			matMulTN(threads, gl.q, dq, la.xn1, rows, qd, d)
			matMulTN(threads, gl.k, dk, la.xn1, rows, kvd, d)
			matMulTN(threads, gl.v, dv, la.xn1, rows, kvd, d)
		}
		copy(dx, dx2)
		rmsNormBackward(threads, dx, gl.attnNorm, dxn, la.x, la.inv1, w.attnNorm, rows, d, true)
	}

	// Embeddings, in row order.
	if g == nil {
		return
	}
	for r, t := range tokens {
		ge, dr := g.embed[int(t)*d:int(t+1)*d], dx[r*d:(r+1)*d]
		for i, v := range dr {
			ge[i] += v
		}
	}
}

// rmsNormBackward sets (or with acc adds to) dx the gradient through the norm y = w ⊙ x·inv,
// inv = 1/rms(x), and adds Σ_rows dy ⊙ x·inv to gw unless gw is nil.
func rmsNormBackward[T Float](threads int, dx, gw, dy, x []T, inv []float64, w []T, rows, d int, acc bool) {
	parallelFor(threads, rows, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			xr, dyr, dxr := x[r*d:(r+1)*d], dy[r*d:(r+1)*d], dx[r*d:(r+1)*d]
			iv := inv[r]
			dot := 0.0
			for i, v := range xr {
				dot += float64(float64(dyr[i]*w[i]) * float64(v))
			}
			k := iv * iv * iv * dot / float64(d)
			for i, v := range xr {
				gi := float64(float64(dyr[i]*w[i])*iv) - float64(float64(v)*k)
				if acc {
					dxr[i] += T(gi)
				} else {
					dxr[i] = T(gi)
				}
			}
		}
	})
	if gw == nil {
		return
	}
	parallelFor(threads, d, 8, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			s := 0.0
			for r := range rows {
				s += float64(float64(dy[r*d+i]) * float64(T(float64(x[r*d+i])*inv[r])))
			}
			gw[i] += T(s)
		}
	})
}

// swigluBackward sets dgate and dup from dact, the gradient of act = silu(gate)·up, with sig
// holding σ(gate): silu(g) = g·σ(g), silu'(g) = σ(g)(1 + g(1 − σ(g))).
func swigluBackward[T Float](threads int, dgate, dup, dact, gate, sig, up []T) {
	parallelFor(threads, len(dact), 1<<13, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			g, s := float64(gate[i]), float64(sig[i])
			da := float64(dact[i])
			dup[i] = T(da * float64(g*s))
			dgate[i] = T(da * float64(up[i]) * float64(s*float64(1+float64(g*float64(1-s)))))
		}
	})
}

// attentionBackward computes dq, and adds into dk and dv, from datt. One task per sequence and
// key/value head: the query heads that share a key/value head add into its gradients in a fixed
// order.
func (m *model[T]) attentionBackward(threads int, la *layerActs[T], seqs []seqView[T], probOff []int, datt, dq, dk, dv []T) {
	c := m.w.cfg
	hd, qd, kvd := c.HeadDim, c.qDim(), c.kvDim()
	rep := c.Heads / c.KVHeads
	scale := 1 / math.Sqrt(float64(hd))
	parallelFor(threads, len(seqs)*c.KVHeads, 2, func(lo, hi int) {
		var dp []float64
		var csb []T
		var dbuf []float32
		for task := lo; task < hi; task++ {
			si, g := task/c.KVHeads, task%c.KVHeads
			s := seqs[si]
			if cap(dp) < s.n {
				dp, csb = make([]float64, s.n), make([]T, s.n)
			}
			for h := g * rep; h < (g+1)*rep; h++ {
				// dots[t][j] = do_t·v_j, or nil: computed below
				dots := dotsMatrix(&dbuf, datt[s.start*qd+h*hd:], qd, la.v[s.start*kvd+g*hd:], kvd, s.n, s.n, hd)
				for t := range s.n {
					r := s.start + t
					n := t + 1
					base := probOff[si] + h*s.n*(s.n+1)/2 + t*(t+1)/2
					p := la.probs[base : base+n]
					do := datt[r*qd+h*hd : r*qd+(h+1)*hd]
					qr := la.q[r*qd+h*hd : r*qd+(h+1)*hd]
					dqr := dq[r*qd+h*hd : r*qd+(h+1)*hd]
					vals := la.v[s.start*kvd+g*hd:]
					j := 0
					if dots != nil {
						for j = range n {
							dp[j] = float64(dots[t*s.n+j])
						}
						j = n
					}
					for ; j+4 <= n; j += 4 { // four independent dot products, as in attendRow
						v0 := vals[j*kvd : j*kvd+hd]
						v1 := vals[(j+1)*kvd : (j+1)*kvd+hd]
						v2 := vals[(j+2)*kvd : (j+2)*kvd+hd]
						v3 := vals[(j+3)*kvd : (j+3)*kvd+hd]
						var d0, d1, d2, d3 T
						for i, o := range do {
							d0 += T(o * v0[i])
							d1 += T(o * v1[i])
							d2 += T(o * v2[i])
							d3 += T(o * v3[i])
						}
						dp[j], dp[j+1], dp[j+2], dp[j+3] = float64(d0), float64(d1), float64(d2), float64(d3)
					}
					for ; j < n; j++ {
						vr := vals[j*kvd : j*kvd+hd]
						var dot T
						for i, v := range vr {
							dot += T(do[i] * v)
						}
						dp[j] = float64(dot)
					}
					sum := 0.0
					for j := range n {
						sum += float64(float64(p[j]) * dp[j])
					}
					for j := range n {
						csb[j] = T(float64(p[j]) * (dp[j] - sum) * scale)
					}
					if qf, ok := any(la.q).([]float32); ok && haveSIMD && hd%16 == 0 {
						base := s.start*kvd + g*hd
						_, _, _ = la.k[base+(n-1)*kvd+hd-1], dk[base+(n-1)*kvd+hd-1], dv[base+(n-1)*kvd+hd-1]
						kf, dkf, dvf := any(la.k).([]float32), any(dk).([]float32), any(dv).([]float32)
						csf, pf, dof, dqf := any(csb).([]float32), any(p).([]float32), any(do).([]float32), any(dqr).([]float32)
						attnGradRow16(n, &csf[0], &pf[0], &kf[base], &dkf[base], &dvf[base], uintptr(kvd)*4, &qf[r*qd+h*hd], &dof[0], &dqf[0], hd/16)
						continue
					}
					clear(dqr)
					for j := range n {
						kvRow := (s.start + j) * kvd
						kr := la.k[kvRow+g*hd : kvRow+(g+1)*hd]
						dkr := dk[kvRow+g*hd : kvRow+(g+1)*hd]
						dvr := dv[kvRow+g*hd : kvRow+(g+1)*hd]
						pj, cs := p[j], csb[j]
						for i := range kr {
							dqr[i] += T(cs * kr[i])
							dkr[i] += T(cs * qr[i])
							dvr[i] += T(pj * do[i])
						}
					}
				}
			}
		}
	})
}
