package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/tasks"
)

// A run folder read later says why its run ended (issue 35): the fatal errors of a run that
// started — every rollout failed, an engine failed, an eval file gone — and of one that did not
// start — its data or eval file missing — are lines of its events.log.
func TestFatalErrorsReachEventsLog(t *testing.T) {
	const good = "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n"
	load := func(t *testing.T, src string, eng engines.Engine, edit func(*config.Config)) (*Run, string, error) {
		out := filepath.Join(t.TempDir(), "run")
		cfg := testConfig(4, "p")
		if edit != nil {
			edit(cfg)
		}
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Out: out,
			Engines: map[string]engines.Engine{"p": eng}, Tasks: numberedTasks(4)})
		return r, out, err
	}
	events := func(t *testing.T, out string) string {
		b, err := os.ReadFile(filepath.Join(out, "events.log"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	for _, tc := range []struct {
		name string
		src  string
		eng  engines.Engine
		edit func(*config.Config)
		want string
	}{
		{"every rollout failed", "def rollout(task):\n    fail(\"boom\")\n", scripted.Echo("x"), nil,
			"stop: step 1: 4 of 4 rollouts failed"},
		{"an engine failed", good, brokenEngine{scripted.Echo("x")}, nil,
			`stop: step 1: the engine of policy "p" failed: engine at 127.0.0.1:1 unavailable`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, out, err := load(t, tc.src, tc.eng, tc.edit)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			if err := r.Train(context.Background()); err == nil {
				t.Fatal("Train: no error")
			}
			if e := events(t, out); !strings.Contains(e, tc.want) {
				t.Errorf("events.log:\n%s\nwant a line with %q", e, tc.want)
			}
		})
	}
	// An eval file that does not exist is found at start-up, before any step, and is bad input.
	t.Run("a missing eval file", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), "eval.jsonl")
		_, out, err := load(t, good, scripted.Echo("x"), func(c *config.Config) {
			c.Eval.Datasets = []config.EvalDataset{{Name: "held", Path: missing, InputKey: "prompt", LabelKey: "label", NSamples: 1}}
			c.Run.EvalInterval = 1
		})
		var se *tasks.SourceError
		if !errors.As(err, &se) || !strings.Contains(err.Error(), `eval dataset "held": data: `+missing+" does not exist") {
			t.Fatalf("Load = %v; want the missing eval file as a SourceError", err)
		}
		if e := events(t, out); !strings.Contains(e, `stop: the run does not start: eval dataset "held": data: `+missing+" does not exist") {
			t.Errorf("events.log:\n%s\nwant why the run did not start", e)
		}
	})
	t.Run("a missing data file", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), "train.jsonl")
		out := filepath.Join(t.TempDir(), "run")
		cfg := testConfig(4, "p")
		cfg.Data.Path = missing
		_, err := Load(context.Background(), writeScript(t, good), Options{Config: cfg, Out: out,
			Engines: map[string]engines.Engine{"p": scripted.Echo("x")}})
		if err == nil {
			t.Fatal("Load: no error")
		}
		if e := events(t, out); !strings.Contains(e, "stop: the run does not start: data: "+missing+" does not exist") {
			t.Errorf("events.log:\n%s\nwant why the run did not start", e)
		}
	})
}

// No reward is no number (issue 35): a policy that generated nothing in a step, and a frozen one
// whose completions nobody rewarded, have no reward_mean or reward_std in metrics.jsonl, where a
// 0 would draw their curves down to 0; a rewarded policy's 0 stays 0.
func TestNoRewardIsAbsentNotZero(t *testing.T) {
	cfg := testConfig(2, "p", "judge", "idle")
	cfg.Policies[1].Trainable = false
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    c = generate("p", task.prompt)
    generate("judge", c.text)
    if False:
        generate("idle", task.prompt)
    reward(c, 0.0)
    train(c)
`), Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x"), "judge": scripted.Echo("y"), "idle": scripted.Echo("z")}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range res.Policies {
		_, has := m["reward_mean"]
		_, hasStd := m["reward_std"]
		if want := m.Policy() == "p"; has != want || hasStd != want {
			t.Errorf("policy %s: reward_mean %v, reward_std %v; want them only for p, which was rewarded", m.Policy(), m["reward_mean"], m["reward_std"])
		}
		if m.Policy() == "p" && m.Float("reward_mean") != 0 {
			t.Errorf("p: reward_mean %v, want 0", m["reward_mean"])
		}
	}
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if (strings.Contains(line, `"policy":"judge"`) || strings.Contains(line, `"policy":"idle"`)) && strings.Contains(line, "reward_") {
			t.Errorf("metrics.jsonl writes a reward for a policy that had none:\n%s", line)
		}
	}
}

// A script that never calls train runs with good rewards and trains nothing: the run says so
// once, at the first such step, on its log and in events.log (issue 35).
func TestNothingTrainedIsWarnedOnce(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	var log strings.Builder
	r, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    reward(generate(\"p\", task.prompt), 1.0)\n"),
		Options{Config: testConfig(2, "p"), Out: out, Log: &log, Tasks: numberedTasks(4), Engines: map[string]engines.Engine{"p": scripted.Echo("x")}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for range 2 {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	want := "warning: step 1 trained nothing: none of its 2 successful rollouts called train(), so no policy learns (rewards alone do not train); queue what you reward with train(c)"
	if n := strings.Count(log.String(), "trained nothing"); n != 1 || !strings.Contains(log.String(), want) {
		t.Errorf("the run's log says %d times that nothing trained:\n%s\nwant once: %q", n, log.String(), want)
	}
	if e, _ := os.ReadFile(filepath.Join(out, "events.log")); !strings.Contains(string(e), want) {
		t.Errorf("events.log:\n%s\nwant %q", e, want)
	}
}

// An eval that graded nothing says so, not "eval NAME at step 0: " and nothing (issue 35).
func TestEvalLineOfNothing(t *testing.T) {
	if got := summarize(newMetrics(0, "_eval"), nil); got != "nothing to grade (no policy yet, or every result empty)" {
		t.Errorf("summarize of no numbers = %q", got)
	}
}
