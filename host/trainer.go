package host

// This file defines the trainer: the part of a run that trains its policies on a step's
// samples.

import (
	"sync"
)

// trainer trains a run's policies on the samples of a step: their advantages (the estimators,
// the reward-side KL, PPO's critic, the teacher terms), each policy's optimizer steps and their
// metrics, and the warnings given once about samples that do not train. The run owns one
// (Run.trainer) and gives it, when it is made, the few things of the run it uses; the step
// itself comes as arguments.
type trainer struct {
	id      string        // the run's id: part of optimizer step ids
	pols    *policyTable  // the run's policies
	events  *eventLog     // the run's events.log
	rec     *recorder     // keeps a step's advantages for rollouts.jsonl
	restart *restartGuard // notes each optimizer step applied, for an engine that restarts
	hint    func() string // the hint of an EngineError (the resume command)
	warned  sync.Map      // warnings given once per run, by key
}
