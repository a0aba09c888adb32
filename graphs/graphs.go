// Package graphs is the topology library: one Starlark file per multi-agent topology (debate,
// solver_summarizer, generator_verifier, orchestrator, exam_swarm, shared_state,
// solver_rewriter_selector, distillation, ppo), each exporting a function that runs one rollout of
// it.
// The files are embedded in the binary and scripts load them as @graphs//NAME.star:
//
//	load("@graphs//debate.star", "debate")
//
//	def rollout(task):
//	    debate(task, generator = "generator", critic = "critic", agents = 3)
//
// docs/topologies.md describes each topology, its reward rule and its prompt templates.
package graphs

import "embed"

// FS holds the library's Starlark sources.
//
//go:embed *.star
var FS embed.FS
