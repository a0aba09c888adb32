package host

import (
	"context"
	"fmt"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// Simulation is what one rollout would have a run train: Simulate's result.
type Simulation struct {
	// Rollout is the rollout that ran: its completions (Generated) and logs (Logs).
	Rollout *script.Rollout
	// Samples are the samples each policy would train, in the order a step trains them.
	Samples map[string][]SimSample
}

// SimSample is one sample a step would train: its train() request, its reward and its
// advantage per token (nil: the policy computes none).
type SimSample struct {
	script.Queued
	Reward    float64
	Advantage []float32
}

// Simulate runs one rollout of fn on task, the policies of cfg answered by engs, as a step
// would, and computes the advantages the run would train with, training nothing: the simulate()
// of `slimen test` (host/scripttest). A failed rollout is an error.
func Simulate(ctx context.Context, cfg *config.Config, engs map[string]engines.Engine, task Task, fn starlark.Callable) (*Simulation, error) {
	r := newRun(Options{Config: cfg, Engines: engs, Tasks: listSource{task}})
	defer r.Close()
	if err := r.openPolicies(ctx); err != nil {
		return nil, err
	}
	fn.Freeze()
	ros, err := r.runRollouts(ctx, 1, []Task{task}, 1, rolloutFn{fn: fn, name: "rollout"}, nil, -1)
	if err != nil {
		return nil, err
	}
	if ros[0].Err != nil {
		return nil, fmt.Errorf("the rollout failed:\n%s", indent(script.ErrorText(ros[0].Err)))
	}
	byPolicy, _ := gather(ros, -1)
	advs, _, err := r.trainer.advantages(ctx, r.step+1, r.pols.list(), byPolicy)
	if err != nil {
		return nil, err
	}
	sim := &Simulation{Rollout: ros[0], Samples: map[string][]SimSample{}}
	for name, samples := range byPolicy {
		for i, s := range samples {
			ss := SimSample{Queued: s.Queued, Reward: s.reward}
			if a := advs[name]; a != nil {
				ss.Advantage = a[i]
			}
			sim.Samples[name] = append(sim.Samples[name], ss)
		}
	}
	return sim, nil
}

// listSource serves the tasks of a list, cycling.
type listSource []Task

func (l listSource) Task(i int) Task { return l[i%len(l)] }
