package tiny

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/slimen/slimen/engines"
)

func testConfig(tied bool) ModelConfig {
	return ModelConfig{VocabSize: 11, Hidden: 8, Intermediate: 12, Layers: 2, Heads: 4, KVHeads: 2,
		HeadDim: 4, MaxSeqLen: 32, RMSNormEps: 1e-5, RopeTheta: 10000, TieEmbeddings: tied}
}

func randomSeqs(r *rand.Rand, n, vocab int) []trainSeq {
	seqs := make([]trainSeq, n)
	for i := range seqs {
		p, q := 1+r.IntN(5), 1+r.IntN(4)
		for range p {
			seqs[i].prompt = append(seqs[i].prompt, int32(r.IntN(vocab)))
		}
		for range q {
			seqs[i].response = append(seqs[i].response, int32(r.IntN(vocab)))
		}
	}
	return seqs
}

// lossOf evaluates the full pipeline (forward → per-token log-probs and entropies → policy loss)
// without gradients: the function the finite differences differentiate.
func lossOf(m, ref *model[float64], seqs []trainSeq, samples []lossSample, w [][]float64, c lossConfig) float64 {
	tokens, views, outRows, targets := packTrain[float64](seqs)
	logits, _ := m.forward(1, tokens, views, outRows, false)
	lp, ent := tokenLogprobs(1, logits, targets, m.w.cfg.VocabSize)
	rl, _ := ref.forward(1, tokens, views, outRows, false)
	refLp, _ := tokenLogprobs(1, rl, targets, m.w.cfg.VocabSize)
	all := make([]lossSample, len(samples))
	lps, ents, refs := splitBySeq(lp, seqs), splitBySeq(ent, seqs), splitBySeq(refLp, seqs)
	for i, s := range samples {
		s.Logp, s.Entropy, s.RefLogp = lps[i], ents[i], refs[i]
		all[i] = s
	}
	st, _, _ := policyLoss(all, w, c)
	return st.Loss
}

// TestGradientsMatchFiniteDifferences checks the hand-written backward pass of the whole
// transformer and the loss, in float64, against central differences.
func TestGradientsMatchFiniteDifferences(t *testing.T) {
	for _, tc := range []struct {
		name string
		tied bool
		loss engines.LossConfig
	}{
		{"ppo-untied", false, engines.LossConfig{EpsClip: 0.2, EpsClipHigh: 0.28, KLLossCoef: 0.3, KLLossType: "k3", EntropyCoef: 0.05}},
		{"gspo-tied", true, engines.LossConfig{EpsClip: 0.2, PolicyLoss: "gspo", KLLossCoef: 0.2, KLLossType: "k2", EntropyCoef: 0.1, Aggregation: "token_mean"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(11, 12))
			cfg := testConfig(tc.tied)
			w := newWeights[float64](cfg)
			w.initRandom(1)
			// Larger weights than the initialisation, so every path carries a visible gradient.
			for _, tn := range w.tensors() {
				for i := range tn.data {
					tn.data[i] += 0.3 * r.NormFloat64()
				}
			}
			refW := w.clone()
			for _, tn := range refW.tensors() {
				for i := range tn.data {
					tn.data[i] += 0.1 * r.NormFloat64()
				}
			}
			m, ref := newModel(w), newModel(refW)
			seqs := randomSeqs(r, 8, cfg.VocabSize)
			c, err := resolveLoss(tc.loss)
			if err != nil {
				t.Fatal(err)
			}
			// Old log-probs near the current ones so that some ratios are clipped and some not.
			tokens, views, outRows, targets := packTrain[float64](seqs)
			logits, _ := m.forward(1, tokens, views, outRows, false)
			lp, _ := tokenLogprobs(1, logits, targets, cfg.VocabSize)
			lps := splitBySeq(lp, seqs)
			samples := make([]lossSample, len(seqs))
			for i, s := range seqs {
				n := len(s.response)
				ls := lossSample{Group: []string{"a", "b"}[i%2], OldLogp: make([]float64, n), Adv: make([]float64, n), Mask: make([]float64, n)}
				for j := range n {
					ls.OldLogp[j] = lps[i][j] + 1.2*(r.Float64()-0.5)
					ls.Adv[j] = r.NormFloat64()
					ls.Mask[j] = 1
					if r.IntN(5) == 0 {
						ls.Mask[j] = 0
					}
				}
				samples[i] = ls
			}
			wts := tokenWeights(samples, c.aggregation)
			// A chunk of 9 rows forces several chunks, so accumulation across chunks is covered.
			st, g, err := m.accumulateGrads(context.Background(), 2, 9, seqs, ref, policyChunkLoss(samples, wts, c))
			if err != nil {
				t.Fatal(err)
			}
			if want := lossOf(m, ref, seqs, samples, wts, c); math.Abs(st.Loss-want) > 1e-12*math.Max(1, math.Abs(want)) {
				t.Fatalf("chunked loss %v, unchunked %v", st.Loss, want)
			}
			if st.Clipped == 0 || st.Clipped == st.Tokens {
				t.Fatalf("clipped %d of %d tokens: the check should cover both branches", st.Clipped, st.Tokens)
			}
			gt := g.tensors()
			checked := 0
			for ti, tn := range w.tensors() {
				for k := 0; k < 3; k++ {
					j := r.IntN(len(tn.data))
					orig := tn.data[j]
					const eps = 1e-6
					tn.data[j] = orig + eps
					lp := lossOf(m, ref, seqs, samples, wts, c)
					tn.data[j] = orig - eps
					lm := lossOf(m, ref, seqs, samples, wts, c)
					tn.data[j] = orig
					fd := (lp - lm) / (2 * eps)
					an := gt[ti].data[j]
					if math.Abs(fd-an) > 1e-6*math.Max(1e-2, math.Abs(fd)) {
						t.Errorf("%s[%d]: backward %.10g, finite difference %.10g", tn.name, j, an, fd)
					}
					checked++
				}
			}
			t.Logf("checked %d gradient entries; loss %.6f, clipped %d/%d", checked, st.Loss, st.Clipped, st.Tokens)
		})
	}
}

// valueLossOf evaluates the critic's pipeline (forward → value head → value loss) without
// gradients.
func valueLossOf(m *model[float64], seqs []trainSeq, samples []lossSample, w [][]float64, c lossConfig) float64 {
	tokens, views, outRows, _ := packTrain[float64](seqs)
	v, _ := m.values(1, tokens, views, outRows, false)
	all := make([]lossSample, len(samples))
	for i, vs := range splitBySeq(v, seqs) {
		all[i] = samples[i]
		all[i].Values = vs
	}
	st, _ := valueLoss(all, w, c)
	return st.Loss
}

// TestValueGradientsMatchFiniteDifferences checks the backward pass of the value head and the
// clipped value loss through the whole transformer against central differences, in float64.
func TestValueGradientsMatchFiniteDifferences(t *testing.T) {
	for _, tc := range []struct {
		name string
		tied bool
		loss engines.LossConfig
	}{
		{"clipped-untied", false, engines.LossConfig{ValueClip: 0.2}},
		{"unclipped-tied-token-sum", true, engines.LossConfig{Aggregation: "token_sum"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(21, 22))
			cfg := testConfig(tc.tied)
			w := newWeights[float64](cfg)
			w.initRandom(1)
			w.addValueHead()
			for _, tn := range w.tensors() {
				for i := range tn.data {
					tn.data[i] += 0.3 * r.NormFloat64()
				}
			}
			m := newModel(w)
			seqs := randomSeqs(r, 8, cfg.VocabSize)
			c, err := resolveLoss(tc.loss)
			if err != nil {
				t.Fatal(err)
			}
			// Old values within ±0.4 of the current ones, so that with a clip of 0.2 some tokens
			// take the clipped term and some not.
			tokens, views, outRows, _ := packTrain[float64](seqs)
			v, _ := m.values(1, tokens, views, outRows, false)
			vs := splitBySeq(v, seqs)
			samples := make([]lossSample, len(seqs))
			for i, s := range seqs {
				n := len(s.response)
				ls := lossSample{Group: []string{"a", "b", ""}[i%3], Mask: make([]float64, n), Returns: make([]float64, n), OldValues: make([]float64, n)}
				for j := range n {
					ls.Returns[j] = r.NormFloat64()
					ls.OldValues[j] = vs[i][j] + 0.8*(r.Float64()-0.5)
					ls.Mask[j] = 1
					if r.IntN(5) == 0 {
						ls.Mask[j] = 0
					}
				}
				samples[i] = ls
			}
			wts := tokenWeights(samples, c.aggregation)
			// A chunk of 9 rows forces several chunks.
			st, g, err := m.accumulateValueGrads(context.Background(), 2, 9, seqs, criticChunkLoss(samples, wts, c))
			if err != nil {
				t.Fatal(err)
			}
			if want := valueLossOf(m, seqs, samples, wts, c); math.Abs(st.Loss-want) > 1e-12*math.Max(1, math.Abs(want)) {
				t.Fatalf("chunked loss %v, unchunked %v", st.Loss, want)
			}
			if c.valueClip > 0 && (st.Clipped == 0 || st.Clipped == st.Tokens) {
				t.Fatalf("clipped %d of %d tokens: the check should cover both branches", st.Clipped, st.Tokens)
			}
			gt := g.tensors()
			names := map[string]bool{}
			for ti, tn := range w.tensors() {
				names[tn.name] = true
				for k := 0; k < 3; k++ {
					j := r.IntN(len(tn.data))
					orig := tn.data[j]
					const eps = 1e-6
					tn.data[j] = orig + eps
					lp := valueLossOf(m, seqs, samples, wts, c)
					tn.data[j] = orig - eps
					lm := valueLossOf(m, seqs, samples, wts, c)
					tn.data[j] = orig
					fd := (lp - lm) / (2 * eps)
					an := gt[ti].data[j]
					if math.Abs(fd-an) > 1e-6*math.Max(1e-2, math.Abs(fd)) {
						t.Errorf("%s[%d]: backward %.10g, finite difference %.10g", tn.name, j, an, fd)
					}
				}
			}
			if !names["score.weight"] || !names["score.bias"] || !names["model.layers.0.self_attn.q_proj.weight"] {
				t.Fatalf("the check did not cover the value head and the layers: %v", names)
			}
			t.Logf("loss %.6f, clipped %d/%d", st.Loss, st.Clipped, st.Tokens)
		})
	}
}
