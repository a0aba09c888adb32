package gpus

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/slimen/slimen/host/config"
)

// Placement defaults, the worker's own (engines/torch/slimen_torch/engine.py): a cache of at most
// 256 rows of 4,096 positions, taking at most 40% of the memory free once the weights are loaded.
const (
	defaultSlots      = 256
	defaultMaxLen     = 4096
	kvMemoryFraction  = 0.4
	minSlots          = 1
	bytesFP32         = 4
	adamWBytesPerElem = 2 * bytesFP32 // two fp32 moments
)

// Estimate is a worker's memory on its GPU, in bytes: the weights it serves, the frozen KL
// reference it loads when the policy uses a KL term, and for a trainable policy the fp32
// gradients and AdamW state (the two moments, plus an fp32 master copy when the weights are
// bf16), and the KV cache of Slots rows × MaxLen positions. Activations are not counted. A worker
// of Ranks > 1 ranks (num_gpus_per_node, under torchrun) holds on each of its GPUs the full
// weights (it generates from them) and 1/Ranks of the gradients and AdamW state with its fp32
// master shard (FSDP2): the estimate is one rank's.
type Estimate struct {
	Weights, Reference, Gradients, Optimizer, KVCache uint64
	Slots, MaxLen, Ranks                              int
}

// Fixed is the estimate without the KV cache (what is resident before the cache is sized).
func (e Estimate) Fixed() uint64 { return e.Weights + e.Reference + e.Gradients + e.Optimizer }

// Total is the whole estimate.
func (e Estimate) Total() uint64 { return e.Fixed() + e.KVCache }

func (e Estimate) String() string {
	s := "weights " + GiB(e.Weights)
	if e.Reference > 0 {
		s += ", KL reference " + GiB(e.Reference)
	}
	if e.Gradients > 0 {
		s += ", gradients " + GiB(e.Gradients) + ", AdamW state " + GiB(e.Optimizer)
		if e.Ranks > 1 {
			s += fmt.Sprintf(" (sharded over %d ranks)", e.Ranks)
		}
	}
	return s + fmt.Sprintf(", KV cache %s (%d rows × %d positions)", GiB(e.KVCache), e.Slots, e.MaxLen)
}

// Worker is one policy's local PyTorch worker as placed: the GPUs it is given (as physical
// indices; it runs on the first, the others are its slice's reserve until a worker spans several
// GPUs), where that came from, and its memory estimate on the first GPU. ExplicitSlots is set
// when engine.args gives --slots (the plan then leaves the cache as the user sized it).
type Worker struct {
	Policy        string
	GPUs          []int
	UUIDs         []string // the same GPUs by UUID (what CUDA_VISIBLE_DEVICES should name: CUDA's order may not be NVML's)
	From          string   // "placement", "engine.gpus" or "engine.device"
	Estimate      Estimate
	ExplicitSlots bool
	Shares        []string // the other policies whose workers run on the same GPU
	// Adapters are the LoRA policies after Policy that are adapters in this worker (their
	// hf_checkpoint and engine are Policy's): they start no worker and take no GPUs of their own.
	Adapters []string
	// Replicas are the GPUs of the policy's rollout slice outside its actor slice (not colocated):
	// where its rollout replicas run at rollout.max_staleness > 0 (its one-process worker then
	// keeps no weights versions, docs/async.md), one after another; empty: on the worker's own
	// GPU (a LoRA worker's replicas included).
	Replicas     []int
	ReplicaUUIDs []string
}

// LoRABaseKey is what the LoRA policies that share one torch worker have in common: the
// hf_checkpoint and the engine settings that shape the worker. host/torch opens one worker per key.
func LoRABaseKey(p config.PolicyConfig) string {
	return strings.Join([]string{"torch", p.HFCheckpoint, p.Engine.Device, strings.Join(p.Engine.GPUs, ","),
		strings.Join(p.Engine.Args, "\x00"), strconv.FormatBool(p.Engine.Deterministic)}, "\x00")
}

// loraRiders maps each LoRA policy that rides on an earlier LoRA policy's worker to that policy.
func loraRiders(c *config.Config) map[string]string {
	first, riders := map[string]string{}, map[string]string{}
	for _, p := range c.Policies {
		if !Local(p) || p.LoRA == nil {
			continue
		}
		k := LoRABaseKey(p)
		if f, ok := first[k]; ok {
			riders[p.Name] = f
		} else {
			first[k] = p.Name
		}
	}
	return riders
}

// Plan is the placement of a config's local workers on this machine's GPUs.
type Plan struct {
	// Actor, Rollout and Total size the placed policies as slime-n does (Config.GPUs' rules).
	Actor, Rollout, Total int
	Colocate              bool
	Workers               []Worker
	// NotPlaced says, per policy slimen does not place here, why.
	NotPlaced []string
}

// Worker returns the placed worker of a policy, or nil.
func (p *Plan) Worker(policy string) *Worker {
	for i := range p.Workers {
		if p.Workers[i].Policy == policy {
			return &p.Workers[i]
		}
	}
	return nil
}

// Local reports whether slimen starts this policy's worker on this machine's GPUs: a torch
// engine not told to run on the CPU.
func Local(p config.PolicyConfig) bool {
	return p.Engine.Kind == "torch" && p.Engine.Device != "cpu" && !strings.HasPrefix(p.Engine.Device, "cpu:")
}

// pinned reports whether a policy names its GPUs itself (engine.gpus, or a cuda:N engine.device):
// such a worker takes no slice and does not count in the sizing.
func pinned(p config.PolicyConfig) bool {
	return len(p.Engine.GPUs) > 0 || strings.HasPrefix(p.Engine.Device, "cuda:")
}

// ModelDir is the folder a policy's worker loads: load:, else hf_checkpoint.
func ModelDir(p config.PolicyConfig) string {
	if p.Load != "" {
		return p.Load
	}
	return p.HFCheckpoint
}

// Place gives each local torch worker of the config its GPUs and a memory estimate, and refuses
// a config that cannot fit this machine, naming the policy and the numbers.
//
// Slices follow slime-n: policy i's actor GPUs are the megatron_num_nodes·num_gpus_per_node GPUs
// after those of the policies before it in YAML order, its rollout GPUs likewise from the rollout
// offset, which is 0 with run.colocate (training and engines share GPUs) and the total of the
// actor GPUs otherwise; pinned policies (below) count for nothing. slimen's worker both trains and generates, so a policy's worker gets the
// union of its two slices. A policy with engine.gpus (or a cuda:N engine.device) is pinned there
// instead and takes no slice. models maps each placed policy's name to its model's shape.
func Place(c *config.Config, models map[string]Model, list []GPU) (*Plan, error) {
	plan := &Plan{Colocate: c.Run.Colocate}
	riders := loraRiders(c)
	for _, p := range c.Policies {
		if !Local(p) || pinned(p) || riders[p.Name] != "" {
			continue
		}
		plan.Actor += p.MegatronNumNodes * p.NumGPUsPerNode
		plan.Rollout += p.SGLangNumNodes * p.NumGPUsPerNode
	}
	plan.Total = plan.Actor + plan.Rollout
	rollOff := plan.Actor
	if c.Run.Colocate {
		plan.Total, rollOff = max(plan.Actor, plan.Rollout), 0
	}
	byIndex := map[string]int{}
	for i, g := range list {
		byIndex[strconv.Itoa(g.Index)] = i
		byIndex[g.UUID] = i
	}
	actOff := 0
	for _, p := range c.Policies {
		if !Local(p) {
			why := "engine kind " + p.Engine.Kind + ": not a worker slimen starts here"
			if p.Engine.Kind == "torch" {
				why = "engine.device " + p.Engine.Device
			}
			plan.NotPlaced = append(plan.NotPlaced, fmt.Sprintf("%s (%s)", p.Name, why))
			continue
		}
		if host := riders[p.Name]; host != "" {
			w := plan.Worker(host)
			w.Adapters = append(w.Adapters, p.Name)
			continue
		}
		a, r := p.MegatronNumNodes*p.NumGPUsPerNode, p.SGLangNumNodes*p.NumGPUsPerNode
		w := Worker{Policy: p.Name, From: "placement"}
		switch {
		case len(p.Engine.GPUs) > 0:
			w.From = "engine.gpus"
			for _, id := range p.Engine.GPUs {
				i, ok := byIndex[id]
				if !ok {
					return nil, fmt.Errorf("policy %q: engine.gpus names GPU %s, which this machine does not have (%s)", p.Name, id, describe(list))
				}
				w.GPUs, w.UUIDs = append(w.GPUs, list[i].Index), append(w.UUIDs, list[i].UUID)
			}
		case strings.HasPrefix(p.Engine.Device, "cuda:"):
			w.From = "engine.device"
			id := strings.TrimPrefix(p.Engine.Device, "cuda:")
			i, ok := byIndex[id]
			if !ok {
				return nil, fmt.Errorf("policy %q: engine.device %s names a GPU this machine does not have (%s)", p.Name, p.Engine.Device, describe(list))
			}
			w.GPUs, w.UUIDs = []int{list[i].Index}, []string{list[i].UUID}
		default:
			var slice []int
			for k := actOff; k < actOff+a; k++ {
				slice = append(slice, k)
			}
			for k := rollOff; k < rollOff+r; k++ {
				if !slices.Contains(slice, k) {
					slice = append(slice, k)
				}
			}
			slices.Sort(slice)
			if len(slice) == 0 {
				plan.NotPlaced = append(plan.NotPlaced, fmt.Sprintf("%s (num_gpus_per_node × nodes is 0: the worker takes the first GPU it sees)", p.Name))
				actOff += a
				rollOff += r
				continue
			}
			if last := slice[len(slice)-1]; last >= len(list) {
				return nil, fmt.Errorf("policy %q needs GPUs %s (%s) but this machine has %d GPU%s: the config needs %d in all (%s); "+
					"lower num_gpus_per_node, megatron_num_nodes or sglang_num_nodes, "+
					"set run.colocate, or pin the worker with engine.gpus",
					p.Name, span(slice), sizing(p), len(list), plural(len(list)), plan.Total, totals(plan))
			}
			for _, k := range slice {
				w.GPUs, w.UUIDs = append(w.GPUs, list[k].Index), append(w.UUIDs, list[k].UUID)
				if k >= rollOff && k < rollOff+r && !(k >= actOff && k < actOff+a) && a > 0 && p.LoRA == nil {
					w.Replicas, w.ReplicaUUIDs = append(w.Replicas, list[k].Index), append(w.ReplicaUUIDs, list[k].UUID)
				}
			}
		}
		if !pinned(p) {
			actOff += a
			rollOff += r
		}
		m, ok := models[p.Name]
		if !ok {
			return nil, fmt.Errorf("policy %q: no model shape for its memory estimate", p.Name)
		}
		w.Estimate, w.ExplicitSlots = fixedEstimate(p, m)
		plan.Workers = append(plan.Workers, w)
	}
	return plan, fitMemory(plan, list)
}

// fitMemory sizes the KV caches of the workers on each GPU and refuses a GPU whose workers do not
// fit its free memory. The cache budget of a GPU is the worker's share (40%) of what its workers'
// weights and optimizer leave free, split evenly among the workers whose cache the plan sizes, so
// the caches of workers sharing a GPU add up to what one worker alone would take. A worker holding
// LoRA adapters starts from the default rows for each policy in it (the rows eight workers of
// their own would have), halved until they fit like any other's.
func fitMemory(plan *Plan, list []GPU) error {
	at := map[int]GPU{}
	for _, g := range list {
		at[g.Index] = g
	}
	on := map[int][]int{} // GPU index → workers running on it
	for i, w := range plan.Workers {
		on[w.GPUs[0]] = append(on[w.GPUs[0]], i)
	}
	for _, w := range plan.Workers {
		for _, g := range w.GPUs[1:] {
			if len(on[g]) > 0 {
				// Another worker runs on a GPU this one only reserves: they share it.
				on[g] = append(on[g], -1)
			}
		}
	}
	for _, g := range list {
		ws := on[g.Index]
		var fixed, explicitKV uint64
		sized := 0
		for _, i := range ws {
			if i < 0 {
				continue
			}
			w := &plan.Workers[i]
			fixed += w.Estimate.Fixed()
			if w.ExplicitSlots {
				explicitKV += w.Estimate.KVCache
			} else {
				sized++
			}
		}
		var budget uint64
		if free := g.Free(); free > fixed+explicitKV {
			budget = uint64(kvMemoryFraction * float64(free-fixed-explicitKV))
		}
		var total uint64
		for _, i := range ws {
			if i < 0 {
				continue
			}
			w := &plan.Workers[i]
			if !w.ExplicitSlots {
				e := &w.Estimate
				row := e.KVCache // fixedEstimate leaves one row's bytes here
				e.Slots = defaultSlots * (1 + len(w.Adapters))
				for e.Slots > minSlots && uint64(e.Slots)*row > budget/uint64(sized) {
					e.Slots /= 2
				}
				e.KVCache = uint64(e.Slots) * row
			}
			total += w.Estimate.Total()
		}
		for _, i := range ws {
			if i >= 0 {
				plan.Workers[i].Shares = sharers(plan, ws, i)
			}
		}
		if total > g.Free() {
			// Name the largest worker; the message lists the others.
			big := ws[0]
			for _, i := range ws {
				if i >= 0 && plan.Workers[i].Estimate.Total() > plan.Workers[big].Estimate.Total() {
					big = i
				}
			}
			w := plan.Workers[big]
			msg := fmt.Sprintf("policy %q does not fit on GPU %d (%s): its worker needs about %s (%s)",
				w.Policy, g.Index, g.Name, GiB(w.Estimate.Total()), w.Estimate)
			for _, i := range ws {
				if i >= 0 && i != big {
					o := plan.Workers[i]
					msg += fmt.Sprintf(", and policy %q shares the GPU with about %s", o.Policy, GiB(o.Estimate.Total()))
				}
			}
			msg += fmt.Sprintf("; %s in all, but the GPU has %s free of %s", GiB(total), GiB(g.Free()), GiB(g.MemTotal))
			if len(g.Processes) > 0 {
				msg += fmt.Sprintf(" (processes already on it: %d)", len(g.Processes))
			}
			return fmt.Errorf("%s; give the policies their own GPUs (engine.gpus), or lower engine.args --slots/--max-seq-len", msg)
		}
	}
	return nil
}

// sharers are the policies other than ws[self]'s on the same GPU.
func sharers(plan *Plan, ws []int, self int) []string {
	var out []string
	for _, i := range ws {
		if i >= 0 && i != self {
			out = append(out, plan.Workers[i].Policy)
		}
	}
	for _, w := range plan.Workers {
		if w.Policy == plan.Workers[self].Policy || slices.Contains(out, w.Policy) {
			continue
		}
		if slices.Contains(w.GPUs[1:], plan.Workers[self].GPUs[0]) {
			out = append(out, w.Policy)
		}
	}
	return out
}

// fixedEstimate is a worker's estimate before its KV cache is sized: KVCache holds one row's
// bytes unless engine.args gives --slots (then the whole cache, and explicit is true).
func fixedEstimate(p config.PolicyConfig, m Model) (e Estimate, explicit bool) {
	dtype := uint64(2) // bf16 on a GPU
	if v := argValue(p.Engine.Args, "--dtype"); v == "float32" || v == "fp32" {
		dtype = bytesFP32
	}
	n := uint64(m.Params)
	e.Weights = n * dtype
	t := p.Train
	if ((t.UseKLLoss && t.KLLossCoef > 0) || t.KLCoef > 0) && p.LoRA == nil {
		e.Reference = n * dtype // a LoRA policy's reference is its base: no copy
	}
	if p.Trainable && p.LoRA == nil { // adapters train over a frozen base: their state is small

		e.Gradients = n * bytesFP32
		e.Optimizer = n * adamWBytesPerElem
		if dtype != bytesFP32 {
			e.Optimizer += n * bytesFP32 // the fp32 master copy
		}
		if r := p.NumGPUsPerNode; r > 1 && p.Engine.Kind == "torch" {
			// FSDP2: each rank a shard of the gradients and of the optimizer with its fp32 master
			// (kept even for fp32 weights: the shards are the masters of the full weights).
			e.Ranks = r
			e.Gradients = (n*bytesFP32 + uint64(r) - 1) / uint64(r)
			e.Optimizer = (n*(adamWBytesPerElem+bytesFP32) + uint64(r) - 1) / uint64(r)
		}
	}
	e.MaxLen = defaultMaxLen
	if v, err := strconv.Atoi(argValue(p.Engine.Args, "--max-seq-len")); err == nil && v > 0 {
		e.MaxLen = v
	}
	if m.MaxPositions > 0 {
		e.MaxLen = min(e.MaxLen, m.MaxPositions)
	}
	kv := dtype // the cache's bytes per element: the weights' dtype, or --kv-cache-dtype fp8's 1
	if argValue(p.Engine.Args, "--kv-cache-dtype") == "fp8" {
		kv = 1
	}
	row := 2 * uint64(m.Layers) * uint64(m.KVHeads) * uint64(e.MaxLen) * uint64(m.HeadDim) * kv
	e.KVCache = row
	if v, err := strconv.Atoi(argValue(p.Engine.Args, "--slots")); err == nil && v > 0 {
		e.Slots, e.KVCache, explicit = v, uint64(v)*row, true
	}
	return e, explicit
}

// argValue is the value of a flag in engine.args (`--flag V` or `--flag=V`), "" when absent.
func argValue(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
	}
	return ""
}

func sizing(p config.PolicyConfig) string {
	return fmt.Sprintf("megatron_num_nodes %d × num_gpus_per_node %d for training, sglang_num_nodes %d × %d for generation",
		p.MegatronNumNodes, p.NumGPUsPerNode, p.SGLangNumNodes, p.NumGPUsPerNode)
}

func totals(p *Plan) string {
	if p.Colocate {
		return fmt.Sprintf("actor %d, rollout %d, colocated: the larger", p.Actor, p.Rollout)
	}
	return fmt.Sprintf("actor %d + rollout %d, not colocated", p.Actor, p.Rollout)
}

func span(s []int) string {
	if len(s) == 1 {
		return strconv.Itoa(s[0])
	}
	if s[len(s)-1]-s[0] == len(s)-1 {
		return fmt.Sprintf("%d–%d", s[0], s[len(s)-1])
	}
	parts := make([]string, len(s))
	for i, k := range s {
		parts[i] = strconv.Itoa(k)
	}
	return strings.Join(parts, ",")
}

func describe(list []GPU) string {
	if len(list) == 0 {
		return "it has none"
	}
	return fmt.Sprintf("it has GPUs 0–%d", len(list)-1)
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
