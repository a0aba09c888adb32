package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The exam swarm's eight LoRA agents (examples/exam_swarm/config_lora8.yaml) as adapters on one
// `slimen serve` of the same base write exactly the metrics of the embedded run (same seed):
// the server holds the base once, each agent's adapter trains with its own optimizer there, and
// the agents' generate batches go out as one mixed batch as they do in process. A second run on
// the same server starts where the first did: it replaces the adapters the first left (the
// names are the policies').
func TestRemoteLoRASwarmEqualsEmbedded(t *testing.T) {
	b, err := os.ReadFile("../../examples/exam_swarm/config_lora8.yaml")
	if err != nil {
		t.Fatal(err)
	}
	embedded := strings.Replace(string(b), "run: {steps: 30, seed: 1}", "run: {steps: 2, seed: 1}", 1)
	if embedded == string(b) {
		t.Fatal("config_lora8.yaml has no run: {steps: 30, seed: 1} line to shorten")
	}
	addr, runs, dir := freeAddr(t), t.TempDir(), t.TempDir()
	served := strings.ReplaceAll(embedded, "engine: {kind: tiny}", fmt.Sprintf("engine: {kind: remote, address: %q}", addr))
	if strings.Count(served, "kind: remote") != 8 {
		t.Fatalf("want the eight agents on the server:\n%s", served)
	}
	local, remote := filepath.Join(dir, "local.yaml"), filepath.Join(dir, "remote.yaml")
	os.WriteFile(local, []byte(embedded), 0o644)
	os.WriteFile(remote, []byte(served), 0o644)
	startServe(t, remoteModel, addr, runs)
	run := func(cfg, name string) string {
		out := filepath.Join(runs, name)
		if log, err := slimen(t, nil, "exec", "examples/exam_swarm/exam_swarm8.star", "--config", cfg, "--out", out); err != nil {
			t.Fatalf("%s run: %v\n%s", name, err, log)
		}
		return out
	}
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
}
