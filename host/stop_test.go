package host

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// loopingScript trains every task and, on t3 (or every task when all is set), then loops forever.
const loopingScript = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t3" or task.metadata.get("all"):
        while True:
            pass
`

// TestRolloutTimeout: a rollout in an endless loop fails at rollout.timeout_s, naming the limit
// and the key; the others train.
func TestRolloutTimeout(t *testing.T) {
	cfg := testConfig(8, "p")
	cfg.Rollout.TimeoutS = 0.5
	eng := scripted.Echo("x")
	r := loadRun(t, loopingScript, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(8))
	t0 := time.Now()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took > 20*time.Second {
		t.Errorf("the step took %v with a 0.5s rollout limit", took)
	}
	if len(res.Failed) != 1 || res.Failed[0].TaskID != "t3" ||
		!strings.Contains(res.Failed[0].Msg, "wall-time limit of 0.5s") || !strings.Contains(res.Failed[0].Msg, "rollout.timeout_s") {
		t.Fatalf("want t3 failed at its time limit, naming rollout.timeout_s; failed: %+v", res.Failed)
	}
	if !strings.Contains(res.Failed[0].Msg, "script.star:") {
		t.Errorf("the failure does not say where the rollout was: %s", res.Failed[0].Msg)
	}
	if got := res.Policies[0].Float("samples"); got != 7 {
		t.Errorf("trained %v samples, want the 7 of the rollouts that finished", got)
	}
	if res.Run.Float("failed") != 1 {
		t.Errorf("_run failed = %v, want 1", res.Run["failed"])
	}
}

// TestStopCancelsAfterGrace: Stop during a step where 3 of 4 rollouts loop forever ends the step
// rollout.stop_grace_s later. The step is then not whole: it is neither trained nor checkpointed
// (issue 39: it used to train the one rollout that finished and save the cut step as complete),
// and Train ends with no error, saying so.
func TestStopCancelsAfterGrace(t *testing.T) {
	for _, sandboxed := range []bool{false, true} {
		name := "in-process"
		if sandboxed {
			name = "sandbox"
		}
		t.Run(name, func(t *testing.T) {
			cfg := testConfig(4, "p")
			cfg.Rollout.TimeoutS, cfg.Rollout.StopGraceS = 0, 0.5
			cfg.Sandbox.Train = []string{"p"}
			cfg.Sandbox.Steps = 1 << 60 // the loops must end by the stop, not on their budget
			tasks := numberedTasks(4)
			for i := range tasks {
				tasks[i].Metadata = map[string]any{"all": i > 0}
			}
			var log strings.Builder
			r, err := Load(context.Background(), writeScript(t, loopingScript), Options{Config: cfg, Tasks: tasks, Log: &log,
				Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: sandboxed, Out: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			trained := false
			r.opts.AfterStep = func(*Run, *StepResult) { trained = true }
			go func() {
				time.Sleep(300 * time.Millisecond)
				r.Stop()
			}()
			t0 := time.Now()
			if err := r.Train(context.Background()); err != nil {
				t.Fatalf("Train: %v", err)
			}
			if took := time.Since(t0); took > 20*time.Second {
				t.Errorf("Train took %v after Stop with a 0.5s grace", took)
			}
			if r.StepsDone() != 0 || trained || r.LastCheckpoint() != "" {
				t.Fatalf("steps done %d, a step completed: %v, checkpoint %q; want the cut step 1 neither trained nor saved", r.StepsDone(), trained, r.LastCheckpoint())
			}
			if want := "step 1 was cut by the stop: 3 of its 4 rollouts were still running 0.5s after it (rollout.stop_grace_s)"; !strings.Contains(log.String(), want) {
				t.Errorf("the run's log does not say %q:\n%s", want, log.String())
			}
		})
	}
}
