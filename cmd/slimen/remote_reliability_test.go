package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Issue 39, item 5: remote engine servers that die, restart or move, and a run that stops or
// resumes meanwhile.

// editConfig writes a copy of the config file cfg with each old string replaced by the new one
// after it, and returns its path.
func editConfig(t *testing.T, cfg string, oldNew ...string) string {
	t.Helper()
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	for i := 0; i < len(oldNew); i += 2 {
		if !strings.Contains(s, oldNew[i]) {
			t.Fatalf("%s has no %q", cfg, oldNew[i])
		}
		s = strings.ReplaceAll(s, oldNew[i], oldNew[i+1])
	}
	p := filepath.Join(t.TempDir(), filepath.Base(cfg))
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRemoteStopWhileServerDown: SIGTERM while the generator's server is down. The step in
// progress waits for it only for the stop grace (2 s here), is cut, and the final checkpoint, which
// would save step 3 on that server, gives up at once instead of retrying for the engine's 2-minute
// reconnect timeout: the run exits well within that, with the command that resumes it from its
// last checkpoint (step 2), and that command, once the server is back, completes the run.
// (Before: the exit took the grace plus the reconnect timeout, 2-2.5 minutes.)
func TestRemoteStopWhileServerDown(t *testing.T) {
	rr := remoteConfigs(t, 6, 4, "save_interval: 2", "")
	cfg := editConfig(t, rr.remote, "max_response_len: 12}", "max_response_len: 12, stop_grace_s: 2}")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	out := filepath.Join(rr.runs, "stopped")
	cmd := exec.Command(slimenBin, "exec", debate, "--config", cfg, "--out", out)
	cmd.Dir = "../.."
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	var stopped time.Time
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if stopped.IsZero() && strings.HasPrefix(sc.Text(), "step 3/6") {
			gen.Process.Kill()
			gen.Wait()
			cmd.Process.Signal(syscall.SIGTERM)
			stopped = time.Now()
		}
	}
	err := cmd.Wait()
	took := time.Since(stopped)
	if stopped.IsZero() {
		t.Fatalf("the run never printed step 3:\n%s", log.String())
	}
	if took > time.Minute {
		t.Errorf("the run took %v to stop with its server down (stop grace 2s, reconnect timeout 2m)", took.Round(time.Second))
	}
	if err == nil {
		t.Errorf("the run exited 0 although it could not save step 3:\n%s", log.String())
	}
	// The step in progress stops either cut by the grace (its rollouts cancelled) or failed by
	// the generator's client giving up at the same moment; either way step 3 cannot be saved.
	for _, want := range []string{"its client stopped waiting for it", "slimen exec --resume " + out} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("the run's stderr lacks %q:\n%s", want, log.String())
		}
	}
	if !strings.Contains(log.String(), "last checkpoint (step 2)") && !strings.Contains(log.String(), "last checkpoint (step_2)") {
		t.Errorf("the run's stderr does not name its last checkpoint, step 2:\n%s", log.String())
	}
	rr.serve(t, 0)
	if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
		t.Fatalf("the resume command: %v\n%s", err, log)
	}
	clean := rr.execRun(t, editConfig(t, rr.local, "max_response_len: 12}", "max_response_len: 12, stop_grace_s: 2}"), "clean")
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("the stopped and resumed run's metrics differ from the uninterrupted run's:\n%s\n---\n%s", ma, mb)
	}
}

// TestRemoteNoCheckpointGivesAWorkingCommand: a run with no checkpoint yet whose server stays
// down past its reconnect timeout stops and prints the command that starts it again — into a
// new folder, since slimen exec refuses --out of a folder that holds a run — and that command
// works once the server is back. (Before: "start it again once the engine is back", and the
// same command was refused: "already holds a run".)
func TestRemoteNoCheckpointGivesAWorkingCommand(t *testing.T) {
	rr := remoteConfigs(t, 3, 4, "", "")
	cfg := editConfig(t, rr.remote, "{kind: remote, ", "{kind: remote, reconnect_timeout: 2s, ")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	out := filepath.Join(rr.runs, "lost")
	log, err := killServerDuring(t, "step 1/3", gen, func() {}, "exec", debate, "--config", cfg, "--out", out)
	if err == nil {
		t.Fatalf("the run went on with its generator's server gone:\n%s", log)
	}
	const intro = "start the run again (once what stopped it is fixed) with: slimen "
	i := strings.Index(log, intro)
	if i < 0 {
		t.Fatalf("the run's stderr gives no command to start it again:\n%s", log)
	}
	line := log[i+len(intro):]
	line = line[:strings.IndexByte(line, '\n')]
	want := fmt.Sprintf("exec %s --config %s --out %s-2", debate, cfg, out)
	if line != want {
		t.Errorf("the command is slimen %s\nwant slimen %s", line, want)
	}
	rr.serve(t, 0)
	if log, err := slimen(t, nil, strings.Fields(line)...); err != nil {
		t.Fatalf("slimen %s: %v\n%s", line, err, log)
	}
	clean := rr.execRun(t, rr.local, "clean")
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out+"-2"); ma != mb {
		t.Errorf("the run started again differs from an uninterrupted one:\n%s\n---\n%s", ma, mb)
	}
}

// TestRemoteResumeOnAMovedServer: a run stops, its generator's server goes away, and a new one
// comes up at another address (same model, same root). `slimen exec --resume RUN --config NEW`
// with NEW naming the new address loads the checkpoint into the new server, says what it moved,
// and the resumed run writes the metrics of the uninterrupted run. (The configs' 5 s reconnect
// timeout makes a resume that still dials the old address fail fast.)
func TestRemoteResumeOnAMovedServer(t *testing.T) {
	rr := remoteConfigs(t, 4, 4, "save_interval: 1", "")
	remote := editConfig(t, rr.remote, "{kind: remote, ", "{kind: remote, reconnect_timeout: 5s, ")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	clean := rr.execRun(t, rr.local, "clean")
	assertTrained(t, clean, 4)
	out := filepath.Join(rr.runs, "moved")
	if log, err := slimen(t, nil, "exec", debate, "--config", remote, "--out", out, "--steps", "2"); err != nil {
		t.Fatalf("the first two steps: %v\n%s", err, log)
	}
	gen.Process.Kill()
	gen.Wait()
	moved := freeAddr(t)
	startServe(t, remoteModel, moved, rr.runs)
	// As the checkpoint's config, which records the command line's --steps 2.
	movedCfg := editConfig(t, remote, fmt.Sprintf("%q", rr.addrs[0]), fmt.Sprintf("%q", moved), "steps: 4", "steps: 2")
	log, err := slimen(t, nil, "exec", "--resume", out, "--config", movedCfg, "--steps", "4")
	if err != nil {
		t.Fatalf("the resume on the moved server: %v\n%s", err, log)
	}
	if want := fmt.Sprintf(`resume: --config %s: policy "generator": engine.address %s → %s`, movedCfg, rr.addrs[0], moved); !strings.Contains(eventsLog(t, out), want) {
		t.Errorf("events.log does not say %q:\n%s", want, eventsLog(t, out))
	}
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("the resumed run's metrics differ from the uninterrupted run's:\n%s\n---\n%s", ma, mb)
	}
}
