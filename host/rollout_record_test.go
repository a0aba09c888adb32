package host

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// recordScript fails on task t1 and otherwise holds a two-turn chat (a user message injected
// between the turns) and two generate samples, all trained.
const recordScript = `
def rollout(task):
    c = chat("p", system = "Be exact.")
    c.user(task.prompt)
    c.generate(max_tokens = 5)
    c.user("Again?")
    c.generate(max_tokens = 5)
    reward(c, 1.0)
    train(c)
    gs = generate("p", task.prompt, n = 2)
    for i, g in enumerate(gs):
        reward(g, float(i))
    train(gs)
    if task.id == "t1":
        fail_here(task)
    return "done " + task.id

def fail_here(task):
    fail("task %s fails on purpose" % task.id)
`

// recordingObserver keeps what it is handed.
type recordingObserver struct {
	mu     sync.Mutex
	starts []RunInfo
	steps  []StepRecord
	evals  []EvalRecord
	closed int
	err    error // returned by Step
}

func (o *recordingObserver) Start(i RunInfo) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.starts = append(o.starts, i)
	return nil
}

func (o *recordingObserver) Step(s StepRecord) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.steps = append(o.steps, s)
	return o.err
}

func (o *recordingObserver) Eval(e EvalRecord) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.evals = append(o.evals, e)
	return nil
}

func (o *recordingObserver) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closed++
	return nil
}

func readRecords(t *testing.T, path string) []RolloutRecord {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []RolloutRecord
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var rec RolloutRecord
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("%s: %v in %s", path, err, sc.Text())
		}
		out = append(out, rec)
	}
	return out
}

func recordConfig(t *testing.T) *config.Config {
	cfg := tinyConfig(tinyModel(t, 1), nil)
	cfg.Rollout.BatchSize = 4
	cfg.Run.SaveRollouts = 3
	cfg.Run.SaveMinutes = 0
	return cfg
}

// TestRolloutsRecord: each step appends run.save_rollouts rollouts to rollouts.jsonl, the failed
// one with its backtrace, a chat as one call with its turns and mask-0 injected tokens, every
// trained token with its advantage and text; observers get the same records with the step's
// metrics lines, rewards and advantages, and are closed with the run.
// A sandboxed run (rollouts in child processes) keeps the same record.
func TestRolloutsRecord(t *testing.T) {
	for _, sandbox := range []bool{false, true} {
		t.Run(fmt.Sprintf("sandbox=%v", sandbox), func(t *testing.T) { testRolloutsRecord(t, sandbox) })
	}
}

func testRolloutsRecord(t *testing.T, sandbox bool) {
	out := t.TempDir()
	obs := &recordingObserver{}
	cfg := recordConfig(t)
	cfg.Sandbox.Train = []string{"p"}
	r, err := Load(context.Background(), writeScript(t, recordScript), Options{Config: cfg, Out: out, Tasks: numberedTasks(4), Observers: []Observer{obs}, Sandbox: sandbox})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	recs := readRecords(t, filepath.Join(out, "rollouts.jsonl"))
	if len(recs) != 6 {
		t.Fatalf("rollouts.jsonl has %d lines, want 3 a step for 2 steps", len(recs))
	}
	for i, rec := range recs {
		if want := 1 + i/3; rec.Step != want || rec.Eval {
			t.Errorf("line %d: step %d eval %v, want step %d eval false", i+1, rec.Step, rec.Eval, want)
		}
	}
	var failed, ok []RolloutRecord
	for _, rec := range recs[:3] {
		if rec.Error != "" {
			failed = append(failed, rec)
		} else {
			ok = append(ok, rec)
		}
	}
	if len(failed) != 1 || failed[0].Task.ID != "t1" || !strings.Contains(failed[0].Error, "fails on purpose") || !strings.Contains(failed[0].Error, "fail_here") {
		t.Fatalf("step 1's failed rollouts: %+v; want t1's, with its error and backtrace", failed)
	}
	if calls := failed[0].Calls; len(calls) != 3 || calls[0].Trained || calls[1].Trained || calls[0].Advantage != nil {
		t.Errorf("the failed rollout's calls: %+v; want its 3 calls, none trained (its train() requests are dropped)", calls)
	}
	rec := ok[0]
	// (A sandboxed rollout's child keeps what rollout() returned; only eval_rollout's comes back.)
	if rec.Result != `"done `+rec.Task.ID+`"` && !sandbox || rec.Task.Label == nil || rec.Task.Prompt == "" {
		t.Errorf("result %q, task %+v", rec.Result, rec.Task)
	}
	if len(rec.Calls) != 3 {
		t.Fatalf("%d calls, want the chat and two generate samples: %+v", len(rec.Calls), rec.Calls)
	}
	chat := rec.Calls[0]
	// (A sandboxed run's host rebuilds a conversation from its turns' tokens: its prompt as text.)
	if chat.Kind != "chat" || !chat.Trained || len(chat.Turns) != 2 || chat.Reward == nil || *chat.Reward != 1 || len(chat.Messages) == 0 && !strings.Contains(chat.Prompt, "Be exact.") {
		t.Fatalf("the chat's call: %+v", chat)
	}
	n := len(chat.TokenIDs)
	if len(chat.Mask) != n || len(chat.Logprob) != n || len(chat.Advantage) != n || len(chat.Pieces) != n {
		t.Fatalf("the chat's arrays: %d ids, %d mask, %d logprob, %d advantage, %d pieces", n, len(chat.Mask), len(chat.Logprob), len(chat.Advantage), len(chat.Pieces))
	}
	t0, t1 := chat.Turns[0], chat.Turns[1]
	if t0.Start != 0 || t0.End > t1.Start || t1.End != n || t1.Start == t0.End {
		t.Fatalf("turns %+v of %d tokens: want the first at 0, the last to the end, injected tokens between", chat.Turns, n)
	}
	for i := range n {
		sampled := i < t0.End || i >= t1.Start
		if (chat.Mask[i] == 1) != sampled {
			t.Errorf("token %d: mask %v; sampled %v", i, chat.Mask[i], sampled)
		}
	}
	if between := strings.Join(chat.Pieces[t0.End:t1.Start], ""); !strings.Contains(between, "Again?") {
		t.Errorf("the injected tokens read %q; want the user's message", between)
	}
	for _, g := range rec.Calls[1:] {
		if g.Kind != "generate" || !g.Trained || g.Reward == nil || len(g.Advantage) != len(g.TokenIDs) || len(g.Messages) != 1 || len(g.Pieces) != len(g.TokenIDs) {
			t.Errorf("generate call: %+v", g)
		}
	}
	if *rec.Calls[1].Reward == *rec.Calls[2].Reward || slices.Equal(rec.Calls[1].Advantage, rec.Calls[2].Advantage) {
		t.Errorf("the two samples rewarded 0 and 1 have rewards %v, %v and advantages %v, %v", *rec.Calls[1].Reward, *rec.Calls[2].Reward, rec.Calls[1].Advantage, rec.Calls[2].Advantage)
	}

	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.starts) != 1 || obs.starts[0].Out != out || obs.starts[0].Config == nil || len(obs.steps) != 2 || obs.closed != 1 {
		t.Fatalf("observer: %d starts (%+v), %d steps, closed %d times", len(obs.starts), obs.starts, len(obs.steps), obs.closed)
	}
	s := obs.steps[0]
	if len(s.Metrics) != 2 || s.Metrics[0].Policy() != "p" || s.Metrics[1].Policy() != "_run" || len(s.Rollouts) != 3 {
		t.Fatalf("step record: %d lines, %d rollouts", len(s.Metrics), len(s.Rollouts))
	}
	// 3 successful rollouts: each a chat and 2 samples, rewarded and trained.
	if len(s.Rewards["p"]) != 9 || len(s.Advantages["p"]) != 9 {
		t.Errorf("step record: %d rewards, %d advantages; want 9 of each", len(s.Rewards["p"]), len(s.Advantages["p"]))
	}
}

// TestObserverErrorLoggedOnce: an observer that fails is said once in events.log and called no
// more; the run goes on and still closes it.
func TestObserverErrorLoggedOnce(t *testing.T) {
	out := t.TempDir()
	obs := &recordingObserver{err: errors.New("sink is gone")}
	r, err := Load(context.Background(), writeScript(t, tinyScript), Options{Config: tinyConfig(tinyModel(t, 1), nil), Out: out, Tasks: numberedTasks(2), Observers: []Observer{obs}})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	r.Close()
	events := readFile(t, filepath.Join(out, "events.log"))
	if strings.Count(events, "sink is gone") != 1 {
		t.Errorf("events.log says the observer's error %d times, want once:\n%s", strings.Count(events, "sink is gone"), events)
	}
	if len(obs.steps) != 1 || obs.closed != 1 {
		t.Errorf("the failed observer had %d steps and %d closes; want 1 and 1", len(obs.steps), obs.closed)
	}
}

// blockedObserver holds up its first Step until released.
type blockedObserver struct {
	recordingObserver
	release chan struct{}
}

func (o *blockedObserver) Step(s StepRecord) error {
	<-o.release
	return o.recordingObserver.Step(s)
}

// TestSlowObserverDoesNotHoldUpSteps: steps go on while an observer is stuck; it gets every record,
// in order, once it moves again.
func TestSlowObserverDoesNotHoldUpSteps(t *testing.T) {
	obs := &blockedObserver{release: make(chan struct{})}
	r, err := Load(context.Background(), writeScript(t, tinyScript), Options{Config: tinyConfig(tinyModel(t, 1), nil), Tasks: numberedTasks(2), Observers: []Observer{obs}})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	close(obs.release)
	r.Close()
	var steps []int
	for _, s := range obs.steps {
		steps = append(steps, s.Step)
	}
	if !slices.Equal(steps, []int{1, 2, 3}) || obs.closed != 1 {
		t.Errorf("the slow observer got steps %v and %d closes; want 1, 2, 3 and 1", steps, obs.closed)
	}
}

// An observer of a run that records nothing is still closed, and never started.
func TestObserverClosedWithoutRecords(t *testing.T) {
	obs := &recordingObserver{}
	r, err := Load(context.Background(), writeScript(t, tinyScript), Options{Config: tinyConfig(tinyModel(t, 1), nil), Out: t.TempDir(), Tasks: numberedTasks(2), Observers: []Observer{obs}})
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	if len(obs.starts) != 0 || obs.closed != 1 {
		t.Errorf("%d starts, %d closes; want 0 and 1", len(obs.starts), obs.closed)
	}
}

// TestRolloutsRecordResume: a run stopped after a checkpoint and resumed writes each step's
// records once: the lines of steps past the checkpoint are dropped and written again.
func TestRolloutsRecordResume(t *testing.T) {
	out := t.TempDir()
	path := writeScript(t, recordScript)
	r, err := Load(context.Background(), path, Options{Config: recordConfig(t), Out: out, Tasks: numberedTasks(4)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(context.Background()); err != nil { // lost: the run dies before its checkpoint
		t.Fatal(err)
	}
	r.Close()
	whole := readRecords(t, filepath.Join(out, "rollouts.jsonl"))
	r2, err := Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4)})
	if err != nil {
		t.Fatal(err)
	}
	if got := readRecords(t, filepath.Join(out, "rollouts.jsonl")); len(got) != 3 {
		t.Fatalf("after resuming from step 1, rollouts.jsonl has %d lines; want step 1's 3", len(got))
	}
	if _, err := r2.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	r2.Close()
	got := readRecords(t, filepath.Join(out, "rollouts.jsonl"))
	steps := func(rs []RolloutRecord) (s []int) {
		for _, r := range rs {
			s = append(s, r.Step)
		}
		return s
	}
	if !slices.Equal(steps(got), []int{1, 1, 1, 2, 2, 2}) {
		t.Fatalf("steps of the resumed run's lines: %v", steps(got))
	}
	for i := range got { // the same rollouts (request ids carry the process's run id)
		if got[i].Task.ID != whole[i].Task.ID || got[i].Result != whole[i].Result || len(got[i].Calls) != len(whole[i].Calls) {
			t.Errorf("line %d differs from the run that never stopped: %+v vs %+v", i+1, got[i], whole[i])
		}
	}
}

// TestPickRollouts: the rollouts kept are the same for the same outcomes: failed ones first (at
// most half), the others spread over the step, in the step's order.
func TestPickRollouts(t *testing.T) {
	ros := make([]*script.Rollout, 10)
	for i := range ros {
		ros[i] = &script.Rollout{Index: i}
	}
	for _, i := range []int{2, 3, 4, 7} {
		ros[i].Err = errors.New("x")
	}
	idx := func(rs []*script.Rollout) (out []int) {
		for _, r := range rs {
			out = append(out, r.Index)
		}
		return out
	}
	for _, c := range []struct {
		n    int
		want []int
	}{
		{0, nil},
		{1, []int{2}},
		{4, []int{0, 2, 3, 6}},
		{8, []int{0, 1, 2, 3, 4, 6, 7, 8}},
		{20, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},
	} {
		if got := idx(pickRollouts(ros, c.n)); !slices.Equal(got, c.want) {
			t.Errorf("pickRollouts(n=%d) = %v, want %v", c.n, got, c.want)
		}
	}
}

// TestRecordLineBounded: a rollout whose calls' token arrays pass maxRecordBytes keeps its first
// calls' arrays and its texts; the last calls' arrays go, counted in tokens_cut.
func TestRecordLineBounded(t *testing.T) {
	call := func(n int) CallRecord {
		c := CallRecord{Policy: "p", Kind: "generate", Response: strings.Repeat("x", n)}
		for i := range n {
			c.TokenIDs = append(c.TokenIDs, int32(i))
			c.Pieces = append(c.Pieces, "x")
			c.Mask = append(c.Mask, 1)
			c.Logprob = append(c.Logprob, -1.2345678)
			c.Advantage = append(c.Advantage, 0.5)
		}
		return c
	}
	rec := RolloutRecord{Step: 1, Calls: []CallRecord{call(500), call(maxRecordTokens), call(maxRecordTokens)}}
	line, err := recordLine(rec)
	if err != nil {
		t.Fatal(err)
	}
	if len(line) > maxRecordBytes {
		t.Fatalf("line of %d bytes, over %d", len(line), maxRecordBytes)
	}
	var back RolloutRecord
	if err := json.Unmarshal(line, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Calls[0].TokenIDs) != 500 || back.Calls[2].TokensCut != maxRecordTokens || len(back.Calls[2].TokenIDs) != 0 || back.Calls[2].Response == "" {
		t.Errorf("calls kept %d, %d, %d tokens (cut %d, %d, %d)", len(back.Calls[0].TokenIDs), len(back.Calls[1].TokenIDs), len(back.Calls[2].TokenIDs),
			back.Calls[0].TokensCut, back.Calls[1].TokensCut, back.Calls[2].TokensCut)
	}
	if back.Calls[0].Logprob[0] != -1.235 {
		t.Errorf("log-prob written as %v, want 4 significant digits", back.Calls[0].Logprob[0])
	}
	if len(rec.Calls[2].TokenIDs) != maxRecordTokens {
		t.Error("cutting the line changed the caller's record")
	}
}

// BenchmarkRecordStep measures what keeping rollouts costs a step of the debate example (32
// tasks, 9 generate calls each) on scripted engines that answer at once, where the host's own
// work is all a step does: rollouts.jsonl off, at the default 8 a step, and with TensorBoard too.
//
//	go test ./host -run '^$' -bench RecordStep -benchtime 20x
func BenchmarkRecordStep(b *testing.B) {
	for _, c := range []struct {
		name string
		n    int
		tb   bool
	}{{"save_rollouts=0", 0, false}, {"save_rollouts=8", 8, false}, {"save_rollouts=8+tensorboard", 8, true}} {
		b.Run(c.name, func(b *testing.B) {
			answer := func(r scripted.Request) string { return fmt.Sprintf(`\boxed{%d}`, r.Seed%3) }
			cfg := testConfig(32, "generator", "critic")
			cfg.Run.SaveRollouts = c.n
			if c.tb {
				cfg.Run.TensorBoard = b.TempDir()
			}
			r, err := Load(context.Background(), "../examples/debate/debate.star", Options{Config: cfg, Tasks: numberedTasks(32), Out: b.TempDir(),
				Engines: map[string]engines.Engine{"generator": scripted.New(answer), "critic": scripted.New(answer)}})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := r.Step(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/step")
		})
	}
}

// endingObserver records what End told it, and whether Close came after.
type endingObserver struct {
	recordingObserver
	ends      []error
	endsAtEnd int // len(ends) when Close was called
}

func (o *endingObserver) End(err error) { o.ends = append(o.ends, err) }

func (o *endingObserver) Close() error {
	o.endsAtEnd = len(o.ends)
	return o.recordingObserver.Close()
}

// An Ender learns, once and before Close, the error Train ended with: nil for a run that ran its
// steps, the error for one that failed (a tracker marks it failed), and nil for a run closed
// without training.
func TestEnderLearnsHowTheRunEnded(t *testing.T) {
	const failing = "def rollout(task):\n    fail(\"no way\")\n"
	for _, tc := range []struct {
		name, script string
		train        bool
		failed       bool
	}{
		{"ran its steps", tinyScript, true, false},
		{"failed", failing, true, true},
		{"never trained", tinyScript, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obs := &endingObserver{}
			cfg := tinyConfig(tinyModel(t, 1), nil)
			cfg.Run.Steps = 2
			r, err := Load(context.Background(), writeScript(t, tc.script), Options{Config: cfg, Out: t.TempDir(), Tasks: numberedTasks(2), Observers: []Observer{obs}})
			if err != nil {
				t.Fatal(err)
			}
			var trainErr error
			if tc.train {
				trainErr = r.Train(context.Background())
			}
			if (trainErr != nil) != tc.failed {
				t.Fatalf("Train: %v; want failed = %v", trainErr, tc.failed)
			}
			r.Close()
			if len(obs.ends) != 1 || obs.endsAtEnd != 1 || obs.closed != 1 {
				t.Fatalf("End called %d times (%d before Close), Close %d times; want End once, then Close once", len(obs.ends), obs.endsAtEnd, obs.closed)
			}
			if got := obs.ends[0]; (got != nil) != tc.failed || tc.failed && got.Error() != trainErr.Error() {
				t.Errorf("End got %v; want Train's error (%v)", got, trainErr)
			}
		})
	}
}
