package host

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/script/sandbox"
)

// The host's own accounting of what a sandbox child asks of it (docs/sandbox.md). The child
// enforces every budget of its rollouts itself, but the host does not take its word for it: a
// child whose process something else controls (a program it started that reached its channel,
// a runaway child) could send anything. So the host charges each rollout's calls and notes as
// they arrive, with the same rules the child applies before sending them, and a message that
// an honest child would never send stops the child: its rollouts run again alone, and the
// rollout that forges again fails with the budget it broke.

// account is what the host has charged one rollout of a child.
type account struct {
	calls      int // generate calls, chat turns (renderings) and score calls (sandbox.generate_calls)
	renders    int // chat turns: renderings of a conversation
	chatGens   int // generate calls of chat turns: each follows its turn's rendering
	tokens     int // reserved n × max_tokens of each call, settled to what was generated, and scored tokens (sandbox.tokens)
	events     int // event notes: prints and lines counted as prints (script.MaxPrintEvents)
	eventBytes int // their bytes (sandbox.print_bytes, with eventAllowance a line)
	running    int // the rollout's "running" notes, summed: undone when the rollout ends
}

// eventAllowance is what an event line may carry besides its share of print_bytes and the
// task's id: the "step N task ID: " before a printed line, or the line that says the rest were
// dropped.
const eventAllowance = 128

// forgedError is a message that the slimen child never sends: the host stops the child.
type forgedError struct{ err error }

func (e *forgedError) Error() string { return e.err.Error() }
func (e *forgedError) Unwrap() error { return e.err }

// forgery says what a child sent that its honest self never does.
func forgery(format string, args ...any) error {
	return &forgedError{fmt.Errorf("sandbox: the script's process sent the host %s, which the slimen sandbox child never "+
		"sends (a forged message); the host stopped the process", fmt.Sprintf(format, args...))}
}

// forgedBudget is a call past a budget that the child's own check refuses.
func forgedBudget(budget string, limit int, format string, args ...any) error {
	return &forgedError{&script.BudgetError{Budget: budget, Limit: strconv.Itoa(limit),
		What: fmt.Sprintf(format, args...) + ", which the child's own check refuses (a forged message); the host stopped the process"}}
}

// pending is a call of a child that the host admitted: charged to its rollout and counted in
// flight until the host replies.
type pending struct {
	m        sandbox.Msg
	ro       *script.Rollout // nil: the rollout has ended (the reply says so)
	acct     *account
	size     int // the bytes counted in flight (0: state_set and state_unlock, which the child does not count)
	counted  bool
	gen      sandbox.Generate
	render   sandbox.Render
	score    sandbox.Score
	reserved int                        // the tokens reserved for gen
	release  func()                     // state_set, state_unlock: the lock they release
	commit   func(starlark.Value) error // and the pending update
}

// admit checks a call of the child as it arrives and charges it, in the order the child sent
// its calls: an error is a forged call.
func (c *sbChild) admit(m sandbox.Msg, cfg config.SandboxConfig) (*pending, error) {
	p := &pending{m: m}
	c.mu.Lock()
	defer c.mu.Unlock()
	if m.Rollout <= 0 || m.Rollout > c.nextID {
		return nil, forgery("a %.40q call for rollout %d, which it was never given", m.Method, m.Rollout)
	}
	p.ro, p.acct = c.rollouts[m.Rollout], c.accts[m.Rollout]
	switch m.Method {
	case "state_set", "state_unlock":
		// The child sends one of these for each state lock the host granted it, and nothing else.
		p.release, p.commit = c.locks[m.Rollout], c.commits[m.Rollout]
		if p.release == nil {
			return nil, forgery("%s for rollout %d, which holds no state lock", m.Method, m.Rollout)
		}
		delete(c.locks, m.Rollout)
		delete(c.commits, m.Rollout)
		return p, nil
	case "policy", "state_get", "state_lock", "generate", "score", "render":
	default:
		return nil, forgery("a call of an unknown method %.40q", m.Method)
	}
	// The child holds a call back while it has MaxCallsInFlight at the host, or their bytes and
	// its own would pass InflightMessages × message_bytes (one call alone always goes).
	p.size = len(m.Args)
	maxBytes := sandbox.InflightMessages * cfg.MessageBytes
	if c.calls >= sandbox.MaxCallsInFlight {
		return nil, forgery("call %d at once (a child has at most %d calls at the host)", c.calls+1, sandbox.MaxCallsInFlight)
	}
	if c.calls > 0 && c.callBytes+p.size > maxBytes {
		return nil, forgery("calls of %d bytes at once (a child has at most %d bytes of calls at the host, 4 × message_bytes)", c.callBytes+p.size, maxBytes)
	}
	if p.ro != nil {
		if err := p.charge(cfg); err != nil {
			return nil, err
		}
	}
	c.calls++
	c.callBytes += p.size
	c.peakCalls = max(c.peakCalls, c.calls)
	p.counted = true
	return p, nil
}

// charge applies a call's budgets to its rollout's account (the caller holds c.mu).
func (p *pending) charge(cfg config.SandboxConfig) error {
	m, a := p.m, p.acct
	switch m.Method {
	case "generate":
		if err := json.Unmarshal(m.Args, &p.gen); err != nil {
			return forgery("a generate call it cannot have encoded (%v)", err)
		}
		n, mt := p.gen.Req.N, p.gen.Req.MaxTokens
		if n < 1 || n > script.MaxSamplesPerCall {
			return forgery("a generate call for n=%d samples (the child allows 1 to %d)", n, script.MaxSamplesPerCall)
		}
		if mt < 0 || mt > math.MaxInt32 {
			return forgery("a generate call with max_tokens=%d", mt)
		}
		if len(p.gen.Req.PromptTokens) > 0 {
			// A chat turn's: the turn was counted when it rendered the conversation.
			if a.chatGens+1 > a.renders {
				return forgery("a chat turn's generate call (%d) without its rendering (%d)", a.chatGens+1, a.renders)
			}
		} else if err := a.call(cfg, "generate"); err != nil {
			return err
		}
		if want := n * mt; a.tokens+want > cfg.Tokens {
			return forgedBudget("tokens", cfg.Tokens, "a generate call asks for up to %d tokens (n=%d × max_tokens=%d) with %d of "+
				"the rollout's reserved", want, n, mt, a.tokens)
		}
		if err := script.CheckPrompt(cfg, "generate", p.gen.Req.Messages); err != nil {
			return &forgedError{fmt.Errorf("%v, which the child's own check refuses (a forged message); the host stopped the process", err)}
		}
		p.reserved = n * mt
		a.tokens += p.reserved
		if len(p.gen.Req.PromptTokens) > 0 {
			a.chatGens++
		}
	case "render":
		if err := json.Unmarshal(m.Args, &p.render); err != nil {
			return forgery("a chat rendering it cannot have encoded (%v)", err)
		}
		if k := len(p.render.Reqs); k < 1 || k > 4 {
			return forgery("a chat rendering of %d conversations (a turn renders 1 to 4)", k)
		}
		if err := script.CheckRender(cfg, "chat", p.render.Reqs); err != nil {
			return &forgedError{fmt.Errorf("%v, which the child's own check refuses (a forged message); the host stopped the process", err)}
		}
		if err := a.call(cfg, "chat turn"); err != nil {
			return err
		}
		a.renders++
	case "score":
		if err := json.Unmarshal(m.Args, &p.score); err != nil {
			return forgery("a score call it cannot have encoded (%v)", err)
		}
		if err := script.CheckPrompt(cfg, "score", p.score.Req.Messages); err != nil {
			return &forgedError{fmt.Errorf("%v, which the child's own check refuses (a forged message); the host stopped the process", err)}
		}
		if err := a.call(cfg, "score"); err != nil {
			return err
		}
		// The tokens a score call scores count against tokens, for good.
		if k := len(p.score.Req.Tokens); a.tokens+k > cfg.Tokens {
			return forgedBudget("tokens", cfg.Tokens, "a score call scores %d tokens with %d of the rollout's reserved", k, a.tokens)
		}
		a.tokens += len(p.score.Req.Tokens)
	}
	return nil
}

// call counts a generate call, a chat turn or a score call against generate_calls, as the
// child's script.Budget does.
func (a *account) call(cfg config.SandboxConfig, what string) error {
	if a.calls+1 > cfg.GenerateCalls {
		return forgedBudget("generate_calls", cfg.GenerateCalls, "the rollout's call %d (a %s) came to the host", a.calls+1, what)
	}
	a.calls++
	return nil
}

// settle replaces a generate call's reservation with the tokens it generated, as the child does.
func (c *sbChild) settle(p *pending, used int) {
	c.mu.Lock()
	p.acct.tokens += used - p.reserved
	c.mu.Unlock()
}

// note checks a note of the child (an event for the run's log, a change of the rollout's running
// threads), charges it to its rollout and acts on it; a note for a rollout that has ended is
// dropped. An error is a forged note.
func (c *sbChild) note(m sandbox.Msg, cfg config.SandboxConfig) error {
	c.mu.Lock()
	if m.Rollout <= 0 || m.Rollout > c.nextID {
		c.mu.Unlock()
		return forgery("a %.40q note for rollout %d, which it was never given", m.Method, m.Rollout)
	}
	a, ro := c.accts[m.Rollout], c.rollouts[m.Rollout]
	switch {
	case m.Method != "event" && m.Method != "running":
		c.mu.Unlock()
		return forgery("a note of an unknown kind %.40q", m.Method)
	case a == nil:
		c.mu.Unlock()
		return nil
	case m.Method == "running":
		var n int
		if err := json.Unmarshal(m.Args, &n); err != nil || (n != 1 && n != -1) {
			c.mu.Unlock()
			return forgery("a running note of %.40s (the child sends 1 or -1)", m.Args)
		}
		a.running += n
		c.mu.Unlock()
		c.sb.r.activity.add(n)
		return nil
	}
	var msg string
	if err := json.Unmarshal(m.Args, &msg); err != nil {
		c.mu.Unlock()
		return forgery("an event note it cannot have encoded (%v)", err)
	}
	// A rollout's events are its first prints (print_bytes bounds their text; a chat turn
	// past the policy's context writes one as a print) and the line that says the rest were
	// dropped.
	a.events++
	a.eventBytes += len(msg)
	events, bytes := a.events, a.eventBytes
	c.mu.Unlock()
	if events > script.MaxPrintEvents {
		return forgedBudget("print_bytes", cfg.PrintBytes, "the rollout's event line %d came to the host (its child sends at most %d)", events, script.MaxPrintEvents)
	}
	if most := cfg.PrintBytes + events*(eventAllowance+len(ro.Task.ID)); bytes > most {
		return forgedBudget("print_bytes", cfg.PrintBytes, "the rollout's %d event lines came to the host with %d bytes (its "+
			"child sends at most %d)", events, bytes, most)
	}
	c.sb.r.events.printf("%s", msg)
	return nil
}
