package tiny

import (
	"context"
	"fmt"
	"math"

	"github.com/slimen/slimen/engines"
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

// Train runs one optimizer step on the batch with the policy loss of DESIGN §4 (see policyLoss),
// then AdamW with global gradient-norm clipping. A non-finite loss or gradient skips the step
// (reported in TrainStats) and leaves weights and optimizer state untouched. The step is
// deterministic: the same weights and batch give the same new weights to the bit, for any number
// of threads.
func (e *Engine) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return engines.TrainStats{}, ErrClosed
	}
	lc, err := resolveLoss(b.Loss)
	if err != nil {
		return engines.TrainStats{}, fmt.Errorf("tiny: train: %w", err)
	}
	oc, err := resolveOptim(b.Loss.LR, b.Loss.Beta1, b.Loss.Beta2, b.Loss.AdamEps, b.Loss.WeightDecay, b.Loss.MaxGradNorm)
	if err != nil {
		return engines.TrainStats{}, fmt.Errorf("tiny: train: %w", err)
	}
	var seqs []trainSeq
	var samples []lossSample
	for i, s := range b.Samples {
		if err := e.checkSample(s); err != nil {
			return engines.TrainStats{}, fmt.Errorf("tiny: train: sample %d: %w", i, err)
		}
		if len(s.Response) == 0 {
			continue
		}
		seqs = append(seqs, trainSeq{prompt: s.Prompt, response: s.Response})
		samples = append(samples, lossSample{Group: s.Group, OldLogp: f64(s.OldLogprobs), Adv: f64(s.Advantages), Mask: f64(s.LossMask)})
	}
	w := tokenWeights(samples, lc.aggregation)
	var ref *model[float32]
	if lc.klCoef > 0 {
		ref = e.ref
	}
	st, g, err := e.m.accumulateGrads(ctx, e.threads, chunkTokens, seqs, ref, policyChunkLoss(samples, w, lc))
	if err != nil {
		return engines.TrainStats{}, err
	}
	out := engines.TrainStats{Loss: st.Loss, PGLoss: st.PG, KL: st.KL, Entropy: st.Entropy, Tokens: st.Tokens}
	if st.Tokens > 0 {
		out.ClipFrac = float64(st.Clipped) / float64(st.Tokens)
	}
	return e.applyStep(out, g, oc), nil
}

// applyStep finishes a step: it skips it when there is nothing to learn from or a number is not
// finite, otherwise clips the gradients and updates the weights.
func (e *Engine) applyStep(st engines.TrainStats, g *weights[float32], oc optimConfig) engines.TrainStats {
	st.GradNorm = gradNorm(g)
	switch {
	case st.Tokens == 0:
		st.Skipped, st.Reason = true, "no trained tokens: every loss mask is 0"
	case math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0):
		st.Skipped, st.Reason = true, fmt.Sprintf("loss is %v", st.Loss)
	case math.IsNaN(st.GradNorm) || math.IsInf(st.GradNorm, 0):
		st.Skipped, st.Reason = true, fmt.Sprintf("gradient norm is %v", st.GradNorm)
	}
	if st.Skipped {
		return st
	}
	scale := 1.0
	if oc.maxGradNorm > 0 && st.GradNorm > oc.maxGradNorm {
		scale = oc.maxGradNorm / (st.GradNorm + 1e-6) // torch.nn.utils.clip_grad_norm_
	}
	e.opt.update(e.m.w, g, oc, scale)
	return st
}

func (e *Engine) checkSample(s engines.Sample) error {
	n := len(s.Response)
	switch {
	case len(s.LossMask) != n || len(s.OldLogprobs) != n || len(s.Advantages) != n:
		return fmt.Errorf("response has %d tokens but loss_mask %d, old_logprobs %d, advantages %d entries", n, len(s.LossMask), len(s.OldLogprobs), len(s.Advantages))
	case len(s.Prompt) == 0 && n > 0:
		return fmt.Errorf("the prompt is empty: the first response token needs a position to be predicted from")
	case len(s.Prompt)+n > e.m.w.cfg.MaxSeqLen:
		return fmt.Errorf("prompt and response are %d tokens; the model takes at most %d", len(s.Prompt)+n, e.m.w.cfg.MaxSeqLen)
	}
	if err := e.checkTokens(s.Prompt); err != nil {
		return fmt.Errorf("prompt: %w", err)
	}
	if err := e.checkTokens(s.Response); err != nil {
		return fmt.Errorf("response: %w", err)
	}
	return nil
}

func f64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}
