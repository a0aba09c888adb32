package host

import (
	"fmt"
	"sync"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/host/config"
)

// budget enforces a sandboxed rollout's limits (config.SandboxConfig). A nil *budget allows
// everything, so the in-process path pays nothing. Steps and wall time are enforced on the
// rollout's threads (SetMaxExecutionSteps, a deadline); the rest here, at each built-in.
type budget struct {
	cfg config.SandboxConfig

	mu         sync.Mutex
	calls      int
	tokens     int // reserved: max_tokens × n of every call, refunded to what was generated
	printBytes int
}

// BudgetError is a sandboxed rollout that went over one of its budgets.
type BudgetError struct {
	Budget string // the config key under sandbox:
	Limit  string
	What   string
}

func (e *BudgetError) Error() string {
	return fmt.Sprintf("sandbox budget %s (%s) exceeded: %s", e.Budget, e.Limit, e.What)
}

func newBudget(c config.SandboxConfig) *budget { return &budget{cfg: c} }

// generate reserves a call of n samples of up to maxTokens tokens.
func (b *budget) generate(fn string, n, maxTokens int) error {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.calls+1 > b.cfg.GenerateCalls {
		return &BudgetError{"generate_calls", fmt.Sprint(b.cfg.GenerateCalls), fmt.Sprintf("%s call %d", fn, b.calls+1)}
	}
	want := n * maxTokens
	if b.tokens+want > b.cfg.Tokens {
		return &BudgetError{"tokens", fmt.Sprint(b.cfg.Tokens), fmt.Sprintf("%s asks for up to %d tokens (n=%d × max_tokens=%d) with %d used", fn, want, n, maxTokens, b.tokens)}
	}
	b.calls++
	b.tokens += want
	return nil
}

// settle replaces a call's reservation with the tokens it generated.
func (b *budget) settle(reserved, used int) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.tokens += used - reserved
	b.mu.Unlock()
}

func (b *budget) parallel(fn string, items int) error {
	if b == nil || items <= b.cfg.ParallelItems {
		return nil
	}
	return &BudgetError{"parallel_items", fmt.Sprint(b.cfg.ParallelItems), fmt.Sprintf("%s over more than %d items", fn, items-1)}
}

// state checks the size of a value about to be stored.
func (b *budget) state(fn string, v starlark.Value) error {
	if b == nil {
		return nil
	}
	enc, err := encodeValue(v)
	if err != nil {
		return nil // plainData reports it
	}
	if n := len(fmt.Sprint(enc)); n > b.cfg.StateBytes {
		return &BudgetError{"state_bytes", fmt.Sprint(b.cfg.StateBytes), fmt.Sprintf("%s stores a value of about %d bytes", fn, n)}
	}
	return nil
}

// print counts output; over budget, the caller cancels the thread.
func (b *budget) print(n int) error {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.printBytes += n
	if b.printBytes > b.cfg.PrintBytes {
		return &BudgetError{"print_bytes", fmt.Sprint(b.cfg.PrintBytes), fmt.Sprintf("%d bytes printed", b.printBytes)}
	}
	return nil
}

// limitThread applies the step budget to a thread of the rollout.
func (b *budget) limitThread(th *starlark.Thread) {
	if b == nil {
		return
	}
	th.SetMaxExecutionSteps(b.cfg.Steps)
	th.OnMaxSteps = func(th *starlark.Thread) {
		th.Cancel((&BudgetError{"steps", fmt.Sprint(b.cfg.Steps), "the script ran too long without finishing (an endless loop?)"}).Error())
	}
}

// allowed checks a policy against sandbox.policies (generate, score) or sandbox.train (train).
func (b *budget) allowed(fn, policy string, train bool) error {
	if b == nil {
		return nil
	}
	list, key := b.cfg.Policies, "policies"
	if train {
		list, key = b.cfg.Train, "train"
	}
	if len(list) == 0 {
		return nil
	}
	for _, p := range list {
		if p == policy {
			return nil
		}
	}
	return fmt.Errorf("%s: policy %q is not granted to this script (sandbox.%s: %v)", fn, policy, key, list)
}
