package tiny

import (
	"math"
	"math/rand/v2"
	"testing"
)

// The whole forward and backward pass, with the SIMD kernels and with the portable loops, on a
// model whose shapes exercise every edge: head_dim 32 (two 16-column groups in the attention
// kernels), widths off the 16-column panels, sequences of 1 to 40 tokens. Logits and every
// gradient must agree bit for bit.
func TestSIMDForwardBackwardMatchPortable(t *testing.T) {
	if !haveSIMD {
		t.Skip("no SIMD kernels on this CPU")
	}
	defer func(saved bool) { haveSIMD = saved }(haveSIMD)
	cfg := ModelConfig{VocabSize: 37, Hidden: 40, Intermediate: 56, Layers: 2, Heads: 4, KVHeads: 2,
		HeadDim: 32, MaxSeqLen: 64, RMSNormEps: 1e-5, RopeTheta: 10000, TieEmbeddings: false}
	w := newWeights[float32](cfg)
	w.initRandom(3)
	r := rand.New(rand.NewPCG(5, 6))
	var seqs []trainSeq
	for _, n := range []int{1, 2, 7, 40, 13} {
		var s trainSeq
		for range n {
			s.prompt = append(s.prompt, int32(r.IntN(cfg.VocabSize)))
		}
		s.response = []int32{int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))}
		seqs = append(seqs, s)
	}
	tokens, views, outRows, targets := packTrain[float32](seqs)
	dl := make([]float32, len(outRows)*cfg.VocabSize)
	for i := range dl {
		dl[i] = float32(r.NormFloat64())
	}
	run := func(simd bool) ([]float32, []float64, *weights[float32]) {
		haveSIMD = simd
		m := newModel(w).packed(2)
		logits, a := m.forward(2, tokens, views, outRows, true)
		lp, _ := tokenLogprobs(2, logits, targets, cfg.VocabSize)
		g := w.zeros()
		m.backward(2, tokens, views, outRows, a, dl, g, m.transposed(2))
		return logits, lp, g
	}
	l0, lp0, g0 := run(false)
	l1, lp1, g1 := run(true)
	for i := range l0 {
		if math.Float32bits(l0[i]) != math.Float32bits(l1[i]) {
			t.Fatalf("logit %d: portable %v, simd %v", i, l0[i], l1[i])
		}
	}
	for i := range lp0 {
		if math.Float64bits(lp0[i]) != math.Float64bits(lp1[i]) {
			t.Fatalf("log-prob %d: portable %v, simd %v", i, lp0[i], lp1[i])
		}
	}
	t0, t1 := g0.tensors(), g1.tensors()
	for k := range t0 {
		for i := range t0[k].data {
			if math.Float32bits(t0[k].data[i]) != math.Float32bits(t1[k].data[i]) {
				t.Fatalf("gradient of %s[%d]: portable %v, simd %v", t0[k].name, i, t0[k].data[i], t1[k].data[i])
			}
		}
	}
}

// SwiGLU with AVX2 gives the portable loop's bits for every gate: ±0, subnormals, infinities,
// NaN, values beyond the vector exp's range, and lengths off the 4-wide blocks.
func TestSwigluSIMDMatchesPortable(t *testing.T) {
	if !haveSIMD {
		t.Skip("no SIMD kernels on this CPU")
	}
	defer func(saved bool) { haveSIMD = saved }(haveSIMD)
	r := rand.New(rand.NewPCG(13, 14))
	specials := []float32{0, float32(math.Copysign(0, -1)), 1e-40, -1e-40, float32(math.Inf(1)), float32(math.Inf(-1)),
		float32(math.NaN()), 706.9, -706.9, 707.1, -707.1, 800, -800, 3e38, -3e38, 88, -88, 1, -1}
	const n = 5000
	gate, up := make([]float32, n), make([]float32, n)
	for i := range gate {
		switch {
		case i < len(specials):
			gate[i] = specials[i]
		case r.IntN(50) == 0:
			gate[i] = specials[r.IntN(len(specials))]
		default:
			gate[i] = float32(4 * r.NormFloat64())
		}
		up[i] = float32(r.NormFloat64())
	}
	for _, off := range []int{0, 100} {
		for _, m := range []int{n - 100, n - 101, 3, 7, 300} {
			for _, withSig := range []bool{true, false} {
				out := func(simd bool) ([]float32, []float32) {
					haveSIMD = simd
					act := make([]float32, m)
					var sig []float32
					if withSig {
						sig = make([]float32, m)
					}
					// From 0 the specials come first; from 100 only now and then.
					swiglu(2, act, sig, gate[off:off+m], up[off:off+m])
					return act, sig
				}
				a0, s0 := out(false)
				a1, s1 := out(true)
				for i := range m {
					if math.Float32bits(a0[i]) != math.Float32bits(a1[i]) && !(a0[i] != a0[i] && a1[i] != a1[i]) {
						t.Fatalf("m=%d: act(gate %v, up %v) = %v with SIMD, %v without", m, gate[off+i], up[off+i], a1[i], a0[i])
					}
					if withSig && math.Float32bits(s0[i]) != math.Float32bits(s1[i]) && !(s0[i] != s0[i] && s1[i] != s1[i]) {
						t.Fatalf("m=%d: σ(%v) = %v with SIMD, %v without", m, gate[off+i], s1[i], s0[i])
					}
				}
			}
		}
	}
}
