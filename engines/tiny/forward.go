package tiny

import "math"

// model is the computation: weights plus the rotary tables derived from the config.
type model[T Float] struct {
	w        *weights[T]
	cos, sin []T          // maxSeqLen × headDim/2
	pk       *modelPanels // the weights packed for the SIMD kernels; nil: multiply them as they are
	// ad is the LoRA adapter of the sequences that name none (nil: the base model), and the one
	// backward differentiates: with it set, only the adapter receives gradients.
	ad *loraWeights[T]
}

// modelPanels are a float32 model's weight matrices packed for the SIMD kernels
// (matmul_panels.go).
type modelPanels struct {
	layers []layerPanels
	head   panels
}

type layerPanels struct{ q, k, v, o, gate, up, d panels }

// packed returns the model with its weights packed for the SIMD kernels, to use while the weights
// do not change (one generation call, one optimizer step), or m itself where there are no such
// kernels. The packing costs about one product of a single row per matrix.
func (m *model[T]) packed(threads int) *model[T] {
	w, ok := any(m.w).(*weights[float32])
	if !ok || !haveSIMD || m.pk != nil {
		return m
	}
	c := w.cfg
	d, qd, kvd, in := c.Hidden, c.qDim(), c.kvDim(), c.Intermediate
	pk := &modelPanels{layers: make([]layerPanels, c.Layers), head: packRows(threads, w.head(), c.VocabSize, d)}
	for l := range pk.layers {
		lw := &w.layers[l]
		pk.layers[l] = layerPanels{
			q: packRows(threads, lw.q, qd, d), k: packRows(threads, lw.k, kvd, d), v: packRows(threads, lw.v, kvd, d),
			o: packRows(threads, lw.o, d, qd), gate: packRows(threads, lw.gate, in, d), up: packRows(threads, lw.up, in, d),
			d: packRows(threads, lw.d, d, in),
		}
	}
	pm := *m
	pm.pk = pk
	return &pm
}

// linear sets out = x·wᵀ for x rows×k and a weight w n×k whose panels, when the model has them,
// are p.
func (m *model[T]) linear(threads int, out, x, w []T, p panels, rows, n, k int) {
	if m.pk != nil {
		mmPanels(threads, any(out).([]float32), any(x).([]float32), k, 1, p, rows, false)
		return
	}
	matMulT(threads, out, x, w, rows, n, k, false)
}

func newModel[T Float](w *weights[T]) *model[T] {
	c := w.cfg
	half := c.HeadDim / 2
	m := &model[T]{w: w, cos: make([]T, c.MaxSeqLen*half), sin: make([]T, c.MaxSeqLen*half)}
	// transformers computes the inverse frequencies and the angles in float32; doing the same keeps
	// long positions within the compatibility tolerance.
	for i := range half {
		e := float32(2*i) / float32(c.HeadDim)
		inv := float32(1) / float32(math.Pow(c.RopeTheta, float64(e)))
		for p := range c.MaxSeqLen {
			a := float64(float32(float32(p) * inv))
			m.cos[p*half+i] = T(math.Cos(a))
			m.sin[p*half+i] = T(math.Sin(a))
		}
	}
	return m
}

// seqView places one sequence in a packed batch: its new tokens are rows start..start+n of the
// batch, at positions pos0..pos0+n−1. Keys and values of earlier positions are in cache (a
// generation in progress); without a cache, pos0 is 0 and the batch rows are the whole sequence.
type seqView[T Float] struct {
	start, n, pos0 int
	cache          *kvCache[T]
	ad             *loraWeights[T] // the sequence's LoRA adapter; nil: the model's (model.ad)
}

// kvCache holds one sequence's keys and values, per layer, capacity×kvDim each.
type kvCache[T Float] struct {
	k, v [][]T
}

func newKVCache[T Float](cfg ModelConfig, capacity int) *kvCache[T] {
	c := &kvCache[T]{k: make([][]T, cfg.Layers), v: make([][]T, cfg.Layers)}
	for l := range cfg.Layers {
		c.k[l] = make([]T, capacity*cfg.kvDim())
		c.v[l] = make([]T, capacity*cfg.kvDim())
	}
	return c
}

// copyPrefix copies the first n positions of src into c.
func (c *kvCache[T]) copyPrefix(src *kvCache[T], n, kvDim int) {
	for l := range c.k {
		copy(c.k[l][:n*kvDim], src.k[l][:n*kvDim])
		copy(c.v[l][:n*kvDim], src.v[l][:n*kvDim])
	}
}

// layerActs are one layer's activations, kept for the backward pass.
type layerActs[T Float] struct {
	x, xn1, q, k, v, att, x2, xn2, gate, up, act []T
	sig                                          []T // σ(gate), for the backward pass
	inv1, inv2                                   []float64
	probs                                        []T // per sequence and head, the lower triangle of its attention matrix
}

// acts are the activations of a forward pass over a packed batch.
type acts[T Float] struct {
	rows    int
	layers  []layerActs[T]
	xf      []T       // input of the final norm
	invf    []float64 // its inverse RMS per row
	xnfOut  []T       // normalised final hidden state at the output rows
	probOff []int     // offset of each sequence's attention probabilities
}

// forward runs the model over a packed batch and returns the logits (len(outRows)×vocab) at
// outRows. keep retains the activations for backward; otherwise buffers are reused across layers.
func (m *model[T]) forward(threads int, tokens []int32, seqs []seqView[T], outRows []int, keep bool) ([]T, *acts[T]) {
	c := m.w.cfg
	a := m.trunk(threads, tokens, seqs, outRows, keep)
	logits := make([]T, len(outRows)*c.VocabSize)
	var hp panels
	if m.pk != nil {
		hp = m.pk.head
	}
	m.linear(threads, logits, a.xnfOut, m.w.head(), hp, len(outRows), c.VocabSize, c.Hidden)
	return logits, a
}

// values runs the model over a packed batch and returns the value head's output at outRows: a
// PPO critic's value of the state before each predicted token.
func (m *model[T]) values(threads int, tokens []int32, seqs []seqView[T], outRows []int, keep bool) ([]T, *acts[T]) {
	a := m.trunk(threads, tokens, seqs, outRows, keep)
	v := make([]T, len(outRows))
	matMulT(threads, v, a.xnfOut, m.w.score, len(outRows), 1, m.w.cfg.Hidden, false)
	for i := range v {
		v[i] += m.w.scoreBias[0]
	}
	return v, a
}

// trunk runs the decoder layers and the final norm over a packed batch; the normalised hidden
// states at outRows are a.xnfOut, what the LM head and the value head read.
func (m *model[T]) trunk(threads int, tokens []int32, seqs []seqView[T], outRows []int, keep bool) *acts[T] {
	c := m.w.cfg
	d, qd, kvd, in := c.Hidden, c.qDim(), c.kvDim(), c.Intermediate
	rows := len(tokens)
	a := &acts[T]{rows: rows}
	pos := make([]int, rows)
	for _, s := range seqs {
		for i := range s.n {
			pos[s.start+i] = s.pos0 + i
		}
	}
	if keep {
		a.probOff = make([]int, len(seqs)+1)
		for i, s := range seqs {
			a.probOff[i+1] = a.probOff[i] + c.Heads*s.n*(s.n+1)/2
		}
	}

	x := make([]T, rows*d)
	for r, t := range tokens {
		copy(x[r*d:(r+1)*d], m.w.embed[int(t)*d:int(t+1)*d])
	}
	var scratch layerActs[T]
	alloc := func(la *layerActs[T]) {
		la.xn1, la.q, la.k, la.v = make([]T, rows*d), make([]T, rows*qd), make([]T, rows*kvd), make([]T, rows*kvd)
		la.att, la.x2, la.xn2 = make([]T, rows*qd), make([]T, rows*d), make([]T, rows*d)
		la.gate, la.up, la.act = make([]T, rows*in), make([]T, rows*in), make([]T, rows*in)
		la.inv1, la.inv2 = make([]float64, rows), make([]float64, rows)
	}
	if keep {
		a.layers = make([]layerActs[T], c.Layers)
	} else {
		alloc(&scratch)
	}
	down := make([]T, rows*d)
	for l := range c.Layers {
		lw := &m.w.layers[l]
		la := &scratch
		var lp layerPanels
		if m.pk != nil {
			lp = m.pk.layers[l]
		}
		if keep {
			la = &a.layers[l]
			alloc(la)
			la.probs = make([]T, a.probOff[len(seqs)])
			la.sig = make([]T, rows*in)
		}
		la.x = x
		rmsNormRows(threads, la.xn1, la.inv1, x, lw.attnNorm, rows, d, c.RMSNormEps)
		m.linear(threads, la.q, la.xn1, lw.q, lp.q, rows, qd, d)
		m.linear(threads, la.k, la.xn1, lw.k, lp.k, rows, kvd, d)
		m.linear(threads, la.v, la.xn1, lw.v, lp.v, rows, kvd, d)
		m.loraAdd(threads, seqs, l, tQ, la.q, la.xn1, qd, d)
		m.loraAdd(threads, seqs, l, tK, la.k, la.xn1, kvd, d)
		m.loraAdd(threads, seqs, l, tV, la.v, la.xn1, kvd, d)
		m.ropeRows(threads, la.q, pos, c.Heads, false)
		m.ropeRows(threads, la.k, pos, c.KVHeads, false)
		for _, s := range seqs {
			if s.cache != nil {
				copy(s.cache.k[l][s.pos0*kvd:(s.pos0+s.n)*kvd], la.k[s.start*kvd:(s.start+s.n)*kvd])
				copy(s.cache.v[l][s.pos0*kvd:(s.pos0+s.n)*kvd], la.v[s.start*kvd:(s.start+s.n)*kvd])
			}
		}
		m.attention(threads, la, seqs, a.probOff, l)
		o := down // o_proj output; down is free until the MLP
		m.linear(threads, o, la.att, lw.o, lp.o, rows, d, qd)
		m.loraAdd(threads, seqs, l, tO, o, la.att, d, qd)
		addRows(threads, la.x2, x, o)
		rmsNormRows(threads, la.xn2, la.inv2, la.x2, lw.mlpNorm, rows, d, c.RMSNormEps)
		m.linear(threads, la.gate, la.xn2, lw.gate, lp.gate, rows, in, d)
		m.linear(threads, la.up, la.xn2, lw.up, lp.up, rows, in, d)
		m.loraAdd(threads, seqs, l, tGate, la.gate, la.xn2, in, d)
		m.loraAdd(threads, seqs, l, tUp, la.up, la.xn2, in, d)
		swiglu(threads, la.act, la.sig, la.gate, la.up)
		m.linear(threads, down, la.act, lw.d, lp.d, rows, d, in)
		m.loraAdd(threads, seqs, l, tDown, down, la.act, d, in)
		next := x // without keep, this layer's input is no longer needed
		if keep {
			next = make([]T, rows*d)
		}
		addRows(threads, next, la.x2, down)
		x = next
	}
	a.xf = x
	a.invf = make([]float64, rows)
	xnf := make([]T, rows*d)
	rmsNormRows(threads, xnf, a.invf, x, m.w.norm, rows, d, c.RMSNormEps)
	out := make([]T, len(outRows)*d)
	for i, r := range outRows {
		copy(out[i*d:(i+1)*d], xnf[r*d:(r+1)*d])
	}
	a.xnfOut = out
	return a
}

// rmsNormRows sets dst = w ⊙ x/rms(x) row by row and records 1/rms per row.
func rmsNormRows[T Float](threads int, dst []T, inv []float64, x, w []T, rows, d int, eps float64) {
	parallelFor(threads, rows, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			xr, yr := x[r*d:(r+1)*d], dst[r*d:(r+1)*d]
			ss := 0.0
			for _, v := range xr {
				ss += float64(float64(v) * float64(v))
			}
			iv := 1 / math.Sqrt(ss/float64(d)+eps)
			inv[r] = iv
			for i, v := range xr {
				yr[i] = T(T(float64(v)*iv) * w[i])
			}
		}
	})
}

func addRows[T Float](threads int, dst, a, b []T) {
	parallelFor(threads, len(dst), 1<<14, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			dst[i] = a[i] + b[i]
		}
	})
}

// swiglu sets act = silu(gate)·up, recording σ(gate) in sig unless sig is nil.
func swiglu[T Float](threads int, act, sig, gate, up []T) {
	parallelFor(threads, len(act), 1<<13, func(lo, hi int) {
		var e [256]float64
		var sbuf [256]float32
		for b := lo; b < hi; b += len(e) {
			n := min(len(e), hi-b)
			done := 0
			if af, ok := any(act[b : b+n]).([]float32); ok {
				// With AVX2: four at a time, the same operations (exp_amd64.s); a value it cannot
				// take ends its run and the loops below do the rest of the chunk.
				s := sbuf[:n]
				if sig != nil {
					s = any(sig[b : b+n]).([]float32)
				}
				done = swigluSIMD(af, s, any(gate[b:b+n]).([]float32), any(up[b:b+n]).([]float32))
			}
			for i := done; i < n; i++ {
				e[i] = -math.Abs(float64(gate[b+i]))
			}
			expSlice(e[done:n], e[done:n])
			for i := done; i < n; i++ {
				g := gate[b+i]
				s := T(sigmoidExp(float64(g), e[i])) // = sigmoid64(g)
				if sig != nil {
					sig[b+i] = s
				}
				act[b+i] = T(g*s) * up[b+i]
			}
		}
	})
}

// ropeRows rotates each head of each row by its position, in the "rotate half" convention of
// transformers' Llama: pairs (i, i+headDim/2). inverse applies the opposite rotation (backward).
func (m *model[T]) ropeRows(threads int, x []T, pos []int, heads int, inverse bool) {
	hd := m.w.cfg.HeadDim
	half := hd / 2
	width := heads * hd
	parallelFor(threads, len(pos), 128, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			cs, sn := m.cos[pos[r]*half:(pos[r]+1)*half], m.sin[pos[r]*half:(pos[r]+1)*half]
			for h := range heads {
				v := x[r*width+h*hd : r*width+(h+1)*hd]
				for i := range half {
					a, b, c, s := v[i], v[i+half], cs[i], sn[i]
					if inverse {
						s = -s
					}
					v[i] = T(a*c) - T(b*s)
					v[i+half] = T(b*c) + T(a*s)
				}
			}
		}
	})
}

// attention computes la.att from la.q and the keys and values of each sequence (the batch rows,
// or its cache), one task per sequence and head.
func (m *model[T]) attention(threads int, la *layerActs[T], seqs []seqView[T], probOff []int, layer int) {
	c := m.w.cfg
	hd, qd, kvd := c.HeadDim, c.qDim(), c.kvDim()
	rep := c.Heads / c.KVHeads
	scale := 1 / math.Sqrt(float64(hd))
	maxCtx := 0
	for _, s := range seqs {
		maxCtx = max(maxCtx, s.pos0+s.n)
	}
	parallelFor(threads, len(seqs)*c.Heads, 4, func(lo, hi int) {
		scores := make([]float64, maxCtx)
		var probs []T
		if probOff == nil {
			probs = make([]T, maxCtx)
		}
		var dbuf []float32
		for task := lo; task < hi; task++ {
			si, h := task/c.Heads, task%c.Heads
			s := seqs[si]
			g := h / rep
			keys, vals := la.k[s.start*kvd:], la.v[s.start*kvd:]
			if s.cache != nil {
				keys, vals = s.cache.k[layer], s.cache.v[layer]
			}
			keys, vals = keys[g*hd:], vals[g*hd:]
			ctx := s.pos0 + s.n
			dots := dotsMatrix(&dbuf, la.q[s.start*qd+h*hd:], qd, keys, kvd, s.n, ctx, hd) // or nil
			for t := range s.n {
				r := s.start + t
				n := s.pos0 + t + 1
				var dr []T
				if dots != nil {
					dr = dots[t*ctx : t*ctx+n]
				}
				p := probs
				if probOff != nil {
					base := probOff[si] + h*s.n*(s.n+1)/2 + t*(t+1)/2
					p = la.probs[base : base+n]
				}
				attendRow(la.att[r*qd+h*hd:r*qd+(h+1)*hd], la.q[r*qd+h*hd:r*qd+(h+1)*hd], keys, vals, kvd, n, scale, p[:n], scores[:n], dr)
			}
		}
	})
}

// attendRow computes one query's attention output over n positions of keys and values (row
// stride kvd) and records the probabilities. It is the only attention code: prefill, decode and
// training all call it, so their numbers agree to the bit. dots, when not nil, holds the n dot
// products of q with the keys, computed as this function would (dotsMatrix).
func attendRow[T Float](out, q, keys, vals []T, kvd, n int, scale float64, probs []T, scores []float64, dots []T) {
	hd := len(q)
	mx := math.Inf(-1)
	s := 0
	if dots != nil {
		for i, dot := range dots[:n] {
			sc := float64(dot) * scale
			scores[i] = sc
			mx = max(mx, sc)
		}
		s = n
	}
	// Four positions at a time: four independent sums (each still in order of i) keep the adder
	// busy where one sum would wait on each addition.
	for ; s+4 <= n; s += 4 {
		k0 := keys[s*kvd : s*kvd+hd]
		k1 := keys[(s+1)*kvd : (s+1)*kvd+hd]
		k2 := keys[(s+2)*kvd : (s+2)*kvd+hd]
		k3 := keys[(s+3)*kvd : (s+3)*kvd+hd]
		var d0, d1, d2, d3 T
		for i, qv := range q {
			d0 += T(qv * k0[i])
			d1 += T(qv * k1[i])
			d2 += T(qv * k2[i])
			d3 += T(qv * k3[i])
		}
		for j, dot := range [4]T{d0, d1, d2, d3} {
			sc := float64(dot) * scale
			scores[s+j] = sc
			mx = max(mx, sc)
		}
	}
	for ; s < n; s++ {
		kr := keys[s*kvd : s*kvd+hd]
		var dot T
		for i, qv := range q {
			dot += T(qv * kr[i])
		}
		sc := float64(dot) * scale
		scores[s] = sc
		mx = max(mx, sc)
	}
	for s := range n {
		scores[s] -= mx
	}
	expSlice(scores[:n], scores[:n])
	sum := 0.0
	for _, e := range scores[:n] {
		sum += e
	}
	inv := 1 / sum
	for s := range n {
		probs[s] = T(scores[s] * inv)
	}
	if of, ok := any(out).([]float32); ok && haveSIMD && hd%16 == 0 && n > 0 {
		pf, vf := any(probs).([]float32), any(vals).([]float32)
		_ = vf[(n-1)*kvd+hd-1]
		attnOut16(&of[0], &pf[0], &vf[0], uintptr(kvd)*4, n, hd/16)
		return
	}
	clear(out)
	for s := range n {
		p := probs[s]
		vr := vals[s*kvd : s*kvd+hd]
		for i, v := range vr {
			out[i] += T(p * v)
		}
	}
}
