package host

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// Issue 39: one writer per run folder, metrics that no crash loses, whole steps only, a folder
// that disappears noticed, every stop said in events.log.

// seededEngine answers by the request's seed, so that a run's metrics are a function of its seeds.
func seededEngine() engines.Engine {
	return scripted.New(func(r scripted.Request) string { return []string{"a", "b"}[r.Seed%2] })
}

// TestRunFolderOneWriter: while a run holds its folder, a second run into it — new or resumed —
// is refused before it writes anything, with a message naming the holder's pid and host; once the
// first run is closed the folder is free again, without a word about a crash.
func TestRunFolderOneWriter(t *testing.T) {
	script := writeScript(t, counterScript)
	out := filepath.Join(t.TempDir(), "run")
	r1 := counterRun(t, script, out, nil)
	if err := r1.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := r1.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	events, metrics := readFile(t, filepath.Join(out, "events.log")), readFile(t, filepath.Join(out, "metrics.jsonl"))
	host, _ := os.Hostname()
	holder := fmt.Sprintf("pid %d on host %s", os.Getpid(), host)

	_, err := Load(context.Background(), script, Options{Config: testConfig(4, "p"), Out: out, Tasks: numberedTasks(4),
		Engines: map[string]engines.Engine{"p": seededEngine()}})
	var locked *RunLockedError
	if !errors.As(err, &locked) || !strings.Contains(err.Error(), holder) || !strings.Contains(err.Error(), filepath.Join(out, LockFile)) {
		t.Fatalf("a second run into a held folder: %v; want a refusal naming %q and the lock file", err, holder)
	}
	_, err = Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": seededEngine()}})
	if err == nil || !strings.Contains(err.Error(), "is in use by "+holder) {
		t.Fatalf("a resume into a held folder: %v; want a refusal naming %q", err, holder)
	}
	if got, ok := RunFolderHolder(out); !ok || !strings.Contains(got, holder) {
		t.Errorf("RunFolderHolder = %q, %v; want %q", got, ok, holder)
	}
	if e, m := readFile(t, filepath.Join(out, "events.log")), readFile(t, filepath.Join(out, "metrics.jsonl")); e != events || m != metrics {
		t.Errorf("the refused runs wrote into the folder:\nevents.log:\n%s\nmetrics.jsonl:\n%s", e, m)
	}

	r1.Close()
	if _, ok := RunFolderHolder(out); ok {
		t.Error("the folder is still held after Close")
	}
	r2, err := Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": seededEngine()}})
	if err != nil {
		t.Fatalf("resume once the first run is closed: %v", err)
	}
	r2.Close()
	if e := readFile(t, filepath.Join(out, "events.log")); strings.Contains(e, "without releasing") {
		t.Errorf("a cleanly closed run's lock was taken for a crashed one:\n%s", e)
	}
}

// TestRunFolderStaleLock: a holder that died (its descriptor closed by the kernel, the file still
// naming it) does not block the folder: the next run takes it over and says whose lock it was.
func TestRunFolderStaleLock(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	os.MkdirAll(out, 0o755)
	f, err := os.OpenFile(filepath.Join(out, LockFile), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(lockHolder{PID: 4242, Host: "gone-host", Since: "2026-01-02T03:04:05Z", Command: "slimen exec x.star"})
	f.Write(b)
	f.Close() // what the kernel does when the holder dies
	r := counterRun(t, writeScript(t, counterScript), out, nil)
	r.Close()
	if e := readFile(t, filepath.Join(out, "events.log")); !strings.Contains(e, "was left locked by pid 4242 on host gone-host") || !strings.Contains(e, "ended without releasing it") {
		t.Errorf("events.log does not say whose stale lock was taken over:\n%s", e)
	}
}

// TestResumeReplacesMetricsBesideIt: dropping the lines past the checkpoint writes a new file and
// renames it over the old one (a crash leaves one or the other, whole), never truncating it in
// place; a resume with nothing to drop leaves the file alone.
func TestResumeReplacesMetricsBesideIt(t *testing.T) {
	script := writeScript(t, counterScript)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, nil)
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 1); err != nil { // step 3, past the checkpoint
		t.Fatal(err)
	}
	r.Close()
	path := filepath.Join(out, "metrics.jsonl")
	before, _ := os.Stat(path)
	r = counterRun(t, script, out, nil)
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	r.Close()
	after, _ := os.Stat(path)
	if os.SameFile(before, after) {
		t.Error("metrics.jsonl was rewritten in place to drop step 3's lines: a crash in between loses the history")
	}
	if got := readFile(t, path); strings.Contains(got, `"step":3`) || !strings.Contains(got, `"step":2`) {
		t.Errorf("metrics after resuming from step 2:\n%s", got)
	}
	if left, _ := filepath.Glob(filepath.Join(out, ".metrics.jsonl.tmp-*")); len(left) > 0 {
		t.Errorf("temporary files left: %v", left)
	}
	// Nothing past the checkpoint: the file is not touched.
	before = after
	r = counterRun(t, script, out, nil)
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if after, _ = os.Stat(path); !os.SameFile(before, after) {
		t.Error("metrics.jsonl was rewritten though it held no line past the checkpoint")
	}
}

// TestTornMetricsLine: a last line cut short by a crash or a full disk is dropped (and said in
// events.log) when the run opens its folder again; a whole last line that only lacks its newline
// gets it. The resumed run then equals an uninterrupted one.
func TestTornMetricsLine(t *testing.T) {
	script := writeScript(t, counterScript)
	whole := wholeCounterRun(t, script, 3)
	for _, tc := range []struct{ name, tail, event string }{
		{"torn", `{"step":3,"policy":"p","rew`, "dropped the torn last line"},
		{"no newline", "", "the newline was added"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "run")
			r := counterRun(t, script, out, nil)
			if err := r.Steps(context.Background(), 2); err != nil {
				t.Fatal(err)
			}
			ck, err := r.Checkpoint(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			r.Close()
			path := filepath.Join(out, "metrics.jsonl")
			b, _ := os.ReadFile(path)
			if tc.tail == "" {
				b = b[:len(b)-1] // the last whole line loses its newline
			}
			os.WriteFile(path, append(b, tc.tail...), 0o644)
			r = counterRun(t, script, out, nil)
			if err := r.restore(context.Background(), ck); err != nil {
				t.Fatal(err)
			}
			if err := r.Steps(context.Background(), 1); err != nil {
				t.Fatal(err)
			}
			r.Close()
			if got := metricsWithoutTimings(t, out); got != whole {
				t.Errorf("metrics after the repair and a resumed step:\n%s\nwant\n%s", got, whole)
			}
			if e := readFile(t, filepath.Join(out, "events.log")); !strings.Contains(e, tc.event) {
				t.Errorf("events.log does not say %q:\n%s", tc.event, e)
			}
		})
	}
}

// TestMissingMetricsSteps: a metrics file that lost the lines of some steps the checkpoint holds
// (cut by hand, or by an older version's crash) is resumed with a warning naming the steps.
func TestMissingMetricsSteps(t *testing.T) {
	script := writeScript(t, counterScript)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, nil)
	if err := r.Steps(context.Background(), 5); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	path := filepath.Join(out, "metrics.jsonl")
	var keep []string
	for _, line := range strings.Split(strings.TrimSpace(readFile(t, path)), "\n") {
		if s, _, _ := metricsStep([]byte(line)); s != 2 && s != 3 && s != 5 {
			keep = append(keep, line)
		}
	}
	os.WriteFile(path, []byte(strings.Join(keep, "\n")+"\n"), 0o644)
	var log strings.Builder
	r, err = Load(context.Background(), script, Options{Config: testConfig(4, "p"), Out: out, Tasks: numberedTasks(4), Log: &log,
		Engines: map[string]engines.Engine{"p": seededEngine()}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	want := "has no lines for step 2-3, 5 of the 5 steps checkpoint"
	if !strings.Contains(log.String(), want) || !strings.Contains(readFile(t, filepath.Join(out, "events.log")), want) {
		t.Errorf("no warning %q on the run's log and in events.log:\n%s", want, log.String())
	}
}

// cutScript is counterScript whose task t3 waits, once hold() says so, until the stop cancels it.
const cutScript = counterScript + `
    if task.id == "t3":
        while hold():
            pass
`

// TestStopGraceCutsNoStep: a stop whose grace expires while a rollout of step 3 still runs does
// not train or checkpoint step 3 (nor keep its state writes): the run stops with the checkpoint
// of step 2, says so, and the resumed run equals one that was never stopped.
func TestStopGraceCutsNoStep(t *testing.T) {
	script := writeScript(t, cutScript)
	var armed atomic.Bool
	var r *Run
	var once sync.Once
	hold := starlark.NewBuiltin("hold", func(*starlark.Thread, *starlark.Builtin, starlark.Tuple, []starlark.Tuple) (starlark.Value, error) {
		if !armed.Load() {
			return starlark.False, nil
		}
		once.Do(r.Stop) // t3 of step 3 is running: the stop comes now, and t3 never ends by itself
		return starlark.True, nil
	})
	load := func(out string, log io.Writer) *Run {
		cfg := testConfig(4, "p")
		cfg.Run.Steps, cfg.Run.KeepCheckpoints = 4, 0
		cfg.Rollout.StopGraceS = 0
		r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(4), Log: log,
			Engines: map[string]engines.Engine{"p": seededEngine()}, Builtins: starlark.StringDict{"hold": hold},
			BeforeStep: func(r *Run) { armed.Store(r.StepsDone() == 2) }})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	wholeOut := filepath.Join(t.TempDir(), "whole")
	w := load(wholeOut, io.Discard)
	w.opts.BeforeStep = nil // never armed: the uninterrupted run
	if err := w.Train(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.Close()
	whole := metricsWithoutTimings(t, wholeOut)

	out := filepath.Join(t.TempDir(), "split")
	var log strings.Builder
	r = load(out, &log)
	if err := r.Train(context.Background()); err != nil {
		t.Fatalf("Train after a stop: %v", err)
	}
	ck := r.LastCheckpoint()
	r.Close()
	if r.StepsDone() != 2 || filepath.Base(ck) != "step_2" {
		t.Fatalf("stopped after %d steps with checkpoint %q; want 2 steps and step_2: step 3 was cut", r.StepsDone(), ck)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoints", "step_3")); err == nil {
		t.Error("the cut step 3 was checkpointed")
	}
	events := readFile(t, filepath.Join(out, "events.log"))
	for _, want := range []string{"step 3 was cut by the stop", "neither trained nor saved", "the checkpoint holds step 2, the last whole step", "stop: stopped (a signal or Run.Stop) after step 2; resume from its last checkpoint (step_2) with: slimen exec --resume " + out} {
		if !strings.Contains(events, want) {
			t.Errorf("events.log does not say %q:\n%s", want, events)
		}
	}
	if !strings.Contains(log.String(), "step 3 was cut by the stop") {
		t.Errorf("the run's log does not say the step was cut:\n%s", log.String())
	}

	armed.Store(false)
	r2, err := Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": seededEngine()},
		Builtins: starlark.StringDict{"hold": hold}})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := r2.Train(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, out); got != whole {
		t.Errorf("the resumed run differs from the uninterrupted one:\n%s\nwant\n%s", got, whole)
	}
}

// TestRunFolderDisappears: a run whose folder is deleted, or made unwritable, stops at the next
// step with an error naming the folder and what happened (with the resume command where there is
// one), instead of finishing into files nobody can see.
func TestRunFolderDisappears(t *testing.T) {
	for _, tc := range []struct {
		name, want, hint string
		do               func(out string) error
	}{
		{"deleted", "it was deleted", "metrics and checkpoints went with it", os.RemoveAll},
		{"moved", "it was deleted or moved", "move it back to", func(out string) error { return os.Rename(out, out+"-moved") }},
		{"unwritable", "it is not writable", "resume from its last checkpoint (step_2) with: slimen exec --resume", readOnly},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "run")
			if tc.name == "unwritable" {
				probe := filepath.Join(t.TempDir(), "probe")
				os.Mkdir(probe, 0o755)
				if err := readOnly(probe); err != nil {
					t.Skipf("cannot make a folder read-only here: %v", err)
				}
				writable(probe)
			}
			r := counterRun(t, writeScript(t, counterScript), out, func(c *config.Config) { c.Run.SaveInterval = 2; c.Run.Steps = 6 })
			defer r.Close()
			defer writable(out)
			r.opts.AfterStep = func(r *Run, res *StepResult) {
				if res.Step == 2 {
					if err := tc.do(out); err != nil {
						t.Fatal(err)
					}
				}
			}
			err := r.Train(context.Background())
			var fe *RunFolderError
			if !errors.As(err, &fe) || !strings.Contains(err.Error(), "run folder "+out+": "+tc.want) || !strings.Contains(err.Error(), tc.hint) {
				t.Fatalf("Train = %v; want a run folder error saying %q and %q", err, tc.want, tc.hint)
			}
			if r.StepsDone() != 2 {
				t.Errorf("the run went on to step %d", r.StepsDone())
			}
			if tc.name == "unwritable" {
				writable(out)
				if e := readFile(t, filepath.Join(out, "events.log")); !strings.Contains(e, "stop: run folder "+out+": it is not writable") {
					t.Errorf("events.log does not say why the run stopped:\n%s", e)
				}
			}
		})
	}
}

// TestEveryStopInEvents: a run that fails says why in events.log, with the resume command.
func TestEveryStopInEvents(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, writeScript(t, counterScript+`
    if n == 9:
        fail("the ninth call")
`), out, func(c *config.Config) { c.Run.SaveInterval = 1; c.Run.Steps = 4; c.Rollout.MaxFailedFraction = 0 })
	defer r.Close()
	err := r.Train(context.Background())
	if err == nil {
		t.Fatal("Train: no error")
	}
	e := readFile(t, filepath.Join(out, "events.log"))
	if !strings.Contains(e, "stop: step 3: 1 of 4 rollouts failed") || !strings.Contains(e, "resume from its last checkpoint (step_2) with: slimen exec --resume "+out) {
		t.Errorf("events.log does not say why the run stopped, with the resume command:\n%s", e)
	}
	r2 := counterRun(t, writeScript(t, counterScript), filepath.Join(t.TempDir(), "done"), func(c *config.Config) { c.Run.Steps = 1 })
	defer r2.Close()
	if err := r2.Train(context.Background()); err != nil {
		t.Fatal(err)
	}
	if e := readFile(t, filepath.Join(r2.opts.Out, "events.log")); !strings.Contains(e, "done: 1 steps (run.steps)") {
		t.Errorf("events.log does not say the run is done:\n%s", e)
	}
}

// readOnly makes a folder unwritable: by its mode, or for root (whom modes do not stop) by the
// immutable attribute, where the file system has one.
func readOnly(dir string) error {
	if os.Geteuid() != 0 {
		return os.Chmod(dir, 0o555)
	}
	if out, err := exec.Command("chattr", "+i", dir).CombinedOutput(); err != nil {
		return fmt.Errorf("chattr +i: %v: %s", err, out)
	}
	return nil
}

// writable undoes readOnly.
func writable(dir string) {
	if os.Geteuid() == 0 {
		exec.Command("chattr", "-i", dir).Run()
	}
	os.Chmod(dir, 0o755)
}

// TestResumeRelocatesEngines: Options.Relocate (--resume with --config) changes where a policy's
// engine lives and says so; a config that changes anything the run computes is refused, naming
// the setting.
func TestResumeRelocatesEngines(t *testing.T) {
	script := writeScript(t, counterScript)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, nil)
	if err := r.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	moved := func(edit func(*config.Config)) *config.Config {
		c, err := config.Load(filepath.Join(ck, "config.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		c.File = "new.yaml"
		edit(c)
		return c
	}
	resume := func(c *config.Config) (*Run, error) {
		return Resume(context.Background(), out, "", Options{Relocate: c, Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": seededEngine()}})
	}
	for _, tc := range []struct {
		edit func(*config.Config)
		want string
	}{
		{func(c *config.Config) { c.Policies[0].Train.LR *= 2 }, `new.yaml: policy "p": train.lr differs from the checkpoint's config`},
		{func(c *config.Config) { c.Rollout.BatchSize++ }, "new.yaml: rollout.batch_size differs from the checkpoint's config"},
		{func(c *config.Config) { c.Policies[0].Name = "q" }, `new.yaml has no policy "p"`},
	} {
		if _, err := resume(moved(tc.edit)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("resume with a config that changes what the run computes: %v; want %q", err, tc.want)
		}
	}
	var log strings.Builder
	r2, err := Resume(context.Background(), out, "", Options{Log: &log, Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": seededEngine()},
		Relocate: moved(func(c *config.Config) {
			c.Policies[0].Engine.Address, c.Policies[0].Engine.TokenEnv = "10.0.0.7:9000", "NEW_TOKEN"
			c.Run.Out = "elsewhere"
		})})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if e := r2.Config().Policies[0].Engine; e.Address != "10.0.0.7:9000" || e.TokenEnv != "NEW_TOKEN" || r2.Config().Run.Out != out {
		t.Errorf("engine after the move: address %q, token_env %q, run.out %q", e.Address, e.TokenEnv, r2.Config().Run.Out)
	}
	for _, want := range []string{`resume: --config new.yaml: policy "p": engine.address  → 10.0.0.7:9000`, `policy "p": engine.token_env  → NEW_TOKEN`} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("the run's log does not say %q:\n%s", want, log.String())
		}
	}
	if err := r2.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
}
