package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/host/config"
)

// Issue 7's acceptance for `slimen exec --watch`, through the binary: edits saved the way editors
// save them (a new file renamed over the old one) reach the running process at a step boundary.
// These runs are asked for far more steps than they take and stopped with SIGTERM once the test
// has seen what it waits for; every wait polls the run's files, with a generous deadline for a
// loaded machine.

// waitLimit bounds every wait on a running slimen.
const waitLimit = 3 * time.Minute

// lockedBuffer collects a process's output while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// running is a slimen process started by a test.
type running struct {
	cmd    *exec.Cmd
	out    *lockedBuffer
	exited chan struct{}
	err    error // set when exited is closed
}

func startSlimen(t *testing.T, dir string, args ...string) *running {
	t.Helper()
	r := &running{cmd: exec.Command(slimenBin, args...), out: &lockedBuffer{}, exited: make(chan struct{})}
	r.cmd.Dir = dir
	r.cmd.Stdout, r.cmd.Stderr = r.out, r.out
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.err = r.cmd.Wait(); close(r.exited) }()
	t.Cleanup(func() {
		select {
		case <-r.exited:
		default:
			r.cmd.Process.Kill()
			<-r.exited
		}
	})
	return r
}

// waitFor polls cond until it holds; it fails the test if the process exits first or the deadline
// passes. what says what was awaited.
func (r *running) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		select {
		case <-r.exited:
			if cond() {
				return
			}
			t.Fatalf("slimen exited (%v) before %s:\n%s", r.err, what, r.out.String())
		case <-time.After(25 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %v:\n%s", what, waitLimit, r.out.String())
		}
	}
}

// stop sends SIGTERM (finish the step, checkpoint, exit 0) and waits for the exit.
func (r *running) stop(t *testing.T) {
	t.Helper()
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(waitLimit):
		t.Fatalf("slimen did not stop on SIGTERM:\n%s", r.out.String())
	}
	if r.err != nil {
		t.Fatalf("slimen exited with %v after SIGTERM, want 0:\n%s", r.err, r.out.String())
	}
}

// runLines returns the "_run" lines of a metrics file written so far, in order; a line still
// being written is left out.
func runLines(path string) []map[string]any {
	b, _ := os.ReadFile(path)
	var out []map[string]any
	for _, line := range strings.Split(string(b), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["policy"] == "_run" {
			out = append(out, m)
		}
	}
	return out
}

func lastStep(path string) int {
	ls := runLines(path)
	if len(ls) == 0 {
		return 0
	}
	return int(ls[len(ls)-1]["step"].(float64))
}

func fileHas(path, text string) bool {
	b, _ := os.ReadFile(path)
	return strings.Contains(string(b), text)
}

// renameInto saves a file as editors do: written beside it, then renamed over it.
func renameInto(t *testing.T, path, text string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".swp")
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestWatchCLIReloadsScript: a rewritten script logs its new value from a following step on with
// the step counter continuous; a syntax error is reported in events.log and the last good version
// keeps running.
func TestWatchCLIReloadsScript(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "s.star")
	version := func(v int) string {
		return fmt.Sprintf("def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n    log(version = %d)\n", v)
	}
	renameInto(t, script, version(1))
	out := filepath.Join(dir, "run")
	metrics, events := filepath.Join(out, "metrics.jsonl"), filepath.Join(out, "events.log")
	r := startSlimen(t, dir, "exec", "s.star", "--watch", "--steps", "100000", "--batch-size", "2", "--out", out)

	r.waitFor(t, "step 1 in metrics.jsonl", func() bool { return lastStep(metrics) >= 1 })
	renameInto(t, script, version(2))
	r.waitFor(t, "a step logging version 2", func() bool {
		ls := runLines(metrics)
		return len(ls) > 0 && ls[len(ls)-1]["version"] == 2.0
	})
	renameInto(t, script, "def rollout(task):\n    this is not starlark\n")
	r.waitFor(t, "the broken version reported in events.log", func() bool { return fileHas(events, "s.star is broken; the run keeps version") })
	// Two whole steps after the report have certainly started after the broken save.
	after := lastStep(metrics) + 2
	r.waitFor(t, fmt.Sprintf("step %d", after), func() bool { return lastStep(metrics) >= after })
	r.stop(t)

	ls := runLines(metrics)
	first2 := 0
	for i, m := range ls {
		if got := int(m["step"].(float64)); got != i+1 {
			t.Fatalf("line %d of _run has step %d: the step counter is not continuous", i+1, got)
		}
		v := m["version"].(float64)
		switch {
		case v == 2 && first2 == 0:
			first2 = i + 1
		case first2 == 0 && v != 1, first2 > 0 && v != 2:
			t.Errorf("step %d logged version %v (version 2 from step %d)", i+1, v, first2)
		}
	}
	if first2 < 2 || len(ls) < after {
		t.Fatalf("version 2 from step %d of %d", first2, len(ls))
	}
	ev, _ := os.ReadFile(events)
	for _, want := range []string{
		fmt.Sprintf("runs from step %d", first2),
		"s.star:2:12", // the position of the syntax error
	} {
		if !strings.Contains(string(ev), want) {
			t.Errorf("events.log lacks %q:\n%s", want, ev)
		}
	}
	if n := strings.Count(string(ev), "reload: script version"); n != 1 {
		t.Errorf("events.log reports %d script versions taking over, want 1:\n%s", n, ev)
	}
	if n := strings.Count(string(ev), "is broken"); n != 1 {
		t.Errorf("events.log reports the broken version %d times, want once:\n%s", n, ev)
	}
	if b, _ := os.ReadFile(filepath.Join(out, "script.star")); string(b) != version(2) {
		t.Errorf("script.star (the running version) = %q", b)
	}
	versions, _ := filepath.Glob(filepath.Join(out, "scripts", "step_*"))
	if len(versions) != 2 || !strings.Contains(versions[1], fmt.Sprintf("step_%d-", first2)) {
		t.Errorf("saved versions %v, want step_1 and step_%d", versions, first2)
	}
}

// TestWatchCLIConfigKeepsOverrides: --batch-size, --seed and --data hold for a reloaded config,
// whose lr and temperature take over.
func TestWatchCLIConfigKeepsOverrides(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "s.star")
	renameInto(t, script, "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n")
	cfgText := func(lr, temperature string) string {
		return `policies:
  - name: p
    hf_checkpoint: builtin:tiny-arith
    engine: {kind: tiny}
    train: {lr: ` + lr + `}
rollout: {batch_size: 4, temperature: ` + temperature + `, max_response_len: 8}
data: {path: synthetic:arith}
run: {steps: 100000, seed: 1}
`
	}
	cfgFile := filepath.Join(dir, "config.yaml")
	renameInto(t, cfgFile, cfgText("1.0e-3", "1.0"))
	out := filepath.Join(dir, "run")
	metrics, events := filepath.Join(out, "metrics.jsonl"), filepath.Join(out, "events.log")
	data := "synthetic:arith?difficulty=2"
	r := startSlimen(t, dir, "exec", "s.star", "--config", "config.yaml", "--watch",
		"--batch-size", "2", "--seed", "5", "--data", data, "--out", out)

	r.waitFor(t, "step 1 in metrics.jsonl", func() bool { return lastStep(metrics) >= 1 })
	renameInto(t, cfgFile, cfgText("2.0e-3", "0.7"))
	r.waitFor(t, "the reloaded config taking effect or refused", func() bool {
		return fileHas(events, "config takes effect from step") || fileHas(events, "config.yaml changes") || fileHas(events, "config.yaml is invalid")
	})
	if ev, _ := os.ReadFile(events); !strings.Contains(string(ev), "config takes effect from step") {
		t.Fatalf("the edit of lr and temperature was not accepted:\n%s", ev)
	}
	after := lastStep(metrics) + 1
	r.waitFor(t, fmt.Sprintf("step %d", after), func() bool { return lastStep(metrics) >= after })
	r.stop(t)

	for _, m := range runLines(metrics) {
		if m["rollouts"] != 2.0 {
			t.Errorf("step %v ran %v rollouts, want --batch-size 2", m["step"], m["rollouts"])
		}
	}
	c, err := config.Load(filepath.Join(out, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Rollout.BatchSize != 2 || c.Run.Seed != 5 || c.Data.Path != data {
		t.Errorf("the run's config after the reload: batch_size %d, seed %d, data %q; want the command line's 2, 5, %q",
			c.Rollout.BatchSize, c.Run.Seed, c.Data.Path, data)
	}
	if c.Policies[0].Train.LR != 2e-3 || c.Rollout.Temperature != 0.7 {
		t.Errorf("the run's config after the reload: lr %v, temperature %v; want the file's new 2e-3, 0.7",
			c.Policies[0].Train.LR, c.Rollout.Temperature)
	}
}

// Shortening run.steps in the watched config ends the run there, with its final checkpoint.
func TestWatchCLIConfigSteps(t *testing.T) {
	dir := t.TempDir()
	renameInto(t, filepath.Join(dir, "s.star"), "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n")
	cfgText := func(steps int) string {
		return fmt.Sprintf("policies:\n  - name: p\nrollout: {batch_size: 2, max_response_len: 8}\nrun: {steps: %d, seed: 1}\n", steps)
	}
	cfgFile := filepath.Join(dir, "config.yaml")
	renameInto(t, cfgFile, cfgText(100000))
	out := filepath.Join(dir, "run")
	metrics := filepath.Join(out, "metrics.jsonl")
	r := startSlimen(t, dir, "exec", "s.star", "--config", "config.yaml", "--watch", "--out", out)
	r.waitFor(t, "step 1 in metrics.jsonl", func() bool { return lastStep(metrics) >= 1 })
	end := lastStep(metrics) + 20 // steps take tens of milliseconds: room for the reload to land first
	renameInto(t, cfgFile, cfgText(end))
	select {
	case <-r.exited:
	case <-time.After(waitLimit):
		r.stop(t)
		t.Fatalf("the run did not end after run.steps was set to %d; it reached step %d", end, lastStep(metrics))
	}
	if r.err != nil {
		t.Fatalf("slimen exited with %v:\n%s", r.err, r.out.String())
	}
	if got := lastStep(metrics); got != end {
		t.Errorf("the run ended after step %d, want %d (the reloaded run.steps)", got, end)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoints", fmt.Sprintf("step_%d", end))); err != nil {
		t.Errorf("no final checkpoint: %v", err)
	}
}
