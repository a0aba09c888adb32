package host

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/advantage"
)

// TestEstimatorSelectsPolicyLoss runs a step per estimator on a scripted engine: gspo must reach
// the engine as the sequence-level policy loss, the others as the per-token PPO loss, with the
// policy's clip settings and the gspo advantages computed by hand.
func TestEstimatorSelectsPolicyLoss(t *testing.T) {
	src := `
def rollout(task):
    cs = generate("p", task.prompt, n = 3)
    for c in cs:
        reward(c, 1.0 if c.text == "0" else 0.0)
    train(cs)
`
	s := math.Sqrt(1.0 / 3)
	hi, lo := f((2.0/3)/(s+1e-6)), f((-1.0/3)/(s+1e-6))
	for est, wantLoss := range map[string]string{"gspo": "gspo", "grpo": "ppo", "reinforce_plus_plus": "ppo", "rloo": "ppo"} {
		cfg := testConfig(2, "p")
		cfg.Policies[0].Train.AdvantageEstimator = est
		cfg.Policies[0].Train.EpsClip, cfg.Policies[0].Train.EpsClipHigh = 3e-4, 4e-4
		eng := scripted.New(func(req scripted.Request) string { return fmt.Sprint(req.Index) })
		r := loadRun(t, src, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(2))
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
		b := eng.Batches()
		if len(b) != 1 {
			t.Fatalf("%s: %d training batches, want 1", est, len(b))
		}
		if l := b[0].Loss; l.PolicyLoss != wantLoss || l.EpsClip != 3e-4 || l.EpsClipHigh != 4e-4 {
			t.Errorf("advantage_estimator %s: engine got policy loss %q (eps_clip %v/%v), want %q", est, l.PolicyLoss, l.EpsClip, l.EpsClipHigh, wantLoss)
		}
		if est != "gspo" {
			continue
		}
		for i, smp := range b[0].Samples {
			want := lo
			if i%3 == 0 {
				want = hi
			}
			for _, a := range smp.Advantages {
				if math.Abs(float64(a-want)) > 1e-5 {
					t.Errorf("gspo sample %d: advantage %v, want %v", i, a, want)
				}
			}
		}
	}
}

// TestSharedAndSplitBuffers runs real steps with three policies on scripted engines. Policy a
// answers twice per task, b and c once; all samples of a task share its group. With a and b in
// buffer_mode shared they are normalised together (a task's group spans both), c alone; split,
// every policy is normalised alone. Each engine trains on its own samples only.
func TestSharedAndSplitBuffers(t *testing.T) {
	src := `
def rollout(task):
    xs = generate("a", task.prompt, n = 2)
    y = generate("b", task.prompt)
    z = generate("c", task.prompt)
    # task t0: a gets 1, 0; task t1: a gets 1, 1. b always 0, c always 1.
    reward(xs[0], 1.0)
    reward(xs[1], 0.0 if task.id == "t0" else 1.0)
    reward(y, 0.0)
    reward(z, 1.0)
    train(xs + [y, z])
`
	s := math.Sqrt(1.0 / 3) // unbiased std of {1, 0, 0} (mean 1/3) and of {1, 1, 0} (mean 2/3)
	big, down := f((2.0/3)/(s+1e-6)), f((-1.0/3)/(s+1e-6))
	up, down2 := f((1.0/3)/(s+1e-6)), f((-2.0/3)/(s+1e-6))
	half := f(0.5 / (math.Sqrt(0.5) + 1e-6)) // a alone in t0: {1, 0}
	for _, c := range []struct {
		mode string
		want map[string][]float32 // per policy, one advantage per sample in task order
	}{
		{"shared", map[string][]float32{
			"a": {big, down, up, up}, // t0 {a:1, a:0, b:0}; t1 {a:1, a:1, b:0}
			"b": {down, down2},
			"c": {0, 0}, // split: alone in its group
		}},
		{"split", map[string][]float32{
			"a": {half, -half, 0, 0}, // t0 {1, 0}; t1 {1, 1}
			"b": {0, 0},
			"c": {0, 0},
		}},
	} {
		t.Run(c.mode, func(t *testing.T) {
			cfg := testConfig(2, "a", "b", "c")
			cfg.Policies[0].BufferMode, cfg.Policies[1].BufferMode = c.mode, c.mode
			engs := map[string]*scripted.Engine{}
			given := map[string]engines.Engine{}
			for _, p := range []string{"a", "b", "c"} {
				engs[p] = scripted.Echo("answer of " + p)
				given[p] = engs[p]
			}
			r := loadRun(t, src, cfg, given, numberedTasks(2))
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Failed) > 0 {
				t.Fatal(res.Failed[0])
			}
			for p, want := range c.want {
				b := engs[p].Batches()
				if len(b) != 1 {
					t.Fatalf("policy %s: %d training batches, want 1", p, len(b))
				}
				var got []float32
				for i, smp := range b[0].Samples {
					if text := scripted.Decode(smp.Response); text != "answer of "+p {
						t.Errorf("policy %s trained sample %d of another policy: %q", p, i, text)
					}
					if smp.Group != fmt.Sprintf("t%d", i*2/len(b[0].Samples)) {
						t.Errorf("policy %s sample %d: group %q", p, i, smp.Group)
					}
					for _, a := range smp.Advantages[1:] {
						if a != smp.Advantages[0] {
							t.Errorf("policy %s sample %d: advantages differ across tokens: %v", p, i, smp.Advantages)
						}
					}
					got = append(got, smp.Advantages[0])
				}
				if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
					t.Errorf("%s buffers, policy %s advantages (-want +got):\n%s", c.mode, p, d)
				}
			}
		})
	}
}

// TestSharedBuffersAroundASplitPolicy: shared-buffer policies listed before and after a split
// one are still one pool, normalised together (a task's group is {a:1, a:0, c:1}), and the split
// policy alone; the later shared policy once got no advantages and the step panicked.
func TestSharedBuffersAroundASplitPolicy(t *testing.T) {
	src := `
def rollout(task):
    xs = generate("a", task.prompt, n = 2)
    y = generate("b", task.prompt)
    z = generate("c", task.prompt)
    reward(xs[0], 1.0)
    reward(xs[1], 0.0)
    reward(y, 0.0)
    reward(z, 1.0)
    train(xs + [y, z])
`
	cfg := testConfig(2, "a", "b", "c")
	cfg.Policies[0].BufferMode, cfg.Policies[2].BufferMode = "shared", "shared"
	engs := map[string]*scripted.Engine{}
	given := map[string]engines.Engine{}
	for _, p := range []string{"a", "b", "c"} {
		engs[p] = scripted.Echo("answer of " + p)
		given[p] = engs[p]
	}
	r := loadRun(t, src, cfg, given, numberedTasks(2))
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	s := math.Sqrt(1.0 / 3) // unbiased std of {1, 0, 1} (mean 2/3)
	up, down := f((1.0/3)/(s+1e-6)), f((-2.0/3)/(s+1e-6))
	for p, want := range map[string][]float32{"a": {up, down, up, down}, "b": {0, 0}, "c": {up, up}} {
		b := engs[p].Batches()
		if len(b) != 1 {
			t.Fatalf("policy %s: %d training batches, want 1", p, len(b))
		}
		var got []float32
		for _, smp := range b[0].Samples {
			got = append(got, smp.Advantages[0])
		}
		if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
			t.Errorf("policy %s advantages (-want +got):\n%s", p, d)
		}
	}
}

// TestGammaFromConfigReachesReinforcePlusPlus: the policy's train.gamma discounts the returns the
// engine trains on.
func TestGammaFromConfigReachesReinforcePlusPlus(t *testing.T) {
	cfg := testConfig(1, "p")
	cfg.Policies[0].Train.AdvantageEstimator = "reinforce_plus_plus"
	cfg.Policies[0].Train.Gamma = 0.5
	// Two samples of three tokens ("ab" + EOS): rewards 4 and 0 give returns 1, 2, 4 and 0, 0, 0.
	eng := scripted.Echo("ab")
	r := loadRun(t, `
def rollout(task):
    cs = generate("p", task.prompt, n = 2)
    reward(cs[0], 4.0)
    reward(cs[1], 0.0)
    train(cs)
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(1))
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Mean 7/6; Σ squares of the deviations 14.8333…; var that over 5.
	mean := 7.0 / 6
	var sq float64
	for _, x := range []float64{1, 2, 4, 0, 0, 0} {
		sq += (x - mean) * (x - mean)
	}
	sd := math.Sqrt(sq/5 + 1e-8)
	w := func(x float64) float32 { return f((x - mean) / sd) }
	var got [][]float32
	for _, s := range eng.Batches()[0].Samples {
		got = append(got, s.Advantages)
	}
	if d := cmp.Diff([][]float32{{w(1), w(2), w(4)}, {w(0), w(0), w(0)}}, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
		t.Errorf("reinforce++ with gamma 0.5 from the config (-want +got):\n%s", d)
	}
}

// refEngine is a scripted engine with a KL reference whose log-probs are refLogprob per token.
type refEngine struct {
	*scripted.Engine
	refLogprob float32
	refCalls   int
}

func (e *refEngine) Info(ctx context.Context) (engines.Info, error) {
	info, err := e.Engine.Info(ctx)
	info.Capabilities = append(info.Capabilities, "reference")
	return info, err
}

func (e *refEngine) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	out, err := e.Engine.Score(ctx, reqs)
	for i, r := range reqs {
		if r.Reference {
			e.refCalls++
			for j := range out[i].Logprobs {
				out[i].Logprobs[j] = e.refLogprob
			}
		}
	}
	return out, err
}

// kl_coef reaches the advantages through reference log-probs the host asks the policy's engine
// for: REINFORCE++ gets −kl_coef·KL per token, here k1 = logp_rollout − logp_ref = 0.5 − (−0.25).
// An engine without a reference is refused with a message naming the setting; grpo ignores
// kl_coef and asks for nothing.
func TestRewardKLUsesTheReference(t *testing.T) {
	src := `
def rollout(task):
    cs = generate("p", task.prompt, n = 2)
    for c in cs:
        reward(c, 1.0 if c.text == "0" else 0.0)
    train(cs)
`
	for _, est := range []string{"reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo"} {
		cfg := testConfig(1, "p")
		tc := &cfg.Policies[0].Train
		tc.AdvantageEstimator, tc.KLCoef, tc.KLLossType, tc.Gamma = est, 0.1, "k1", 1
		se := scripted.New(func(req scripted.Request) string { return fmt.Sprint(req.Index) })
		se.Logprob = 0.5
		eng := &refEngine{Engine: se, refLogprob: -0.25}
		r := loadRun(t, src, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(1))
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatalf("%s: %v", est, err)
		}
		b := se.Batches()
		var in []advantage.Input
		for _, s := range b[0].Samples {
			kl := make([]float64, len(s.Response))
			for j := range kl {
				kl[j] = 0.75
			}
			rw := 0.0
			if scripted.Decode(s.Response[:1]) == "0" {
				rw = 1
			}
			in = append(in, advantage.Input{Reward: rw, Group: s.Group, Tokens: len(s.Response), KL: kl})
		}
		want, err := advantage.Compute(estimatorOf(*tc), in)
		if err != nil {
			t.Fatal(err)
		}
		if est == "grpo" {
			want, _ = advantage.Compute(advantage.Estimator{Name: "grpo", Normalize: true, StdNormalize: true}, in)
		}
		for i, s := range b[0].Samples {
			if d := cmp.Diff(want[i], s.Advantages, cmpopts.EquateApprox(0, 1e-6)); d != "" {
				t.Errorf("%s: sample %d advantages (-want +got):\n%s", est, i, d)
			}
		}
		if (eng.refCalls > 0) != (est != "grpo") {
			t.Errorf("%s: %d reference scores", est, eng.refCalls)
		}
		noKL, _ := advantage.Compute(advantage.Estimator{Name: est, Normalize: true, StdNormalize: true, Gamma: 1}, in)
		if est == "reinforce_plus_plus" && cmp.Equal(noKL, want, cmpopts.EquateApprox(0, 1e-6)) {
			t.Errorf("%s: kl_coef changed nothing", est)
		}
	}
	cfg := testConfig(1, "p")
	cfg.Policies[0].Train.AdvantageEstimator, cfg.Policies[0].Train.KLCoef = "reinforce_plus_plus", 0.1
	r := loadRun(t, src, cfg, map[string]engines.Engine{"p": scripted.New(answerLastChar)}, numberedTasks(1))
	if _, err := r.Step(context.Background()); err == nil || !strings.Contains(err.Error(), `kl_coef 0.1 needs the log-probs of the KL reference`) {
		t.Errorf("an engine without a reference: %v", err)
	}
}
