package main

import (
	"flag"
	"strings"
	"testing"

	"github.com/slimen/slimen/host/config"
)

// slimen exec --deterministic sets engine.deterministic on every torch policy, and refuses a run
// where it cannot hold: no torch policy, or one on several GPUs a worker.
func TestExecDeterministicFlag(t *testing.T) {
	override := func(yaml string) (*config.Config, error) {
		c, err := config.Parse([]byte(yaml), "c.yaml")
		if err != nil {
			t.Fatal(err)
		}
		f := newExecFlags()
		if _, err := parseInterleaved(f.fs, []string{"--deterministic", "s.star"}); err != nil {
			t.Fatal(err)
		}
		f.fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
		return c, f.override(c)
	}
	c, err := override("policies:\n  - {name: a, hf_checkpoint: /m, engine: {kind: torch, device: cpu}}\n  - {name: b, hf_checkpoint: builtin:tiny-arith}\n")
	if err != nil || !c.Policies[0].Engine.Deterministic || c.Policies[1].Engine.Deterministic {
		t.Errorf("a torch and a tiny policy: %v, deterministic %v %v; want the torch one's set", err, c.Policies[0].Engine.Deterministic, c.Policies[1].Engine.Deterministic)
	}
	if _, err := override("policies:\n  - {name: b, hf_checkpoint: builtin:tiny-arith}\n"); err == nil || !strings.Contains(err.Error(), "no policy runs on a torch worker") {
		t.Errorf("no torch policy: %v", err)
	}
	if _, err := override("policies:\n  - {name: a, hf_checkpoint: /m, engine: {kind: torch}, num_gpus_per_node: 2}\n"); err == nil || !strings.Contains(err.Error(), `policy "a" runs on 2 GPUs`) {
		t.Errorf("two GPUs: %v", err)
	}
}
