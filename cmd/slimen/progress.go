package main

import (
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/host"
)

// progress shows a run's progress. On a terminal a live line (step, rollouts done — or eval
// rollouts done while an evaluation runs —, the engines' generation rate, reward per policy of
// the last step, ETA) is redrawn in place while a step runs, and each finished step leaves a line
// above it; otherwise there is one plain line per finished step. The rate is tokens over the time
// an engine was generating them, not over the rollouts' time: an agent() run's programs start
// and run tools while no engine generates.
type progress struct {
	w     io.Writer
	tty   bool
	total int
	now   func() time.Time // the clock (tests replace it)
	tick  time.Duration    // how often the live line is redrawn

	mu        sync.Mutex
	started   bool      // begin has been called once
	start     time.Time // when the first step of this process began
	startStep int       // steps done before it (a resumed run)
	stepStart time.Time
	last      string    // reward per policy of the last finished step ("" before the first)
	genEnd    time.Time // when the step's rollouts were all done (zero while they run)
	live      bool      // a live line is on screen
	stop      chan struct{}
	stopped   chan struct{}
}

// liveRun is what the live line reads of a run (a *host.Run).
type liveRun interface {
	Live() host.LivePass
	StepsDone() int
}

func newProgress(f *os.File, total int) *progress {
	st, err := f.Stat()
	tty := err == nil && st.Mode()&os.ModeCharDevice != 0 && os.Getenv("TERM") != "dumb"
	return newProgressTo(f, tty, total)
}

// newProgressTo shows progress on w, as on a terminal when tty is set.
func newProgressTo(w io.Writer, tty bool, total int) *progress {
	return &progress{w: w, tty: tty, total: total, now: time.Now, tick: 200 * time.Millisecond}
}

// logWriter is where run log lines go: on a terminal the live line is cleared first (the next
// redraw puts it back under them).
func (p *progress) logWriter() io.Writer { return logLines{p} }

type logLines struct{ p *progress }

func (l logLines) Write(b []byte) (int, error) {
	l.p.mu.Lock()
	defer l.p.mu.Unlock()
	l.p.clearLive()
	return l.p.w.Write(b)
}

// clearLive erases the live line; p.mu is held.
func (p *progress) clearLive() {
	if p.live {
		fmt.Fprint(p.w, "\r\033[K")
		p.live = false
	}
}

// begin starts redrawing the live line for the step now starting.
func (p *progress) begin(r liveRun) {
	p.mu.Lock()
	p.stepStart, p.genEnd = p.now(), time.Time{}
	if !p.started {
		p.started, p.start, p.startStep = true, p.stepStart, r.StepsDone()
	}
	p.mu.Unlock()
	if !p.tty {
		return
	}
	p.stop, p.stopped = make(chan struct{}), make(chan struct{})
	go func(stop <-chan struct{}, stopped chan<- struct{}) {
		defer close(stopped)
		t := time.NewTicker(p.tick)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				p.drawLive(r)
			}
		}
	}(p.stop, p.stopped)
}

// drawLive redraws the live line of the step in progress.
func (p *progress) drawLive(r liveRun) {
	live := r.Live()
	done, total := live.Done, live.Total
	steps := r.StepsDone()
	p.mu.Lock()
	defer p.mu.Unlock()
	pass := fmt.Sprintf("rollouts %d/%d", done, total)
	if live.Eval {
		pass = fmt.Sprintf("eval %d/%d", done, total)
	}
	parts := []string{fmt.Sprintf("step %d/%d", steps+1, p.total), pass}
	// Once every rollout of the step is done the step trains, and the line says for how long.
	now := p.now()
	if total > 0 && done == total && !live.Eval && p.genEnd.IsZero() {
		p.genEnd = now
	}
	if s := live.Generating.Seconds(); s > 0 {
		parts = append(parts, fmt.Sprintf("gen %.0f tok/s", float64(live.Tokens)/s))
	}
	if !p.genEnd.IsZero() {
		parts = append(parts, fmt.Sprintf("training %.0fs", now.Sub(p.genEnd).Seconds()))
	}
	if p.last != "" {
		parts = append(parts, p.last)
	}
	parts = append(parts, "ETA "+p.eta(steps))
	fmt.Fprintf(p.w, "\r\033[K%s", strings.Join(parts, " · "))
	p.live = true
}

// eta estimates the time left from the pace of the steps this process ran; p.mu is held.
func (p *progress) eta(done int) string {
	ran := done - p.startStep
	if !p.started || ran <= 0 {
		return "?"
	}
	left := time.Duration(float64(p.now().Sub(p.start)) / float64(ran) * float64(p.total-done))
	return left.Round(time.Second).String()
}

func (p *progress) halt() {
	if p.stop != nil {
		close(p.stop)
		<-p.stopped
		p.stop = nil
	}
}

// rewards renders the reward of each policy; a policy with no reward this step (a PPO critic,
// one that generated nothing, one whose completions nobody rewarded) is named without one.
func rewards(res *host.StepResult) string {
	var parts []string
	for _, m := range res.Policies { // sorted by name
		if rw := m.Float("reward_mean"); !math.IsNaN(rw) {
			parts = append(parts, fmt.Sprintf("%s %.2f", m.Policy(), rw))
		} else {
			parts = append(parts, m.Policy()+" –")
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "reward " + strings.Join(parts, " ")
}

// step reports a finished step: a line that stays (on a terminal, in place of the live line).
func (p *progress) step(res *host.StepResult) {
	p.halt()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.last = rewards(res)
	parts := []string{fmt.Sprintf("step %d/%d", res.Step, p.total)}
	if p.last != "" {
		parts = append(parts, p.last)
	}
	parts = append(parts,
		fmt.Sprintf("%.1fs (rollout %.1fs, train %.1fs)", res.Run.Float("step_s"), res.Run.Float("rollout_s"), res.Run.Float("train_s")),
		fmt.Sprintf("gen %.0f tok/s", res.Run.Float("tokens_per_s")))
	if len(res.Failed) > 0 {
		parts = append(parts, fmt.Sprintf("%d rollouts failed", len(res.Failed)))
	}
	if p.tty {
		p.clearLive()
		parts = append(parts, "ETA "+p.eta(res.Step))
	}
	fmt.Fprintln(p.w, strings.Join(parts, " · "))
}

func (p *progress) end() {
	p.halt()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clearLive()
}
