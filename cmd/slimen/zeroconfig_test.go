package main

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/slimen/slimen/host/config"
)

// TestZeroConfigEval: a zero-config run on the synthetic source is config.Default plus a held-out
// eval of 200 synthetic:arith problems every 10 steps, sampled as the rollouts are; with --data it
// is config.Default alone.
func TestZeroConfigEval(t *testing.T) {
	plain, err := zeroConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(config.Default(nil), plain); d != "" {
		t.Errorf("zero-config with --data (-want +got):\n%s", d)
	}
	c, err := zeroConfig(true)
	if err != nil {
		t.Fatal(err)
	}
	want := []config.EvalDataset{{Name: "arith", Path: "synthetic:arith", InputKey: "prompt", LabelKey: "label",
		Limit: 200, NSamples: 1, Temperature: 1, TopP: 1, MaxResponseLen: 32}}
	if d := cmp.Diff(want, c.Eval.Datasets, cmpopts.IgnoreFields(config.EvalDataset{}, "Line")); d != "" {
		t.Errorf("eval datasets (-want +got):\n%s", d)
	}
	if c.Run.EvalInterval != 10 {
		t.Errorf("run.eval_interval %d, want 10", c.Run.EvalInterval)
	}
	// Everything else is exactly the zero-config defaults.
	c.Eval.Datasets, c.Run.EvalInterval = nil, 0
	if d := cmp.Diff(config.Default(nil), c); d != "" {
		t.Errorf("zero-config with eval, eval removed (-want +got):\n%s", d)
	}
}
