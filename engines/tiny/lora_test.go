package tiny

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/slimen/slimen/engines"
)

func allTargetsLoRA(rank int) LoRAConfig {
	return LoRAConfig{Rank: rank, Alpha: 2 * float64(rank), Targets: LoRATargets}
}

// TestLoRAGradientsMatchFiniteDifferences checks the backward pass into an adapter's A and B (every
// target projection, the KL reference being the base without the adapter) against central
// differences, in float64, and that training an adapter leaves the base without a gradient.
func TestLoRAGradientsMatchFiniteDifferences(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	cfg := testConfig(false)
	w := newWeights[float64](cfg)
	w.initRandom(1)
	for _, tn := range w.tensors() {
		for i := range tn.data {
			tn.data[i] += 0.3 * r.NormFloat64()
		}
	}
	ad := newLoRA[float64](cfg, allTargetsLoRA(3))
	ad.initRandom(5)
	for _, tn := range ad.tensors() { // B non-zero, so that A has a gradient
		for i := range tn.data {
			tn.data[i] += 0.3 * r.NormFloat64()
		}
	}
	base := newModel(w)
	m := *base
	m.ad = ad
	seqs := randomSeqs(r, 6, cfg.VocabSize)
	c, err := resolveLoss(engines.LossConfig{EpsClip: 0.2, EpsClipHigh: 0.28, KLLossCoef: 0.3, KLLossType: "k3", EntropyCoef: 0.05})
	if err != nil {
		t.Fatal(err)
	}
	tokens, views, outRows, targets := packTrain[float64](seqs)
	logits, _ := m.forward(1, tokens, views, outRows, false)
	lp, _ := tokenLogprobs(1, logits, targets, cfg.VocabSize)
	lps := splitBySeq(lp, seqs)
	samples := make([]lossSample, len(seqs))
	for i, s := range seqs {
		n := len(s.response)
		ls := lossSample{Group: "g", OldLogp: make([]float64, n), Adv: make([]float64, n), Mask: make([]float64, n)}
		for j := range n {
			ls.OldLogp[j] = lps[i][j] + 0.8*(r.Float64()-0.5)
			ls.Adv[j] = r.NormFloat64()
			ls.Mask[j] = 1
		}
		samples[i] = ls
	}
	wts := tokenWeights(samples, c.aggregation)
	st, g, err := m.policyGrads(context.Background(), 2, 9, seqs, base, policyChunkLoss(samples, wts, c))
	if err != nil {
		t.Fatal(err)
	}
	if g.w != nil || g.ad == nil {
		t.Fatalf("training an adapter gave base gradients %v, adapter gradients %v; want only the adapter's", g.w != nil, g.ad != nil)
	}
	if want := lossOf(&m, base, seqs, samples, wts, c); math.Abs(st.Loss-want) > 1e-12*math.Max(1, math.Abs(want)) {
		t.Fatalf("chunked loss %v, unchunked %v", st.Loss, want)
	}
	gt := g.ad.tensors()
	checked := 0
	for ti, tn := range ad.tensors() {
		for range 3 {
			j := r.IntN(len(tn.data))
			orig := tn.data[j]
			const eps = 1e-6
			tn.data[j] = orig + eps
			lp := lossOf(&m, base, seqs, samples, wts, c)
			tn.data[j] = orig - eps
			lm := lossOf(&m, base, seqs, samples, wts, c)
			tn.data[j] = orig
			fd := (lp - lm) / (2 * eps)
			if an := gt[ti].data[j]; math.Abs(fd-an) > 1e-6*math.Max(1e-2, math.Abs(fd)) {
				t.Errorf("%s[%d]: backward %.10g, finite difference %.10g", tn.name, j, an, fd)
			}
			checked++
		}
	}
	t.Logf("checked %d adapter gradient entries; loss %.6f", checked, st.Loss)
}

// TestLoRAFoldedIntoWeights checks the forward pass of an adapter against the reference
// computation: the same model with s·B·A added to each target weight.
func TestLoRAFoldedIntoWeights(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	cfg := testConfig(true)
	w := newWeights[float64](cfg)
	w.initRandom(2)
	ad := newLoRA[float64](cfg, LoRAConfig{Rank: 2, Alpha: 3, Targets: []string{"q_proj", "v_proj", "o_proj", "down_proj"}})
	ad.initRandom(9)
	for _, tn := range ad.tensors() {
		for i := range tn.data {
			tn.data[i] += 0.2 * r.NormFloat64()
		}
	}
	folded := w.clone()
	for l := range cfg.Layers {
		lw := &folded.layers[l]
		for ti, dst := range [nTargets][]float64{lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.d} {
			a, b := ad.a[l][ti], ad.b[l][ti]
			if a == nil {
				continue
			}
			out, in := cfg.projShape(ti)
			for i := range out {
				for j := range in {
					s := 0.0
					for k := range ad.cfg.Rank {
						s += b[i*ad.cfg.Rank+k] * a[k*in+j]
					}
					dst[i*in+j] += float64(ad.scale) * s
				}
			}
		}
	}
	seqs := randomSeqs(r, 4, cfg.VocabSize)
	tokens, views, outRows, _ := packTrain[float64](seqs)
	m := newModel(w)
	m.ad = ad
	got, _ := m.forward(1, tokens, views, outRows, false)
	want, _ := newModel(folded).forward(1, tokens, views, outRows, false)
	for i := range got {
		if math.Abs(got[i]-want[i]) > 1e-12 {
			t.Fatalf("logit %d: adapter %v, folded weights %v", i, got[i], want[i])
		}
	}
}
