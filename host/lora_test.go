package host

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

const loraScript = `
def rollout(task):
    for name in ["a", "b", "full"]:
        cs = generate(name, task.prompt, n = 2)
        for c in cs:
            reward(c, 1.0 if "1" in c.text else 0.0)
            train(c)
`

// loraRun loads loraScript with two LoRA policies and a full-weight one on the tiny engine.
func loraRun(t *testing.T, out string) *Run {
	t.Helper()
	return loraRunScript(t, loraScript, out)
}

func loraRunScript(t *testing.T, script, out string, edit ...func(*Options)) *Run {
	t.Helper()
	cfg := testConfig(2, "a", "b", "full")
	for i := range cfg.Policies[:2] {
		cfg.Policies[i].LoRA = &config.LoRAConfig{Rank: 2 + i, Alpha: 8, Targets: []string{"q_proj", "v_proj", "up_proj"}}
		cfg.Policies[i].Train.LR = 1e-2
	}
	cfg.Run.KeepCheckpoints = 0
	cfg.Rollout.MaxResponseLen = 6
	opts := Options{Config: cfg, Out: out, Tasks: numberedTasks(4)}
	for _, e := range edit {
		e(&opts)
	}
	r, err := Load(context.Background(), writeScript(t, script), opts)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// LoRA policies on one hf_checkpoint share one base engine; a full-weight policy has its own; a
// checkpoint holds each adapter as a PEFT folder and resuming from it continues the run exactly.
func TestLoRAPoliciesShareABase(t *testing.T) {
	ctx := context.Background()
	whole := filepath.Join(t.TempDir(), "whole")
	r := loraRun(t, whole)
	a, okA := r.pols.byName["a"].eng.(*sharedAdapter)
	b, okB := r.pols.byName["b"].eng.(*sharedAdapter)
	if !okA || !okB || a.Base() != b.Base() {
		t.Fatalf("policies a and b have engines %T and %T; want adapters on one base", r.pols.byName["a"].eng, r.pols.byName["b"].eng)
	}
	if _, ok := r.pols.byName["a"].eng.(engines.Renderer); !ok {
		t.Fatal("a LoRA policy's engine does not render chats: chat() would refuse it")
	}
	if _, ok := r.pols.byName["full"].eng.(*sharedAdapter); ok {
		t.Fatal("the full-weight policy got an adapter")
	}
	if err := r.Steps(ctx, 4); err != nil {
		t.Fatal(err)
	}
	r.Close()
	want := metricsWithoutTimings(t, whole)

	split := filepath.Join(t.TempDir(), "split")
	r = loraRun(t, split)
	if err := r.Steps(ctx, 2); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	for _, f := range []string{"adapter_config.json", "adapter_model.safetensors", "adapter_optimizer.safetensors"} {
		if _, err := os.Stat(filepath.Join(ck, "a", f)); err != nil {
			t.Fatalf("the checkpoint of a LoRA policy: %v", err)
		}
	}
	r = loraRun(t, split)
	defer r.Close()
	if err := r.restore(ctx, ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, split); got != want {
		t.Errorf("the resumed run's metrics differ from the uninterrupted run's:\n%s\n---\n%s", want, got)
	}
}

// The generate batches of the LoRA policies on one base go out together as one engine batch
// (adapterBatcher), and the run's metrics are those of a run that sends them policy by policy.
func TestLoRACrossPolicyBatching(t *testing.T) {
	ctx := context.Background()
	// Odd tasks ask a first, even ones b: both policies have requests waiting at once.
	const script = `
def rollout(task):
    names = ["a", "b", "full"] if int(task.label) % 2 else ["b", "full", "a"]
    for name in names:
        cs = generate(name, task.prompt, n = 2)
        for c in cs:
            reward(c, 1.0 if "1" in c.text else 0.0)
            train(c)
`
	run := func(on bool) (string, *adapterBatcher) {
		out := filepath.Join(t.TempDir(), "run")
		r := loraRunScript(t, script, out, func(o *Options) { o.perPolicyBatches = !on })
		defer r.Close()
		if err := r.Steps(ctx, 2); err != nil {
			t.Fatal(err)
		}
		var bt *adapterBatcher
		for _, b := range r.pols.adapterBatchers {
			bt = b
		}
		return metricsWithoutTimings(t, out), bt
	}
	merged, bt := run(true)
	if bt == nil {
		t.Fatal("no batcher for the policies on the shared base")
	}
	bt.mu.Lock()
	batches, calls := bt.batches, bt.calls
	bt.mu.Unlock()
	t.Logf("%d engine batches carried %d policy batches", batches, calls)
	if batches == 0 || calls <= batches {
		t.Errorf("%d engine batches carried %d policy batches; want fewer engine batches than policy batches", batches, calls)
	}
	apart, bt2 := run(false)
	if bt2 != nil {
		t.Fatal("a batcher with cross-policy batching off")
	}
	if merged != apart {
		t.Errorf("the metrics with cross-policy batching differ from those without:\n%s\n---\n%s", merged, apart)
	}
}
