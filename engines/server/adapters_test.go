package server

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/tiny"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// stepBatch is an optimizer step on completions cs: advantages -1, 0, 1 by sample.
func stepBatch(id string, cs []engines.Completion) engines.Batch {
	b := engines.Batch{ID: id, Loss: engines.LossConfig{LR: 1e-2, EpsClip: 0.2, EpsClipHigh: 0.28}}
	for i, cm := range cs {
		n := len(cm.Tokens)
		adv, mask := make([]float32, n), make([]float32, n)
		for j := range n {
			adv[j], mask[j] = float32(i%3)-1, 1
		}
		b.Samples = append(b.Samples, engines.Sample{Prompt: cm.PromptTokens, Response: cm.Tokens, LossMask: mask, OldLogprobs: cm.Logprobs, Advantages: adv, Group: cm.RequestID})
	}
	return b
}

// A host reaches the LoRA adapters of a tiny engine served by `slimen serve` as it reaches the
// torch worker's: the server lists "lora"; a new adapter samples what the base does; a step of
// the adapter changes what it samples and scores, not the base, and the server's answers are
// the engine's own (the same step of an adapter on an engine in this process gives the same
// numbers); a batch mixing base and adapter requests gets each its own; the adapter saves as a
// PEFT folder that loads into a new adapter; a removed adapter is an error that names it; the
// base cannot train or load under its adapters.
func TestServedEngineHoldsAdapters(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, root := serveTinyArith(t)
	info, err := c.Info(ctx)
	if err != nil || !slices.Contains(info.Capabilities, "lora") {
		t.Fatalf("Info: capabilities %v, %v; want \"lora\" for an engine that holds adapters", info.Capabilities, err)
	}
	l := remote.LoRA{Rank: 4, Alpha: 8, Targets: []string{"q_proj", "v_proj"}}
	n, err := c.AddAdapter(ctx, "a", l, 7)
	if err != nil || n <= 0 {
		t.Fatalf("AddAdapter = %d, %v", n, err)
	}
	if _, err := c.AddAdapter(ctx, "a", l, 7); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Errorf("adding adapter a twice: %v; want the refusal", err)
	}
	a := c.Adapter("a")

	base, err := c.Generate(ctx, versionReqs("base/"))
	if err != nil {
		t.Fatal(err)
	}
	fresh, err := a.Generate(ctx, versionReqs("fresh/"))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(samples(fresh), samples(base)) {
		t.Fatal("a new adapter (B = 0) samples differently from the base")
	}

	// The same adapter and step on an engine in this process: what the server must answer.
	local, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	if err := local.AddAdapter("a", tiny.LoRAConfig{Rank: l.Rank, Alpha: l.Alpha, Targets: l.Targets}, 7); err != nil {
		t.Fatal(err)
	}
	la, err := local.Adapter("a")
	if err != nil {
		t.Fatal(err)
	}
	b := stepBatch("step1", base)
	st, err := a.Train(ctx, b)
	if err != nil || st.Skipped {
		t.Fatalf("Train: %+v, %v", st, err)
	}
	want, err := la.Train(ctx, b)
	if err != nil || !reflect.DeepEqual(st, want) {
		t.Errorf("the served adapter's step: %+v; the same step in this process: %+v (%v)", st, want, err)
	}

	baseAfter, err := c.Generate(ctx, versionReqs("base2/"))
	if err != nil || !reflect.DeepEqual(samples(baseAfter), samples(base)) {
		t.Fatalf("the adapter's step changed what the base samples (%v)", err)
	}
	trained, err := a.Generate(ctx, versionReqs("trained/"))
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(samples(trained), samples(base)) {
		t.Fatal("the adapter's step did not change what it samples: the test shows nothing")
	}
	if got, err := la.Generate(ctx, versionReqs("trained/")); err != nil || !reflect.DeepEqual(got, trained) {
		t.Errorf("the served adapter samples\n%+v\nthe same adapter in this process\n%+v (%v)", trained, got, err)
	}

	// One batch, base and adapter requests mixed: each gets what it gets alone.
	reqs := append(versionReqs("mixB/"), versionReqs("mixA/")...)
	names := []string{"", "", "", "a", "a", "a"}
	mixed, err := c.GenerateAdapters(ctx, reqs, names)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(samples(mixed[:6]), samples(base)) || !reflect.DeepEqual(samples(mixed[6:]), samples(trained)) {
		t.Error("a batch mixing the base and the adapter did not give each request what it gets alone")
	}

	// Score: the adapter, its reference (the base), the base.
	score := []engines.ScoreRequest{{Messages: versionReqs("")[0].Messages, Tokens: trained[0].Tokens}}
	ref := []engines.ScoreRequest{{Messages: score[0].Messages, Tokens: score[0].Tokens, Reference: true}}
	sa, err := a.Score(ctx, score)
	if err != nil {
		t.Fatal(err)
	}
	if w, err := la.Score(ctx, score); err != nil || !reflect.DeepEqual(sa, w) {
		t.Errorf("the served adapter scores %v; in this process %v (%v)", sa, w, err)
	}
	sb, err := c.Score(ctx, score)
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(sa, sb) {
		t.Error("the trained adapter scores as the base does")
	}
	if sr, err := a.Score(ctx, ref); err != nil || !reflect.DeepEqual(sr, sb) {
		t.Errorf("the adapter's reference scores %v (%v); the base %v", sr, err, sb)
	}

	// The base is frozen under its adapters.
	if _, err := c.Train(ctx, stepBatch("full", base)); err == nil || !strings.Contains(err.Error(), "frozen under its LoRA adapters [a]") {
		t.Errorf("training the base under adapter a: %v; want the refusal naming it", err)
	}
	if err := c.Load(ctx, "builtin:tiny-arith"); err == nil || !strings.Contains(err.Error(), "frozen under its LoRA adapters [a]") {
		t.Errorf("loading the base under adapter a: %v; want the refusal", err)
	}

	// Save as a PEFT folder; it loads into a new adapter (made by Load), which samples the same.
	if err := a.Save(ctx, "peft"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "peft", "adapter_config.json")); err != nil {
		t.Fatalf("the saved adapter is no PEFT folder: %v", err)
	}
	bb := c.Adapter("b")
	if err := bb.Load(ctx, "peft"); err != nil {
		t.Fatal(err)
	}
	if got, err := bb.Generate(ctx, versionReqs("loaded/")); err != nil || !reflect.DeepEqual(samples(got), samples(trained)) {
		t.Errorf("the adapter loaded from its save samples differently (%v)", err)
	}

	// A load that fails leaves no new adapter behind.
	if err := c.Adapter("c").Load(ctx, "nowhere"); err == nil || !strings.Contains(err.Error(), "nowhere") {
		t.Errorf("loading a missing folder into a new adapter: %v; want an error naming the folder", err)
	}
	if _, err := c.Adapter("c").Generate(ctx, versionReqs("c/")); err == nil || !strings.Contains(err.Error(), `no adapter "c"`) {
		t.Errorf("generating with the adapter of a failed load: %v; want no such adapter", err)
	}

	if err := c.RemoveAdapter(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Generate(ctx, versionReqs("gone/")); err == nil || !strings.Contains(err.Error(), `"a"`) {
		t.Errorf("generating with a removed adapter: %v; want an error naming it", err)
	}
	if _, err := a.Train(ctx, stepBatch("step2", base)); err == nil || !strings.Contains(err.Error(), `no adapter "a"`) {
		t.Errorf("training a removed adapter: %v; want an error naming it", err)
	}
}

// An engine without adapters answers the adapter calls UNIMPLEMENTED with a message, and lists
// no "lora" capability.
func TestEngineWithoutAdaptersRefusesThem(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveVersioned(t, newGated(), t.TempDir())
	if info, err := c.Info(ctx); err != nil || slices.Contains(info.Capabilities, "lora") {
		t.Errorf("Info: capabilities %v, %v; want no \"lora\"", info.Capabilities, err)
	}
	if _, err := c.AddAdapter(ctx, "a", remote.LoRA{Rank: 1, Alpha: 1, Targets: []string{"q_proj"}}, 1); !errors.Is(err, engines.ErrNotSupported) || !strings.Contains(err.Error(), "holds no LoRA adapters") {
		t.Errorf("AddAdapter: %v; want UNIMPLEMENTED saying why", err)
	}
	if err := c.RemoveAdapter(ctx, "a"); !errors.Is(err, engines.ErrNotSupported) {
		t.Errorf("RemoveAdapter: %v; want UNIMPLEMENTED", err)
	}
	a := c.Adapter("a")
	if _, err := a.Generate(ctx, []engines.GenerateRequest{{ID: "x", PromptTokens: []int32{1}, Sampling: engines.Sampling{MaxTokens: 1}}}); err == nil || !strings.Contains(err.Error(), "holds no adapters") {
		t.Errorf("Generate with an adapter: %v; want the refusal", err)
	}
	if _, err := a.Train(ctx, engines.Batch{ID: "s"}); !errors.Is(err, engines.ErrNotSupported) {
		t.Errorf("Train of an adapter: %v; want UNIMPLEMENTED", err)
	}
	if _, err := a.Score(ctx, []engines.ScoreRequest{{PromptTokens: []int32{1}, Tokens: []int32{2}}}); !errors.Is(err, engines.ErrNotSupported) {
		t.Errorf("Score with an adapter: %v; want UNIMPLEMENTED", err)
	}
}

// The adapter calls are guarded by the token like every other call.
func TestAdapterCallsNeedTheToken(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	c := start(t, eng, Options{Token: "s3cret"})
	for _, call := range []struct {
		name string
		f    func(context.Context) error
	}{
		{"AddAdapter", func(ctx context.Context) error {
			_, err := c.AddAdapter(ctx, &enginepb.AddAdapterRequest{Name: "a", Rank: 2, Alpha: 2, Targets: []string{"q_proj"}, Seed: 1})
			return err
		}},
		{"RemoveAdapter", func(ctx context.Context) error {
			_, err := c.RemoveAdapter(ctx, &enginepb.RemoveAdapterRequest{Name: "a"})
			return err
		}},
	} {
		if err := call.f(ctx); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s without a token: %v; want Unauthenticated", call.name, err)
		}
		authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer s3cret")
		if err := call.f(authed); err != nil {
			t.Errorf("%s with the token: %v", call.name, err)
		}
	}
	if n := eng.AdapterNames(); len(n) != 0 {
		t.Errorf("adapters after add and remove: %v", n)
	}
}
