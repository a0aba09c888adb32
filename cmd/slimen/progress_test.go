package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/host"
)

// fakeRun is the step in progress as the live line reads it.
type fakeRun struct {
	done, total, tokens, steps int
	eval                       bool
	gen                        time.Duration // the engines' generating time in the pass
}

func (f *fakeRun) Live() host.LivePass {
	return host.LivePass{Done: f.done, Total: f.total, Tokens: f.tokens, Eval: f.eval, Generating: f.gen}
}
func (f *fakeRun) StepsDone() int { return f.steps }

// stepResult is a finished step of policies a (rewarded) and critic (no completions: a PPO critic).
func stepResult(step int) *host.StepResult {
	return &host.StepResult{
		Step: step,
		Policies: []host.Metrics{
			{"step": step, "policy": "a", "reward_mean": 0.5, "completions": 4},
			{"step": step, "policy": "critic", "completions": 0},
		},
		Run: host.Metrics{"step": step, "policy": "_run", "step_s": 4.0, "rollout_s": 3.0, "train_s": 1.0, "tokens_per_s": 25.0},
	}
}

// fakeClock is a clock the test moves by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time          { return c.t }
func (c *fakeClock) advance(d time.Duration) { c.t = c.t.Add(d) }

// On a terminal: the live line is redrawn in place (carriage return, erase line), a finished step
// replaces it with a line of its own that stays, log lines clear the live line first, and ETA
// comes from the pace of the steps this process ran.
func TestProgressTerminal(t *testing.T) {
	var buf bytes.Buffer
	clock := &fakeClock{t: time.Unix(1000, 0)}
	p := newProgressTo(&buf, true, 10)
	p.now, p.tick = clock.now, time.Hour                                            // the test draws the live line itself
	run := &fakeRun{done: 3, total: 8, tokens: 100, steps: 2, gen: 2 * time.Second} // a run resumed after step 2

	p.begin(run)
	clock.advance(2 * time.Second)
	p.drawLive(run)
	run.done, run.tokens, run.gen = 8, 150, 3*time.Second
	clock.advance(time.Second)
	p.drawLive(run)
	clock.advance(time.Second) // training: the generation rate stays, the training time counts
	p.drawLive(run)
	p.step(stepResult(3))
	run.steps, run.done, run.tokens, run.gen = 3, 1, 40, 2*time.Second
	p.begin(run)
	clock.advance(2 * time.Second)
	p.drawLive(run)
	p.logWriter().Write([]byte("checkpoint: saved\n"))
	p.drawLive(run)
	p.end()

	const clr = "\r\033[K"
	want := clr + "step 3/10 · rollouts 3/8 · gen 50 tok/s · ETA ?" +
		clr + "step 3/10 · rollouts 8/8 · gen 50 tok/s · training 0s · ETA ?" +
		clr + "step 3/10 · rollouts 8/8 · gen 50 tok/s · training 1s · ETA ?" +
		clr + "step 3/10 · reward a 0.50 critic – · 4.0s (rollout 3.0s, train 1.0s) · gen 25 tok/s · ETA 28s\n" +
		clr + "step 4/10 · rollouts 1/8 · gen 20 tok/s · reward a 0.50 critic – · ETA 42s" +
		clr + "checkpoint: saved\n" +
		clr + "step 4/10 · rollouts 1/8 · gen 20 tok/s · reward a 0.50 critic – · ETA 42s" +
		clr
	if d := cmp.Diff(strings.Split(want, "\r"), strings.Split(buf.String(), "\r")); d != "" {
		t.Errorf("terminal output (-want +got), split at carriage returns:\n%s", d)
	}
}

// The live line of the evaluation before step 1 says it is the eval's rollouts (it said
// "rollouts 0/200" of a step that had not begun), and its rate is the tokens over the engines'
// generating time: an agent() run whose programs take 8 s of 10 to start generates 100 tokens in
// 2 s, 50 tok/s, not 10. Once the eval's rollouts are all done the step's have not begun: no
// "training".
func TestProgressEvalAndGenerationRate(t *testing.T) {
	var buf bytes.Buffer
	clock := &fakeClock{t: time.Unix(1000, 0)}
	p := newProgressTo(&buf, true, 10)
	p.now, p.tick = clock.now, time.Hour
	run := &fakeRun{done: 37, total: 200, tokens: 100, eval: true, gen: 2 * time.Second}
	p.begin(run)
	clock.advance(10 * time.Second)
	p.drawLive(run)
	run.done = 200
	p.drawLive(run)
	run.done, run.total, run.tokens, run.eval, run.gen = 0, 8, 0, false, 0 // the step's rollouts begin
	p.drawLive(run)
	p.end()
	const clr = "\r\033[K"
	want := clr + "step 1/10 · eval 37/200 · gen 50 tok/s · ETA ?" +
		clr + "step 1/10 · eval 200/200 · gen 50 tok/s · ETA ?" +
		clr + "step 1/10 · rollouts 0/8 · ETA ?" +
		clr
	if d := cmp.Diff(strings.Split(want, "\r"), strings.Split(buf.String(), "\r")); d != "" {
		t.Errorf("terminal output (-want +got), split at carriage returns:\n%s", d)
	}
}

// Not on a terminal: one plain line per finished step, no live line, no control characters.
func TestProgressPlain(t *testing.T) {
	var buf bytes.Buffer
	p := newProgressTo(&buf, false, 10)
	p.tick = time.Millisecond // a live line, if one were drawn, would show up
	run := &fakeRun{done: 3, total: 8, tokens: 100}
	p.begin(run)
	time.Sleep(20 * time.Millisecond)
	p.step(stepResult(1))
	p.logWriter().Write([]byte("checkpoint: saved\n"))
	res := stepResult(2)
	res.Failed = []*host.RolloutError{{Step: 2, TaskID: "t1", Msg: "boom"}}
	p.begin(run)
	p.step(res)
	p.end()
	want := "step 1/10 · reward a 0.50 critic – · 4.0s (rollout 3.0s, train 1.0s) · gen 25 tok/s\n" +
		"checkpoint: saved\n" +
		"step 2/10 · reward a 0.50 critic – · 4.0s (rollout 3.0s, train 1.0s) · gen 25 tok/s · 1 rollouts failed\n"
	if d := cmp.Diff(want, buf.String()); d != "" {
		t.Errorf("plain output (-want +got):\n%s", d)
	}
}

// A policy with no reward this step has none on the line, not 0.00: a frozen judge whose
// completions nobody rewarded, a policy that generated nothing (issue 35).
func TestRewardsAbsentIsNotZero(t *testing.T) {
	res := &host.StepResult{Step: 1, Policies: []host.Metrics{
		{"step": 1, "policy": "a", "reward_mean": 0.0, "completions": 4},
		{"step": 1, "policy": "idle", "completions": 0},
		{"step": 1, "policy": "judge", "completions": 4},
	}}
	if got, want := rewards(res), "reward a 0.00 idle – judge –"; got != want {
		t.Errorf("rewards = %q, want %q", got, want)
	}
}
