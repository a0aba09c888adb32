package torch

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/gpus"
)

// inventory is what torch workers are placed on: this machine's GPUs (tests replace it).
var inventory gpus.Inventory = gpus.NVML()

// runPlan is the placement of one run's torch workers, made when its first worker opens, before
// any starts (so a config that cannot fit starts none), and forgotten once all have opened.
type runPlan struct {
	plan *gpus.Plan // nil: nothing is placed (no GPUs visible)
	left int        // placed workers not opened yet
}

var plans = struct {
	sync.Mutex
	m    map[*config.Config]*runPlan
	made map[*config.Config]*gpus.Plan // every plan made: where a run's rollout replicas go
}{m: map[*config.Config]*runPlan{}, made: map[*config.Config]*gpus.Plan{}}

// placement is a policy's worker as the run's placement gives it (docs/gpus.md), nil when it is
// not placed: no config, not a local GPU worker, or no GPUs visible.
func placement(p config.PolicyConfig, env host.EngineEnv) (*gpus.Worker, error) {
	if env.Config == nil || !gpus.Local(p) {
		return nil, nil
	}
	plans.Lock()
	defer plans.Unlock()
	if env.Replica > 0 {
		// A rollout replica opens after the run's workers, under the plan they were placed by (a
		// plan made now would count their memory as taken).
		if plan := plans.made[env.Config]; plan != nil {
			return plan.Worker(p.Name), nil
		}
		return nil, nil
	}
	rp := plans.m[env.Config]
	if rp == nil {
		plan, err := place(env.Config, env.Logf)
		if err != nil {
			return nil, fmt.Errorf("placement of the torch workers on this machine's GPUs: %w", err)
		}
		rp = &runPlan{plan: plan}
		if plan != nil {
			rp.left = len(plan.Workers)
			plans.made[env.Config] = plan
		}
		plans.m[env.Config] = rp
	}
	if rp.plan == nil {
		return nil, nil
	}
	w := rp.plan.Worker(p.Name)
	if w == nil {
		return nil, nil
	}
	if rp.left--; rp.left <= 0 {
		delete(plans.m, env.Config)
	}
	return w, nil
}

// place reads the GPUs and the models of the config's local workers and places them.
func place(c *config.Config, logf func(string, ...any)) (*gpus.Plan, error) {
	list, err := inventory.GPUs()
	if errors.Is(err, gpus.ErrNoNVML) {
		logf("torch workers are not placed: %v; each uses the device it finds", err)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	models := map[string]gpus.Model{}
	for _, p := range c.Policies {
		if !gpus.Local(p) {
			continue
		}
		m, err := gpus.ReadModel(gpus.ModelDir(p))
		if err != nil {
			return nil, fmt.Errorf("policy %q: %w", p.Name, err)
		}
		models[p.Name] = m
	}
	plan, err := gpus.Place(c, models, list)
	if err != nil {
		return nil, err
	}
	for _, w := range plan.Workers {
		line := fmt.Sprintf("policy %q: placed on GPU %s (%s): memory about %s (%s)", w.Policy, joinInts(w.GPUs), w.From, gpus.GiB(w.Estimate.Total()), w.Estimate)
		if len(w.Adapters) > 0 {
			line += fmt.Sprintf("; LoRA adapters of %s in it", strings.Join(w.Adapters, ", "))
		}
		if len(w.Shares) > 0 {
			line += fmt.Sprintf("; shares GPU %d with %s", w.GPUs[0], strings.Join(w.Shares, ", "))
		}
		logf("%s", line)
	}
	return plan, nil
}

// placed is what a placement changes in a worker's start: CUDA_VISIBLE_DEVICES for a worker
// placed by the sizing rules (engine.gpus, when given, wins), and --slots for a worker sharing its
// GPU or holding LoRA adapters whose engine.args do not size the cache: the caches of the workers
// on a GPU add up to what one worker alone would take (the worker's own rule measures the free
// memory when it starts, which counts its neighbours only if they started first), and a worker of
// N policies has the rows of N (its own rule knows nothing of the adapters).
func placed(p config.PolicyConfig, w *gpus.Worker) (env, args []string) {
	if w == nil {
		return nil, nil
	}
	if w.From == "placement" && len(p.Engine.GPUs) == 0 {
		env = []string{"CUDA_VISIBLE_DEVICES=" + strings.Join(w.UUIDs, ",")}
	}
	if (len(w.Shares) > 0 || len(w.Adapters) > 0) && !w.ExplicitSlots {
		args = []string{"--slots", strconv.Itoa(w.Estimate.Slots)}
	}
	return env, args
}

// replicaPlace is where the n-th rollout replica (n ≥ 1) of a policy placed as w runs: one GPU of
// its rollout slice outside its actor slice, in turn (w.Replicas); nil when there is none (the
// replica then runs where the policy's worker does).
func replicaPlace(p config.PolicyConfig, w *gpus.Worker, n int) *gpus.Worker {
	if w == nil || len(w.ReplicaUUIDs) == 0 || len(p.Engine.GPUs) > 0 || n < 1 {
		return nil
	}
	i := (n - 1) % len(w.ReplicaUUIDs)
	return &gpus.Worker{Policy: w.Policy, GPUs: []int{w.Replicas[i]}, UUIDs: []string{w.ReplicaUUIDs[i]}, From: "rollout slice"}
}

// replicasOnRolloutSlice says whether policy p, placed as w, samples the weights versions of the
// asynchronous loop (rollout.max_staleness > 0) from rollout replicas on the GPUs of its rollout
// slice outside its actor slice (slime's layout: actor GPUs train, rollout GPUs generate) rather
// than from copies its worker keeps on its actor GPU. One-process workers only: an FSDP group keeps
// no versions anyway.
func replicasOnRolloutSlice(p config.PolicyConfig, w *gpus.Worker, cfg *config.Config) bool {
	return w != nil && cfg != nil && cfg.Rollout.MaxStaleness > 0 && len(w.ReplicaUUIDs) > 0 &&
		len(p.Engine.GPUs) == 0 && p.NumGPUsPerNode <= 1 && !slices.Contains(p.Engine.Args, "--no-versions")
}

func joinInts(s []int) string {
	parts := make([]string, len(s))
	for i, k := range s {
		parts[i] = strconv.Itoa(k)
	}
	return strings.Join(parts, ",")
}
