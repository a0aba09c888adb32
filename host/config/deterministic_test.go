package config

import (
	"strings"
	"testing"
)

// engine.deterministic (issue 38): a torch policy's setting, refused where the batch-invariant
// kernels cannot hold (several GPUs a worker, an fp8 KV cache, the worker flag given by hand),
// warned about on another engine, and a misspelling of it named.
func TestDeterministicEngineSetting(t *testing.T) {
	policy := func(engine string) []byte {
		return []byte("policies:\n  - name: p\n    hf_checkpoint: /models/m\n    engine: " + engine + "\n")
	}
	c, err := Parse(policy("{kind: torch, deterministic: true}"), "p.yaml")
	if err != nil || !c.Policies[0].Engine.Deterministic {
		t.Fatalf("deterministic: true: %v, %+v", err, c)
	}
	for _, tc := range []struct{ engine, want string }{
		{"{kind: torch, deterministic: true}\n    num_gpus_per_node: 2", "policies[0].engine.deterministic"},
		{"{kind: torch, deterministic: true, args: [--kv-cache-dtype, fp8]}", "policies[0].engine.args[0]"},
		{"{kind: torch, deterministic: true, args: [--kv-cache-dtype=fp8]}", "KV cache in the model's dtype"},
		{"{kind: torch, args: [--deterministic]}", "--deterministic is set by the host from engine.deterministic"},
	} {
		_, err := Parse(policy(tc.engine), "p.yaml")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("engine %s: %v; want an error naming %q", tc.engine, err, tc.want)
		}
	}
	if _, err := Parse(policy("{kind: torch, deterministic: true, args: [--kv-cache-dtype, auto]}"), "p.yaml"); err != nil {
		t.Errorf("--kv-cache-dtype auto: %v", err)
	}
	c, err = Parse([]byte("policies:\n  - name: p\n    hf_checkpoint: builtin:tiny-arith\n    engine: {kind: tiny, deterministic: true}\n"), "p.yaml")
	if err != nil || !strings.Contains(strings.Join(c.Warnings, "\n"), "policies[0].engine.deterministic: has no effect on a tiny engine") {
		t.Errorf("deterministic on tiny: %v, warnings %q", err, c.Warnings)
	}
	c, err = Parse(policy("{kind: torch, determinstic: true}"), "p.yaml")
	if err != nil || !strings.Contains(strings.Join(c.Warnings, "\n"), "did you mean deterministic?") {
		t.Errorf("a misspelling: %v, warnings %q", err, c.Warnings)
	}
}
