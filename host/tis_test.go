package host

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// stepOffOn runs one step of cfg's policies "off" and "on" (testConfig's, on the embedded engine,
// responses of at most 8 tokens) on two numbered tasks, each rollout rewarding two samples of both
// 0 and 1: "off" samples through offRollout, its log-probs a nat off. It returns the step, the run
// folder and, by pointer, what offRollout saw sent.
func stepOffOn(t *testing.T, cfg *config.Config) (res *StepResult, out string, sent *[]bool) {
	t.Helper()
	open := func() engines.Engine {
		e, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	sent = new([]bool)
	cfg.Rollout.MaxResponseLen = 8
	out = t.TempDir()
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    for p in ["off", "on"]:
        cs = generate(p, task.prompt, n = 2)
        for i, c in enumerate(cs):
            reward(c, float(i))
        train(cs)
`), Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
		Engines: map[string]engines.Engine{"off": offRollout{open(), sent}, "on": open()}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err = r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return res, out, sent
}

// offRollout is the embedded engine seen through a rollout engine whose log-probs are one nat
// above the trainer's on every token (what another engine's numerics or older weights give):
// every TIS ratio is e^−1.
type offRollout struct {
	engines.Engine
	sent *[]bool // per optimizer step: whether every sample carried the trainer's log-probs
}

func (e offRollout) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	*e.sent = append(*e.sent, !slices.ContainsFunc(b.Samples, func(s engines.Sample) bool {
		return len(s.TrainLogprobs) != len(s.Response) || len(s.Response) == 0
	}))
	return e.Engine.Train(ctx, b)
}

func (e offRollout) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	cs, err := e.Engine.Generate(ctx, reqs)
	for i := range cs {
		lp := slices.Clone(cs[i].Logprobs)
		for j := range lp {
			lp[j]++
		}
		cs[i].Logprobs = lp
	}
	return cs, err
}

// A run with use_tis on the embedded engine trains and reports the correction per policy: "off"
// samples from a rollout engine one nat off (every ratio e^−1, below the band [0.5, 2]: every
// token clipped to 0.5), "on" from its own weights (ratios 1: nothing clipped or masked). Each
// step is cut into two optimizer steps, so the trainer's old log-probs come from scoring before
// the first.
func TestUseTISOnTheEmbeddedEngine(t *testing.T) {
	cfg := testConfig(2, "off", "on")
	for i, mode := range []string{"tis", "icepop"} {
		tc := &cfg.Policies[i].Train
		tc.UseTIS, tc.TISMode, tc.TISClip, tc.TISClipLow, tc.GlobalBatchSize = true, mode, 2, 0.5, 2
	}
	res, out, sent := stepOffOn(t, cfg)
	for _, m := range res.Policies {
		frac, w := m.Float("tis_clip_frac"), m.Float("tis_weight")
		if m.Float("optimizer_steps") != 2 || m.Float("trained_tokens") == 0 || math.IsNaN(m.Float("loss")) {
			t.Errorf("%s: did not train: %v", m.Policy(), m)
		}
		switch m.Policy() {
		case "off":
			if frac != 1 || math.Abs(w-0.5) > 1e-12 {
				t.Errorf("off: tis_clip_frac %v, tis_weight %v; want 1 and 0.5", frac, w)
			}
		case "on":
			if frac != 0 || math.Abs(w-1) > 1e-4 {
				t.Errorf("on: tis_clip_frac %v, tis_weight %v; want 0 and 1", frac, w)
			}
		}
	}
	if !slices.Equal(*sent, []bool{true, true}) {
		t.Errorf("optimizer steps with the trainer's old log-probs: %v, want both", *sent)
	}
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil || strings.Count(string(b), `"tis_clip_frac":`) != 2 {
		t.Errorf("metrics.jsonl lacks tis_clip_frac per policy: %v\n%s", err, b)
	}
}

// An engine that does not apply the correction (no "tis" capability) is refused at start-up,
// naming the policy.
func TestUseTISNeedsAnEngineThatHasIt(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Policies[0].Train.UseTIS = true
	_, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    train(generate(\"p\", task.prompt))\n"),
		Options{Config: cfg, Out: t.TempDir(), Tasks: numberedTasks(2), Engines: map[string]engines.Engine{"p": scripted.Echo("x")}})
	if err == nil || !strings.Contains(err.Error(), `policy "p"`) || !strings.Contains(err.Error(), `train.use_tis needs an engine that applies the off-policy correction`) {
		t.Fatalf("Load: %v", err)
	}
}
