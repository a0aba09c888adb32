package gpus

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/host/config"
)

const gib = 1 << 30

func torchPolicy(name string, gpn, megatron, sglang int) config.PolicyConfig {
	return config.PolicyConfig{Name: name, Trainable: true, NumGPUsPerNode: gpn, MegatronNumNodes: megatron,
		SGLangNumNodes: sglang, Engine: config.EngineConfig{Kind: "torch"}}
}

func frozen(p config.PolicyConfig) config.PolicyConfig { p.Trainable = false; return p }

func onGPUs(p config.PolicyConfig, gpus ...string) config.PolicyConfig {
	p.Engine.GPUs = gpus
	return p
}

func machine(n int, free uint64) []GPU {
	var list []GPU
	for i := range n {
		list = append(list, GPU{Index: i, UUID: "GPU-" + string(rune('a'+i)), Name: "H200", MemTotal: 80 * gib, MemUsed: 80*gib - free, Util: 0})
	}
	return list
}

// small has 1 Gi parameters (2 GiB of bf16 weights, 18 GiB with training state) and a KV-cache
// row of 2·64 layers·1 head·4,096 positions·64·2 bytes = 64 MiB.
var small = Model{Params: gib, Layers: 64, KVHeads: 1, HeadDim: 64}

func TestPlace(t *testing.T) {
	cases := []struct {
		name     string
		colocate bool
		policies []config.PolicyConfig
		gpus     int
		want     map[string][]int // policy → GPUs
		shares   map[string][]string
		replicas map[string][]int // policy → its rollout replicas' GPUs (absent: none)
		total    int
		err      string
	}{
		{name: "one policy colocated", colocate: true, policies: []config.PolicyConfig{torchPolicy("a", 1, 1, 1)}, gpus: 1,
			want: map[string][]int{"a": {0}}, total: 1},
		{name: "one policy, training and engine apart", policies: []config.PolicyConfig{torchPolicy("a", 1, 1, 1)}, gpus: 2,
			want: map[string][]int{"a": {0, 1}}, replicas: map[string][]int{"a": {1}}, total: 2},
		{name: "apart on too few GPUs", policies: []config.PolicyConfig{torchPolicy("a", 1, 1, 1)}, gpus: 1,
			err: `policy "a" needs GPUs 0–1 (megatron_num_nodes 1 × num_gpus_per_node 1 for training, sglang_num_nodes 1 × 1 for generation) but this machine has 1 GPU: the config needs 2 in all (actor 1 + rollout 1, not colocated)`},
		{name: "slices in YAML order, colocated", colocate: true,
			policies: []config.PolicyConfig{torchPolicy("solver", 2, 1, 1), torchPolicy("critic", 1, 1, 1)}, gpus: 3,
			want: map[string][]int{"solver": {0, 1}, "critic": {2}}, total: 3},
		{name: "slices in YAML order, apart",
			policies: []config.PolicyConfig{torchPolicy("solver", 1, 1, 1), torchPolicy("critic", 1, 1, 1)}, gpus: 4,
			want: map[string][]int{"solver": {0, 2}, "critic": {1, 3}}, replicas: map[string][]int{"solver": {2}, "critic": {3}}, total: 4},
		{name: "a train-only and an engine-only policy share when colocated", colocate: true,
			policies: []config.PolicyConfig{torchPolicy("critic", 1, 1, 0), frozen(torchPolicy("judge", 1, 0, 1))}, gpus: 1,
			want: map[string][]int{"critic": {0}, "judge": {0}}, shares: map[string][]string{"critic": {"judge"}, "judge": {"critic"}}, total: 1},
		{name: "the default num_gpus_per_node 8 on one GPU", colocate: true,
			policies: []config.PolicyConfig{torchPolicy("a", 8, 1, 1)}, gpus: 1,
			err: `policy "a" needs GPUs 0–7`},
		{name: "engine.gpus wins and takes no slice",
			policies: []config.PolicyConfig{onGPUs(torchPolicy("a", 8, 1, 1), "0"), onGPUs(frozen(torchPolicy("b", 8, 1, 1)), "GPU-a"), torchPolicy("c", 1, 1, 0)}, gpus: 1,
			want: map[string][]int{"a": {0}, "b": {0}, "c": {0}}, shares: map[string][]string{"a": {"b", "c"}}, total: 1},
		{name: "engine.gpus names a missing GPU", policies: []config.PolicyConfig{onGPUs(torchPolicy("a", 1, 1, 1), "3")}, gpus: 2,
			err: `policy "a": engine.gpus names GPU 3, which this machine does not have (it has GPUs 0–1)`},
		{name: "tiny, remote and CPU workers are not placed",
			policies: []config.PolicyConfig{
				{Name: "t", Engine: config.EngineConfig{Kind: "tiny"}},
				{Name: "r", NumGPUsPerNode: 8, SGLangNumNodes: 1, Engine: config.EngineConfig{Kind: "remote"}},
				{Name: "cpu", Engine: config.EngineConfig{Kind: "torch", Device: "cpu"}},
				torchPolicy("g", 1, 1, 0)}, gpus: 1,
			want: map[string][]int{"g": {0}}, total: 1},
		{name: "memory: three trainable workers on one GPU", policies: []config.PolicyConfig{
			onGPUs(torchPolicy("a", 1, 1, 1), "0"), onGPUs(torchPolicy("b", 1, 1, 1), "0"), onGPUs(torchPolicy("c", 1, 1, 1), "0")}, gpus: 1,
			err: `policy "a" does not fit on GPU 0 (H200): its worker needs about 18.1 GiB (weights 2.0 GiB, gradients 4.0 GiB, AdamW state 12.0 GiB, KV cache 64.0 MiB (1 rows × 4096 positions)), and policy "b" shares the GPU with about 18.1 GiB, and policy "c" shares the GPU with about 18.1 GiB; 54.2 GiB in all, but the GPU has 48.0 GiB free of 80.0 GiB`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := &config.Config{Policies: tc.policies, Run: config.RunConfig{Colocate: tc.colocate}}
			models := map[string]Model{}
			for _, p := range tc.policies {
				models[p.Name] = small
			}
			plan, err := Place(c, models, machine(tc.gpus, 48*gib))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v\nwant it to contain %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if plan.Total != tc.total {
				t.Errorf("total = %d, want %d", plan.Total, tc.total)
			}
			got := map[string][]int{}
			for _, w := range plan.Workers {
				got[w.Policy] = w.GPUs
				if want, ok := tc.shares[w.Policy]; ok && !slices.Equal(w.Shares, want) {
					t.Errorf("%s shares with %v, want %v", w.Policy, w.Shares, want)
				}
				// Colocated, pinned or without a rollout slice: the replicas stay on the worker's GPU.
				if want := tc.replicas[w.Policy]; !slices.Equal(w.Replicas, want) || len(w.ReplicaUUIDs) != len(want) {
					t.Errorf("%s's rollout replicas on %v (%v), want %v", w.Policy, w.Replicas, w.ReplicaUUIDs, want)
				}
			}
			if len(got) != len(tc.want) {
				t.Errorf("placed %v, want %v", got, tc.want)
			}
			for name, want := range tc.want {
				if !slices.Equal(got[name], want) {
					t.Errorf("%s on %v, want %v", name, got[name], want)
				}
			}
		})
	}
}

// The KV caches of workers sharing a GPU are sized so that together they take what one worker
// alone would: 40% of the memory their weights and training state leave free.
func TestPlaceKVCacheShares(t *testing.T) {
	one := &config.Config{Policies: []config.PolicyConfig{onGPUs(torchPolicy("a", 1, 1, 1), "0")}}
	two := &config.Config{Policies: []config.PolicyConfig{onGPUs(torchPolicy("a", 1, 1, 1), "0"), onGPUs(torchPolicy("b", 1, 1, 1), "0")}}
	models := map[string]Model{"a": small, "b": small}
	// Alone on 80 GiB: 18 GiB resident, 0.4 × 62 GiB = 24.8 GiB for the cache: all 256 rows (16 GiB).
	plan, err := Place(one, models, machine(1, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	if e := plan.Workers[0].Estimate; e.Slots != 256 || e.KVCache != 16*gib {
		t.Errorf("alone: %d rows, %d bytes; want 256 rows, 16 GiB", e.Slots, e.KVCache)
	}
	// Two: 36 GiB resident, 0.4 × 44 GiB = 17.6 GiB, 8.8 GiB each: 128 rows (8 GiB) each.
	plan, err = Place(two, models, machine(1, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range plan.Workers {
		if w.Estimate.Slots != 128 || w.Estimate.KVCache != 8*gib {
			t.Errorf("%s: %d rows; want 128", w.Policy, w.Estimate.Slots)
		}
	}
	// --slots in engine.args is kept as given.
	two.Policies[1].Engine.Args = []string{"--slots=4", "--max-seq-len", "1024"}
	plan, err = Place(two, models, machine(1, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	if e := plan.Worker("b").Estimate; e.Slots != 4 || e.MaxLen != 1024 || e.KVCache != 4*16<<20 || !plan.Worker("b").ExplicitSlots {
		t.Errorf("b with --slots 4 --max-seq-len 1024: %+v", e)
	}
	if e := plan.Worker("a").Estimate; e.Slots != 256 {
		t.Errorf("a beside a 4-row cache: %d rows, want 256 (17.6 GiB budget less 64 MiB)", e.Slots)
	}
}

// A frozen worker holds its weights only; a KL term adds the reference model; fp32 weights need
// no master copy.
func TestEstimateParts(t *testing.T) {
	m := Model{Params: 1000, Layers: 2, KVHeads: 2, HeadDim: 8}
	cases := []struct {
		name string
		p    config.PolicyConfig
		want Estimate
	}{
		{"frozen", frozen(torchPolicy("a", 1, 0, 1)), Estimate{Weights: 2000}},
		{"trainable bf16", torchPolicy("a", 1, 1, 1), Estimate{Weights: 2000, Gradients: 4000, Optimizer: 12000}},
		{"trainable fp32 with KL", func() config.PolicyConfig {
			p := torchPolicy("a", 1, 1, 1)
			p.Engine.Args = []string{"--dtype", "float32"}
			p.Train.UseKLLoss, p.Train.KLLossCoef = true, 0.01
			return p
		}(), Estimate{Weights: 4000, Reference: 4000, Gradients: 4000, Optimizer: 8000}},
		// FSDP2 over 4 ranks: full weights on each GPU, a quarter of the gradients and of the
		// optimizer with its fp32 master shard.
		{"trainable over 4 ranks", torchPolicy("a", 4, 1, 1), Estimate{Weights: 2000, Gradients: 1000, Optimizer: 3000}},
	}
	for _, tc := range cases {
		e, _ := fixedEstimate(tc.p, m)
		if e.Weights != tc.want.Weights || e.Reference != tc.want.Reference || e.Gradients != tc.want.Gradients || e.Optimizer != tc.want.Optimizer {
			t.Errorf("%s: %+v, want %+v", tc.name, e, tc.want)
		}
	}
}

func TestReadModel(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 80}`), 0o644)
	header := `{"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [10, 64], "data_offsets": [0, 2560]}, "b": {"dtype": "F32", "shape": [64], "data_offsets": [2560, 2816]}}`
	for i, h := range []string{header, `{"c": {"dtype": "BF16", "shape": [2, 3, 5], "data_offsets": [0, 60]}}`} {
		b := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
		b = append(b, h...)
		os.WriteFile(filepath.Join(dir, []string{"model-00001.safetensors", "model-00002.safetensors"}[i]), b, 0o644)
	}
	m, err := ReadModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Model{Params: 640 + 64 + 30, Layers: 3, KVHeads: 2, HeadDim: 16, MaxPositions: 80}); m != want {
		t.Errorf("ReadModel = %+v, want %+v", m, want)
	}
	os.WriteFile(filepath.Join(dir, "model-00002.safetensors"), []byte("short"), 0o644)
	if _, err := ReadModel(dir); err == nil || !strings.Contains(err.Error(), "model-00002.safetensors") {
		t.Errorf("a broken shard: err = %v, want it named", err)
	}
}

func TestFake(t *testing.T) {
	if _, err := (Fake{Err: noNVML("none here")}).GPUs(); !errors.Is(err, ErrNoNVML) {
		t.Errorf("err = %v", err)
	}
}

// The cache rows are no longer than the model's max_position_embeddings, as in the worker.
func TestEstimateMaxPositions(t *testing.T) {
	e, _ := fixedEstimate(torchPolicy("a", 1, 1, 1), Model{Params: 10, Layers: 1, KVHeads: 1, HeadDim: 4, MaxPositions: 80})
	if e.MaxLen != 80 || e.KVCache != 2*80*4*2 {
		t.Errorf("MaxLen %d, row %d bytes; want 80 and %d", e.MaxLen, e.KVCache, 2*80*4*2)
	}
}

// An fp8 KV cache (--kv-cache-dtype fp8) is one byte an element, as the worker sizes it.
func TestEstimateFP8KVCache(t *testing.T) {
	p := torchPolicy("a", 1, 1, 1)
	p.Engine.Args = []string{"--kv-cache-dtype", "fp8"}
	m := Model{Params: 10, Layers: 1, KVHeads: 1, HeadDim: 4, MaxPositions: 80}
	if e, _ := fixedEstimate(p, m); e.KVCache != 2*80*4 {
		t.Errorf("fp8 row %d bytes; want %d", e.KVCache, 2*80*4)
	}
	p.Engine.Args = []string{"--kv-cache-dtype=auto", "--dtype", "float32"}
	if e, _ := fixedEstimate(p, m); e.KVCache != 2*80*4*4 {
		t.Errorf("auto fp32 row %d bytes; want %d", e.KVCache, 2*80*4*4)
	}
}

// Eight LoRA policies on one hf_checkpoint are one worker: the first is placed, the others are
// its adapters and take no GPUs; its estimate holds the frozen base, no optimizer or reference.
// Eight full-weight copies of the same model do not fit the GPU.
func TestPlaceLoRAPoliciesShareAWorker(t *testing.T) {
	c := &config.Config{Run: config.RunConfig{Colocate: true}}
	for i := range 8 {
		p := torchPolicy(string(rune('a'+i)), 1, 1, 1)
		p.HFCheckpoint = "/models/base"
		p.Train.UseKLLoss, p.Train.KLLossCoef = true, 0.01
		p.LoRA = &config.LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj"}}
		p.Engine.Args = []string{"--max-seq-len", "256"} // 4 MiB a cache row
		c.Policies = append(c.Policies, p)
	}
	models := map[string]Model{}
	for _, p := range c.Policies {
		models[p.Name] = small
	}
	plan, err := Place(c, models, machine(1, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.Workers) != 1 || plan.Workers[0].Policy != "a" || len(plan.Workers[0].Adapters) != 7 || plan.Total != 1 {
		t.Fatalf("plan: %+v; want one worker (a) with 7 adapters on 1 GPU", plan)
	}
	if e := plan.Workers[0].Estimate; e.Weights != 2*gib || e.Optimizer != 0 || e.Gradients != 0 || e.Reference != 0 {
		t.Errorf("the shared worker's estimate: %+v; want the bf16 base only", e)
	}
	// The worker's cache has the rows of eight workers of their own (8 × 256) on a GPU with room
	// for them, halved on one whose memory holds fewer.
	alone, err := Place(&config.Config{Policies: c.Policies[:1], Run: c.Run}, models, machine(1, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	row := alone.Workers[0].Estimate.KVCache / uint64(alone.Workers[0].Estimate.Slots)
	for _, g := range []struct {
		free  uint64
		slots int
	}{{2*gib + 3*8*defaultSlots*row, 8 * defaultSlots}, {2*gib + 3*defaultSlots*row, defaultSlots}} {
		plan, err := Place(c, models, machine(1, g.free)) // the cache's budget: 40% of what is free
		if err != nil {
			t.Fatal(err)
		}
		if e := plan.Workers[0].Estimate; e.Slots != g.slots {
			t.Errorf("the shared worker's rows on a GPU with %s free: %d; want %d", GiB(g.free), e.Slots, g.slots)
		}
	}
	for i := range c.Policies {
		c.Policies[i].LoRA = nil
	}
	if _, err := Place(c, models, machine(1, 80*gib)); err == nil {
		t.Error("eight full copies of 1 Gi parameters placed on one 80 GiB GPU")
	}
}

// A worker runs in one mode: LoRA policies on one hf_checkpoint that disagree on
// engine.deterministic are two workers, each placed, not one whose mode the first policy picks.
func TestPlaceLoRAPoliciesOfTwoModes(t *testing.T) {
	c := &config.Config{Run: config.RunConfig{Colocate: true}}
	for i := range 4 {
		p := torchPolicy(string(rune('a'+i)), 1, 1, 1)
		p.HFCheckpoint = "/models/base"
		p.LoRA = &config.LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj"}}
		p.Engine.Deterministic = i >= 2
		c.Policies = append(c.Policies, p)
	}
	models := map[string]Model{}
	for _, p := range c.Policies {
		models[p.Name] = small
	}
	plan, err := Place(c, models, machine(2, 80*gib))
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.Workers) != 2 || plan.Workers[0].Policy != "a" || plan.Workers[1].Policy != "c" ||
		len(plan.Workers[0].Adapters) != 1 || len(plan.Workers[1].Adapters) != 1 {
		t.Fatalf("plan: %+v; want worker a (adapter b) and worker c (adapter d)", plan)
	}
}
