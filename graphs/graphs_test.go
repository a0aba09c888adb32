package graphs_test

import (
	"context"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	scriptpkg "github.com/slimen/slimen/host/script"
)

// Two tasks whose answers differ, so a policy that always answers 5 is right on "a" and wrong on
// "b": every reward below follows from that by hand.
// Their metadata is what the agent examples read: memagent's document, toolorchestra's parts.
var twoTasks = taskList{
	{ID: "a", Prompt: "Ann has 2 pens and gets 3 more. How many pens?", Label: "5", HasLabel: true,
		Metadata: map[string]any{"document": "Ann's pens is 5. It rained at noon.",
			"parts": []any{map[string]any{"prompt": "Ann has 2 pens and gets 3 more. How many pens?", "label": "5", "kind": "arith", "expr": ""}}}},
	{ID: "b", Prompt: "Bo has 4 eggs and gets 3 more. How many eggs?", Label: "7", HasLabel: true,
		Metadata: map[string]any{"document": "Bo's eggs is 7. The sun was out.",
			"parts": []any{map[string]any{"prompt": "Bo has 4 eggs and gets 3 more. How many eggs?", "label": "7", "kind": "arith", "expr": ""}}}},
}

type taskList []host.Task

func (l taskList) Task(i int) host.Task { return l[i%len(l)] }

func examples(t *testing.T) []string {
	t.Helper()
	dirs, err := filepath.Glob("../examples/*/config.yaml")
	if err != nil || len(dirs) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	var names []string
	for _, d := range dirs {
		names = append(names, filepath.Base(filepath.Dir(d)))
	}
	sort.Strings(names)
	return names
}

// needOpenAIPython skips a test whose agent() program needs the openai package when the python
// agent() runs ($SLIMEN_PYTHON, else python3) lacks it.
func needOpenAIPython(t *testing.T) {
	t.Helper()
	py := os.Getenv(scriptpkg.PythonEnv)
	if py == "" {
		py = "python3"
	}
	if err := exec.Command(py, "-c", "import openai").Run(); err != nil {
		t.Skipf("%s cannot import openai (%v): set %s to the python of scripts/pyenv.sh to run examples/openai_agent", py, err, scriptpkg.PythonEnv)
	}
}

func script(name string) string { return filepath.Join("..", "examples", name, name+".star") }

func loadConfig(t *testing.T, name string) *config.Config {
	t.Helper()
	cfg, err := config.Load(filepath.Join("..", "examples", name, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestExamplesCheck: every example folder has its script, a unit test and a README, and the
// script passes `slimen check` against its config.
func TestExamplesCheck(t *testing.T) {
	for _, name := range examples(t) {
		for _, f := range []string{name + ".star", name + "_test.star", "README.md"} {
			if _, err := os.Stat(filepath.Join("..", "examples", name, f)); err != nil {
				t.Errorf("%s: %v", name, err)
			}
		}
		if problems := scriptpkg.Check(script(name), loadConfig(t, name)); len(problems) > 0 {
			t.Errorf("slimen check %s:\n%v", name, problems)
		}
	}
}

// perTask counts the samples one policy's engine was trained on in one step, per task (the GRPO
// group).
type perTask map[string]int

type want struct {
	counts     map[string]perTask // policy → task → samples, every step
	rewardMean map[string]float64 // policy → reward_mean, every step
}

// TestExamplesTwoSteps runs every example for two steps with its own config on scripted engines
// where every policy answers \boxed{5}: right on task a, wrong on task b. It checks what each
// policy's buffer received per task and the rewards the topology's rule gives.
func TestExamplesTwoSteps(t *testing.T) {
	both := func(n int) perTask { return perTask{"a": n, "b": n} }
	cases := map[string]want{
		// Every answer by the label: right on a, wrong on b. Each role's answers to a task are then
		// all right or all wrong, zero advantage under GRPO, so the debate trains none of them.
		"debate": {
			rewardMean: map[string]float64{"generator": 0.5, "critic": 0.5},
		},
		// a: right and the summarizers are right, ×1.2; b: wrong, 0×0.8.
		"solver_summarizer": {
			counts:     map[string]perTask{"solver": both(4), "summarizer": both(4)},
			rewardMean: map[string]float64{"solver": 0.6, "summarizer": 0.6},
		},
		"generator_verifier": {
			counts:     map[string]perTask{"generator": both(8), "verifier": both(4)},
			rewardMean: map[string]float64{"generator": 0.5, "verifier": 0.5},
		},
		"orchestrator": {
			counts:     map[string]perTask{"orchestrator": both(4), "subagent": both(6)},
			rewardMean: map[string]float64{"orchestrator": 0.5, "subagent": 0.5},
		},
		"exam_swarm": {
			counts:     map[string]perTask{"agent_0": both(4), "agent_1": both(4), "agent_2": both(4), "agent_3": both(4)},
			rewardMean: map[string]float64{"agent_0": 0.5, "agent_1": 0.5, "agent_2": 0.5, "agent_3": 0.5},
		},
		"shared_state": {
			counts:     map[string]perTask{"peer_a": both(6), "peer_b": both(6)},
			rewardMean: map[string]float64{"peer_a": 0.5, "peer_b": 0.5},
		},
		// Selectors pick by answer: on a the right rewrite (1, then ×1.2), on b a wrong one.
		"solver_rewriter_selector": {
			counts:     map[string]perTask{"solver": both(4), "rewriter": both(4), "selector": both(4)},
			rewardMean: map[string]float64{"solver": 0.6, "rewriter": 0.6, "selector": 0.6},
		},
		"distillation": {
			counts:     map[string]perTask{"student": both(4)},
			rewardMean: map[string]float64{"student": 0.5},
		},
		// The planner answers itself (no tool call): one turn, one sample a trajectory; the
		// executor and verifier are frozen and never asked.
		"agentflow": {
			counts:     map[string]perTask{"planner": both(4)},
			rewardMean: map[string]float64{"planner": 0.5},
		},
		// One chunk (the documents are two sentences): a memory update and the answer, two
		// samples a trajectory, both with the answer's reward.
		"memagent": {
			counts:     map[string]perTask{"agent": both(8)},
			rewardMean: map[string]float64{"agent": 0.5},
		},
		// One part a task answered directly: the trajectory is one sample; the expert is frozen.
		"toolorchestra": {
			counts:     map[string]perTask{"orchestrator": both(4)},
			rewardMean: map[string]float64{"orchestrator": 0.5},
		},
		// Four conversations a task, each one sample; no tool call in "\boxed{5}": one turn each.
		"calculator_agent": {
			counts:     map[string]perTask{"agent": both(4)},
			rewardMean: map[string]float64{"agent": 0.5},
		},
		// agent.py (the OpenAI client) answers \boxed{5} in one call; four runs of it a task.
		"openai_agent": {
			counts:     map[string]perTask{"agent": both(4)},
			rewardMean: map[string]float64{"agent": 0.5},
		},
		// The critic is never named by the script: it trains on the actor's samples.
		"ppo": {
			counts:     map[string]perTask{"actor": both(4), "critic": both(4)},
			rewardMean: map[string]float64{"actor": 0.5},
		},
	}
	for _, name := range examples(t) {
		w, ok := cases[name]
		if !ok {
			t.Errorf("example %s has no case here", name)
			continue
		}
		t.Run(name, func(t *testing.T) {
			if name == "openai_agent" {
				needOpenAIPython(t)
			}
			cfg := loadConfig(t, name)
			cfg.Rollout.BatchSize = 2
			engs := map[string]engines.Engine{}
			for _, p := range cfg.Policies {
				engs[p.Name] = scripted.Echo(`\boxed{5}`)
			}
			run, err := host.Load(context.Background(), script(name), host.Options{Config: cfg, Engines: engs, Tasks: twoTasks})
			if err != nil {
				t.Fatal(err)
			}
			defer run.Close()
			for step := 1; step <= 2; step++ {
				res, err := run.Step(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if len(res.Failed) > 0 {
					t.Fatal(res.Failed[0])
				}
				for _, m := range res.Policies {
					if r, ok := w.rewardMean[m.Policy()]; ok && math.Abs(m.Float("reward_mean")-r) > 1e-9 {
						t.Errorf("step %d %s: reward_mean %v, want %v", step, m.Policy(), m.Float("reward_mean"), r)
					}
				}
			}
			for _, p := range cfg.Policies {
				e := engs[p.Name].(*scripted.Engine)
				batches := e.Batches()
				if _, trained := w.counts[p.Name]; !trained {
					if len(batches) != 0 {
						t.Errorf("%s trained %d batches, want none", p.Name, len(batches))
					}
					continue
				}
				if len(batches) != 2 {
					t.Fatalf("%s: %d training batches, want one a step", p.Name, len(batches))
				}
				for i, b := range batches {
					got := perTask{}
					for _, s := range b.Samples {
						got[s.Group]++
					}
					if d := cmp.Diff(w.counts[p.Name], got); d != "" {
						t.Errorf("step %d %s samples per task (-want +got):\n%s", i+1, p.Name, d)
					}
				}
			}
		})
	}
}

// TestDistillationTerm: with a teacher that gives the student's tokens log-prob −0.2 where the
// student sampled them at −0.5, every token's advantage gains −opd_kl_coef·(−0.5 − (−0.2)) =
// 0.1·0.3 on top of the reward's GRPO advantage (0 here: a task's samples agree).
func TestDistillationTerm(t *testing.T) {
	cfg := loadConfig(t, "distillation")
	cfg.Rollout.BatchSize = 2
	student, teacher := scripted.Echo(`\boxed{5}`), scripted.Echo("unused")
	teacher.Logprob = -0.2
	run, err := host.Load(context.Background(), script("distillation"), host.Options{Config: cfg, Tasks: twoTasks,
		Engines: map[string]engines.Engine{"student": student, "teacher": teacher}})
	if err != nil {
		t.Fatal(err)
	}
	defer run.Close()
	for step := 0; step < 2; step++ {
		if _, err := run.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if len(teacher.Calls()) != 0 {
		t.Error("the teacher generated; it should only score")
	}
	for _, b := range student.Batches() {
		for _, s := range b.Samples {
			for _, a := range s.Advantages {
				if math.Abs(float64(a)-0.03) > 1e-6 {
					t.Fatalf("task %s: advantage %v, want 0.03 on every token", s.Group, a)
				}
			}
		}
	}
}

// TestPPOExample runs examples/ppo for two steps on scripted policies: the actor always answers
// 5 (right on task a, wrong on b) and the critic values every token at 0.25. With γ = λ = 1 GAE
// gives every token of a sample the advantage R − 0.25 and the return R; the critic trains on
// those returns against its old values 0.25 with value clipping 0.2.
func TestPPOExample(t *testing.T) {
	cfg := loadConfig(t, "ppo")
	cfg.Rollout.BatchSize = 2
	actor, critic := scripted.Echo(`\boxed{5}`), scripted.Echo("unused")
	critic.Value = 0.25
	run, err := host.Load(context.Background(), script("ppo"), host.Options{Config: cfg, Tasks: twoTasks,
		Engines: map[string]engines.Engine{"actor": actor, "critic": critic}})
	if err != nil {
		t.Fatal(err)
	}
	defer run.Close()
	reward := map[string]float32{"a": 1, "b": 0}
	for step := 1; step <= 2; step++ {
		res, err := run.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatal(res.Failed[0])
		}
		got := map[string]float64{}
		for _, m := range res.Policies {
			got[m.Policy()+" samples"] = m.Float("samples")
			if m.Policy() == "actor" {
				got["actor reward_mean"] = m.Float("reward_mean")
			}
		}
		want := map[string]float64{"actor samples": 8, "critic samples": 8, "actor reward_mean": 0.5}
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("step %d metrics (-want +got):\n%s", step, d)
		}
		if acc := res.Run.Float("accuracy"); acc != 0.5 {
			t.Errorf("step %d accuracy %v, want 0.5", step, acc)
		}
	}
	if len(critic.Calls()) != 0 {
		t.Error("the critic generated; the host should only value with it")
	}
	ab, cb := actor.Batches(), critic.Batches()
	if len(ab) != 2 || len(cb) != 2 {
		t.Fatalf("%d actor and %d critic batches, want one each a step", len(ab), len(cb))
	}
	for step := range 2 {
		for i, s := range ab[step].Samples {
			for _, a := range s.Advantages {
				if want := reward[s.Group] - 0.25; a != want {
					t.Fatalf("step %d actor sample %d (task %s): advantage %v, want %v", step+1, i, s.Group, a, want)
				}
			}
		}
		b := cb[step]
		if b.Loss.ValueClip != 0.2 || len(b.Samples) != 8 {
			t.Fatalf("step %d critic batch: value clip %v, %d samples", step+1, b.Loss.ValueClip, len(b.Samples))
		}
		for i, s := range b.Samples {
			if scripted.Decode(s.Response) != `\boxed{5}` || len(s.Returns) != len(s.Response) || len(s.OldValues) != len(s.Response) {
				t.Fatalf("step %d critic sample %d: %q, %d returns, %d old values", step+1, i, scripted.Decode(s.Response), len(s.Returns), len(s.OldValues))
			}
			for j := range s.Returns {
				if s.Returns[j] != reward[s.Group] || s.OldValues[j] != 0.25 || s.LossMask[j] != 1 {
					t.Fatalf("step %d critic sample %d (task %s) token %d: return %v, old value %v, mask %v; want %v, 0.25, 1",
						step+1, i, s.Group, j, s.Returns[j], s.OldValues[j], s.LossMask[j], reward[s.Group])
				}
			}
		}
	}
}

// TestSwarmEMAAcrossSteps runs an exam swarm with no warm-up for two steps. Agents always answer
// 5, so the swarm's pass rate g is 1 on task a and 0 on task b, self and peer terms are 0, and each
// sample's advantage is 0.3·z. Step 1 scores both tasks against the initial EMA (μ 0, σ² 1); step
// 2 against the EMA after folding in step 1's rates in task order (a, then b).
func TestSwarmEMAAcrossSteps(t *testing.T) {
	cfg := config.Default([]string{"agent_0", "agent_1"})
	cfg.Rollout.BatchSize = 2
	engs := map[string]engines.Engine{"agent_0": scripted.Echo(`\boxed{5}`), "agent_1": scripted.Echo(`\boxed{5}`)}
	run, err := host.Load(context.Background(), "testdata/swarm_no_warmup.star", host.Options{Config: cfg, Engines: engs, Tasks: twoTasks})
	if err != nil {
		t.Fatal(err)
	}
	defer run.Close()
	for step := 0; step < 2; step++ {
		if _, err := run.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	// The EMA of slime-n's SwarmBaseline, written out independently of the script.
	mu, v := 0.0, 1.0
	z := func(g float64) float64 { return math.Max(-3, math.Min(3, (g-mu)/(math.Sqrt(v)+1e-6))) }
	step1 := map[string]float64{"a": 0.3 * z(1), "b": 0.3 * z(0)}
	for _, g := range []float64{1, 0} {
		mu = 0.95*mu + 0.05*g
		v = 0.95*v + 0.05*(g-mu)*(g-mu)
	}
	step2 := map[string]float64{"a": 0.3 * z(1), "b": 0.3 * z(0)}
	for _, e := range engs {
		bs := e.(*scripted.Engine).Batches()
		if len(bs) != 2 {
			t.Fatalf("%d batches, want 2", len(bs))
		}
		for i, want := range []map[string]float64{step1, step2} {
			got := map[string]float64{}
			for _, s := range bs[i].Samples {
				got[s.Group] = float64(s.Advantages[0])
			}
			if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-6)); d != "" {
				t.Errorf("step %d advantages per task (-want +got):\n%s", i+1, d)
			}
		}
	}
	if step1["a"] == step2["a"] {
		t.Error("the EMA did not move between steps")
	}
}
