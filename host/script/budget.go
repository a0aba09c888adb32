package script

import (
	"fmt"
	"sync"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// Budget enforces a sandboxed rollout's limits (config.SandboxConfig). A nil *Budget allows
// everything, so the in-process path pays nothing. Steps and wall time are enforced on the
// rollout's threads (a shared step count, a deadline); the rest here, at each built-in. The
// budgets that bound the whole run rather than one rollout (state_total_bytes, message_bytes)
// are the host's to enforce (host/sandbox.go).
type Budget struct {
	cfg  config.SandboxConfig
	zero bool // zero-config run: every policy is a fresh model of this run, so train may use any

	mu         sync.Mutex
	calls      int
	tokens     int // reserved: max_tokens × n of every call, refunded to what was generated
	printBytes int
	steps      uint64 // Starlark steps counted so far, all the rollout's threads together
}

// BudgetError is a sandboxed rollout that went over one of its budgets.
type BudgetError struct {
	Budget string // the config key under sandbox:
	Limit  string
	What   string
}

// Error names the budget, its limit and what went over it.
func (e *BudgetError) Error() string {
	return fmt.Sprintf("sandbox budget %s (%s) exceeded: %s", e.Budget, e.Limit, e.What)
}

// NewBudget is a rollout's budget under the sandbox settings c; zero says the run is
// zero-config, so that train may use any policy.
func NewBudget(c config.SandboxConfig, zero bool) *Budget { return &Budget{cfg: c, zero: zero} }

// generate counts a call (generate, a chat turn, score) and reserves n samples of up to
// maxTokens tokens.
func (b *Budget) generate(fn string, n, maxTokens int) error {
	if err := b.call(fn); err != nil {
		return err
	}
	return b.reserve(fn, n, maxTokens)
}

// call counts a call against generate_calls: a generate call, a chat turn (counted before its
// conversation is rendered, and whether or not it samples anything) or a score call.
func (b *Budget) call(fn string) error {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.calls+1 > b.cfg.GenerateCalls {
		return &BudgetError{"generate_calls", fmt.Sprint(b.cfg.GenerateCalls), fmt.Sprintf("%s call %d", fn, b.calls+1)}
	}
	b.calls++
	return nil
}

// reserve reserves n × maxTokens tokens of a call counted by call.
func (b *Budget) reserve(fn string, n, maxTokens int) error {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	want := n * maxTokens
	if b.tokens+want > b.cfg.Tokens {
		return &BudgetError{"tokens", fmt.Sprint(b.cfg.Tokens),
			fmt.Sprintf("%s asks for up to %d tokens (n=%d × max_tokens=%d) with %d used", fn, want, n, maxTokens, b.tokens)}
	}
	b.tokens += want
	return nil
}

// settle replaces a call's reservation with the tokens it generated.
func (b *Budget) settle(reserved, used int) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.tokens += used - reserved
	b.mu.Unlock()
}

// Prompt checks the size of one prompt passed to generate or score.
func (b *Budget) Prompt(fn string, msgs []engines.Message) error {
	if b == nil {
		return nil
	}
	return CheckPrompt(b.cfg, fn, msgs)
}

// CheckPrompt is the prompt_bytes budget, which the host also applies to what a child sends.
func CheckPrompt(cfg config.SandboxConfig, fn string, msgs []engines.Message) error {
	if n := promptBytes(msgs); n > cfg.PromptBytes {
		return &BudgetError{"prompt_bytes", fmt.Sprint(cfg.PromptBytes), fmt.Sprintf("%s was given a prompt of %d bytes", fn, n)}
	}
	return nil
}

// promptBytes is the size of a prompt: the bytes of its roles and contents.
func promptBytes(msgs []engines.Message) int {
	n := 0
	for _, m := range msgs {
		n += len(m.Role) + len(m.Content)
	}
	return n
}

func (b *Budget) parallel(fn string, items int) error {
	if b == nil || items <= b.cfg.ParallelItems {
		return nil
	}
	return &BudgetError{"parallel_items", fmt.Sprint(b.cfg.ParallelItems), fmt.Sprintf("%s over more than %d items", fn, items-1)}
}

// threads is how many of the rollout's threads may run at once: sandbox.threads, or
// maxRolloutThreads without a sandbox.
func (b *Budget) threads() int {
	if b == nil {
		return maxRolloutThreads
	}
	return b.cfg.Threads
}

// state checks the size of a value about to be stored under a key.
func (b *Budget) state(fn string, v starlark.Value) error {
	if b == nil {
		return nil
	}
	if n := valueSize(v, 0, b.cfg.StateBytes); n > b.cfg.StateBytes {
		return &BudgetError{"state_bytes", fmt.Sprint(b.cfg.StateBytes), fmt.Sprintf("%s stores a value of about %d bytes or more", fn, n)}
	}
	return nil
}

// EntrySize is the size a state entry counts for (sandbox.state_bytes): its key and its value, as valueSize estimates.
func EntrySize(key string, v starlark.Value, limit int) int {
	return len(key) + 16 + valueSize(v, 0, limit)
}

// valueSize estimates the memory a plain-data value takes in the host: 16 bytes a value plus the
// bytes of its strings, 32 more per list or tuple and 48 per dict plus 16 per dict entry. It stops
// counting once past limit (a value built of shared parts can be far larger unfolded than it is),
// and counts what plainData will refuse (too deep, not data) as 16 bytes.
func valueSize(v starlark.Value, depth, limit int) int {
	if depth > 32 {
		return 16
	}
	switch v := v.(type) {
	case starlark.String:
		return 16 + len(v)
	case starlark.Int:
		if _, ok := v.Int64(); ok {
			return 16
		}
		return 16 + (v.BigInt().BitLen()+7)/8
	case *starlark.List, starlark.Tuple:
		n := 32
		it := starlark.Iterate(v)
		defer it.Done()
		var x starlark.Value
		for n <= limit && it.Next(&x) {
			n += valueSize(x, depth+1, limit-n)
		}
		return n
	case *starlark.Dict:
		n := 48
		for _, kv := range v.Items() {
			if n > limit {
				break
			}
			n += 16 + valueSize(kv[0], depth+1, limit-n)
			n += valueSize(kv[1], depth+1, limit-n)
		}
		return n
	}
	return 16
}

// print counts output; over budget, the caller cancels the thread.
func (b *Budget) print(n int) error {
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

// The steps budget is the rollout's, not a thread's: parallel must not multiply it. Each thread
// runs in grants of at most stepGrant steps; at the end of a grant and when the thread finishes
// (threadDone) it adds what it ran to the rollout's count, and a thread that finds the count
// over the budget stops. Threads that are running may each overrun by less than a grant before
// they notice; a thread that finishes over the budget fails it.
const (
	stepGrant  = 10_000
	stepsLocal = "slimen.steps"
)

// threadSteps is a thread's share of the count: the steps of it already counted.
type threadSteps struct{ counted uint64 }

// threadStepCost is what starting a thread costs a rollout's steps budget: a thread (its goroutine,
// its Starlark state, its seeds) costs the host as much as a few hundred steps of a loop, so a
// fan-out of tiny items meets the budget as soon as a loop of the same cost would.
const threadStepCost = 200

// limitThread applies the step budget to a thread of the rollout, charging it threadStepCost.
func (b *Budget) limitThread(th *starlark.Thread) {
	if b == nil {
		return
	}
	acct := &threadSteps{}
	th.SetLocal(stepsLocal, acct)
	b.mu.Lock()
	b.steps += threadStepCost
	over := b.steps > b.cfg.Steps
	steps := b.steps
	b.mu.Unlock()
	if over {
		th.Cancel((&BudgetError{"steps", fmt.Sprint(b.cfg.Steps),
			fmt.Sprintf("the rollout's threads ran %d Starlark steps in all, counting %d for each thread it started, without finishing",
				steps, threadStepCost)}).Error())
	}
	th.OnMaxSteps = func(th *starlark.Thread) {
		if err := b.countSteps(th, acct); err != nil {
			th.Cancel(err.Error())
			return
		}
		th.SetMaxExecutionSteps(th.ExecutionSteps() + b.grant())
	}
	th.SetMaxExecutionSteps(b.grant())
}

// grant is how many steps a thread may run before it counts them again (at least 1: a limit of 0
// means none to Starlark).
func (b *Budget) grant() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	left := uint64(0)
	if b.steps < b.cfg.Steps {
		left = b.cfg.Steps - b.steps
	}
	return max(1, min(stepGrant, left))
}

// countSteps adds the steps a thread ran since it last counted to the rollout's count.
func (b *Budget) countSteps(th *starlark.Thread, acct *threadSteps) error {
	ran := th.ExecutionSteps() - acct.counted
	acct.counted = th.ExecutionSteps()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.steps += ran
	if b.steps > b.cfg.Steps {
		return &BudgetError{"steps", fmt.Sprint(b.cfg.Steps),
			fmt.Sprintf("the rollout's threads ran %d Starlark steps in all without finishing (an endless loop?)", b.steps)}
	}
	return nil
}

// threadDone counts the last steps of a thread that returned; an error if they put the rollout
// over its budget.
func (b *Budget) threadDone(th *starlark.Thread) error {
	if b == nil {
		return nil
	}
	acct, _ := th.Local(stepsLocal).(*threadSteps)
	if acct == nil {
		return nil
	}
	return b.countSteps(th, acct)
}

// allowed checks a policy against sandbox.policies (generate, score) or sandbox.train (train).
// Without sandbox.policies every policy of the config may be used (the host refuses names the
// config does not define); without sandbox.train no policy may be trained, except in a
// zero-config run, whose policies are fresh models the run itself created.
func (b *Budget) allowed(fn, policy string, train bool) error {
	if b == nil {
		return nil
	}
	return GrantCheck(b.cfg, b.zero, fn, policy, train)
}

// GrantCheck is allowed without a rollout: the host applies it to what a child reports.
func GrantCheck(cfg config.SandboxConfig, zero bool, fn, policy string, train bool) error {
	list, key := cfg.Policies, "policies"
	if train {
		list, key = cfg.Train, "train"
	}
	for _, p := range list {
		if p == policy {
			return nil
		}
	}
	switch {
	case len(list) > 0:
		return fmt.Errorf("%s: policy %q is not granted to this script (sandbox.%s: %v)", fn, policy, key, list)
	case !train || zero:
		return nil
	}
	return fmt.Errorf("%s: policy %q is not granted to this script for training (sandbox.train is not set: "+
		"a sandboxed script trains only the policies it lists, e.g. sandbox: {train: [%s]})", fn, policy, policy)
}
