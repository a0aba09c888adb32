package torch

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

const model = "../../testdata/tiny_compat/gqa_untied"

func withInventory(t *testing.T, inv gpus.Inventory) {
	old := inventory
	inventory = inv
	t.Cleanup(func() { inventory = old })
}

func gpu(i int, freeGiB uint64) gpus.GPU {
	return gpus.GPU{Index: i, UUID: fmt.Sprintf("GPU-%d", i), Name: "H200", MemTotal: 80 << 30, MemUsed: (80 - freeGiB) << 30}
}

func policy(name string, gpn, megatron, sglang int) config.PolicyConfig {
	return config.PolicyConfig{Name: name, Trainable: true, HFCheckpoint: model, NumGPUsPerNode: gpn,
		MegatronNumNodes: megatron, SGLangNumNodes: sglang, Engine: config.EngineConfig{Kind: "torch"}}
}

// Two policies sharing a GPU each get --slots so that their caches add up; a policy placed by the
// sizing rules gets its slice as CUDA_VISIBLE_DEVICES (by UUID); engine.gpus wins over the slice.
func TestPlacementInRun(t *testing.T) {
	withInventory(t, gpus.Fake{List: []gpus.GPU{gpu(0, 40), gpu(1, 80)}})
	critic, judge, pinned := policy("critic", 1, 1, 0), policy("judge", 1, 0, 1), policy("pinned", 1, 1, 0)
	judge.Trainable = false
	pinned.Engine.GPUs = []string{"1"}
	cfg := &config.Config{Policies: []config.PolicyConfig{critic, judge, pinned}, Run: config.RunConfig{Colocate: true}}
	var logged []string
	env := host.EngineEnv{Config: cfg, Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }}

	var slots []int
	for _, p := range cfg.Policies[:2] {
		w, err := placement(p, env)
		if err != nil {
			t.Fatal(err)
		}
		envVars, args := placed(p, w)
		if !slices.Equal(envVars, []string{"CUDA_VISIBLE_DEVICES=GPU-0"}) {
			t.Errorf("%s: env %v, want CUDA_VISIBLE_DEVICES=GPU-0", p.Name, envVars)
		}
		if len(args) != 2 || args[0] != "--slots" {
			t.Fatalf("%s shares GPU 0 but gets args %v, want --slots N", p.Name, args)
		}
		var n int
		fmt.Sscan(args[1], &n)
		slots = append(slots, n)
		if want := w.Estimate.Slots; n != want {
			t.Errorf("%s: --slots %d, the plan says %d", p.Name, n, want)
		}
	}
	// Pinned alone on GPU 1 keeps its engine.gpus and sizes its own cache.
	w, err := placement(pinned, env)
	if err != nil {
		t.Fatal(err)
	}
	if envVars, args := placed(pinned, w); envVars != nil || args != nil || !slices.Equal(w.GPUs, []int{1}) {
		t.Errorf("pinned: env %v args %v GPUs %v; want nothing changed, GPU 1", envVars, args, w.GPUs)
	}
	if len(plans.m) != 0 {
		t.Errorf("the run's plan is still kept after all its workers opened: %d", len(plans.m))
	}
	if len(logged) != 3 || !strings.Contains(logged[0], `policy "critic": placed on GPU 0 (placement)`) || !strings.Contains(logged[0], "shares GPU 0 with judge") {
		t.Errorf("logged %q", logged)
	}
	// Alone, critic's cache would have more rows than either of the two sharing GPU 0.
	alone := &config.Config{Policies: []config.PolicyConfig{critic}}
	plan, err := gpus.Place(alone, map[string]gpus.Model{"critic": mustModel(t)}, []gpus.GPU{gpu(0, 40)})
	if err != nil {
		t.Fatal(err)
	}
	if got := plan.Workers[0].Estimate.Slots; got < slots[0] {
		t.Errorf("alone %d rows, sharing %v", got, slots)
	}
}

// A worker alone on its GPU that holds LoRA adapters gets the plan's rows for all its policies
// (its own rule would size them for one); one whose engine.args give --slots keeps them.
func TestPlacedLoRAWorkerRows(t *testing.T) {
	p := policy("a", 1, 1, 0)
	w := &gpus.Worker{Policy: "a", GPUs: []int{0}, From: "engine.device", Adapters: []string{"b", "c"}}
	w.Estimate.Slots = 768
	if _, args := placed(p, w); !slices.Equal(args, []string{"--slots", "768"}) {
		t.Errorf("args %v, want --slots 768", args)
	}
	w.ExplicitSlots = true
	if _, args := placed(p, w); args != nil {
		t.Errorf("explicit --slots: args %v, want none", args)
	}
	w.ExplicitSlots, w.Adapters = false, nil
	if _, args := placed(p, w); args != nil {
		t.Errorf("alone, no adapters: args %v, want none (the worker sizes its cache)", args)
	}
}

// A policy apart from its rollout slice (not colocated) puts its rollout replicas there, in turn,
// under the plan its worker was placed by; colocated on one GPU (its rollout slice is its actor
// slice), they run where the worker does.
func TestPlacementOfRolloutReplicas(t *testing.T) {
	withInventory(t, gpus.Fake{List: []gpus.GPU{gpu(0, 80), gpu(1, 80), gpu(2, 80)}})
	a := policy("a", 1, 1, 2)
	cfg := &config.Config{Policies: []config.PolicyConfig{a}}
	env := host.EngineEnv{Config: cfg, Logf: func(string, ...any) {}}
	w, err := placement(a, env)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(w.GPUs, []int{0, 1, 2}) || !slices.Equal(w.Replicas, []int{1, 2}) {
		t.Fatalf("a on %v, replicas on %v; want 0–2 and 1–2", w.GPUs, w.Replicas)
	}
	// The worker's GPUs are taken now: a replica still finds the plan.
	withInventory(t, gpus.Fake{List: []gpus.GPU{gpu(0, 1), gpu(1, 1), gpu(2, 1)}})
	for n, want := range map[int]int{1: 1, 2: 2, 3: 1} {
		env.Replica = n
		rw, err := placement(a, env)
		if err != nil {
			t.Fatal(err)
		}
		on := replicaPlace(a, rw, n)
		if on == nil || !slices.Equal(on.GPUs, []int{want}) || on.UUIDs[0] != fmt.Sprintf("GPU-%d", want) {
			t.Errorf("replica %d on %+v, want GPU %d", n, on, want)
		}
	}
	// At K > 0 its worker keeps no versions: its replicas on the rollout slice do.
	if replicasOnRolloutSlice(a, w, cfg) {
		t.Errorf("K = 0: replicas on the rollout slice")
	}
	async := *cfg
	async.Rollout.MaxStaleness = 1
	if !replicasOnRolloutSlice(a, w, &async) {
		t.Errorf("K = 1 with a rollout slice: the worker keeps the versions on its actor GPU")
	}
	pinned := a
	pinned.Engine.GPUs = []string{"0"}
	if replicasOnRolloutSlice(pinned, w, &async) {
		t.Errorf("engine.gpus given: replicas moved to the rollout slice")
	}
	b := policy("b", 1, 1, 1)
	colo := &config.Config{Policies: []config.PolicyConfig{b}, Run: config.RunConfig{Colocate: true}}
	withInventory(t, gpus.Fake{List: []gpus.GPU{gpu(0, 80), gpu(1, 80)}})
	w, err = placement(b, host.EngineEnv{Config: colo, Logf: func(string, ...any) {}})
	if err != nil {
		t.Fatal(err)
	}
	if on := replicaPlace(b, w, 1); on != nil {
		t.Errorf("colocated, a replica goes to %+v; want the worker's GPU", on)
	}
	colo.Rollout.MaxStaleness = 1
	if replicasOnRolloutSlice(b, w, colo) {
		t.Errorf("colocated at K = 1: its worker should keep the versions")
	}
}

func mustModel(t *testing.T) gpus.Model {
	m, err := gpus.ReadModel(model)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Without NVML nothing is placed and the run says so once; a config that cannot fit is refused
// at the first worker, before any starts.
func TestPlacementRefusalAndNoGPUs(t *testing.T) {
	withInventory(t, gpus.Fake{Err: fmt.Errorf("%w: no driver here", gpus.ErrNoNVML)})
	cfg := &config.Config{Policies: []config.PolicyConfig{policy("a", 8, 1, 1)}}
	var logged []string
	env := host.EngineEnv{Config: cfg, Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }}
	if w, err := placement(cfg.Policies[0], env); w != nil || err != nil {
		t.Errorf("no NVML: %v, %v; want nothing placed", w, err)
	}
	if len(logged) != 1 || !strings.Contains(logged[0], "torch workers are not placed: no NVIDIA GPUs visible: no driver here") {
		t.Errorf("logged %q", logged)
	}
	delete(plans.m, cfg)

	withInventory(t, gpus.Fake{List: []gpus.GPU{gpu(0, 80)}})
	cfg = &config.Config{Policies: []config.PolicyConfig{policy("a", 8, 1, 1)}}
	_, err := placement(cfg.Policies[0], host.EngineEnv{Config: cfg, Logf: func(string, ...any) {}})
	if err == nil || !strings.Contains(err.Error(), `policy "a" needs GPUs 0–15`) {
		t.Errorf("16 GPUs on 1: err = %v", err)
	}
	withInventory(t, gpus.Fake{Err: errors.New("NVML: init: Unknown Error")})
	cfg = &config.Config{Policies: []config.PolicyConfig{policy("a", 1, 1, 0)}}
	if _, err := placement(cfg.Policies[0], host.EngineEnv{Config: cfg, Logf: func(string, ...any) {}}); err == nil || !strings.Contains(err.Error(), "Unknown Error") {
		t.Errorf("an NVML failure: err = %v", err)
	}
	// A CPU worker and a run without a config are never placed.
	cpu := policy("c", 1, 1, 0)
	cpu.Engine.Device = "cpu"
	if w, err := placement(cpu, host.EngineEnv{Config: &config.Config{Policies: []config.PolicyConfig{cpu}}}); w != nil || err != nil {
		t.Errorf("cpu: %v, %v", w, err)
	}
	if w, err := placement(policy("x", 1, 1, 0), host.EngineEnv{}); w != nil || err != nil {
		t.Errorf("no config: %v, %v", w, err)
	}
}
