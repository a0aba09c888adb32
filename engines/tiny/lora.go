package tiny

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/slimen/slimen/engines"
)

// LoRA (Hu et al.): a target projection y = x·Wᵀ becomes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with A rank×in,
// B out×rank and s = alpha/rank, PEFT's scaling. The base W is shared and frozen; only A and B
// train. B starts at zero, so a new adapter computes exactly what the base does.

// LoRAConfig describes an adapter.
type LoRAConfig struct {
	Rank    int      // r; > 0
	Alpha   float64  // lora_alpha; the update is scaled by Alpha/Rank
	Dropout float64  // lora_dropout: the tiny engine trains without dropout and refuses > 0
	Targets []string // projections: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
}

// LoRATargets are the projections an adapter can target, in the order of the layer that tQ …
// tDown index: engines.LoRATargets.
var LoRATargets = engines.LoRATargets

const (
	tQ = iota
	tK
	tV
	tO
	tGate
	tUp
	tDown
	nTargets
)

// targetModule is the module path of a projection under a layer, as in PEFT's tensor names.
func targetModule(t int) string {
	if t <= tO {
		return "self_attn." + LoRATargets[t]
	}
	return "mlp." + LoRATargets[t]
}

// projShape is the out×in shape of a target projection.
func (c ModelConfig) projShape(t int) (out, in int) {
	d, qd, kvd, im := c.Hidden, c.qDim(), c.kvDim(), c.Intermediate
	switch t {
	case tQ:
		return qd, d
	case tK, tV:
		return kvd, d
	case tO:
		return d, qd
	case tGate, tUp:
		return im, d
	}
	return d, im
}

func (c LoRAConfig) validate() error {
	switch {
	case c.Rank < 1:
		return fmt.Errorf("lora rank %d; want at least 1", c.Rank)
	case !(c.Alpha > 0) || math.IsInf(c.Alpha, 0):
		return fmt.Errorf("lora alpha %v; want a finite value > 0", c.Alpha)
	case c.Dropout != 0:
		return fmt.Errorf("lora dropout %v: the tiny engine trains adapters without dropout; set it to 0", c.Dropout)
	case len(c.Targets) == 0:
		return fmt.Errorf("lora targets are empty; name at least one of %v", LoRATargets)
	}
	for _, t := range c.Targets {
		if !slices.Contains(LoRATargets, t) {
			return fmt.Errorf("lora target %q is not a projection of the model (want one of %v)", t, LoRATargets)
		}
	}
	return nil
}

// loraWeights is one adapter: A and B per layer and target projection, nil where the adapter does
// not target it.
type loraWeights[T Float] struct {
	cfg   LoRAConfig
	mc    ModelConfig
	scale T
	a, b  [][nTargets][]T // per layer
}

func newLoRA[T Float](mc ModelConfig, c LoRAConfig) *loraWeights[T] {
	l := &loraWeights[T]{cfg: c, mc: mc, scale: T(c.Alpha / float64(c.Rank)), a: make([][nTargets][]T, mc.Layers), b: make([][nTargets][]T, mc.Layers)}
	for layer := range mc.Layers {
		for t := range nTargets {
			if slices.Contains(c.Targets, LoRATargets[t]) {
				out, in := mc.projShape(t)
				l.a[layer][t], l.b[layer][t] = make([]T, c.Rank*in), make([]T, out*c.Rank)
			}
		}
	}
	return l
}

// tensors lists the adapter's parameters with PEFT's names, layer by layer, A before B.
func (l *loraWeights[T]) tensors() []namedTensor[T] {
	var out []namedTensor[T]
	for layer := range l.a {
		for t := range nTargets {
			if l.a[layer][t] == nil {
				continue
			}
			o, in := l.mc.projShape(t)
			p := fmt.Sprintf("base_model.model.model.layers.%d.%s.", layer, targetModule(t))
			out = append(out, namedTensor[T]{p + "lora_A.weight", []int{l.cfg.Rank, in}, l.a[layer][t]},
				namedTensor[T]{p + "lora_B.weight", []int{o, l.cfg.Rank}, l.b[layer][t]})
		}
	}
	return out
}

// zeros returns an adapter of the same shapes set to 0 (gradients, moments).
func (l *loraWeights[T]) zeros() *loraWeights[T] { return newLoRA[T](l.mc, l.cfg) }

// initRandom draws A as PEFT does (kaiming_uniform with a = √5: uniform in ±1/√in) and sets B
// to 0.
func (l *loraWeights[T]) initRandom(seed uint64) {
	r := rand.New(rand.NewPCG(seed, 0x6c6f_7261)) // "lora"
	for layer := range l.a {
		for t := range nTargets {
			if l.a[layer][t] == nil {
				continue
			}
			_, in := l.mc.projShape(t)
			bound := 1 / math.Sqrt(float64(in))
			for i := range l.a[layer][t] {
				l.a[layer][t][i] = T((2*r.Float64() - 1) * bound)
			}
			clear(l.b[layer][t])
		}
	}
}

// adapterGroups calls fn for each run of consecutive sequences that use the same adapter (a
// sequence's own, or def when it has none), with the rows the run covers.
func adapterGroups[T Float](seqs []seqView[T], def *loraWeights[T], fn func(ad *loraWeights[T], r0, r1 int)) {
	for i := 0; i < len(seqs); {
		ad := seqs[i].ad
		if ad == nil {
			ad = def
		}
		j := i + 1
		for j < len(seqs) && (seqs[j].ad == ad || seqs[j].ad == nil && ad == def) {
			j++
		}
		if ad != nil {
			fn(ad, seqs[i].start, seqs[j-1].start+seqs[j-1].n)
		}
		i = j
	}
}

// loraAdd adds each row group's low-rank update of target t in layer l to out (rows×n), whose
// input is x (rows×k): out += s·(x·Aᵀ)·Bᵀ. The base product is computed once for all rows
// beforehand; a row's result depends only on its own row and adapter.
func (m *model[T]) loraAdd(threads int, seqs []seqView[T], l, t int, out, x []T, n, k int) {
	adapterGroups(seqs, m.ad, func(ad *loraWeights[T], r0, r1 int) {
		a, b := ad.a[l][t], ad.b[l][t]
		if a == nil {
			return
		}
		r, rows := ad.cfg.Rank, r1-r0
		u := make([]T, rows*r)
		matMulT(threads, u, x[r0*k:r1*k], a, rows, r, k, false)
		for i := range u {
			u[i] *= ad.scale
		}
		matMulT(threads, out[r0*n:r1*n], u, b, rows, n, r, true)
	})
}

// loraBackward is loraAdd's backward pass for the trained adapter m.ad, given dy (rows×n), the
// gradient of out: it adds the gradients of A and B to ga and the gradient of x to dx.
func (m *model[T]) loraBackward(threads int, seqs []seqView[T], l, t int, dy, x, dx []T, n, k int, ga *loraWeights[T]) {
	if ga == nil {
		return
	}
	adapterGroups(seqs, m.ad, func(ad *loraWeights[T], r0, r1 int) {
		a, b := ad.a[l][t], ad.b[l][t]
		if ad != m.ad || a == nil {
			return
		}
		r, rows := ad.cfg.Rank, r1-r0
		xg, dyg := x[r0*k:r1*k], dy[r0*n:r1*n]
		u := make([]T, rows*r)
		matMulT(threads, u, xg, a, rows, r, k, false)
		for i := range u {
			u[i] *= ad.scale
		}
		matMulTN(threads, ga.b[l][t], dyg, u, rows, n, r) // dB += dyᵀ·u
		du := make([]T, rows*r)
		matMulT(threads, du, dyg, transposeOf(threads, b, n, r), rows, r, n, false) // dy·B
		for i := range du {
			du[i] *= ad.scale
		}
		matMulTN(threads, ga.a[l][t], du, xg, rows, r, k)                                    // dA += s·(dy·B)ᵀ·x
		matMulT(threads, dx[r0*k:r1*k], du, transposeOf(threads, a, r, k), rows, k, r, true) // dx += s·(dy·B)·A
	})
}

// loraTensors32 converts an adapter's tensors to the safetensors form.
func loraTensors32(l *loraWeights[float32]) []tensor {
	var ts []tensor
	for _, t := range l.tensors() {
		ts = append(ts, tensor{name: t.name, shape: t.shape, data: t.data})
	}
	return ts
}

// clone returns a copy of the adapter's weights.
func (l *loraWeights[T]) clone() *loraWeights[T] {
	c := l.zeros()
	c.scale = l.scale
	for layer := range l.a {
		for t := range nTargets {
			copy(c.a[layer][t], l.a[layer][t])
			copy(c.b[layer][t], l.b[layer][t])
		}
	}
	return c
}
