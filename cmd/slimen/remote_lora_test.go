package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const swarm8 = "examples/exam_swarm/exam_swarm8.star"

// lora8Configs writes config_lora8.yaml for steps steps (run keys extra, e.g. ", save_interval:
// 1") embedded and with every agent on the engine server at addr.
func lora8Configs(t *testing.T, steps int, extra, addr string) (local, remote string) {
	t.Helper()
	b, err := os.ReadFile("../../examples/exam_swarm/config_lora8.yaml")
	if err != nil {
		t.Fatal(err)
	}
	embedded := strings.Replace(string(b), "run: {steps: 30, seed: 1}", fmt.Sprintf("run: {steps: %d, seed: 1%s}", steps, extra), 1)
	if embedded == string(b) {
		t.Fatal("config_lora8.yaml has no run: {steps: 30, seed: 1} line to change")
	}
	served := strings.ReplaceAll(embedded, "engine: {kind: tiny}", fmt.Sprintf("engine: {kind: remote, address: %q}", addr))
	if strings.Count(served, "kind: remote") != 8 {
		t.Fatalf("want the eight agents on the server:\n%s", served)
	}
	dir := t.TempDir()
	local, remote = filepath.Join(dir, "local.yaml"), filepath.Join(dir, "remote.yaml")
	os.WriteFile(local, []byte(embedded), 0o644)
	os.WriteFile(remote, []byte(served), 0o644)
	return local, remote
}

// runSwarm8 runs the eight-agent exam swarm with cfg into runs/name.
func runSwarm8(t *testing.T, cfg, runs, name string) string {
	t.Helper()
	out := filepath.Join(runs, name)
	if log, err := slimen(t, nil, "exec", swarm8, "--config", cfg, "--out", out); err != nil {
		t.Fatalf("%s run: %v\n%s", name, err, log)
	}
	return out
}

// The exam swarm's eight LoRA agents (examples/exam_swarm/config_lora8.yaml) as adapters on one
// `slimen serve` of the same base write exactly the metrics of the embedded run (same seed):
// the server holds the base once, each agent's adapter trains with its own optimizer there, and
// the agents' generate batches go out as one mixed batch as they do in process. A second run on
// the same server starts where the first did: it replaces the adapters the first left (the
// names are the policies').
func TestRemoteLoRASwarmEqualsEmbedded(t *testing.T) {
	addr, runs := freeAddr(t), t.TempDir()
	local, remote := lora8Configs(t, 2, "", addr)
	startServe(t, remoteModel, addr, runs)
	run := func(cfg, name string) string { return runSwarm8(t, cfg, runs, name) }
	a, r := run(local, "embedded"), run(remote, "served")
	moved := map[string]bool{}
	for _, m := range metricLines(t, a) {
		if p, _ := m["policy"].(string); strings.HasPrefix(p, "agent_") {
			if g, _ := m["grad_norm"].(float64); g > 0 {
				moved[p] = true
			}
		}
	}
	if len(moved) != 8 {
		t.Fatalf("agents with a gradient in the embedded run: %v; the test needs all eight to train", moved)
	}
	want := metricsNoTimings(t, a)
	if got := metricsNoTimings(t, r); got != want {
		t.Errorf("the served adapters' metrics differ from the embedded run's:\n%s\n---\n%s", got, want)
	}
	if got := metricsNoTimings(t, run(remote, "again")); got != want {
		t.Errorf("a second run on the same server differs from the first:\n%s\n---\n%s", got, want)
	}
	// Asynchronously, an adapter on a server has no weights versions: refused at start, saying so.
	log, err := slimen(t, nil, "exec", swarm8, "--config", remote, "--out", filepath.Join(runs, "async"), "--max-staleness", "1")
	if err == nil || !strings.Contains(log, "a LoRA adapter on a server keeps no weights versions") {
		t.Errorf("remote LoRA at --max-staleness 1: %v\n%s", err, log)
	}
}

// The server of the eight adapters killed after step 1 of 3 and started again on its port: with
// a checkpoint every step, the host gives it every adapter back (each from its policy's
// checkpoint, a PEFT folder the server wrote) and the run ends with the metrics of a run without
// the fault; --resume from step 1 ends alike.
func TestRemoteLoRAServerKilledAndRestarted(t *testing.T) {
	addr, runs := freeAddr(t), t.TempDir()
	local, remote := lora8Configs(t, 3, ", save_interval: 1, keep_checkpoints: 0", addr)
	srv := startServe(t, remoteModel, addr, runs)
	want := metricsNoTimings(t, runSwarm8(t, local, runs, "clean"))

	out := filepath.Join(runs, "faulty")
	log, err := killServerDuring(t, "step 1/3", srv, func() { startServe(t, remoteModel, addr, runs) },
		"exec", swarm8, "--config", remote, "--out", out)
	if err != nil {
		t.Fatalf("the run failed after the server came back: %v\n%s", err, log)
	}
	events := eventsLog(t, out)
	for i := range 8 {
		restarted := fmt.Sprintf(`policy "agent_%d": its engine at %s (shared by the run's LoRA policies there) restarted`, i, addr)
		loaded := fmt.Sprintf("loaded %s (step 1) into it", filepath.Join(out, "checkpoints", "step_1", fmt.Sprintf("agent_%d", i)))
		if !strings.Contains(events, restarted) || !strings.Contains(events, loaded) {
			t.Errorf("events.log does not tell that agent_%d's server restarted and got its adapter back:\n%s", i, events)
			break
		}
	}
	if got := metricsNoTimings(t, out); got != want {
		t.Errorf("metrics differ from the fault-free run's:\n%s\n---\n%s", got, want)
	}

	// --resume from step 1 loads each adapter's checkpoint into the server and ends alike.
	if log, err := slimen(t, nil, "exec", "--resume", filepath.Join(out, "checkpoints", "step_1")); err != nil || !strings.Contains(log, "(steps 2 to 3,") {
		t.Fatalf("resume from step_1 (%v) does not go on at step 2:\n%s", err, log)
	}
	if got := metricsNoTimings(t, out); got != want {
		t.Errorf("after resuming from step_1:\n%s\nwant\n%s", got, want)
	}
}
