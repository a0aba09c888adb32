package script

import (
	"context"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// Host is what a rollout's built-ins may ask of the run: the one way from the Starlark runtime to
// the orchestration. In-process it is the run itself; in a sandbox child it is the pipe to the
// host process (host/script/sandbox). Keeping the built-ins on this interface is what lets
// untrusted Starlark run in another process unchanged. What a rollout queues for training and
// logs stays on its Rollout, for the run to gather once the rollout succeeded.
type Host interface {
	// CheckPolicy says whether a policy exists and can be trained; place names where it was
	// configured, for messages (" in config.yaml:7").
	CheckPolicy(name string) (trainable bool, place string, err error)
	// Sampling is the run's default sampling settings (the rollout: section of its config).
	Sampling() engines.Sampling
	// Generate samples from a policy; the run batches the calls of all rollouts per policy.
	Generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error)
	// Score returns the log-probabilities of req's tokens under a policy.
	Score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error)
	// Render renders messages with a policy's chat template, in its engine (engines.Renderer),
	// and tells the model facts a conversation (chat) needs.
	Render(ctx context.Context, policy string, reqs []engines.RenderRequest) (Rendered, error)
	// StateGet reads the run-wide `state` store.
	StateGet(key string) (starlark.Value, bool, error)
	// StateLock holds the state store for an atomic update of key: the caller computes the new
	// value and calls commit, or release to leave it unchanged. release after commit is a no-op.
	StateLock(key string) (cur starlark.Value, found bool, commit func(starlark.Value) error, release func(), err error)
	// Event writes a line to the run's log (print, rate-limited per rollout).
	Event(msg string)
	// Running adds n (or removes, n < 0) threads to the count of running Starlark threads.
	Running(n int)
	// Generated counts tokens sampled, for progress displays.
	Generated(tokens int)
}

// Rendered is the answer to Host.Render: the token ids of each request, the model's end-of-sequence
// tokens and its context length (prompt and response together), and whether its engine constrains
// decoding (engines.Sampling.Constraint; "constrain" in its Info.Capabilities).
type Rendered struct {
	Tokens    [][]int32 `json:"tokens"`
	EOS       []int32   `json:"eos"`
	MaxSeqLen int       `json:"max_seq_len"`
	Constrain bool      `json:"constrain,omitempty"`
}
