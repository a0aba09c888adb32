package tiny

import (
	"context"
	"fmt"
	"math"
)

// trainSeq is one training sequence: the model reads prompt + response[:len−1] and is scored on
// each response token.
type trainSeq struct {
	prompt, response []int32
}

// chunkTokens bounds the rows of one forward/backward pass: the activations of a d_model 64,
// two-layer model take about 10 KB a row, so a chunk stays near 40 MB however large the batch.
const chunkTokens = 4096

// chunkLoss maps the per-token log-probabilities and entropies of the sequences first..first+n−1
// (and, when a reference model is given, the reference log-probabilities) to loss statistics and
// the gradient of the loss with respect to each of them.
type chunkLoss func(first int, logp, ent, refLogp [][]float64) (lossStats, [][]float64, [][]float64)

// accumulateGrads runs forward and backward over seqs, chunk by chunk in order, and returns the
// gradient of the loss that lossFn defines, with the summed statistics. Sequences never straddle
// chunks, so per-sequence losses (gspo) see all their tokens at once.
func (m *model[T]) accumulateGrads(ctx context.Context, threads, chunk int, seqs []trainSeq, ref *model[T], lossFn chunkLoss) (lossStats, *weights[T], error) {
	var total lossStats
	g := newWeights[T](m.w.cfg)
	wt := m.transposed(threads)
	for lo := 0; lo < len(seqs); {
		if err := ctx.Err(); err != nil {
			return total, nil, err
		}
		hi, rows := lo, 0
		for hi < len(seqs) && (hi == lo || rows+len(seqs[hi].prompt)+len(seqs[hi].response)-1 <= chunk) {
			rows += len(seqs[hi].prompt) + len(seqs[hi].response) - 1
			hi++
		}
		tokens, views, outRows, targets := packTrain[T](seqs[lo:hi])
		var refLogp [][]float64
		if ref != nil {
			logits, _ := ref.forward(threads, tokens, views, outRows, false)
			lp, _ := tokenLogprobs(threads, logits, targets, m.w.cfg.VocabSize)
			refLogp = splitBySeq(lp, seqs[lo:hi])
		}
		logits, a := m.forward(threads, tokens, views, outRows, true)
		lp, ent := tokenLogprobs(threads, logits, targets, m.w.cfg.VocabSize)
		st, dLogp, dEnt := lossFn(lo, splitBySeq(lp, seqs[lo:hi]), splitBySeq(ent, seqs[lo:hi]), refLogp)
		total.Loss += st.Loss
		total.PG += st.PG
		total.KL += st.KL
		total.Entropy += st.Entropy
		total.Clipped += st.Clipped
		total.Tokens += st.Tokens
		dlogits := make([]T, len(logits))
		logitsGrad(threads, dlogits, logits, targets, m.w.cfg.VocabSize, concat(dLogp), concat(dEnt))
		m.backward(threads, tokens, views, outRows, a, dlogits, g, wt)
		lo = hi
	}
	return total, g, nil
}

// packTrain lays sequences out for forward: rows, views, the rows that predict response tokens and
// those tokens.
func packTrain[T Float](seqs []trainSeq) (tokens []int32, views []seqView[T], outRows []int, targets []int32) {
	for _, s := range seqs {
		start := len(tokens)
		tokens = append(tokens, s.prompt...)
		tokens = append(tokens, s.response[:len(s.response)-1]...)
		views = append(views, seqView[T]{start: start, n: len(tokens) - start})
		for i := range s.response {
			outRows = append(outRows, start+len(s.prompt)-1+i)
		}
		targets = append(targets, s.response...)
	}
	return tokens, views, outRows, targets
}

func splitBySeq(v []float64, seqs []trainSeq) [][]float64 {
	out := make([][]float64, len(seqs))
	for i, s := range seqs {
		out[i], v = v[:len(s.response)], v[len(s.response):]
	}
	return out
}

func concat(v [][]float64) []float64 {
	var out []float64
	for _, x := range v {
		out = append(out, x...)
	}
	return out
}

// gradNorm returns the global L2 norm of the gradients, summed in parameter order.
func gradNorm[T Float](g *weights[T]) float64 {
	s := 0.0
	for _, t := range g.tensors() {
		for _, v := range t.data {
			s += float64(float64(v) * float64(v))
		}
	}
	return math.Sqrt(s)
}

// adamState is AdamW's state: step count and first and second moments per parameter tensor, in
// the parameters' canonical order.
type adamState struct {
	step int64
	m, v [][]float32
}

func newAdamState(w *weights[float32]) *adamState {
	o := &adamState{}
	for _, t := range w.tensors() {
		o.m = append(o.m, make([]float32, len(t.data)))
		o.v = append(o.v, make([]float32, len(t.data)))
	}
	return o
}

// optimConfig is the optimizer part of a LossConfig, defaults resolved.
type optimConfig struct {
	lr, beta1, beta2, eps, weightDecay, maxGradNorm float64
}

func resolveOptim(lr, beta1, beta2, eps, wd, maxNorm float64) (optimConfig, error) {
	c := optimConfig{lr, beta1, beta2, eps, wd, maxNorm}
	if c.beta1 == 0 {
		c.beta1 = 0.9
	}
	if c.beta2 == 0 {
		c.beta2 = 0.999
	}
	if c.eps == 0 {
		c.eps = 1e-8
	}
	if !(c.lr >= 0) || !(c.beta1 > 0 && c.beta1 < 1) || !(c.beta2 > 0 && c.beta2 < 1) || !(c.eps > 0) || !(c.weightDecay >= 0) || !(c.maxGradNorm >= 0) {
		return c, fmt.Errorf("optimizer settings out of range: lr %g, beta1 %g, beta2 %g, adam_eps %g, weight_decay %g, max_grad_norm %g (want lr ≥ 0, betas in (0,1), eps > 0, decay and norm ≥ 0)",
			lr, beta1, beta2, eps, wd, maxNorm)
	}
	return c, nil
}

// update applies one AdamW step (PyTorch's algorithm: decoupled weight decay p ← p(1 − lr·wd),
// then p ← p − lr·m̂/(√v̂ + eps)) with the gradients scaled by gradScale. As in Megatron, norm
// weights (the 1-D tensors) are not decayed.
func (o *adamState) update(w, g *weights[float32], c optimConfig, gradScale float64) {
	o.step++
	bc1 := 1 - math.Pow(c.beta1, float64(o.step))
	bc2 := 1 - math.Pow(c.beta2, float64(o.step))
	gt := g.tensors()
	for i, t := range w.tensors() {
		decay := c.weightDecay
		if len(t.shape) == 1 {
			decay = 0
		}
		m, v, gd := o.m[i], o.v[i], gt[i].data
		for j, p := range t.data {
			gr := float64(gd[j]) * gradScale
			mj := float64(float64(c.beta1*float64(m[j])) + float64((1-c.beta1)*gr))
			vj := float64(float64(c.beta2*float64(v[j])) + float64(float64((1-c.beta2)*gr)*gr))
			m[j], v[j] = float32(mj), float32(vj)
			np := float64(p) * (1 - float64(c.lr*decay))
			np -= float64(c.lr*float64(mj/bc1)) / (math.Sqrt(vj/bc2) + c.eps)
			t.data[j] = float32(np)
		}
	}
}

// policyChunkLoss evaluates the policy loss on each chunk: samples carry the batch's advantages,
// masks and old log-probabilities, w the batch-wide token weights.
func policyChunkLoss(samples []lossSample, w [][]float64, c lossConfig) chunkLoss {
	return func(first int, logp, ent, refLogp [][]float64) (lossStats, [][]float64, [][]float64) {
		chunk := make([]lossSample, len(logp))
		for i := range chunk {
			s := samples[first+i]
			s.Logp, s.Entropy = logp[i], ent[i]
			if refLogp != nil {
				s.RefLogp = refLogp[i]
			}
			chunk[i] = s
		}
		return policyLoss(chunk, w[first:first+len(chunk)], c)
	}
}
