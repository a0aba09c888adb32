// Package sandbox is the sandbox child of a sandboxed run and its wire protocol: a copy of the
// slimen binary, started with ChildEnv set, that evaluates rollouts of an untrusted script under
// memory and CPU rlimits and reaches the host for everything else (generate, score, state, print)
// over two pipes the host hands it as fds 3 and 4, one JSON message a line. No program the child
// starts inherits them (they close on exec), and the child's own stdout and stderr are for
// diagnostics only: the host keeps their tail for its messages and reads nothing from them. If the script exhausts the child's memory, the
// child dies and the host loses nothing but the rollouts it ran. The host's side of the pipe is
// the host package's (host/sandbox.go); the child runs the same built-ins as an in-process run,
// on a script.Host that is the pipe.
package sandbox

import (
	"bytes"
	"encoding/json"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/tasks"
)

// ChildEnv marks a process as a sandbox child; its value is the memory limit in MiB, and
// CPUEnv (if set) the CPU limit in seconds.
const (
	ChildEnv = "SLIMEN_SANDBOX_CHILD"
	CPUEnv   = "SLIMEN_SANDBOX_CPU"
)

// The host's channel: the child reads the host's messages from HostInFD and writes its own to
// HostOutFD (exec.Cmd.ExtraFiles 0 and 1).
const (
	HostInFD  = 3
	HostOutFD = 4
)

// Msg is one line of the host–child protocol (JSON lines in both directions).
//
//	host → child:  init {script, source, config}, rollout {id, args}, reply {id, result|error}
//	child → host:  ready | fatal {error}, call {id, rollout, method, args}, note {rollout, method, args},
//	               done {id, result}
type Msg struct {
	T       string          `json:"t"`
	ID      int64           `json:"id,omitempty"`
	Rollout int64           `json:"rollout,omitempty"`
	Method  string          `json:"method,omitempty"`
	Args    json.RawMessage `json:"args,omitempty"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   string          `json:"error,omitempty"`
}

// Init starts a child: the script to load and the run's config.
type Init struct {
	Script string         `json:"script"`
	Source string         `json:"source"`
	Config *config.Config `json:"config"`
	Zero   bool           `json:"zero,omitempty"` // zero-config run: train may use any policy
}

// Rollout is a rollout to run. Fn is "rollout", "eval_rollout" or "default_eval".
type Rollout struct {
	Fn        string            `json:"fn"`
	Task      tasks.Task        `json:"task"`
	Index     int               `json:"index"`
	Step      int               `json:"step"`
	Seed      uint64            `json:"seed"`
	Sampling  engines.Sampling  `json:"sampling"`
	Eval      *engines.Sampling `json:"eval,omitempty"`
	Policies  []string          `json:"policies,omitempty"` // default_eval
	NSamples  int               `json:"n_samples,omitempty"`
	WallLimit float64           `json:"wall_limit"`
}

// Done is a finished rollout's report.
type Done struct {
	Error   string                `json:"error,omitempty"`
	Queued  []Queued              `json:"queued,omitempty"`
	Rewards map[string]float64    `json:"rewards,omitempty"` // completion id → reward
	Logs    map[string][2]float64 `json:"logs,omitempty"`
	Result  any                   `json:"result,omitempty"` // eval_rollout's dict, encoded
}

// Queued is a train() request of a finished rollout; ID names its completion.
type Queued struct {
	ID        string    `json:"id"`
	Group     string    `json:"group"`
	Advantage []float64 `json:"advantage,omitempty"`
	HasAdv    bool      `json:"has_adv,omitempty"`
	PerToken  bool      `json:"per_token,omitempty"`
	Teacher   string    `json:"teacher,omitempty"`
	// A chat's sample: the ids of its turns and its position in the call tree; the host
	// rebuilds the conversation from its own copies of the turns (script.NewConversation).
	Turns []string `json:"turns,omitempty"`
	Key   []int    `json:"key,omitempty"`
}

// Generate is the arguments of a generate call.
type Generate struct {
	Policy string                  `json:"policy"`
	Req    engines.GenerateRequest `json:"req"`
}

// Score is the arguments of a score call.
type Score struct {
	Policy string               `json:"policy"`
	Req    engines.ScoreRequest `json:"req"`
}

// Render is the arguments of a render call (a chat's turn).
type Render struct {
	Policy string                  `json:"policy"`
	Reqs   []engines.RenderRequest `json:"reqs"`
}

// Marshal encodes a value as JSON without HTML escaping (which would turn every < of a prompt
// into six bytes).
func Marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// CPULimitMsg is what a child that used up its CPU time (sandbox.cpu_seconds) writes to stderr.
const CPULimitMsg = "slimen sandbox child: CPU time limit reached (RLIMIT_CPU)"
