package host

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// oneSample is the simplest single-agent script: one generate, reward and train a task.
const oneSample = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0 if c.text == "1" else 0.0)
    train(c)
`

// bySeed answers "1" or "0" by the request's seed, so the samples of a task differ.
func bySeed(r scripted.Request) string { return []string{"0", "1"}[r.Seed%2] }

// TestSingleSampleGroupsWarn: under grpo, groups of one sample train nothing; the run says so
// once, naming the policy and the ways out.
func TestSingleSampleGroupsWarn(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(deadline(t, time.Minute), writeScript(t, oneSample), Options{Config: testConfig(4, "p"), Out: out,
		Engines: map[string]engines.Engine{"p": scripted.New(bySeed)}, Tasks: numberedTasks(4)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	stepOK(t, r)
	stepOK(t, r)
	b, _ := os.ReadFile(filepath.Join(out, "events.log"))
	want := `warning: policy "p": every grpo group of step 1 holds one sample, so every advantage is 0`
	if n := strings.Count(string(b), "every grpo group of step"); n != 1 || !strings.Contains(string(b), want) {
		t.Fatalf("events.log has %d warnings, want one containing %q:\n%s", n, want, b)
	}
	for _, hint := range []string{"n=4", "n_samples_per_prompt: 4", "reinforce_plus_plus"} {
		if !strings.Contains(string(b), hint) {
			t.Errorf("the warning does not mention %q", hint)
		}
	}
}

// TestSamplesPerPrompt: n_samples_per_prompt runs each task that many times a step, and the runs
// of a task form its group, so the same script now learns (advantages ±1, no warning).
func TestSamplesPerPrompt(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Policies[0].Train.NSamplesPerPrompt = 4
	out := filepath.Join(t.TempDir(), "run")
	eng := scripted.New(bySeed)
	r, err := Load(deadline(t, time.Minute), writeScript(t, oneSample), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": eng}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res := stepOK(t, r)
	if res.Run.Float("rollouts") != 8 {
		t.Errorf("%v rollouts, want 2 tasks × 4", res.Run["rollouts"])
	}
	batches := eng.Batches()
	if len(batches) == 0 {
		t.Fatal("nothing trained")
	}
	var samples []engines.Sample
	for _, b := range batches {
		samples = append(samples, b.Samples...)
	}
	nonzero := 0
	for _, s := range samples {
		if s.Advantages[0] != 0 {
			nonzero++
		}
	}
	if len(samples) != 8 || nonzero == 0 {
		t.Fatalf("%d samples trained, %d with a nonzero advantage; want 8, some nonzero (groups of 4)", len(samples), nonzero)
	}
	b, _ := os.ReadFile(filepath.Join(out, "events.log"))
	if strings.Contains(string(b), "holds one sample") {
		t.Errorf("warned about groups of one with n_samples_per_prompt 4:\n%s", b)
	}
}

// TestZeroConfigPoliciesAtStart: a zero-config run starts the policies its script names before
// the first step, lists them in config.yaml, and warns about names a typo apart.
func TestZeroConfigPoliciesAtStart(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	src := `
def rollout(task):
    a = generate("solver", task.prompt)
    b = generate("sovler", a.text)
    reward([a, b], 1.0)
    train([a, b])
`
	r, err := Load(deadline(t, time.Minute), writeScript(t, src), Options{Out: out, Tasks: numberedTasks(2),
		OpenEngine: func(context.Context, config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	y, _ := os.ReadFile(filepath.Join(out, "config.yaml"))
	if !strings.Contains(string(y), "name: solver") || !strings.Contains(string(y), "name: sovler") {
		t.Errorf("config.yaml before the first step lists no policies:\n%s", y)
	}
	b, _ := os.ReadFile(filepath.Join(out, "events.log"))
	if !strings.Contains(string(b), `generate("solver") and `) || !strings.Contains(string(b), `generate("sovler") name two policies that differ by a letter or two`) {
		t.Errorf("no typo warning at start-up:\n%s", b)
	}
}
