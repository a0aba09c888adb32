package script

import (
	"fmt"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// What the host of a sandboxed run needs to charge a child's calls itself (host/sandbox.go): the
// child applies the same rules first, so a call past them was not made by an honest child.

// MaxSamplesPerCall is the most samples one generate call or chat turn may ask for (its n).
const MaxSamplesPerCall = maxSamplesPerCall

// MaxPrintEvents is the most print lines a rollout sends to the run's events: its first prints
// and the line that says the rest were dropped.
const MaxPrintEvents = maxPrintsPerRollout + 1

// RenderBytes is what one chat rendering counts against sandbox.prompt_bytes: its messages' roles
// and contents and its tool schemas, which the template renders into the prompt as well.
func RenderBytes(req engines.RenderRequest) int {
	n := promptBytes(req.Messages)
	for _, t := range req.Tools {
		n += len(t)
	}
	return n
}

// CheckRender is the prompt_bytes budget of a chat's rendering (fn is the built-in that renders),
// tool schemas included.
func CheckRender(cfg config.SandboxConfig, fn string, reqs []engines.RenderRequest) error {
	for _, r := range reqs {
		if n := RenderBytes(r); n > cfg.PromptBytes {
			return &BudgetError{"prompt_bytes", fmt.Sprint(cfg.PromptBytes),
				fmt.Sprintf("%s was given a conversation of %d bytes (its messages and tool schemas)", fn, n)}
		}
	}
	return nil
}
