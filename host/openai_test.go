package host

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// A frozen judge of engine kind openai, here the OpenAI front of a scripted engine, answers a
// trainable solver's rollouts through a run; a judge the server does not serve stops the run at
// start-up, naming the policy.
func TestOpenAIJudge(t *testing.T) {
	judge := scripted.New(func(r scripted.Request) string {
		if strings.Contains(r.Prompt, "judge:") {
			return "yes"
		}
		return "no"
	})
	h, err := openai.NewHandler(context.Background(), judge, openai.HandlerOptions{Model: "judge-model", Token: "sk-j"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	t.Setenv("JUDGE_KEY", "sk-j")
	yaml := func(model string) string {
		return fmt.Sprintf("policies:\n  - {name: solver, engine: {kind: tiny, threads: 1}}\n"+
			"  - {name: judge, trainable: false, engine: {kind: openai, base_url: %s/v1, model: %s, api_key_env: JUDGE_KEY}}\n"+
			"rollout: {batch_size: 2, max_response_len: 4}\n", srv.URL, model)
	}
	script := writeScript(t, `def rollout(task):
    c = generate("solver", task.prompt)
    v = generate("judge", "judge: " + c.text)
    reward(c, 1.0 if v.text == "yes" else 0.0)
    train(c)
`)
	cfg, err := config.Parse([]byte(yaml("judge-model")), "openai.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(2), Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	st, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var mean float64
	for _, m := range st.Policies {
		if m.Policy() == "solver" {
			mean = m.Float("reward_mean")
		}
	}
	if mean != 1 {
		t.Fatalf("solver's mean reward %v; want 1 (every judge call said yes)\n%s", mean, log.String())
	}
	if n := len(judge.Calls()); n == 0 {
		t.Fatal("the judge's engine was never called")
	}

	cfg, err = config.Parse([]byte(yaml("other")), "openai.yaml")
	if err != nil {
		t.Fatal(err)
	}
	_, err = Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(2)})
	if err == nil || !strings.Contains(err.Error(), `policy "judge"`) || !strings.Contains(err.Error(), `does not serve model "other"; its /v1/models lists: judge-model`) {
		t.Fatalf("a model the server does not serve: %v", err)
	}
}

// A script that scores with an openai-kind policy (score, or train's teacher) is refused when the
// run loads, naming the script's line and the policy's config line, not at its first score call.
func TestOpenAIScoreRefusedAtStartup(t *testing.T) {
	h, err := openai.NewHandler(context.Background(), scripted.Echo("x"), openai.HandlerOptions{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	cfg, err := config.Parse([]byte(fmt.Sprintf("policies:\n  - {name: solver, engine: {kind: tiny, threads: 1}}\n"+
		"  - {name: judge, trainable: false, engine: {kind: openai, base_url: %s/v1, model: m}}\n", srv.URL)), "openai.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ src, want string }{
		{"def rollout(task):\n    c = generate(\"solver\", task.prompt)\n    lp = score(\"judge\", c)\n",
			`script.star:3:16: score("judge", …) scores with policy "judge", whose engine (kind openai, openai.yaml:3) only generates`},
		{"def rollout(task):\n    c = generate(\"solver\", task.prompt)\n    train(c, teacher = \"judge\")\n",
			`script.star:3:24: train(…, teacher="judge") scores with policy "judge"`},
	} {
		_, err := Load(context.Background(), writeScript(t, tc.src), Options{Config: cfg, Tasks: numberedTasks(1)})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("got %v, want it to say %s", err, tc.want)
		}
	}
}
