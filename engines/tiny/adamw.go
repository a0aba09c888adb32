package tiny

import (
	"fmt"
	"math"
)

// gradNorm returns the global L2 norm of the gradients, summed in parameter order.
func gradNorm[T Float](g *weights[T]) float64 { return tensorsNorm(g.tensors()) }

// tensorsNorm is the L2 norm of tensors, summed in their order.
func tensorsNorm[T Float](ts []namedTensor[T]) float64 {
	s := 0.0
	for _, t := range ts {
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

func newAdamState(w *weights[float32]) *adamState { return newAdamStateOf(w.tensors()) }

// newAdamStateOf is a fresh optimizer state for the parameters ts.
func newAdamStateOf(ts []namedTensor[float32]) *adamState {
	o := &adamState{}
	for _, t := range ts {
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
		return c, fmt.Errorf("optimizer settings out of range: lr %g, beta1 %g, beta2 %g, adam_eps %g, weight_decay %g, "+
			"max_grad_norm %g (want lr ≥ 0, betas in (0,1), eps > 0, decay and norm ≥ 0)",
			lr, beta1, beta2, eps, wd, maxNorm)
	}
	return c, nil
}

// update applies one AdamW step (PyTorch's algorithm: decoupled weight decay p ← p(1 − lr·wd),
// then p ← p − lr·m̂/(√v̂ + eps)) with the gradients scaled by gradScale. As in Megatron, norm
// weights (the 1-D tensors) are not decayed.
func (o *adamState) update(w, g *weights[float32], c optimConfig, gradScale float64) {
	o.updateTensors(w.tensors(), g.tensors(), c, gradScale)
}

// updateTensors is update for the parameters ws with the gradients gt, in the same order.
func (o *adamState) updateTensors(ws, gt []namedTensor[float32], c optimConfig, gradScale float64) {
	o.step++
	bc1 := 1 - math.Pow(c.beta1, float64(o.step))
	bc2 := 1 - math.Pow(c.beta2, float64(o.step))
	for i, t := range ws {
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

// grow adds zero moments for the parameters of w created after the optimizer state (the value
// head, which comes last in the canonical order).
func (o *adamState) grow(w *weights[float32]) {
	for _, t := range w.tensors()[len(o.m):] {
		o.m = append(o.m, make([]float32, len(t.data)))
		o.v = append(o.v, make([]float32, len(t.data)))
	}
}
