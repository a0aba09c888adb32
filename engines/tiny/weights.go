package tiny

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// weights holds a model's parameters in the Hugging Face layout: every projection is out×in,
// row-major, as PyTorch's Linear stores it.
type weights[T Float] struct {
	cfg    ModelConfig
	embed  []T // vocab×hidden
	layers []layerWeights[T]
	norm   []T // hidden
	lmHead []T // vocab×hidden; nil when the embeddings are tied
	// A PPO critic's value head (hidden → 1 on the final-norm hidden state), saved as score.weight
	// and score.bias — transformers' names for a one-label token-classification head, as the
	// PyTorch engine saves it. nil until the engine first values or trains on returns.
	score     []T // 1×hidden
	scoreBias []T // 1
}

type layerWeights[T Float] struct {
	attnNorm, q, k, v, o []T
	mlpNorm, gate, up, d []T // d is down_proj
}

// namedTensor is one parameter with its Hugging Face name; data aliases the weights.
type namedTensor[T Float] struct {
	name  string
	shape []int
	data  []T
}

func newWeights[T Float](cfg ModelConfig) *weights[T] {
	w := &weights[T]{cfg: cfg, layers: make([]layerWeights[T], cfg.Layers)}
	for _, p := range w.shapes() {
		n := 1
		for _, d := range p.shape {
			n *= d
		}
		*p.ptr = make([]T, n)
	}
	return w
}

type paramSlot[T Float] struct {
	name  string
	shape []int
	ptr   *[]T
}

// shapes lists the parameters in their canonical order (the order of gradients, optimizer state
// and the global gradient norm).
func (w *weights[T]) shapes() []paramSlot[T] {
	c := w.cfg
	d, v, q, kv, in := c.Hidden, c.VocabSize, c.qDim(), c.kvDim(), c.Intermediate
	s := []paramSlot[T]{{"model.embed_tokens.weight", []int{v, d}, &w.embed}}
	for i := range w.layers {
		l := &w.layers[i]
		p := fmt.Sprintf("model.layers.%d.", i)
		s = append(s,
			paramSlot[T]{p + "input_layernorm.weight", []int{d}, &l.attnNorm},
			paramSlot[T]{p + "self_attn.q_proj.weight", []int{q, d}, &l.q},
			paramSlot[T]{p + "self_attn.k_proj.weight", []int{kv, d}, &l.k},
			paramSlot[T]{p + "self_attn.v_proj.weight", []int{kv, d}, &l.v},
			paramSlot[T]{p + "self_attn.o_proj.weight", []int{d, q}, &l.o},
			paramSlot[T]{p + "post_attention_layernorm.weight", []int{d}, &l.mlpNorm},
			paramSlot[T]{p + "mlp.gate_proj.weight", []int{in, d}, &l.gate},
			paramSlot[T]{p + "mlp.up_proj.weight", []int{in, d}, &l.up},
			paramSlot[T]{p + "mlp.down_proj.weight", []int{d, in}, &l.d},
		)
	}
	s = append(s, paramSlot[T]{"model.norm.weight", []int{d}, &w.norm})
	if !c.TieEmbeddings {
		s = append(s, paramSlot[T]{"lm_head.weight", []int{v, d}, &w.lmHead})
	}
	if w.score != nil { // last, so that optimizer state made before the head still lines up
		s = append(s, paramSlot[T]{"score.weight", []int{1, d}, &w.score}, paramSlot[T]{"score.bias", []int{1}, &w.scoreBias})
	}
	return s
}

// addValueHead creates a zero value head: every value starts at 0, as in the PyTorch engine.
func (w *weights[T]) addValueHead() {
	w.score, w.scoreBias = make([]T, w.cfg.Hidden), make([]T, 1)
}

// zeros returns weights of the same shapes, value head included, set to 0 (gradients, moments).
func (w *weights[T]) zeros() *weights[T] {
	z := newWeights[T](w.cfg)
	if w.score != nil {
		z.addValueHead()
	}
	return z
}

// tensors lists the parameters with their data.
func (w *weights[T]) tensors() []namedTensor[T] {
	var out []namedTensor[T]
	for _, p := range w.shapes() {
		out = append(out, namedTensor[T]{p.name, p.shape, *p.ptr})
	}
	return out
}

// head is the LM head matrix: the embeddings when tied.
func (w *weights[T]) head() []T {
	if w.cfg.TieEmbeddings {
		return w.embed
	}
	return w.lmHead
}

// initRandom draws the initial weights from seed: uniform with the standard deviation
// 1/√fan_in for projections (scaled by 1/√(2·layers) for the two that feed the residual stream,
// so its variance does not grow with depth), 0.02 for the embeddings and the LM head (near-uniform
// initial predictions, as transformers' initializer_range), 1 for norms. Uniform
// rather than normal draws keep the initialisation free of transcendental functions, hence
// identical on every platform.
func (w *weights[T]) initRandom(seed uint64) {
	r := rand.New(rand.NewPCG(seed, 0x7469_6e79)) // "tiny"
	fill := func(x []T, std float64) {
		a := std * math.Sqrt(3)
		for i := range x {
			x[i] = T((2*r.Float64() - 1) * a)
		}
	}
	c := w.cfg
	resid := 1 / math.Sqrt(2*float64(c.Layers))
	fill(w.embed, 0.02)
	for i := range w.layers {
		l := &w.layers[i]
		fill(l.q, 1/math.Sqrt(float64(c.Hidden)))
		fill(l.k, 1/math.Sqrt(float64(c.Hidden)))
		fill(l.v, 1/math.Sqrt(float64(c.Hidden)))
		fill(l.o, resid/math.Sqrt(float64(c.qDim())))
		fill(l.gate, 1/math.Sqrt(float64(c.Hidden)))
		fill(l.up, 1/math.Sqrt(float64(c.Hidden)))
		fill(l.d, resid/math.Sqrt(float64(c.Intermediate)))
		for j := range l.attnNorm {
			l.attnNorm[j], l.mlpNorm[j] = 1, 1
		}
	}
	for j := range w.norm {
		w.norm[j] = 1
	}
	if w.lmHead != nil {
		fill(w.lmHead, 0.02)
	}
}

// convertWeights copies weights into another element type (float64 for gradient checks).
func convertWeights[U, T Float](w *weights[T]) *weights[U] {
	u := newWeights[U](w.cfg)
	if w.score != nil {
		u.addValueHead()
	}
	src, dst := w.tensors(), u.tensors()
	for i := range src {
		for j, x := range src[i].data {
			dst[i].data[j] = U(x)
		}
	}
	return u
}

// clone returns a deep copy.
func (w *weights[T]) clone() *weights[T] { return convertWeights[T](w) }
