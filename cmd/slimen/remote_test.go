package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/internal/loopback/loopbacktest"
)

// Issue 5's acceptance: the debate (under slime-n's agreement rule) against `slimen serve` engines
// over real gRPC on loopback writes the same metrics as in-process, and survives an engine killed
// mid-run.
//
// The runs train for real: the embedded base model answers the arithmetic tasks well enough for
// the debate's agreement rewards to vary within groups, so every optimizer step has a gradient
// (asserted below). An engine that dropped a step, or lost its weights, would then sample
// differently from the in-process run in the steps after.

// freeAddr is a free loopback address the tests' engine servers can be killed and restarted on.
func freeAddr(t *testing.T) string { return loopbacktest.Addr(t) }

// startServe starts `slimen serve` on addr, with Save and Load confined to root, and waits until
// it accepts connections.
func startServe(t *testing.T, model, addr, root string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(slimenBin, "serve", "--engine", "tiny", "--model", model, "--listen", addr, "--root", root)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return cmd
		}
	}
	t.Fatalf("slimen serve on %s did not come up", addr)
	return nil
}

// remoteModel is the model every engine of these tests runs.
const remoteModel = "builtin:tiny-arith"

// remoteRun is a run configured twice: on in-process engines and on two `slimen serve` engines.
type remoteRun struct {
	local, remote string    // config files
	addrs         [2]string // the generator's and the critic's engine
	runs          string    // the run directories' folder, the engine servers' root
}

// serve starts the engine server i (0: the generator's, 1: the critic's).
func (rr remoteRun) serve(t *testing.T, i int) *exec.Cmd {
	t.Helper()
	return startServe(t, remoteModel, rr.addrs[i], rr.runs)
}

// remoteConfigs writes the two configs of a debate run. run and data are YAML flow mappings'
// extra keys ("save_interval: 1") and a data section ("" for the synthetic default).
func remoteConfigs(t *testing.T, steps, batch int, run, data string) remoteRun {
	t.Helper()
	dir := t.TempDir()
	rr := remoteRun{addrs: [2]string{freeAddr(t), freeAddr(t)}, runs: t.TempDir()}
	if run != "" {
		run = ", " + run
	}
	tail := fmt.Sprintf("rollout: {batch_size: %d, max_response_len: 12}\nrun: {steps: %d, seed: 1%s}\n%s", batch, steps, run, data)
	pol := func(name, engine string) string {
		return fmt.Sprintf("  - {name: %s, hf_checkpoint: %q, engine: %s, train: {lr: 1.0e-3, global_batch_size: 0}}\n", name, remoteModel, engine)
	}
	rr.local = filepath.Join(dir, "local.yaml")
	os.WriteFile(rr.local, []byte("policies:\n"+pol("generator", "{kind: tiny}")+pol("critic", "{kind: tiny}")+tail), 0o644)
	rr.remote = filepath.Join(dir, "remote.yaml")
	os.WriteFile(rr.remote, []byte("policies:\n"+
		pol("generator", fmt.Sprintf("{kind: remote, address: %q}", rr.addrs[0]))+
		pol("critic", fmt.Sprintf("{kind: remote, address: %q}", rr.addrs[1]))+tail), 0o644)
	return rr
}

// execRun runs the debate example with a config into a fresh run directory in rr.runs.
func (rr remoteRun) execRun(t *testing.T, cfg, name string) string {
	t.Helper()
	out := filepath.Join(rr.runs, name)
	if log, err := slimen(t, nil, "exec", debate, "--config", cfg, "--out", out); err != nil {
		t.Fatalf("%s run: %v\n%s", name, err, log)
	}
	return out
}

// metricLines reads a run's metrics.jsonl.
func metricLines(t *testing.T, dir string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// assertTrained checks that every policy took an optimizer step with a gradient in every one of
// the run's steps: the run can tell an engine that trains from one that does not.
func assertTrained(t *testing.T, dir string, steps int) {
	t.Helper()
	seen := map[string]bool{}
	for _, m := range metricLines(t, dir) {
		p, _ := m["policy"].(string)
		if strings.HasPrefix(p, "_") {
			continue
		}
		key := fmt.Sprintf("%s@%v", p, m["step"])
		seen[key] = true
		if g, _ := m["grad_norm"].(float64); !(g > 0) || m["optimizer_steps"] != 1.0 {
			t.Errorf("%s: grad_norm %v after %v optimizer steps; the test needs a gradient in every step (rewards that vary within a group)", key, m["grad_norm"], m["optimizer_steps"])
		}
	}
	for s := 1; s <= steps; s++ {
		for _, p := range []string{"generator", "critic"} {
			if !seen[fmt.Sprintf("%s@%d", p, s)] {
				t.Errorf("%s@%d: no metrics line", p, s)
			}
		}
	}
}

func TestRemoteEqualsInProcess(t *testing.T) {
	rr := remoteConfigs(t, 3, 4, "", "")
	rr.serve(t, 0)
	rr.serve(t, 1)
	a, b := rr.execRun(t, rr.local, "local"), rr.execRun(t, rr.remote, "remote")
	assertTrained(t, a, 3)
	if ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b); ma != mb {
		t.Errorf("remote metrics differ from in-process:\n%s\n---\n%s", ma, mb)
	}
}

// A data file smaller than the batch: every step runs each task twice, and the steps pass over
// the file again and again. Each generate request still needs an id of its own on the engine
// server, which remembers ids across steps to answer resends once.
func TestRemoteSmallDataFile(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "two.jsonl")
	os.WriteFile(file, []byte(`{"id": "a", "prompt": "Ann has 3 apples and gets 4 more. How many apples?", "label": "7"}
{"id": "b", "prompt": "Bob has 9 pens and gives away 5. How many pens?", "label": "4"}
`), 0o644)
	rr := remoteConfigs(t, 3, 4, "", fmt.Sprintf("data: {path: %q}\n", file))
	rr.serve(t, 0)
	rr.serve(t, 1)
	a, b := rr.execRun(t, rr.local, "local"), rr.execRun(t, rr.remote, "remote")
	assertTrained(t, a, 3)
	if ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b); ma != mb {
		t.Errorf("remote metrics differ from in-process:\n%s\n---\n%s", ma, mb)
	}
	for _, m := range metricLines(t, b) {
		if m["policy"] == "_run" && (m["rollouts"] != 4.0 || m["failed"] != 0.0) {
			t.Errorf("step %v: %v rollouts, %v failed; want 4 and 0", m["step"], m["rollouts"], m["failed"])
		}
	}
}

// samplesPerStep reads "policy@step" → samples from a run's metrics.
func samplesPerStep(t *testing.T, dir string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, m := range metricLines(t, dir) {
		if s, ok := m["samples"].(float64); ok {
			out[fmt.Sprintf("%v@%v", m["policy"], m["step"])] = s
		}
	}
	return out
}

// killGeneratorDuring runs the remote config and, once the progress line of step `after` is out,
// SIGKILLs the generator's engine (the next step's generate calls are in flight) and starts a
// new one on the same port a moment later. It returns the run directory, the run's stderr and
// its error.
func killGeneratorDuring(t *testing.T, rr remoteRun, gen *exec.Cmd, after, steps int) (string, string, error) {
	t.Helper()
	out := filepath.Join(rr.runs, "faulty")
	log, err := killServerDuring(t, fmt.Sprintf("step %d/%d", after, steps), gen, func() { rr.serve(t, 0) },
		"exec", debate, "--config", rr.remote, "--out", out)
	return out, log, err
}

// killServerDuring runs slimen with args and, once a line of its stderr starts with prefix,
// SIGKILLs the engine server srv and calls restart a moment later. It returns the run's stderr
// and its error.
func killServerDuring(t *testing.T, prefix string, srv *exec.Cmd, restart func(), args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(slimenBin, args...)
	cmd.Dir = "../.."
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	killed := false
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if !killed && strings.HasPrefix(sc.Text(), prefix) {
			killed = true
			srv.Process.Kill()
			srv.Wait()
			time.Sleep(700 * time.Millisecond) // the run's stderr waits in the pipe meanwhile
			restart()
		}
	}
	err := cmd.Wait()
	if !killed {
		t.Fatalf("the run never printed %q:\n%s", prefix, log.String())
	}
	return log.String(), err
}

func eventsLog(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// With a checkpoint after every step the host loads the newest one into the restarted engine
// before anything else reaches it: the run completes exactly as if nothing had happened.
func TestRemoteEngineKilledAndRestarted(t *testing.T) {
	rr := remoteConfigs(t, 4, 4, "save_interval: 1", "")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	clean := rr.execRun(t, rr.local, "clean")
	assertTrained(t, clean, 4)
	out, log, err := killGeneratorDuring(t, rr, gen, 1, 4)
	if err != nil {
		t.Fatalf("the run failed after the engine came back: %v\n%s", err, log)
	}
	events := eventsLog(t, out)
	if !strings.Contains(events, `policy "generator": its engine at `+rr.addrs[0]+" restarted") ||
		!strings.Contains(events, "loaded "+filepath.Join(out, "checkpoints", "step_1")) {
		t.Errorf("events.log does not tell that the generator's engine restarted and got its checkpoint back:\n%s", events)
	}
	want, got := samplesPerStep(t, clean), samplesPerStep(t, out)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %v samples, the fault-free run had %v", k, got[k], v)
		}
	}
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("metrics differ from the fault-free run's:\n%s\n---\n%s", ma, mb)
	}
}

// A restart between checkpoints (run.save_interval 2 here; by default a run checkpoints every 5
// minutes): the host loads the last checkpoint into the restarted engine and replays every
// optimizer step applied since, and the run completes exactly as the fault-free run does.
// (Before: the host kept only the step in progress's optimizer steps, and the run stopped.)
func TestRemoteEngineRestartBetweenCheckpoints(t *testing.T) {
	rr := remoteConfigs(t, 4, 4, "save_interval: 2", "")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	clean := rr.execRun(t, rr.local, "clean")
	assertTrained(t, clean, 4)
	out, log, err := killGeneratorDuring(t, rr, gen, 3, 4) // step 3 was trained, not saved
	if err != nil {
		t.Fatalf("the run stopped although its last checkpoint and the optimizer steps since could be put back: %v\n%s", err, log)
	}
	events := eventsLog(t, out)
	if !strings.Contains(events, `policy "generator": its engine at `+rr.addrs[0]+" restarted") ||
		!strings.Contains(events, "loaded "+filepath.Join(out, "checkpoints", "step_2", "generator")+" (step 2) into it and replayed the") {
		t.Errorf("events.log does not tell that the generator's engine got step 2's checkpoint and the optimizer steps since:\n%s", events)
	}
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("metrics differ from the fault-free run's:\n%s\n---\n%s", ma, mb)
	}
}

// TestRemoteServerTrainedByAnEarlierRun (issue 15): a second run against engine servers that an
// earlier run trained starts from the servers' starting weights, so it writes the first run's
// metrics; with engine.continue it trains on from what the first run taught them, and differs.
func TestRemoteServerTrainedByAnEarlierRun(t *testing.T) {
	rr := remoteConfigs(t, 3, 4, "", "")
	rr.serve(t, 0)
	rr.serve(t, 1)
	first := rr.execRun(t, rr.remote, "first")
	assertTrained(t, first, 3)
	second := rr.execRun(t, rr.remote, "second")
	if a, b := metricsNoTimings(t, first), metricsNoTimings(t, second); a != b {
		t.Errorf("a second run against the trained servers differs from the first:\n%s\n---\n%s", a, b)
	}
	if ev := eventsLog(t, second); !strings.Contains(ev, `policy "generator": reset its engine at `+rr.addrs[0]+" to builtin:tiny-arith") {
		t.Errorf("the events do not say the engine was reset:\n%s", ev)
	}
	b, err := os.ReadFile(rr.remote)
	if err != nil {
		t.Fatal(err)
	}
	cont := filepath.Join(t.TempDir(), "continue.yaml")
	if err := os.WriteFile(cont, []byte(strings.ReplaceAll(string(b), "{kind: remote,", "{kind: remote, continue: true,")), 0o644); err != nil {
		t.Fatal(err)
	}
	third := rr.execRun(t, cont, "third")
	if metricsNoTimings(t, first) == metricsNoTimings(t, third) {
		t.Errorf("with engine.continue the run starts from the trained weights, yet it equals the first run")
	}
}

// TestRemoteTwoTrainersOneServer (issue 15): two trainable policies whose engines are one server
// process — here reached by two addresses — are refused at start-up, naming both; a frozen policy
// may share a trained policy's server, with a warning.
func TestRemoteTwoTrainersOneServer(t *testing.T) {
	addr := freeAddr(t)
	runs := t.TempDir()
	startServe(t, remoteModel, addr, runs)
	_, port, _ := net.SplitHostPort(addr)
	cfg := func(criticTrains bool) string {
		p := filepath.Join(t.TempDir(), "shared.yaml")
		y := fmt.Sprintf(`policies:
  - {name: generator, engine: {kind: remote, address: %q}}
  - {name: critic, trainable: %v, engine: {kind: remote, address: "localhost:%s"}}
rollout: {batch_size: 2, max_response_len: 8}
run: {steps: 1, seed: 1}
`, addr, criticTrains, port)
		if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	out, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg(true), "--out", filepath.Join(runs, "both"))
	if err == nil || !strings.Contains(out, `policies "generator" and "critic" are both trainable, and their engines at `+addr+" and at localhost:"+port+" are one server process") {
		t.Fatalf("two trainers on one server: %v\n%s", err, out)
	}
	// The debate trains the critic too, so this run's rollouts fail; the warning comes at
	// start-up, before them.
	out, _ = slimen(t, nil, "exec", "examples/debate/debate.star", "--config", cfg(false), "--out", filepath.Join(runs, "frozen"))
	if !strings.Contains(out, `warning: policy "critic" is frozen, but its engine is policy "generator"'s`) || strings.Contains(out, "are both trainable") {
		t.Errorf("no warning about the shared server:\n%s", out)
	}
}
