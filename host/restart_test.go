package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// restarting is a scripted engine that plays a remote engine restarting: at a chosen call its
// client "meets the new process" and runs the run's OnRestart (engineRestarted) before going on,
// as engines/remote does. It records what reaches it.
type restarting struct {
	*scripted.Engine
	r      *Run
	policy string
	// at is the call that meets the new process: "train N" (the Nth Train, from 1) or "generate
	// after N" (the first Generate call after N Trains).
	at string

	mu       sync.Mutex
	trains   int
	met      bool // the new process was met
	log      []string
	restartE error // what OnRestart returned
}

func (e *restarting) note(s string) {
	e.mu.Lock()
	e.log = append(e.log, s)
	e.mu.Unlock()
}

func (e *restarting) restartIf(call string) error {
	e.mu.Lock()
	meet := call == e.at && !e.met
	e.met = e.met || meet
	e.mu.Unlock()
	if !meet {
		return nil
	}
	e.note("restart")
	err := e.r.engineRestarted(context.Background(), restartEvent{policy: e.policy, trainable: true,
		engine: "its engine at test:1", prev: "old", cur: "new", eng: e})
	e.mu.Lock()
	e.restartE = err
	e.mu.Unlock()
	return err
}

func (e *restarting) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	e.mu.Lock()
	n := e.trains
	e.mu.Unlock()
	if err := e.restartIf(fmt.Sprintf("generate after %d", n)); err != nil {
		return nil, err
	}
	return e.Engine.Generate(ctx, reqs)
}

func (e *restarting) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	e.mu.Lock()
	e.trains++
	n := e.trains
	e.mu.Unlock()
	if err := e.restartIf(fmt.Sprintf("train %d", n)); err != nil {
		return engines.TrainStats{}, err
	}
	e.note("train " + b.ID[strings.Index(b.ID, "/")+1:])
	return e.Engine.Train(ctx, b)
}

func (e *restarting) Load(ctx context.Context, dir string) error {
	e.note("load " + dir)
	return e.Engine.Load(ctx, dir)
}

func (e *restarting) events() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.log...)
}

const restartScript = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0 if task.id == "t0" else 0.0)
    train(c)
`

// restartRun loads a one-policy run with a run directory on the restarting engine.
func restartRun(t *testing.T, saveInterval int, at string) (*Run, *restarting, string) {
	t.Helper()
	cfg := testConfig(2, "p")
	cfg.Run.SaveInterval = saveInterval
	cfg.Policies[0].Train.GlobalBatchSize = 1 // two optimizer steps a step
	out := filepath.Join(t.TempDir(), "run")
	eng := &restarting{Engine: scripted.Echo("x"), policy: "p", at: at}
	r, err := Load(context.Background(), writeScript(t, restartScript), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": eng}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	eng.r = r
	return r, eng, out
}

func readEvents(t *testing.T, out string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// An engine that restarts in the middle of a step's training, after one of its two optimizer
// steps: the host loads the checkpoint of the step before and replays that optimizer step before
// the second one goes on, so the engine ends the step as if nothing had happened.
func TestRestartedEngineGetsCheckpointAndReplay(t *testing.T) {
	r, eng, out := restartRun(t, 1, "train 4")
	stepsWithoutFailures(t, r, 3)
	step1 := filepath.Join(out, "checkpoints", "step_1", "p")
	if abs, err := filepath.Abs(step1); err == nil {
		step1 = abs
	}
	want := []string{
		"train p/step1/0", "train p/step1/1",
		"train p/step2/0", "restart", "load " + step1, "train p/step2/0", "train p/step2/1",
		"train p/step3/0", "train p/step3/1",
	}
	if got := eng.events(); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("the engine got:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	if ev := readEvents(t, out); !strings.Contains(ev, `policy "p": its engine at test:1 restarted as a new process (instance old → new): loaded `+step1+" (step 1) into it and replayed the 1 optimizer steps applied since") {
		t.Errorf("events.log does not tell of the restart and the reload:\n%s", ev)
	}
}

// A restart during the rollouts of the first step needs no checkpoint: nothing was trained yet.
func TestRestartBeforeAnyTrainingNeedsNoCheckpoint(t *testing.T) {
	r, eng, out := restartRun(t, 0, "generate after 0")
	stepsWithoutFailures(t, r, 1)
	if got := eng.events(); len(got) == 0 || got[0] != "restart" || strings.Contains(strings.Join(got, " "), "load") {
		t.Errorf("the engine got %q; want the restart and no load", got)
	}
	if ev := readEvents(t, out); !strings.Contains(ev, "it had not been trained yet, so it needs no checkpoint") {
		t.Errorf("events.log:\n%s", ev)
	}
}

// An engine that restarts between checkpoints (run.save_interval 2; the run's default is a
// checkpoint every few minutes) gets the last checkpoint and every optimizer step applied since,
// step by step, and the step in progress goes on: the engine ends it as if nothing had happened.
// (Before: the host kept only the step in progress's optimizer steps, and the run stopped.)
func TestRestartBetweenCheckpointsReplaysSinceTheLast(t *testing.T) {
	r, eng, out := restartRun(t, 2, "generate after 6") // in step 4: step 2 was saved, not 3
	stepsWithoutFailures(t, r, 5)
	step2 := filepath.Join(out, "checkpoints", "step_2", "p")
	if abs, err := filepath.Abs(step2); err == nil {
		step2 = abs
	}
	want := []string{
		"train p/step1/0", "train p/step1/1", "train p/step2/0", "train p/step2/1", "train p/step3/0", "train p/step3/1",
		"restart", "load " + step2, "train p/step3/0", "train p/step3/1",
		"train p/step4/0", "train p/step4/1", "train p/step5/0", "train p/step5/1",
	}
	if got := eng.events(); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("the engine got:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	if eng.restartE != nil {
		t.Errorf("OnRestart refused the new process: %v", eng.restartE)
	}
	if ev := readEvents(t, out); !strings.Contains(ev, `policy "p": its engine at test:1 restarted as a new process (instance old → new): loaded `+step2+" (step 2) into it and replayed the 2 optimizer steps applied since (step 3); the run goes on") {
		t.Errorf("events.log does not tell of the reload and the replay:\n%s", ev)
	}

	// With no checkpoint at all, the engine gets the model it was started with and every
	// optimizer step of the run.
	r, eng, out = restartRun(t, 0, "generate after 4") // in step 3
	stepsWithoutFailures(t, r, 3)
	want = []string{"train p/step1/0", "train p/step1/1", "train p/step2/0", "train p/step2/1",
		"restart", "train p/step1/0", "train p/step1/1", "train p/step2/0", "train p/step2/1",
		"train p/step3/0", "train p/step3/1"}
	if got := eng.events(); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("without a checkpoint the engine got:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	if ev := readEvents(t, out); !strings.Contains(ev, "it had been trained from the model it was started with and replayed the 4 optimizer steps applied since (step 1–2)") {
		t.Errorf("events.log:\n%s", ev)
	}
}

// Past the bound on what the host keeps to replay, the engine's state cannot be put back before
// the next checkpoint: OnRestart refuses the new process, and the step stops with the error that
// says how to resume.
func TestRestartPastTheReplayLimitStopsTheRun(t *testing.T) {
	r, eng, out := restartRun(t, 2, "generate after 6") // in step 4: step 2 was saved, not 3
	r.restart.limit = 1                                 // the first optimizer step outgrows it
	stepsWithoutFailures(t, r, 3)
	if _, err := r.Step(context.Background()); err == nil {
		t.Fatal("step 4 on an engine that lost steps 3's training: no error")
	} else {
		var re *RestartError
		if !errors.As(err, &re) || re.Step != 4 || re.Policy != "p" {
			t.Fatalf("step 4: got %v, want a RestartError of policy p in step 4", err)
		}
		for _, want := range []string{
			`step 4: policy "p": its engine at test:1 restarted as a new process (instance old → new)`,
			"the optimizer steps applied since the run's last checkpoint outgrew the 0 MiB the host keeps to replay into a restarted engine in step 3, and the run has no checkpoint of step 3 to load into it",
			"resume from its last checkpoint (step 2) once the engine is back: slimen exec --resume " + out,
		} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("the error lacks %q:\n%s", want, err)
			}
		}
	}
	if eng.restartE == nil {
		t.Error("OnRestart accepted the new process")
	}
	if r.StepsDone() != 3 {
		t.Errorf("%d steps done, want 3", r.StepsDone())
	}
}

// A frozen policy is what its config says: its engine restarting costs nothing.
func TestFrozenPolicyRestartIsOnlyLogged(t *testing.T) {
	cfg := testConfig(1, "p")
	cfg.Policies[0].Trainable = false
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    generate(\"p\", task.prompt)\n"),
		Options{Config: cfg, Out: out, Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(1)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	err = r.engineRestarted(context.Background(), restartEvent{policy: "p", engine: "its engine at test:1", prev: "a", cur: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if ev := readEvents(t, out); !strings.Contains(ev, `policy "p": its engine at test:1 restarted as a new process (instance a → b); the policy is frozen, so it lost nothing`) {
		t.Errorf("events.log:\n%s", ev)
	}
}

// failingTrain fails every optimizer step, as a remote engine does once its client gives up.
type failingTrain struct{ *scripted.Engine }

func (failingTrain) Train(context.Context, engines.Batch) (engines.TrainStats, error) {
	return engines.TrainStats{}, fmt.Errorf("engine at 127.0.0.1:1 is unreachable: train gave up after retrying for 2m0s")
}

// A failing optimizer step stops the run like a failing generate call: an EngineError naming the
// policy, with the command that resumes the run.
func TestTrainFailureStopsTheRunWithResumeHint(t *testing.T) {
	cfg := testConfig(1, "p")
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), writeScript(t, restartScript), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": failingTrain{scripted.Echo("x")}}, Tasks: numberedTasks(1)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_, err = r.Step(context.Background())
	var ee *EngineError
	if !errors.As(err, &ee) || ee.Policy != "p" || ee.Step != 1 {
		t.Fatalf("got %v, want an EngineError of policy p in step 1", err)
	}
	for _, want := range []string{`step 1: the engine of policy "p" failed: train: engine at 127.0.0.1:1 is unreachable`,
		"the run stops: " + out + " has no checkpoint to resume from (run.save_interval writes them), and slimen exec does not write a new run into a folder that holds one: start it again once the engine is back, with another --out (or remove " + out + " first)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error lacks %q:\n%s", want, err)
		}
	}
}

type failingScore struct{ *scripted.Engine }

func (failingScore) Score(context.Context, []engines.ScoreRequest) ([]engines.Scores, error) {
	return nil, fmt.Errorf("engine at 127.0.0.1:1 is unreachable: score gave up after retrying for 2m0s")
}

type failingValues struct{ *scripted.Engine }

func (failingValues) Values(context.Context, []engines.ScoreRequest) ([][]float32, error) {
	return nil, fmt.Errorf("engine at 127.0.0.1:1 is unreachable: values gave up after retrying for 2m0s")
}

// A teacher that cannot score and a critic that cannot value stop the run like a failing
// optimizer step: an EngineError naming the failing policy, with the resume hint.
func TestTeacherAndCriticFailuresStopTheRunWithResumeHint(t *testing.T) {
	for _, tc := range []struct {
		name, script, failing, want string
		cfg                         func() *config.Config
		engs                        map[string]engines.Engine
	}{
		{name: "teacher", failing: "t", want: `the engine of policy "t" failed: scoring 1 samples of policy "p" as their teacher: engine at 127.0.0.1:1 is unreachable`,
			script: "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c, teacher = \"t\")\n",
			cfg: func() *config.Config {
				c := testConfig(1, "p", "t")
				c.Policies[1].Trainable = false
				return c
			},
			engs: map[string]engines.Engine{"p": scripted.Echo("x"), "t": failingScore{scripted.Echo("x")}}},
		{name: "critic", failing: "c", want: `the engine of policy "c" failed: values: engine at 127.0.0.1:1 is unreachable`,
			script: restartScript,
			cfg: func() *config.Config {
				c := testConfig(1, "p", "c")
				c.Policies[0].Train.AdvantageEstimator = "ppo"
				c.Policies[1].Role = "critic"
				return c
			},
			engs: map[string]engines.Engine{"p": scripted.Echo("x"), "c": failingValues{scripted.Echo("x")}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "run")
			r, err := Load(context.Background(), writeScript(t, tc.script), Options{Config: tc.cfg(), Out: out,
				Engines: tc.engs, Tasks: numberedTasks(1)})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			_, err = r.Step(context.Background())
			var ee *EngineError
			if !errors.As(err, &ee) || ee.Policy != tc.failing || ee.Step != 1 {
				t.Fatalf("got %v, want an EngineError of policy %s in step 1", err, tc.failing)
			}
			for _, want := range []string{tc.want, "has no checkpoint to resume from"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("the error lacks %q:\n%s", want, err)
				}
			}
		})
	}
}

// A server the run reset to a policy's load: folder that restarts before the first checkpoint is
// given that folder again before the optimizer steps are replayed; one that trained on from the
// state its server held (engine.continue) cannot be given it back, and the run stops.
func TestRestartBeforeCheckpointOfServerStartedFromFolder(t *testing.T) {
	start := t.TempDir()
	if err := os.WriteFile(filepath.Join(start, "scripted.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r, eng, out := restartRun(t, 0, "train 2")
	r.restart.startedFrom("p", start, false)
	stepsWithoutFailures(t, r, 1)
	want := []string{"train p/step1/0", "restart", "load " + start, "train p/step1/0", "train p/step1/1"}
	if got := eng.events(); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("the engine got:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	if ev := readEvents(t, out); !strings.Contains(ev, "loaded its load: folder "+start+", which the run started from, into it and replayed the 1 optimizer steps") {
		t.Errorf("events.log:\n%s", ev)
	}

	r, _, _ = restartRun(t, 0, "train 2")
	r.restart.startedFrom("p", "", true)
	_, err := r.Step(context.Background())
	var re *RestartError
	if !errors.As(err, &re) || !strings.Contains(err.Error(), "engine.continue") {
		t.Errorf("a restart of a server trained on from its own state: %v, want a RestartError naming engine.continue", err)
	}
}
