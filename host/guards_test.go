package host

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// These tests guard invariants that a small slip would break silently: every other test passes
// with the slip in place. Each fails within seconds, with a message, instead of hanging.

// TestRolloutsCannotMutateGlobals: the script's top level is frozen before rollouts run, so a
// rollout that writes to a global list or dict fails (in process and sandboxed) instead of racing
// with the other rollouts and leaking values from one task into another.
func TestRolloutsCannotMutateGlobals(t *testing.T) {
	src := `
SEEN = []
COUNTS = {}

def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t1":
        SEEN.append(task.id)
    if task.id == "t2":
        COUNTS[task.id] = 1
`
	for _, sandbox := range []bool{false, true} {
		t.Run(fmt.Sprintf("sandbox=%v", sandbox), func(t *testing.T) {
			cfg := testConfig(4, "p")
			cfg.Rollout.MaxFailedFraction = 1
			cfg.Sandbox.Train = []string{"p"}
			r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(4),
				Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: sandbox})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			res, err := r.Step(deadline(t, 60*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			got := failures(res)
			if len(got) != 2 || !strings.Contains(got["t1"], "frozen list") || !strings.Contains(got["t2"], "frozen hash table") {
				t.Fatalf("failed rollouts %v; want t1 (append to a frozen list) and t2 (insert into a frozen dict)", got)
			}
		})
	}
}

// TestSandboxStepsBudgetBitesOnTime: the steps budget stops a rollout near the budget, counted over
// all its threads — not merely at some point. A loop of a twentieth of the budget passes; a loop
// of half the budget (at least three Starlark steps an iteration), or four parallel threads of a
// sixth each, fails. A budget counted per thread, or ten times too large, lets those pass.
func TestSandboxStepsBudgetBitesOnTime(t *testing.T) {
	const budget = 200_000
	src := fmt.Sprintf(`
def spin(n):
    x = 0
    for i in range(n):
        x += i
    return x

def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t0":
        spin(%[1]d // 20)
    if task.id == "t1":
        spin(%[1]d // 2)
    if task.id == "t2":
        parallel(spin, [%[1]d // 6] * 4)
`, budget)
	cfg := testConfig(3, "p")
	cfg.Rollout.MaxFailedFraction = 1
	cfg.Sandbox.Steps, cfg.Sandbox.Train = budget, []string{"p"}
	r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(3),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(deadline(t, 60*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := failures(res)
	want := fmt.Sprintf("sandbox budget steps (%d) exceeded", budget)
	if _, ok := got["t0"]; ok || !strings.Contains(got["t1"], want) || !strings.Contains(got["t2"], want) {
		t.Fatalf("failed rollouts %v; want t1 and t2 (not t0) failed with %q", got, want)
	}
}

// countingEngine answers each request with n completions whose text names the request, so every
// caller can check that what came back is its own.
type countingEngine struct {
	scripted.Engine
	mu      sync.Mutex
	batches []int
}

func (e *countingEngine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	e.mu.Lock()
	e.batches = append(e.batches, len(reqs))
	e.mu.Unlock()
	var out []engines.Completion
	for _, r := range reqs {
		for i := range max(r.N, 1) {
			out = append(out, engines.Completion{Text: fmt.Sprintf("%s/%d", r.ID, i), FinishReason: "stop"})
		}
	}
	return out, nil
}

// TestDispatcherAnswersEveryRequest: concurrent generate calls of mixed n, cut into many batches
// by a small sample cap, each get exactly their own completions within a deadline. A dispatcher
// that drops or misroutes a request fails here in seconds, naming it.
func TestDispatcherAnswersEveryRequest(t *testing.T) {
	eng := &countingEngine{}
	act := &activity{}
	d := newDispatcher(eng, act, 7)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go d.loop(ctx)
	const callers = 200
	act.add(callers)
	errs := make(chan error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer act.leave()
			n := 1 + i%4
			id := fmt.Sprintf("r%d", i)
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			defer ccancel()
			out, err := d.generate(cctx, engines.GenerateRequest{ID: id, N: n, PromptTokens: []int32{1}}, -1)
			if err != nil {
				errs <- fmt.Errorf("request %s was not answered: %v", id, err)
				return
			}
			if len(out) != n {
				errs <- fmt.Errorf("request %s: %d completions, want %d", id, len(out), n)
				return
			}
			for j, c := range out {
				if want := fmt.Sprintf("%s/%d", id, j); c.Text != want {
					errs <- fmt.Errorf("request %s got completion %q, want %q", id, c.Text, want)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if batches, requests := d.stats(); requests != callers || batches < callers*10/4/7 {
		t.Errorf("%d requests in %d batches reached the engine; want %d requests in batches of at most 7 samples", requests, batches, callers)
	}
}

// deadline is a context that ends after d, so that a step which would hang fails the test in
// seconds (its rollouts fail with the context's error) instead of at the suite's timeout.
func deadline(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
