package host

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// rewardsOf returns the rewards a policy's engine trained on, batch by batch, read back from the
// advantages' signs is not enough, so the test engine's samples are matched to completions by
// text: each scripted response encodes its reward-relevant answer.
func trainedTexts(e *scripted.Engine) []string {
	var out []string
	for _, b := range e.Batches() {
		for _, s := range b.Samples {
			out = append(out, scripted.Decode(s.Response))
		}
	}
	return out
}

var ownAnswer = regexp.MustCompile(`Answers: ([^,]+),`)

// TestDebateExampleRewards runs examples/debate/debate.star on scripted policies: generators
// answer 5, 5, 7; each critic repeats its own previous answer. Every answer is rewarded by the
// label: on task a (5) agents 0 and 1 get reward 1 and agent 2 gets 0 in every round, on task b
// (7) the other way round. The example plays six debates a rollout (DEBATES = 6): 18 drafts and
// 36 critic answers a task.
func TestDebateExampleRewards(t *testing.T) {
	gen := scripted.New(func(r scripted.Request) string {
		return []string{`\boxed{5}`, `\boxed{5}`, `\boxed{7}`}[r.Index]
	})
	critic := scripted.New(func(r scripted.Request) string {
		m := ownAnswer.FindStringSubmatch(r.Messages[0].Content)
		return `\boxed{` + m[1] + `}`
	})
	cfg := testConfig(2, "generator", "critic")
	tasks := listTasks{{ID: "a", Prompt: "2+3?", Label: "5", HasLabel: true}, {ID: "b", Prompt: "3+4?", Label: "7", HasLabel: true}}
	r, err := Load(context.Background(), "../examples/debate/debate.star", Options{Config: cfg, Tasks: tasks,
		Engines: map[string]engines.Engine{"generator": gen, "critic": critic}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for step := 1; step <= 2; step++ {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatal(res.Failed[0])
		}
		byPolicy := map[string]Metrics{}
		for _, m := range res.Policies {
			byPolicy[m.Policy()] = m
		}
		if g := byPolicy["generator"]; g.Float("samples") != 36 || math.Abs(g.Float("reward_mean")-0.5) > 1e-9 {
			t.Errorf("step %d generator: %v", step, g)
		}
		if c := byPolicy["critic"]; c.Float("samples") != 72 || math.Abs(c.Float("reward_mean")-0.5) > 1e-9 {
			t.Errorf("step %d critic: %v", step, c)
		}
		// Task a's majority (5) matches its label, task b's does not (label 7).
		if res.Run.Float("accuracy") != 0.5 || math.Abs(res.Run.Float("generator_accuracy")-0.5) > 1e-9 {
			t.Errorf("step %d accuracy: %v", step, res.Run)
		}
	}
	// The critic of agent i sees its own answer first, then the others': in each of the six
	// debates and both rounds, two critics see "5, 5, 7" and one "7, 5, 5".
	// (Step 1's calls of task a may reach the engine in one batch or several, under load.)
	prompts := map[string]int{}
	n := 0
	for _, batch := range critic.Calls() {
		for _, req := range batch {
			if strings.HasPrefix(rolloutID(req.ID), "a/") && n < 36 { // task a's 36 critics of step 1
				prompts[req.Messages[0].Content]++
				n++
			}
		}
	}
	want := map[string]int{"2+3? Answers: 5, 5, 7.": 24, "2+3? Answers: 7, 5, 5.": 12}
	if d := cmp.Diff(want, prompts); d != "" {
		t.Errorf("step 1's critic prompts of task a (-want +got):\n%s", d)
	}
	// Per task: 18 generator samples, rewards 1, 1, 0 per debate on a → GRPO advantages +, +, −; b the reverse.
	b := gen.Batches()[0]
	for i, s := range b.Samples {
		if (i%3 == 2) != (s.Advantages[0] < 0) != (s.Group == "b") {
			t.Errorf("generator sample %d (%q): advantage %v", i, scripted.Decode(s.Response), s.Advantages[0])
		}
	}
	if got := strings.Join(trainedTexts(critic)[:6], " "); got != `\boxed{5} \boxed{5} \boxed{7} \boxed{5} \boxed{5} \boxed{7}` {
		t.Errorf("critic samples of task a, in order: %s", got)
	}
}

// TestSameSeedSameMetrics runs a topology whose scripted answers depend on the sampling seed, and
// whose rollouts fan out with parallel(): two runs with the same seed must write the same
// metrics, a third with another seed must not.
func TestSameSeedSameMetrics(t *testing.T) {
	run := func(seed uint64) string {
		seeded := func(r scripted.Request) string { return fmt.Sprintf(`\boxed{%d}`, (r.Seed>>7)%3) }
		cfg := testConfig(8, "generator", "critic")
		cfg.Run.Seed = seed
		tasks := numberedTasks(8)
		r, err := Load(context.Background(), "../examples/debate/debate.star", Options{Config: cfg, Tasks: tasks,
			Engines: map[string]engines.Engine{"generator": scripted.New(seeded), "critic": scripted.New(seeded)}})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		var lines []string
		for i := 0; i < 3; i++ {
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range append(res.Policies, res.Run) {
				for _, k := range TimingFields {
					delete(m, k)
				}
				b, _ := json.Marshal(m)
				lines = append(lines, string(b))
			}
		}
		return strings.Join(lines, "\n")
	}
	a, b, c := run(1), run(1), run(2)
	if a != b {
		t.Errorf("same seed, different metrics:\n%s\n---\n%s", a, b)
	}
	if a == c {
		t.Error("different seeds gave identical metrics: seeds do not reach the engine")
	}
}

// TestPPOExampleOnTinyEngine runs examples/ppo with its own config on the embedded engine for two
// small steps: the actor trains on GAE advantages and the critic, the tiny engine's value head,
// trains on the returns — end to end, no scripted engine.
func TestPPOExampleOnTinyEngine(t *testing.T) {
	cfg, err := config.Load("../examples/ppo/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Rollout.BatchSize = 2
	r, err := Load(context.Background(), "../examples/ppo/ppo.star", Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	critic, ok := r.pols.byName["critic"].eng.(*tiny.Engine)
	if !ok {
		t.Fatalf("the critic's engine is a %T, want the tiny engine", r.pols.byName["critic"].eng)
	}
	probe := []engines.ScoreRequest{{Messages: []engines.Message{{Role: "user", Content: "Ann has 2 pens and gets 3 more. How many pens?"}}, Tokens: []int32{10, 11, 12}}}
	for step := 1; step <= 2; step++ {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatal(res.Failed[0])
		}
		byPolicy := map[string]Metrics{}
		for _, m := range res.Policies {
			byPolicy[m.Policy()] = m
		}
		a, c := byPolicy["actor"], byPolicy["critic"]
		if a.Float("samples") != 8 || a.Float("optimizer_steps") != 1 || !(a.Float("grad_norm") > 0) || math.IsNaN(a.Float("loss")) {
			t.Errorf("step %d actor: %v", step, a)
		}
		if c.Float("samples") != 8 || c.Float("optimizer_steps") != 1 || c.Float("trained_tokens") != a.Float("trained_tokens") || !(c.Float("grad_norm") > 0) {
			t.Errorf("step %d critic: %v", step, c)
		}
		// A fresh head values everything at 0, so at step 1 every token's advantage and return is
		// its sample's reward R ∈ {0, 1}: the critic's loss, the task-mean of each task's
		// token-mean of R², equals the actor's on-policy loss, the same mean of −1·R.
		if step == 1 && (c.Float("value_loss") <= 0 || math.Abs(c.Float("value_loss")+a.Float("pg_loss")) > 1e-6) {
			t.Errorf("step 1: critic value loss %v, actor pg loss %v; want opposite numbers", c.Float("value_loss"), a.Float("pg_loss"))
		}
		v, err := critic.Values(context.Background(), probe)
		if err != nil {
			t.Fatal(err)
		}
		if v[0][0] == 0 {
			t.Errorf("step %d: the critic still values everything at 0: its head did not train", step)
		}
	}
}

// TestAgentExamplesOnTinyEngine runs each agent example with its own config, zero set-up, on the
// embedded engine (builtin:tiny-chat or builtin:tiny-agent) for one step of one task, its eval
// left out: its conversations train the policy its config trains, and no rollout fails.
func TestAgentExamplesOnTinyEngine(t *testing.T) {
	trained := map[string]string{"calculator_agent": "agent", "agentflow": "planner", "memagent": "agent", "toolorchestra": "orchestrator"}
	for _, name := range []string{"calculator_agent", "agentflow", "memagent", "toolorchestra"} {
		t.Run(name, func(t *testing.T) {
			cfg, err := config.Load("../examples/" + name + "/config.yaml")
			if err != nil {
				t.Fatal(err)
			}
			cfg.Rollout.BatchSize = 1
			cfg.Eval.Datasets = nil
			r, err := Load(context.Background(), "../examples/"+name+"/"+name+".star", Options{Config: cfg})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Failed) > 0 {
				t.Fatal(res.Failed[0])
			}
			for _, m := range res.Policies {
				if m.Policy() == trained[name] && (m.Float("samples") < 4 || m.Float("optimizer_steps") != 1) {
					t.Errorf("%s: %v", m.Policy(), m)
				}
			}
			if _, ok := res.Run["accuracy"]; !ok {
				t.Errorf("no accuracy logged: %v", res.Run)
			}
		})
	}
}
