package host

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// requestsOf flattens the generate requests a scripted engine received.
func requestsOf(e *scripted.Engine) []engines.GenerateRequest {
	var out []engines.GenerateRequest
	for _, call := range e.Calls() {
		out = append(out, call...)
	}
	return out
}

// rolloutID is the id within its rollout ("TASK/CALL") of a request an engine received: its
// wire id without the run, pass and index ("RUN/PASS/INDEX/").
func rolloutID(wire string) string {
	parts := strings.SplitN(wire, "/", 4)
	if len(parts) < 4 {
		return wire
	}
	return parts[3]
}

// stepsWithoutFailures runs n steps and fails the test on an error or a failed rollout.
func stepsWithoutFailures(t *testing.T, r *Run, n int) {
	t.Helper()
	for range n {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range res.Failed {
			t.Errorf("rollout failed: %v", f)
		}
	}
}

// An engine server remembers request ids to answer a resent request once, so no two requests of
// a run may share one: not the same task twice in a step (two tasks, a batch of four), not the
// next pass over the data, not the eval of the same tasks after the step, and not a second run
// (a resumed host) talking to the same server.
func TestGenerateRequestIDsAreUniqueInARun(t *testing.T) {
	dir := t.TempDir()
	evalFile := filepath.Join(dir, "eval.jsonl")
	os.WriteFile(evalFile, []byte(`{"id": "t0", "prompt": "q0", "label": "0"}`+"\n"), 0o644)
	src := `
def rollout(task):
    c = generate("p", task.prompt)
    d = parallel(lambda i: generate("p", task.prompt + str(i)), range(2))
    reward(c, 1.0)
    train(c)

def eval_rollout(task):
    return {"len": len(generate("p", task.prompt).text)}
`
	cfg := testConfig(4, "p")
	cfg.Run.EvalInterval = 1
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "same", Path: evalFile, Temperature: 1}}
	eng := scripted.Echo("x")
	var runIDs []string
	for range 2 { // two hosts (a run and its resume) on one engine
		r := loadRun(t, src, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(2))
		runIDs = append(runIDs, r.id)
		stepsWithoutFailures(t, r, 2)
	}
	reqs := requestsOf(eng)
	// 2 runs × (eval before step 1 + 2 × (4 rollouts × 3 calls + eval)) requests.
	if want := 2 * (1 + 2*(4*3+1)); len(reqs) != want {
		t.Fatalf("%d requests reached the engine, want %d", len(reqs), want)
	}
	seen := map[string]bool{}
	for _, q := range reqs {
		if seen[q.ID] {
			t.Errorf("request id %q was used twice", q.ID)
		}
		seen[q.ID] = true
		if !strings.HasPrefix(q.ID, runIDs[0]+"/") && !strings.HasPrefix(q.ID, runIDs[1]+"/") {
			t.Errorf("request id %q does not start with its run's id (%q or %q)", q.ID, runIDs[0], runIDs[1])
		}
	}
}

// A task that runs twice in one step is two rollouts: the second samples with seeds of its own
// and forms a group of its own, as the second prompt of a batch does in slime. The first keeps the
// seeds a step of distinct tasks gives it, so runs without repeated tasks are unchanged.
func TestRepeatedTaskIsARolloutOfItsOwn(t *testing.T) {
	eng := scripted.Echo("x")
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
`, testConfig(4, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(2))
	stepsWithoutFailures(t, r, 1)
	seeds := map[string]uint64{} // "task/occurrence index in the step" → seed
	for _, q := range requestsOf(eng) {
		seeds[q.ID[strings.Index(q.ID, "/")+1:]] = q.Sampling.Seed
	}
	base := r.Config().Run.Seed
	for i, id := range []string{"t0", "t1"} {
		first, again := seeds[fmt.Sprintf("1/%d/%s/0", i, id)], seeds[fmt.Sprintf("1/%d/%s/0", i+2, id)]
		if want := script.KeySeed(script.KeySeed(base, id, []int{1}), id, []int{0}); first != want {
			t.Errorf("task %s, first rollout: seed %d, want %d (as when each task runs once)", id, first, want)
		}
		if again == first {
			t.Errorf("task %s: its second rollout in the step sampled with the first one's seed %d", id, first)
		}
	}
	var groups []string
	for _, b := range eng.Batches() {
		for _, s := range b.Samples {
			groups = append(groups, s.Group)
		}
	}
	if got, want := strings.Join(groups, " "), "t0 t1 t0#2 t1#2"; got != want {
		t.Errorf("groups of the step's samples: %s, want %s", got, want)
	}
}

// group= names a group; an empty name is a mistake, not the default.
func TestEmptyGroupIsAnError(t *testing.T) {
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c, group = "")
`, testConfig(1, "p"), map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(1))
	_, err := r.Step(context.Background())
	if err == nil || !strings.Contains(err.Error(), "Error in train: group is an empty string") {
		t.Errorf("train(c, group = \"\"): got %v, want the rollout to fail naming the empty group", err)
	}
}
