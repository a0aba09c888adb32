// Package host runs multi-agent reinforcement learning of language models written as Starlark
// rollout scripts: it loads a script (host/script is the Starlark runtime), opens an engine per
// policy (the embedded pure-Go engine, an engine server, or a registered kind such as
// host/torch's PyTorch worker), runs the script's rollout(task) for every task of a step on its
// own thread, batches their generate calls per policy, computes advantages and trains.
//
// Embedding takes a few calls:
//
//	r, err := host.Load(ctx, "debate.star", host.Options{Config: cfg, Out: "runs/debate"})
//	defer r.Close()
//	res, err := r.Step(ctx)              // one step: rollouts, advantages, training, metrics
//	err = r.Train(ctx)                   // or every step up to run.steps, then a checkpoint
//	r, err = host.Resume(ctx, "runs/debate", "", host.Options{}) // later: go on from its checkpoint
//
// A nil Config is zero-config: every policy the script names runs on the embedded engine with
// builtin:tiny-arith. Options also take engines made in Go (Engines, OpenEngine), tasks made in
// Go (Tasks), a script and its files from an fs.FS (FS), Go built-ins and Starlark modules
// (Builtins, Modules) and hooks around steps and evals. The run directory, the checkpoints and
// the invariants a run keeps (determinism, idempotent request ids, atomic checkpoints) are
// described in docs/architecture.md.
//
// Charts (host/plot) and dataflow diagrams (host/graph) are drawn outside this package, by the CLI
// or a hook: importing host links neither, nor the PyTorch worker.
package host
