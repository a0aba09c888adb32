package tiny

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

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

// packed is a run of sequences laid out for forward by packTrain.
type packed[T Float] struct {
	tokens  []int32
	views   []seqView[T]
	outRows []int   // the rows whose outputs predict the response tokens
	targets []int32 // those tokens
}

// eachChunk packs seqs, in order, into chunks of at most chunk rows (a longer sequence alone) and
// calls fn with each chunk and the range lo..hi−1 of seqs it holds. Sequences never straddle
// chunks, so per-sequence losses (gspo) see all their tokens at once. Every sequence has a
// response.
func eachChunk[T Float](ctx context.Context, seqs []trainSeq, chunk int, fn func(lo, hi int, p packed[T])) error {
	for lo := 0; lo < len(seqs); {
		if err := ctx.Err(); err != nil {
			return err
		}
		hi, rows := lo, 0
		for hi < len(seqs) && (hi == lo || rows+len(seqs[hi].prompt)+len(seqs[hi].response)-1 <= chunk) {
			rows += len(seqs[hi].prompt) + len(seqs[hi].response) - 1
			hi++
		}
		var p packed[T]
		p.tokens, p.views, p.outRows, p.targets = packTrain[T](seqs[lo:hi])
		fn(lo, hi, p)
		lo = hi
	}
	return nil
}

// accumulate runs forward and backward over seqs chunk by chunk: step evaluates the loss on the
// chunk holding seqs[lo:hi] and adds its gradient to g. It returns the gradient (of the weights,
// or of the adapter m.ad when the model has one) and the summed statistics.
func (m *model[T]) accumulate(ctx context.Context, threads, chunk int, seqs []trainSeq,
	step func(lo, hi int, p packed[T], g grads[T], wt *transposedWeights[T]) lossStats) (lossStats, grads[T], error) {
	var total lossStats
	var g grads[T]
	if m.ad != nil {
		g.ad = m.ad.zeros()
	} else {
		g.w = m.w.zeros()
	}
	wt := m.transposed(threads)
	err := eachChunk(ctx, seqs, chunk, func(lo, hi int, p packed[T]) {
		total.add(step(lo, hi, p, g, wt))
	})
	if err != nil {
		return total, grads[T]{}, err
	}
	return total, g, nil
}

// accumulateGrads returns the gradient of the loss that lossFn defines on the per-token
// log-probabilities and entropies (and reference log-probabilities, when ref is given), with the
// summed statistics.
func (m *model[T]) accumulateGrads(ctx context.Context, threads, chunk int, seqs []trainSeq, ref *model[T], lossFn chunkLoss) (lossStats, *weights[T], error) {
	st, g, err := m.policyGrads(ctx, threads, chunk, seqs, ref, lossFn)
	return st, g.w, err
}

// policyGrads is accumulateGrads for a model that may train an adapter (m.ad).
func (m *model[T]) policyGrads(ctx context.Context, threads, chunk int, seqs []trainSeq, ref *model[T], lossFn chunkLoss) (lossStats, grads[T], error) {
	vocab := m.w.cfg.VocabSize
	pm := m.packed(threads) // the weights change only after the step
	if ref != nil {
		ref = ref.packed(threads)
	}
	return m.accumulate(ctx, threads, chunk, seqs, func(lo, hi int, p packed[T], g grads[T], wt *transposedWeights[T]) lossStats {
		var refLogp [][]float64
		if ref != nil {
			logits, _ := ref.forward(threads, p.tokens, p.views, p.outRows, false)
			lp, _ := tokenLogprobs(threads, logits, p.targets, vocab)
			refLogp = splitBySeq(lp, seqs[lo:hi])
		}
		logits, a := pm.forward(threads, p.tokens, p.views, p.outRows, true)
		lp, ent := tokenLogprobs(threads, logits, p.targets, vocab)
		st, dLogp, dEnt := lossFn(lo, splitBySeq(lp, seqs[lo:hi]), splitBySeq(ent, seqs[lo:hi]), refLogp)
		dlogits := make([]T, len(logits))
		logitsGrad(threads, dlogits, logits, p.targets, vocab, concat(dLogp), concat(dEnt))
		m.backwardG(threads, p.tokens, p.views, p.outRows, a, dlogits, g, wt)
		return st
	})
}

// valueChunkLoss maps the values of the sequences first..first+n−1 (one per response token) to
// loss statistics and the gradient of the loss with respect to each value.
type valueChunkLoss func(first int, values [][]float64) (lossStats, [][]float64)

// accumulateValueGrads returns the gradient of the loss that lossFn defines on the value head's
// per-token values (the model must have a value head), with the summed statistics.
func (m *model[T]) accumulateValueGrads(ctx context.Context, threads, chunk int, seqs []trainSeq, lossFn valueChunkLoss) (lossStats, *weights[T], error) {
	pm := m.packed(threads)
	st, g, err := m.accumulate(ctx, threads, chunk, seqs, func(lo, hi int, p packed[T], g grads[T], wt *transposedWeights[T]) lossStats {
		v, a := pm.values(threads, p.tokens, p.views, p.outRows, true)
		st, dV := lossFn(lo, splitBySeq(f64(v), seqs[lo:hi]))
		m.valueBackward(threads, p.tokens, p.views, p.outRows, a, fromF64[T](concat(dV)), g.w, wt)
		return st
	})
	return st, g.w, err
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
			if c.useTIS && len(s.OldLogp) == 0 {
				// The trainer's old log-probs are those of the weights before this step: the
				// current ones, held constant by policyLoss.
				s.OldLogp = logp[i]
			}
			if refLogp != nil {
				s.RefLogp = refLogp[i]
			}
			chunk[i] = s
		}
		return policyLoss(chunk, w[first:first+len(chunk)], c)
	}
}

// criticChunkLoss evaluates the value loss on each chunk: samples carry the batch's returns,
// old values and masks, w the batch-wide token weights.
func criticChunkLoss(samples []lossSample, w [][]float64, c lossConfig) valueChunkLoss {
	return func(first int, values [][]float64) (lossStats, [][]float64) {
		chunk := make([]lossSample, len(values))
		for i := range chunk {
			chunk[i] = samples[first+i]
			chunk[i].Values = values[i]
		}
		return valueLoss(chunk, w[first:first+len(chunk)], c)
	}
}

// Train runs one optimizer step on the batch, then AdamW with global gradient-norm clipping. The
// loss is the policy loss of docs/architecture.md (see policyLoss), or, when the samples carry Returns (a PPO
// critic), the clipped value loss of the value head (see valueLoss), which is created on first use
// and trains with the whole model. A non-finite loss or gradient skips the step (reported in
// TrainStats) and leaves weights and optimizer state untouched. The step is deterministic: the
// same weights and batch give the same new weights to the bit, for any number of threads.
func (e *Engine) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	return e.train(ctx, b, nil)
}

// train is Train of the base weights (ad nil) or of one adapter, whose KL reference is the base.
func (e *Engine) train(ctx context.Context, b engines.Batch, ad *adapterState) (engines.TrainStats, error) {
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
	critic := slices.ContainsFunc(b.Samples, func(s engines.Sample) bool { return len(s.Returns) > 0 })
	all := make([]lossSample, len(b.Samples))
	for i, s := range b.Samples {
		if err := e.checkSample(s, critic, lc); err != nil {
			return engines.TrainStats{}, fmt.Errorf("tiny: train: sample %d: %w", i, err)
		}
		all[i] = lossSample{Group: s.Group, OldLogp: f64(s.OldLogprobs), Adv: f64(s.Advantages), Mask: f64(s.LossMask),
			Returns: f64(s.Returns), OldValues: f64(s.OldValues)}
		if lc.useTIS && !critic {
			// The rollout's log-probs only divide the TIS ratio; the PPO ratio's old log-probs are
			// the trainer's (policyChunkLoss fills them in when the host sent none).
			all[i].RolloutLogp, all[i].OldLogp = all[i].OldLogp, f64(s.TrainLogprobs)
		}
	}
	// The weights count every sample of the step, those with an empty response too (slime's
	// reductions count a sample without trained tokens); only the others are run.
	allW := tokenWeights(all, lc.aggregation)
	var seqs []trainSeq
	var samples []lossSample
	var w [][]float64
	for i, s := range b.Samples {
		if len(s.Response) > 0 {
			seqs = append(seqs, trainSeq{prompt: s.Prompt, response: s.Response})
			samples = append(samples, all[i])
			w = append(w, allW[i])
		}
	}
	if critic && ad != nil {
		return engines.TrainStats{}, errors.New("tiny: train: a LoRA adapter has no value head; a PPO critic trains full weights")
	}
	if ad != nil {
		m := *e.m
		m.ad = ad.w
		st, g, err := m.policyGrads(ctx, e.threads, chunkTokens, seqs, e.m, policyChunkLoss(samples, w, lc))
		if err != nil {
			return engines.TrainStats{}, err
		}
		out := policyStats(st)
		return finishStep(out, g.ad.tensors(), func(scale float64) { ad.opt.updateTensors(ad.w.tensors(), g.ad.tensors(), oc, scale) }, oc), nil
	}
	if critic {
		e.ensureValueHead()
		st, g, err := e.m.accumulateValueGrads(ctx, e.threads, chunkTokens, seqs, criticChunkLoss(samples, w, lc))
		if err != nil {
			return engines.TrainStats{}, err
		}
		return e.applyStep(engines.TrainStats{Loss: st.Loss, ValueLoss: st.Loss, Tokens: st.Tokens, ClipFrac: st.clipFrac()}, g, oc), nil
	}
	var ref *model[float32]
	if lc.klCoef > 0 {
		ref = e.ref
	}
	st, g, err := e.m.accumulateGrads(ctx, e.threads, chunkTokens, seqs, ref, policyChunkLoss(samples, w, lc))
	if err != nil {
		return engines.TrainStats{}, err
	}
	out := policyStats(st)
	return e.applyStep(out, g, oc), nil
}

// policyStats reports a policy step's statistics.
func policyStats(st lossStats) engines.TrainStats {
	out := engines.TrainStats{Loss: st.Loss, PGLoss: st.PG, KL: st.KL, Entropy: st.Entropy, Tokens: st.Tokens, ClipFrac: st.clipFrac()}
	out.TISClipFrac, out.TISWeight = st.tisStats()
	out.LogprobDiffMean, out.LogprobDiffMax, out.LogprobAbsDiff = st.diffStats()
	return out
}

// ensureValueHead gives the model a zero value head, and the optimizer its moments, unless it has
// one. The caller holds the write lock.
func (e *Engine) ensureValueHead() {
	if e.m.w.score == nil {
		e.m.w.addValueHead()
		e.opt.grow(e.m.w)
	}
}

// applyStep finishes a step: it skips it when there is nothing to learn from or a number is not
// finite, otherwise clips the gradients and updates the weights.
func (e *Engine) applyStep(st engines.TrainStats, g *weights[float32], oc optimConfig) engines.TrainStats {
	return finishStep(st, g.tensors(), func(scale float64) { e.opt.update(e.m.w, g, oc, scale) }, oc)
}

// finishStep is applyStep for the gradients g, which update applies with the gradient scale.
func finishStep(st engines.TrainStats, g []namedTensor[float32], update func(scale float64), oc optimConfig) engines.TrainStats {
	st.GradNorm = tensorsNorm(g)
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
	update(scale)
	return st
}

// checkSample checks one sample of a batch: a policy sample needs a loss mask, old log-probs and
// advantages per response token; a critic sample (critic: the batch carries returns) a loss mask
// and returns per token, and old values where value clipping is on. The policy fields of a critic
// sample are ignored.
func (e *Engine) checkSample(s engines.Sample, critic bool, lc lossConfig) error {
	n := len(s.Response)
	switch {
	case critic && (len(s.LossMask) != n || len(s.Returns) != n):
		return fmt.Errorf("response has %d tokens but loss_mask %d, returns %d entries "+
			"(a critic batch needs returns for every sample)", n, len(s.LossMask), len(s.Returns))
	case critic && lc.valueClip > 0 && len(s.OldValues) != n:
		return fmt.Errorf("response has %d tokens but old_values %d entries (value_clip needs old_values for every sample)", n, len(s.OldValues))
	case critic && len(s.OldValues) != 0 && len(s.OldValues) != n:
		return fmt.Errorf("response has %d tokens but old_values %d entries", n, len(s.OldValues))
	case !critic && (len(s.LossMask) != n || len(s.OldLogprobs) != n || len(s.Advantages) != n):
		return fmt.Errorf("response has %d tokens but loss_mask %d, old_logprobs %d, advantages %d entries",
			n, len(s.LossMask), len(s.OldLogprobs), len(s.Advantages))
	case !critic && len(s.TrainLogprobs) != 0 && len(s.TrainLogprobs) != n:
		return fmt.Errorf("response has %d tokens but train_logprobs %d entries (give one per token, or none)", n, len(s.TrainLogprobs))
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

func f64[T Float](v []T) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func fromF64[T Float](v []float64) []T {
	out := make([]T, len(v))
	for i, x := range v {
		out[i] = T(x)
	}
	return out
}
