package host

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// stepOK runs one step and fails the test on an error or a failed rollout; a step still running
// after a minute fails it (see deadline).
func stepOK(t *testing.T, r *Run) *StepResult {
	t.Helper()
	res, err := r.Step(deadline(t, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Failed {
		t.Errorf("rollout failed: %v", f)
	}
	return res
}

// failures maps each failed rollout's task id to its message.
func failures(res *StepResult) map[string]string {
	out := map[string]string{}
	for _, f := range res.Failed {
		out[f.TaskID] = f.Msg
	}
	return out
}

func starlarkFloats(t *testing.T, v starlark.Value) []float32 {
	t.Helper()
	var out []float32
	it := starlark.Iterate(v)
	if it == nil {
		t.Fatalf("%v is not iterable", v)
	}
	defer it.Done()
	var x starlark.Value
	for it.Next(&x) {
		f, ok := starlark.AsFloat(x)
		if !ok {
			t.Fatalf("%v holds %v, not a number", v, x)
		}
		out = append(out, float32(f))
	}
	return out
}

func starlarkInts(t *testing.T, v starlark.Value) []int32 {
	t.Helper()
	var out []int32
	for _, f := range starlarkFloats(t, v) {
		out = append(out, int32(f))
	}
	return out
}

// TestScoreUnderAnotherPolicy: score(policy, prompt, completion) returns the log-probs of the
// completion's tokens under that policy's engine — exactly what the engine's Score gives for the
// same messages and tokens — for a string prompt and for a message list. The completion comes from
// builtin:tiny-arith; the judge is a tiny model with other (random) weights, so scoring under the
// wrong policy, or the wrong tokens or prompt, gives other numbers.
func TestScoreUnderAnotherPolicy(t *testing.T) {
	gen, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer gen.Close()
	judge, err := tiny.New(tiny.DefaultConfig(), 7, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer judge.Close()
	r := loadRun(t, `
def rollout(task):
    c = generate("gen", task.prompt, max_tokens = 8)
    chat = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": task.prompt}]
    out = {
        "tokens": c.tokens,
        "logprobs": c.logprobs,
        "judge": score("judge", task.prompt, c),
        "judge_chat": score("judge", chat, c),
        "own": score("gen", task.prompt, c),
    }
    state.update("score", lambda _: out, None)
`, testConfig(1, "gen", "judge"), map[string]engines.Engine{"gen": gen, "judge": judge},
		listTasks{{ID: "s", Prompt: "Ann has 3 pens and gets 4 more. How many pens?"}})
	stepOK(t, r)
	v, ok := r.State().Get("score")
	if !ok {
		t.Fatal("the rollout stored nothing")
	}
	d := v.(*starlark.Dict)
	get := func(k string) starlark.Value {
		x, _, _ := d.Get(starlark.String(k))
		return x
	}
	tokens := starlarkInts(t, get("tokens"))
	if len(tokens) == 0 {
		t.Fatal("empty completion")
	}
	prompt := "Ann has 3 pens and gets 4 more. How many pens?"
	ask := func(e engines.Engine, msgs []engines.Message) []float32 {
		out, err := e.Score(context.Background(), []engines.ScoreRequest{{Messages: msgs, Tokens: tokens}})
		if err != nil {
			t.Fatal(err)
		}
		return out[0].Logprobs
	}
	user := []engines.Message{{Role: "user", Content: prompt}}
	chat := []engines.Message{{Role: "system", Content: "Be exact."}, {Role: "user", Content: prompt}}
	wantJudge, wantChat := ask(judge, user), ask(judge, chat)
	if d := cmp.Diff(wantJudge, starlarkFloats(t, get("judge"))); d != "" {
		t.Errorf("score(judge, prompt, c) differs from the judge engine's Score (-engine +score):\n%s", d)
	}
	if d := cmp.Diff(wantChat, starlarkFloats(t, get("judge_chat"))); d != "" {
		t.Errorf("score(judge, messages, c) differs from the judge engine's Score (-engine +score):\n%s", d)
	}
	if d := cmp.Diff(ask(gen, user), starlarkFloats(t, get("own"))); d != "" {
		t.Errorf("score(gen, prompt, c) differs from the generator engine's Score (-engine +score):\n%s", d)
	}
	// The generator's own scores are its sampling log-probs; the judge's are not.
	own, sampled := starlarkFloats(t, get("own")), starlarkFloats(t, get("logprobs"))
	far := 0.0
	for i := range sampled {
		if math.Abs(float64(own[i]-sampled[i])) > 1e-4 {
			t.Errorf("token %d: score under the generator %v, sampling log-prob %v", i, own[i], sampled[i])
		}
		far = math.Max(far, math.Abs(float64(wantJudge[i]-sampled[i])))
	}
	if far < 1e-3 || cmp.Equal(wantJudge, wantChat) {
		t.Error("the judge scores like the generator, or ignores the prompt: the test cannot tell policies apart")
	}
}

// TestConfigViewReadOnly: config shows the run's configuration (a policy's train settings flat on
// the policy, as slime-n names them) and refuses every assignment.
func TestConfigViewReadOnly(t *testing.T) {
	cfg := testConfig(4, "p")
	cfg.Policies[0].Train.LR = 0.0125
	cfg.Policies[0].Train.NSamplesPerPrompt = 3
	cfg.Rollout.Temperature = 0.75
	cfg.Run.Seed = 42
	cfg.Rollout.MaxFailedFraction = 1
	r := loadRun(t, `
def rollout(task):
    if task.id == "t0":
        p = config.policies["p"]
        log(lr = p.lr, n = p.n_samples_per_prompt, temp = config.rollout.temperature, seed = config.run.seed,
            named = 1 if "p" in config.policies and p.name == "p" else 0)
    elif task.id == "t1":
        config.policies["p"].lr = 1.0
    elif task.id == "t2":
        config.policies["q"] = config.policies["p"]
    else:
        config.rollout = None
`, cfg, map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(4))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]float64{"lr": 0.0125, "n": 3, "temp": 0.75, "seed": 42, "named": 1} {
		// (n_samples_per_prompt 3 runs t0 three times: log averages three equal values.)
		if got := res.Run.Float(k); math.Abs(got-want) > 1e-12*want {
			t.Errorf("config view: %s = %v, want %v", k, got, want)
		}
	}
	fails := failures(res)
	if msg, failed := fails["t0"]; failed {
		t.Errorf("reading config failed: %s", msg)
	}
	for task, want := range map[string][]string{
		"t1": {"script.star:8:", "can't assign to .lr field"},       // a policy's fields
		"t2": {"script.star:10:", "frozen"},                         // the policies dict
		"t3": {"script.star:12:", "can't assign to .rollout field"}, // the config's own attributes
	} {
		msg := fails[task]
		for _, w := range want {
			if !strings.Contains(msg, w) {
				t.Errorf("task %s: an assignment to config did not fail with %q: %q", task, w, msg)
			}
		}
	}
	if cfg.Policies[0].Train.LR != 0.0125 || r.Config().Policies[0].Train.LR != 0.0125 || len(r.Config().Policies) != 1 {
		t.Errorf("the script changed the run's config: %+v", r.Config().Policies)
	}
}

// TestPrintToEventsLog: print goes to events.log as "step N task ID: …", at most 20 lines a
// rollout (prints of parallel threads count towards their rollout's cap) and one line saying the
// rest was dropped; the cap starts again with every rollout.
func TestPrintToEventsLog(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    if task.id == "t0":
        for i in range(25):
            print("line", i, "of", task.id)
    else:
        parallel(lambda i: print("thread", i), range(25))
`), Options{Config: testConfig(2, "p"), Out: out, Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	stepOK(t, r)
	stepOK(t, r)
	b, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	count := func(re string) int { return len(regexp.MustCompile(`(?m)^\S+ `+re+`$`).FindAllString(string(b), -1)) }
	for step := 1; step <= 2; step++ {
		for i := 0; i < 20; i++ {
			if n := count(fmt.Sprintf(`step %d task t0: line %d of t0`, step, i)); n != 1 {
				t.Errorf("step %d: print line %d of t0 appears %d times in events.log", step, i, n)
			}
		}
		if n := count(fmt.Sprintf(`step %d task t0: line 2\d of t0`, step)); n != 0 {
			t.Errorf("step %d: %d lines past the cap of 20 reached events.log", step, n)
		}
		if n := count(fmt.Sprintf(`step %d task t1: thread \d+`, step)); n != 20 {
			t.Errorf("step %d: %d print lines of t1's parallel threads, want the cap of 20", step, n)
		}
		for _, task := range []string{"t0", "t1"} {
			if n := count(fmt.Sprintf(`step %d task %s: more print output dropped \(limit 20 lines a rollout\)`, step, task)); n != 1 {
				t.Errorf("step %d task %s: %d 'dropped' notes, want 1\n%s", step, task, n, b)
			}
		}
	}
}

// TestRewardReplace: a second reward on a completion is an error that names replace=True; with
// replace=True the new value is the one trained on.
func TestRewardReplace(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Rollout.MaxFailedFraction = 1
	eng := scripted.Echo("x")
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    if task.id == "t0":
        reward(c, 0.25, replace = True)
        if c.reward != 0.25:
            fail("reward after replace: %s" % c.reward)
        reward([c], -2, replace = True)
    else:
        reward(c, 0.5)
    train(c)
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(2))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	fails := failures(res)
	if msg := fails["t0"]; msg != "" {
		t.Fatalf("reward(replace=True) failed: %s", msg)
	}
	if msg := fails["t1"]; !strings.Contains(msg, "already has reward 1") || !strings.Contains(msg, "replace=True") || !strings.Contains(msg, "script.star:11:") {
		t.Errorf("a second reward without replace=True: %q", msg)
	}
	if got := res.Policies[0].Float("reward_mean"); got != -2 {
		t.Errorf("reward_mean %v, want -2 (the replaced reward of t0 only)", got)
	}
	b := eng.Batches()
	if len(b) != 1 || len(b[0].Samples) != 1 {
		t.Fatalf("trained %d batches, want 1 with t0's sample only", len(b))
	}
}

// TestStateGet: state.get returns the stored value or the default (None without one), sees values
// from earlier steps and from the Go side, and hands out frozen values.
func TestStateGet(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Rollout.MaxFailedFraction = 1
	r := loadRun(t, `
def rollout(task):
    if task.id == "t0":
        log(preset = state.get("preset", 0), missing = state.get("nope", 3),
            none = 1 if state.get("nope") == None else 0, count = state.get("count", -1),
            first = state.get(key = "list", default = [])[0])
        state.update("count", lambda n: n + 1, 0)
    else:
        state.get("list").append(3)
`, cfg, map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(2))
	if err := r.State().Set("preset", starlark.MakeInt(41)); err != nil {
		t.Fatal(err)
	}
	if err := r.State().Set("list", starlark.NewList([]starlark.Value{starlark.MakeInt(7)})); err != nil {
		t.Fatal(err)
	}
	for step, count := range []float64{-1, 1, 2} {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for k, want := range map[string]float64{"preset": 41, "missing": 3, "none": 1, "count": count, "first": 7} {
			if got := res.Run.Float(k); got != want {
				t.Errorf("step %d: %s = %v, want %v", step+1, k, got, want)
			}
		}
		if msg := failures(res)["t1"]; !strings.Contains(msg, "frozen") {
			t.Errorf("step %d: appending to a list from state.get: %q, want a frozen-value error", step+1, msg)
		}
	}
	if v, _ := r.State().Get("list"); v.String() != "[7]" {
		t.Errorf("state list = %v", v)
	}
	if _, err := Load(context.Background(), writeScript(t, "x = state.get(\"a\", 1)\ndef rollout(task):\n    pass\n"),
		Options{Config: testConfig(1, "p"), Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(1)}); err == nil ||
		!strings.Contains(err.Error(), "top level") {
		t.Errorf("state.get at the top level: %v", err)
	}
}

// TestStateUpdateRefusesWaitingCalls: a state.update function runs holding the store's lock, so
// state.get there (the same lock: the run used to hang), generate, score and parallel fail the
// rollout with a clear error naming the line; the lock is released and other rollouts go on.
func TestStateUpdateRefusesWaitingCalls(t *testing.T) {
	cfg := testConfig(5, "p")
	cfg.Rollout.MaxFailedFraction = 1
	r := loadRun(t, `
def rollout(task):
    if task.id == "t0":
        state.update("a", lambda v: state.get("b", 0) + 1, 0)
    elif task.id == "t1":
        state.update("a", lambda v: generate("p", "hi").text, 0)
    elif task.id == "t2":
        state.update("a", lambda v: score("p", "hi", "x"), 0)
    elif task.id == "t3":
        state.update("a", lambda v: parallel(lambda i: i, [1, 2]), 0)
    else:
        state.update("count", lambda n: n + 1, 0)
`, cfg, map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(5))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	f := failures(res)
	for id, fn := range map[string]string{"t0": "state.get", "t1": "generate", "t2": "score", "t3": "parallel"} {
		if msg := f[id]; !strings.Contains(msg, fn+": called inside a state.update function") || !strings.Contains(msg, ".star:") {
			t.Errorf("%s: %q, want %s refused inside state.update with the script's line", id, msg, fn)
		}
	}
	if v, _ := r.State().Get("count"); v == nil || v.String() != "1" {
		t.Errorf("count = %v, want 1: the other rollout's update went through", v)
	}
}

// TestMessageListPrompt: a prompt given as a message list — built by the script, or a JSONL task's
// prompt — reaches the engine as those messages, not rendered into one string.
func TestMessageListPrompt(t *testing.T) {
	data := filepath.Join(t.TempDir(), "chat.jsonl")
	line := `{"id": "c1", "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Sure?"}], "label": "4"}`
	if err := os.WriteFile(data, []byte(line+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(1, "p")
	cfg.Data.Path = data
	eng := scripted.Echo("ok")
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    a = generate("p", task.prompt)
    b = generate("p", [{"role": "system", "content": "Judge."}, {"role": "user", "content": "Is " + task.label + " right?"}])
    c = generate("p", "plain")
`), Options{Config: cfg, Engines: map[string]engines.Engine{"p": eng}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	stepOK(t, r)
	got := map[string][]engines.Message{}
	for _, call := range eng.Calls() {
		for _, req := range call {
			if len(req.PromptTokens) > 0 {
				t.Errorf("request %s carried prompt tokens, not messages", req.ID)
			}
			got[rolloutID(req.ID)] = req.Messages
		}
	}
	want := map[string][]engines.Message{
		"c1/0": {{Role: "system", Content: "S"}, {Role: "user", Content: "2+2?"}, {Role: "assistant", Content: "5"}, {Role: "user", Content: "Sure?"}},
		"c1/1": {{Role: "system", Content: "Judge."}, {Role: "user", Content: "Is 4 right?"}},
		"c1/2": {{Role: "user", Content: "plain"}},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("messages the engine received (-want +got):\n%s", d)
	}
}
