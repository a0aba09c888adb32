package tiny

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/slimen/slimen/engines"
)

// criticBatch is three samples with returns ret + 0.1·t, two groups and an untrained last token,
// as the PyTorch engine's test_critic.py builds them.
func criticBatch(ret float32, oldValues [][]float32, clip, lr float64) engines.Batch {
	b := engines.Batch{ID: "critic", Loss: engines.LossConfig{LR: lr, ValueClip: clip, MaxGradNorm: 1}}
	for i := range 3 {
		s := engines.Sample{Group: []string{"g0", "g1"}[i%2]}
		for k := range 4 + i {
			s.Prompt = append(s.Prompt, int32(3+(7*i+5*k)%90))
		}
		for t := range 5 + i {
			s.Response = append(s.Response, int32(3+(11*i+3*t)%90))
			s.LossMask = append(s.LossMask, 1)
			s.Returns = append(s.Returns, ret+0.1*float32(t))
		}
		s.LossMask[len(s.LossMask)-1] = 0
		if oldValues != nil {
			s.OldValues = oldValues[i]
		}
		b.Samples = append(b.Samples, s)
	}
	return b
}

func valuesOf(t *testing.T, e *Engine, b engines.Batch) [][]float32 {
	t.Helper()
	reqs := make([]engines.ScoreRequest, len(b.Samples))
	for i, s := range b.Samples {
		reqs[i] = engines.ScoreRequest{PromptTokens: s.Prompt, Tokens: s.Response}
	}
	v, err := e.Values(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// expectedValueLoss is the clipped value loss written out from its definition with the default
// reduction (slime's value_loss_function): mean over samples of each sample's token-mean of
// max((V − R)², (clip(V, V_old ± clip) − R)²).
func expectedValueLoss(b engines.Batch, values [][]float32, clip float64) float64 {
	total := 0.0
	for i, s := range b.Samples {
		mass := 0.0
		for _, m := range s.LossMask {
			mass += float64(m)
		}
		for t, r := range s.Returns {
			v, ret := float64(values[i][t]), float64(r)
			l := (v - ret) * (v - ret)
			if clip > 0 {
				o := float64(s.OldValues[t])
				vc := o + math.Min(math.Max(v-o, -clip), clip)
				l = math.Max(l, (vc-ret)*(vc-ret))
			}
			total += float64(s.LossMask[t]) * l / math.Max(mass, 1) / float64(len(b.Samples))
		}
	}
	return total
}

func trunkOf(e *Engine) [][]float32 {
	var out [][]float32
	for _, t := range e.m.w.tensors() {
		if strings.HasPrefix(t.name, "model.layers.") {
			out = append(out, slices.Clone(t.data))
		}
	}
	return out
}

// A fresh critic values everything at 0; training on a fixed batch lowers the value loss, reports
// it as the definition says, and moves the whole model, not only the head.
func TestCriticLearnsTheReturns(t *testing.T) {
	e := newSmall(t, 2)
	info, _ := e.Info(ctx)
	before := info.Params
	if !slices.Contains(info.Capabilities, "values") {
		t.Fatalf("capabilities %v lack values", info.Capabilities)
	}
	if e.m.w.score != nil {
		t.Fatal("a new engine has a value head before it is used")
	}
	b := criticBatch(2, nil, 0, 1e-2)
	v0 := valuesOf(t, e, b)
	for i, v := range v0 {
		if len(v) != len(b.Samples[i].Response) || slices.ContainsFunc(v, func(x float32) bool { return x != 0 }) {
			t.Fatalf("fresh head: values %v for %d tokens, want all 0", v, len(b.Samples[i].Response))
		}
	}
	if info, _ := e.Info(ctx); info.Params != before+int64(smallConfig().Hidden+1) {
		t.Errorf("params %d after the head was created, want %d + hidden + 1", info.Params, before)
	}
	trunk0 := trunkOf(e)
	first, err := e.Train(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	if first.Skipped || math.Abs(first.ValueLoss-expectedValueLoss(b, v0, 0)) > 1e-5*first.ValueLoss ||
		first.Loss != first.ValueLoss || first.PGLoss != 0 || first.GradNorm <= 0 {
		t.Fatalf("first step %+v, want value loss %v", first, expectedValueLoss(b, v0, 0))
	}
	if want := 5 + 6 + 7 - 3; first.Tokens != want {
		t.Errorf("trained tokens %d, want %d", first.Tokens, want)
	}
	var last engines.TrainStats
	for range 10 {
		if last, err = e.Train(ctx, b); err != nil || last.Skipped {
			t.Fatalf("%v %+v", err, last)
		}
	}
	if last.ValueLoss > 0.5*first.ValueLoss {
		t.Errorf("value loss %v after 11 steps, from %v", last.ValueLoss, first.ValueLoss)
	}
	// Each step reports the loss before its update; after the last one it is lower still.
	if after := expectedValueLoss(b, valuesOf(t, e, b), 0); after >= last.ValueLoss {
		t.Errorf("value loss %v after the last step, %v before it", after, last.ValueLoss)
	}
	if cmp.Equal(trunk0, trunkOf(e)) {
		t.Error("the layers did not move: the value loss does not reach past the head")
	}
}

// With old values 0.2 below the current ones and a clip of 0.05, the clipped term decides the
// loss wherever V moved towards the return by more than the clip.
func TestCriticValueClipping(t *testing.T) {
	e := newSmall(t, 1)
	if _, err := e.Train(ctx, criticBatch(3, nil, 0, 5e-2)); err != nil { // move the values off 0
		t.Fatal(err)
	}
	v := valuesOf(t, e, criticBatch(3, nil, 0, 0))
	old := make([][]float32, len(v))
	for i := range v {
		for _, x := range v[i] {
			old[i] = append(old[i], x-0.2)
		}
	}
	b := criticBatch(3, old, 0.05, 1e-2)
	st, err := e.Train(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	want, unclipped := expectedValueLoss(b, v, 0.05), expectedValueLoss(b, v, 0)
	if math.Abs(st.ValueLoss-want) > 1e-5*want || want <= unclipped || st.ClipFrac <= 0 {
		t.Fatalf("value loss %v (clip frac %v), want %v (unclipped %v)", st.ValueLoss, st.ClipFrac, want, unclipped)
	}
}

func TestCriticBatchErrors(t *testing.T) {
	e := newSmall(t, 1)
	b := criticBatch(1, nil, 0, 1e-2)
	b.Samples[1].Returns = nil
	if _, err := e.Train(ctx, b); err == nil || !strings.Contains(err.Error(), "returns") {
		t.Errorf("a sample without returns: %v", err)
	}
	if _, err := e.Train(ctx, criticBatch(1, nil, 0.2, 1e-2)); err == nil || !strings.Contains(err.Error(), "old_values") {
		t.Errorf("value_clip without old values: %v", err)
	}
	if _, err := e.Train(ctx, criticBatch(1, nil, -0.1, 1e-2)); err == nil || !strings.Contains(err.Error(), "value_clip") {
		t.Errorf("a negative value_clip: %v", err)
	}
	// A policy step does not make a value head.
	if _, err := e.Train(ctx, rolloutBatch(t, e, func(int, engines.Completion) float32 { return 1 })); err != nil || e.m.w.score != nil {
		t.Errorf("policy step: err %v, value head %v", err, e.m.w.score)
	}
}

// Save writes the head as the PyTorch engine does (score.weight 1×hidden, score.bias 1) and its
// AdamW moments; Open and Load bring both back, so values and the next step are unchanged.
func TestCriticSaveLoad(t *testing.T) {
	e := newSmall(t, 2)
	b := criticBatch(2, nil, 0, 1e-2)
	for range 2 {
		if _, err := e.Train(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	dir := t.TempDir()
	if err := e.Save(ctx, dir); err != nil {
		t.Fatal(err)
	}
	read := func(file string) map[string]tensor {
		raw, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			t.Fatal(err)
		}
		ts, err := decodeSafetensors(raw)
		if err != nil {
			t.Fatal(err)
		}
		return ts
	}
	ts := read(fileWeights)
	hidden := smallConfig().Hidden
	if !slices.Equal(ts["score.weight"].shape, []int{1, hidden}) || !slices.Equal(ts["score.bias"].shape, []int{1}) {
		t.Fatalf("score.weight %v, score.bias %v; want [1 %d] and [1]", ts["score.weight"].shape, ts["score.bias"].shape, hidden)
	}
	if ots := read(fileOptimizer); len(ots["exp_avg.score.weight"].data) != hidden || len(ots["exp_avg_sq.score.bias"].data) != 1 {
		t.Fatal("optimizer.safetensors lacks the value head's moments")
	}
	want := valuesOf(t, e, b)
	if slices.ContainsFunc(want, func(v []float32) bool { return slices.Contains(v, 0) }) {
		t.Fatal("trained values are still 0: the round trip would prove nothing")
	}
	opened, err := Open(dir, Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, valuesOf(t, opened, b)); d != "" || !cmp.Equal(snapshot(e), snapshot(opened)) {
		t.Fatalf("opened checkpoint differs (values -want +got):\n%s", d)
	}
	fresh := newSmall(t, 1)
	if err := fresh.Load(ctx, dir); err != nil {
		t.Fatal(err)
	}
	st1, _ := e.Train(ctx, b)
	st2, _ := fresh.Train(ctx, b)
	if st1.ValueLoss != st2.ValueLoss || !cmp.Equal(snapshot(e), snapshot(fresh)) {
		t.Fatal("training after Load diverged from training without the round trip")
	}
	// A plain language model's folder loaded into a critic leaves it without a head until it is
	// next used, when a fresh one values everything at 0 again.
	plain := t.TempDir()
	if err := newSmall(t, 1).Save(ctx, plain); err != nil {
		t.Fatal(err)
	}
	if err := fresh.Load(ctx, plain); err != nil || fresh.m.w.score != nil {
		t.Fatalf("load of a plain model: err %v, head %v", err, fresh.m.w.score)
	}
	for _, v := range valuesOf(t, fresh, b) {
		if slices.ContainsFunc(v, func(x float32) bool { return x != 0 }) {
			t.Fatalf("values %v after loading a model without a head, want 0", v)
		}
	}
}
