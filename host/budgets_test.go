package host

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// lockedBuffer is a bytes.Buffer for a run's Log, written from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestLogNamesPerRun: a run writes at most script.MaxLogNamesPerRun log() names to its _run
// lines, however many rollouts each log their most; names past it are left out with an event.
// Each rollout here logs 64 names no other rollout uses: 3 steps of 8 would make 1,536.
func TestLogNamesPerRun(t *testing.T) {
	src := `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    k = state.update("k", lambda n: n + 1, 0)
    log(**{"m%d_%d" % (k, i): 1 for i in range(64)})
`
	for _, sandboxed := range []bool{false, true} {
		cfg := testConfig(8, "p")
		cfg.Sandbox.Train = []string{"p"}
		var log lockedBuffer
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(8),
			Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: sandboxed, Log: &log})
		if err != nil {
			t.Fatal(err)
		}
		names := map[string]bool{}
		for step := 1; step <= 3; step++ {
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Failed) > 0 {
				t.Fatalf("sandbox=%v: %v", sandboxed, res.Failed[0])
			}
			for k := range res.Run {
				if !slices.Contains(script.RunFields, k) {
					names[k] = true
				}
			}
			if want := min(step*512, script.MaxLogNamesPerRun); len(names) != want {
				t.Errorf("sandbox=%v: after step %d the _run lines hold %d log() names, want %d", sandboxed, step, len(names), want)
			}
		}
		r.Close()
		if !strings.Contains(log.String(), "step 3: log(): the run has written 1024 metric names, the most a run writes; 512 new names are left out of its metrics") {
			t.Errorf("sandbox=%v: no event about the names left out:\n%s", sandboxed, log.String())
		}
	}
}

// TestRunFieldsReserved: every field the host writes on a _run line, in the synchronous and the
// asynchronous loop, is one of script.RunFields, which log() may not use.
func TestRunFieldsReserved(t *testing.T) {
	model := tinyModel(t, 1)
	for _, k := range []int{0, 1} {
		cfg := tinyConfig(model, nil)
		cfg.Rollout.MaxStaleness = k
		r, err := Load(context.Background(), writeScript(t, tinyScript), Options{Config: cfg, Tasks: numberedTasks(100)})
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			for f := range res.Run {
				if !slices.Contains(script.RunFields, f) {
					t.Errorf("max_staleness %d: the host writes %q on the _run line, and script.RunFields lacks it: log() could overwrite it", k, f)
				}
			}
		}
		r.Close()
	}
}

// TestForgedLogsLeftOut: the host applies log()'s rules to what a sandboxed rollout's child
// reports: a report with a _run field, too many names or a name too long counts with none of its
// values; an honest one counts.
func TestForgedLogsLeftOut(t *testing.T) {
	many := map[string][2]float64{}
	for i := range 100 {
		many[fmt.Sprintf("n%d", i)] = [2]float64{1, 1}
	}
	reports := []map[string][2]float64{
		{"failed": {0, 1}, "acc": {1, 1}},
		many,
		{strings.Repeat("m", 65): {1, 1}},
		{"nan": {math.NaN(), 1}},
		{"acc": {3, 2}}, // the honest one
	}
	var ros []*script.Rollout
	for i, logs := range reports {
		ro := &script.Rollout{Task: script.Task{ID: fmt.Sprintf("t%d", i)}}
		if err := ro.Adopt(nil, nil, logs, nil); err != nil {
			t.Fatal(err)
		}
		ros = append(ros, ro)
	}
	var log lockedBuffer
	r := &Run{events: &eventLog{w: &log}}
	sums := r.logNames.sums(1, ros, r.events)
	if len(sums) != 1 || sums["acc"] != [2]float64{3, 2} {
		t.Errorf("sums = %v, want only the honest rollout's acc", sums)
	}
	for _, want := range []string{"task t0: its log() values are left out of the metrics: log: \"failed\" is a field the host writes",
		"task t1: its log() values are left out of the metrics: 100 metric names, more than the 64 a rollout logs",
		"task t2: its log() values are left out of the metrics: log: metric name", "task t3: its log() values are left out of the metrics: log: nan is not a finite number"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("events lack %q:\n%s", want, log.String())
		}
	}
}

// TestZeroConfigPolicyNames: a zero-config run creates a policy under the name a script passes
// only where a config could give it that name: ".." would write its model above its checkpoint's
// folder, a 300-byte name is past what a file name may hold (it failed the final checkpoint), and
// "_run" is the run's own metrics line. Each fails its rollout alone, in and out of the sandbox;
// the honest rollouts train.
func TestZeroConfigPolicyNames(t *testing.T) {
	src := `
def rollout(task):
    c = generate("solver", task.prompt)
    reward(c, 1.0)
    train(c)
    bad = {"t1": "." * 2, "t2": "x" * 300, "t3": "_" + "run", "t4": "a" + chr(10) + "b"}
    if task.id in bad:
        generate(bad[task.id], task.prompt)
`
	want := map[string]string{
		"t1": `generate: policy name ".." would name the folder that holds the policies' folders, or the one above it (a zero-config run creates each policy under the name the script passes`,
		"t2": `generate: policy name "xxxxxxxxxxxxxxxxxxxx"… is 300 bytes, more than 128`,
		"t3": `generate: policy name "_run" is the name of the run's own metrics lines`,
		"t4": `generate: policy name "a\nb" must not contain spaces, control characters or slashes`,
	}
	for _, sandboxed := range []bool{false, true} {
		out := filepath.Join(t.TempDir(), "run")
		var opened []string
		var mu sync.Mutex
		r, err := Load(deadline(t, time.Minute), writeScript(t, src), Options{Out: out, Tasks: numberedTasks(10), Sandbox: sandboxed,
			OpenEngine: func(_ context.Context, pc config.PolicyConfig) (engines.Engine, error) {
				mu.Lock()
				opened = append(opened, pc.Name)
				mu.Unlock()
				return scripted.Echo("x"), nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for _, f := range res.Failed {
			got[f.TaskID] = f.Msg
		}
		for id, w := range want {
			if !strings.Contains(got[id], w) {
				t.Errorf("sandbox=%v: task %s: failed with %q, want a message containing %q", sandboxed, id, got[id], w)
			}
		}
		if len(got) != len(want) {
			t.Errorf("sandbox=%v: %d rollouts failed, want %d: %v", sandboxed, len(got), len(want), got)
		}
		if _, err := r.Checkpoint(context.Background()); err != nil {
			t.Errorf("sandbox=%v: checkpoint: %v", sandboxed, err)
		}
		r.Close()
		mu.Lock()
		if !slices.Equal(opened, []string{"solver"}) {
			t.Errorf("sandbox=%v: the run opened engines for %q, want only solver's", sandboxed, opened)
		}
		mu.Unlock()
	}
}

// shortContext is a scripted engine whose policy's context is 64 tokens.
type shortContext struct{ *scripted.Engine }

func (e shortContext) Info(ctx context.Context) (engines.Info, error) {
	info, err := e.Engine.Info(ctx)
	info.MaxSeqLen = 64
	return info, err
}

// TestChatPastContext: a chat past its policy's context samples nothing, yet each turn renders
// the conversation and writes a line to the run's events. Under the sandbox each such turn is a
// generate call of the rollout's budget (and a token a sample), so a loop of them fails at
// generate_calls; in and out of the sandbox its event lines are the rollout's prints: at most 20
// and a line that says the rest were dropped.
func TestChatPastContext(t *testing.T) {
	src := `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t1":
        ch = chat("p")
        ch.user("x" * 200)
        for i in range(2000):
            t = ch.generate()
            if t.finish_reason != "length" or len(t.tokens) != 0:
                fail("turn %d: %s %s" % (i, t.finish_reason, t.tokens))
`
	for _, sandboxed := range []bool{false, true} {
		cfg := testConfig(4, "p")
		cfg.Sandbox = hostileSandbox()
		cfg.Sandbox.Policies = nil
		out := filepath.Join(t.TempDir(), "run")
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(4), Out: out,
			Engines: map[string]engines.Engine{"p": shortContext{scripted.Echo(`\boxed{1}`)}}, Sandbox: sandboxed})
		if err != nil {
			t.Fatal(err)
		}
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
		if sandboxed {
			// 32 calls, 4,096 bytes printed: the event lines meet print_bytes first.
			want := regexp.MustCompile(`Error in chat.generate: sandbox budget (generate_calls \(32\) exceeded: chat.generate call 33|print_bytes \(4096\) exceeded)`)
			if len(res.Failed) != 1 || res.Failed[0].TaskID != "t1" || !want.MatchString(res.Failed[0].Msg) {
				t.Errorf("sandboxed: failed %v, want task t1 failed at generate_calls or print_bytes", res.Failed)
			}
		} else if len(res.Failed) != 0 {
			t.Errorf("in-process: failed %v, want none", res.Failed)
		}
		events, _ := os.ReadFile(filepath.Join(out, "events.log"))
		if n := strings.Count(string(events), "the turn ends with finish_reason"); n > 20 {
			t.Errorf("sandbox=%v: %d event lines about turns past the context, want at most 20", sandboxed, n)
		}
		if !strings.Contains(string(events), "task t1: more print output dropped (limit 20 lines a rollout)") {
			t.Errorf("sandbox=%v: no line saying the rest were dropped:\n%s", sandboxed, events)
		}
	}
}

// TestChatPastContextCalls: with room in print_bytes, turns past the context meet generate_calls.
func TestChatPastContextCalls(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Sandbox = hostileSandbox()
	cfg.Sandbox.Policies, cfg.Sandbox.PrintBytes = nil, 1<<20
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t1":
        ch = chat("p")
        ch.user("x" * 200)
        for i in range(2000):
            ch.generate()
`), Options{Config: cfg, Tasks: numberedTasks(2), Engines: map[string]engines.Engine{"p": shortContext{scripted.Echo("x")}}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Msg, "sandbox budget generate_calls (32) exceeded: chat.generate call 33") {
		t.Errorf("failed %v, want task t1 failed at generate_calls", res.Failed)
	}
}

// scoreCounter is a scripted engine that records the batches of its Score calls.
type scoreCounter struct {
	*scripted.Engine
	mu      sync.Mutex
	batches []int
}

func (e *scoreCounter) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	e.mu.Lock()
	e.batches = append(e.batches, len(reqs))
	e.mu.Unlock()
	return e.Engine.Score(ctx, reqs)
}

// TestDispatcherBatchesScores: concurrent score calls reach the engine in batches of at most the
// dispatcher's sample cap, as generate calls do (r.score used to send each alone), and each gets
// its own log-probs back.
func TestDispatcherBatchesScores(t *testing.T) {
	eng := &scoreCounter{Engine: scripted.Echo("x")}
	eng.Logprob = -0.5
	act := &activity{}
	d := newDispatcher(eng, act, 16)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go d.loop(ctx)
	const callers = 64
	act.add(callers)
	errs := make(chan error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer act.leave()
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			defer ccancel()
			lp, err := d.score(cctx, engines.ScoreRequest{PromptTokens: []int32{1}, Tokens: make([]int32, i+1)}, -1)
			if err != nil || len(lp) != i+1 || lp[0] != -0.5 {
				errs <- fmt.Errorf("score %d: %v, %v; want %d log-probs of -0.5", i, lp, err, i+1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	eng.mu.Lock()
	defer eng.mu.Unlock()
	reqs := 0
	for _, n := range eng.batches {
		reqs += n
		if n > 16 {
			t.Errorf("a batch of %d score requests, more than the dispatcher's 16", n)
		}
	}
	if reqs != callers || len(eng.batches) > 8 {
		t.Errorf("%d score requests reached the engine in %d batches, want %d in at most 8", reqs, len(eng.batches), callers)
	}
}
