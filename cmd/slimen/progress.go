package main

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/host"
)

// progress shows a run's progress: on a terminal one live line (step, rollouts done, tokens/s,
// reward per policy, ETA) redrawn in place; otherwise one plain line per step.
type progress struct {
	w     io.Writer
	tty   bool
	total int
	start time.Time

	mu      sync.Mutex
	last    string // the latest per-step summary
	stop    chan struct{}
	stopped chan struct{}
	live    bool // a live line is on screen
}

func newProgress(f *os.File, total int) *progress {
	st, err := f.Stat()
	tty := err == nil && st.Mode()&os.ModeCharDevice != 0 && os.Getenv("TERM") != "dumb"
	return &progress{w: f, tty: tty, total: total, start: time.Now()}
}

// logWriter is where run log lines go: on a terminal the live line is cleared first.
func (p *progress) logWriter() io.Writer { return logLines{p} }

type logLines struct{ p *progress }

func (l logLines) Write(b []byte) (int, error) {
	l.p.mu.Lock()
	defer l.p.mu.Unlock()
	if l.p.live {
		fmt.Fprint(l.p.w, "\r\033[K")
		l.p.live = false
	}
	return l.p.w.Write(b)
}

// begin starts redrawing the live line for the step now starting.
func (p *progress) begin(r *host.Run) {
	if !p.tty {
		return
	}
	p.stop, p.stopped = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(p.stopped)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		stepStart := time.Now()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
			}
			done, total, tokens := r.Live()
			rate := float64(tokens) / time.Since(stepStart).Seconds()
			p.draw(fmt.Sprintf("step %d/%d · rollouts %d/%d · %.0f tok/s · %s · ETA %s",
				r.StepsDone()+1, p.total, done, total, rate, p.last, p.eta(r.StepsDone())))
		}
	}()
}

func (p *progress) draw(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "\r\033[K%s", s)
	p.live = true
}

func (p *progress) eta(done int) string {
	if done == 0 {
		return "?"
	}
	left := time.Duration(float64(time.Since(p.start)) / float64(done) * float64(p.total-done))
	return left.Round(time.Second).String()
}

func (p *progress) halt() {
	if p.stop != nil {
		close(p.stop)
		<-p.stopped
		p.stop = nil
	}
}

// step reports a finished step.
func (p *progress) step(res *host.StepResult) {
	p.halt()
	var parts []string
	for _, m := range res.Policies {
		parts = append(parts, fmt.Sprintf("%s %.2f", m.Policy(), m.Float("reward_mean")))
	}
	sort.Strings(parts)
	p.last = "reward " + strings.Join(parts, " ")
	line := fmt.Sprintf("step %d/%d · %s · %.1fs (rollout %.1fs, train %.1fs) · %.0f tok/s",
		res.Step, p.total, p.last, res.Run.Float("step_s"), res.Run.Float("rollout_s"),
		res.Run.Float("train_s"), res.Run.Float("tokens_per_s"))
	if len(res.Failed) > 0 {
		line += fmt.Sprintf(" · %d rollouts failed", len(res.Failed))
	}
	if p.tty {
		p.draw(line + " · ETA " + p.eta(res.Step))
		return
	}
	fmt.Fprintln(p.w, line)
}

func (p *progress) end() {
	p.halt()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.live {
		fmt.Fprintln(p.w)
		p.live = false
	}
}
