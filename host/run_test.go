package host

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// listTasks is a finite task source for tests: task i has prompt "q<i>" and label "<i>".
type listTasks []Task

func (l listTasks) Task(i int) Task { return l[i%len(l)] }

func numberedTasks(n int) listTasks {
	out := make(listTasks, n)
	for i := range out {
		out[i] = Task{ID: fmt.Sprintf("t%d", i), Prompt: fmt.Sprintf("q%d", i), Label: fmt.Sprint(i), HasLabel: true}
	}
	return out
}

// testConfig is a config with the given trainable policies on scripted engines.
func testConfig(batch int, policies ...string) *config.Config {
	c := config.Default(policies)
	c.Rollout.BatchSize = batch
	return c
}

func writeScript(t testing.TB, src string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "script.star")
	if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func loadRun(t testing.TB, src string, cfg *config.Config, engs map[string]engines.Engine, tasks TaskSource) *Run {
	t.Helper()
	r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Engines: engs, Tasks: tasks})
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// answerLastChar answers a prompt with its last character, so rewards are predictable.
func answerLastChar(req scripted.Request) string {
	m := req.Messages[len(req.Messages)-1].Content
	return m[len(m)-1:]
}

func TestDispatcherBatchesConcurrentGenerates(t *testing.T) {
	eng := scripted.New(answerLastChar)
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
`, testConfig(64, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(64))
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	calls := eng.Calls()
	reqs := 0
	for _, c := range calls {
		reqs += len(c)
	}
	if reqs != 64 {
		t.Fatalf("engine saw %d requests, want 64", reqs)
	}
	if len(calls) > 3 {
		t.Errorf("64 concurrent generate calls reached the engine as %d batches, want at most 3", len(calls))
	}
}

func TestDispatcherBatchesParallelFanOut(t *testing.T) {
	eng := scripted.New(answerLastChar)
	r := loadRun(t, `
def rollout(task):
    first = generate("p", task.prompt)
    outs = parallel(lambda i: generate("p", first.text + str(i)), range(4))
    for c in [first] + outs:
        reward(c, 0.0)
    train([first] + outs)
`, testConfig(16, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(16))
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	calls := eng.Calls()
	// 16 first calls, then 64 fan-out calls: two waves, each coalesced.
	if len(calls) > 4 {
		t.Errorf("two waves of generate calls reached the engine as %d batches, want at most 4", len(calls))
	}
	trained := 0
	for _, b := range eng.Batches() {
		trained += len(b.Samples)
	}
	if trained != 80 {
		t.Errorf("trained %d samples, want 80", trained)
	}
}

func f(x float64) float32 { return float32(x) }

func TestTrainedAdvantagesReachEngine(t *testing.T) {
	eng := scripted.New(func(req scripted.Request) string { return fmt.Sprint(req.Index) })
	r := loadRun(t, `
def rollout(task):
    cs = generate("p", task.prompt, n = 3)
    for c in cs:
        reward(c, 1.0 if c.text == "0" else 0.0)
    train(cs)
`, testConfig(2, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(2))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	b := eng.Batches()
	if len(b) != 1 || len(b[0].Samples) != 6 {
		t.Fatalf("got %d batches, want 1 of 6 samples", len(b))
	}
	// Each group (task) has rewards 1, 0, 0: advantages 2/3/s, −1/3/s, −1/3/s with s = sqrt(1/3).
	s := math.Sqrt(1.0 / 3)
	for i, smp := range b[0].Samples {
		want := float32((-1.0 / 3) / (s + 1e-6))
		if i%3 == 0 {
			want = float32((2.0 / 3) / (s + 1e-6))
		}
		for _, a := range smp.Advantages {
			if math.Abs(float64(a-want)) > 1e-5 {
				t.Errorf("sample %d: advantage %v, want %v", i, a, want)
			}
		}
		if smp.Group != fmt.Sprintf("t%d", i/3) {
			t.Errorf("sample %d: group %q", i, smp.Group)
		}
	}
	p := res.Policies[0]
	if p.Float("samples") != 6 || math.Abs(p.Float("reward_mean")-1.0/3) > 1e-9 {
		t.Errorf("metrics: %v", p)
	}
}

func TestFailingRolloutDropsOnlyItsSamples(t *testing.T) {
	eng := scripted.New(answerLastChar)
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
    if task.id == "t3":
        fail("task three is broken")
`, testConfig(8, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(8))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Failed) != 1 || res.Failed[0].TaskID != "t3" || !strings.Contains(res.Failed[0].Msg, "task three is broken") {
		t.Fatalf("failed rollouts: %+v", res.Failed)
	}
	if !strings.Contains(res.Failed[0].Msg, "script.star:7:13") {
		t.Errorf("failure has no file:line:col: %s", res.Failed[0].Msg)
	}
	if got := len(eng.Batches()[0].Samples); got != 7 {
		t.Errorf("trained %d samples, want 7 (the failed rollout's sample dropped)", got)
	}
	if res.Run.Float("failed") != 1 {
		t.Errorf("_run failed = %v", res.Run["failed"])
	}
}

func TestTooManyFailuresStopTheRun(t *testing.T) {
	r := loadRun(t, `
def rollout(task):
    fail("always")
`, testConfig(4, "p"), map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(4))
	_, err := r.Step(context.Background())
	if err == nil || !strings.Contains(err.Error(), "4 of 4 rollouts failed") {
		t.Fatalf("err = %v", err)
	}
}

func TestLogStateAndParallelOrder(t *testing.T) {
	r := loadRun(t, `
def rollout(task):
    xs = parallel(lambda i: i * i, range(5))
    if xs != [0, 1, 4, 9, 16]:
        fail("parallel order: %s" % xs)
    state.update("count", lambda n: n + 1, 0)
    log(score = 2.0 if task.id == "t0" else 4.0, flag = True)
`, testConfig(2, "p"), map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(2))
	for i := 0; i < 2; i++ {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatal(res.Failed[0])
		}
		if res.Run.Float("score") != 3 || res.Run.Float("flag") != 1 {
			t.Errorf("logged metrics: %v", res.Run)
		}
	}
	v, _ := r.State().Get("count")
	if v.String() != "4" {
		t.Errorf("state count = %v, want 4", v)
	}
}

// TestWatchReloadsAtStepBoundary is issue 7's acceptance: a run with --watch sees a rewritten
// script from the next step on with the step counter continuous, and a broken rewrite leaves the
// last good version running with the error in events.log.
func TestWatchReloadsAtStepBoundary(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "s.star")
	write := func(src string) {
		if err := os.WriteFile(script, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	version := func(v int) string {
		return fmt.Sprintf("def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n    log(version = %d)\n", v)
	}
	write(version(1))
	out := filepath.Join(dir, "run")
	r, err := Load(context.Background(), script, Options{Config: testConfig(2, "p"), Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Watch(""); err != nil {
		t.Fatal(err)
	}
	logged := func() float64 {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return res.Run.Float("version")
	}
	if v := logged(); v != 1 {
		t.Fatalf("step 1 logged version %v", v)
	}
	write(version(2))
	if v := logged(); v != 2 {
		t.Fatalf("step 2 after the rewrite logged version %v, want 2", v)
	}
	write("def rollout(task):\n    this is not starlark\n")
	if v := logged(); v != 2 {
		t.Fatalf("step 3 after a broken rewrite logged version %v, want the last good version 2", v)
	}
	r.Close()
	metrics, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	var steps []string
	for _, line := range strings.Split(strings.TrimSpace(string(metrics)), "\n") {
		if strings.Contains(line, `"_run"`) {
			steps = append(steps, line[:strings.Index(line, ",")])
		}
	}
	if d := cmp.Diff([]string{`{"step":1`, `{"step":2`, `{"step":3`}, steps); d != "" {
		t.Errorf("step counter (-want +got):\n%s", d)
	}
	events, _ := os.ReadFile(filepath.Join(out, "events.log"))
	for _, want := range []string{"runs from step 2", "is broken; the run keeps version", "s.star:2:12"} {
		if !strings.Contains(string(events), want) {
			t.Errorf("events.log lacks %q:\n%s", want, events)
		}
	}
	versions, _ := filepath.Glob(filepath.Join(out, "scripts", "step_*"))
	if len(versions) != 2 {
		t.Errorf("saved script versions: %v, want step_1 and step_2", versions)
	}
}

func TestEvalDefaultAndScripted(t *testing.T) {
	dir := t.TempDir()
	evalFile := filepath.Join(dir, "eval.jsonl")
	os.WriteFile(evalFile, []byte(`{"prompt": "a", "label": "5"}`+"\n"+`{"prompt": "b", "label": "6"}`+"\n"), 0o644)
	cfg := testConfig(1, "p")
	cfg.Run.EvalInterval = 2
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "small", Path: evalFile, Temperature: 1, NSamples: 4}}
	// The policy answers \boxed{5}: right on task a, wrong on b.
	eng := scripted.Echo(`\boxed{5}`)
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(2))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Eval) != 0 {
		t.Errorf("eval after step 1 with eval_interval 2: %v", res.Eval)
	}
	if res, err = r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(res.Eval) != 1 {
		t.Fatalf("no eval after step 2")
	}
	m := res.Eval[0]
	for k, want := range map[string]float64{"p/greedy_accuracy": 0.5, "p/accuracy": 0.5, "p/pass@4": 0.5, "tasks": 2} {
		if m.Float(k) != want {
			t.Errorf("%s = %v, want %v (%v)", k, m.Float(k), want, m)
		}
	}
	// A script's eval_rollout replaces the default; it may not train.
	r2 := loadRun(t, `
def rollout(task):
    pass
def eval_rollout(task):
    c = generate("p", task.prompt, temperature = 0)
    if task.prompt == "b":
        train(c)
    return {"len": len(c.text)}
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(2))
	evs, err := r2.Eval(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if evs[0].Float("len") != 9 || evs[0].Float("failed") != 1 {
		t.Errorf("scripted eval: %v", evs[0])
	}
}

// brokenEngine fails every Generate, as a remote engine does once its client gives up.
type brokenEngine struct{ *scripted.Engine }

func (brokenEngine) Generate(context.Context, []engines.GenerateRequest) ([]engines.Completion, error) {
	return nil, fmt.Errorf("engine at 127.0.0.1:1 unavailable for 2m0s")
}

func TestEngineFailureStopsTheRun(t *testing.T) {
	r := loadRun(t, `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
`, testConfig(4, "p"), map[string]engines.Engine{"p": brokenEngine{scripted.Echo("x")}}, numberedTasks(4))
	_, err := r.Step(context.Background())
	var ee *EngineError
	if !errors.As(err, &ee) || ee.Policy != "p" || !strings.Contains(err.Error(), "resume from its last checkpoint") {
		t.Fatalf("err = %v", err)
	}
}

func TestPPOActorAndCritic(t *testing.T) {
	cfg := testConfig(2, "actor", "critic")
	cfg.Policies[0].Train.AdvantageEstimator = "ppo"
	cfg.Policies[1].Role = "critic"
	actor, critic := scripted.Echo("ok"), scripted.Echo("unused")
	critic.Value = 0.25
	r := loadRun(t, `
def rollout(task):
    c = generate("actor", task.prompt)
    reward(c, 1.0 if task.id == "t0" else 0.0)
    train(c)
`, cfg, map[string]engines.Engine{"actor": actor, "critic": critic}, numberedTasks(2))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// γ = λ = 1: every token's advantage is R − V, every return R.
	ab := actor.Batches()[0].Samples
	for i, want := range []float32{0.75, -0.25} {
		for _, a := range ab[i].Advantages {
			if a != want {
				t.Errorf("actor sample %d: advantage %v, want %v", i, a, want)
			}
		}
	}
	cb := critic.Batches()
	if len(cb) != 1 || len(cb[0].Samples) != 2 || cb[0].Loss.ValueClip != 0.2 {
		t.Fatalf("critic batches: %+v", cb)
	}
	for i, want := range []float32{1, 0} {
		s := cb[0].Samples[i]
		if s.Returns[0] != want || s.OldValues[0] != 0.25 || len(s.Returns) != len(s.Response) {
			t.Errorf("critic sample %d: returns %v old values %v", i, s.Returns, s.OldValues)
		}
	}
	for _, m := range res.Policies {
		if m.Policy() == "critic" && m.Float("samples") != 2 {
			t.Errorf("critic metrics: %v", m)
		}
	}
}

func TestGAE(t *testing.T) {
	// γ = 0.5, λ = 1, values 0.5, 0.25, 0.1, reward 1 at the end:
	// δ = (0 + 0.5·0.25 − 0.5, 0 + 0.5·0.1 − 0.25, 1 − 0.1) = (−0.375, −0.2, 0.9)
	// A_2 = 0.9, A_1 = −0.2 + 0.5·0.9 = 0.25, A_0 = −0.375 + 0.5·0.25 = −0.25.
	adv, ret := gae(ppoRewards(1, 0, nil, 3), []float32{0.5, 0.25, 0.1}, 0.5, 1)
	if d := cmp.Diff([]float32{-0.25, 0.25, 0.9}, adv, cmpopts.EquateApprox(0, 1e-6)); d != "" {
		t.Errorf("advantages (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]float32{0.25, 0.5, 1}, ret, cmpopts.EquateApprox(0, 1e-6)); d != "" {
		t.Errorf("returns (-want +got):\n%s", d)
	}
}

// trainGate counts the Train calls in flight on the engines it wraps; until want calls have been
// in flight at once, each call waits up to wait for that, so that calls made one after another
// show as max 1.
type trainGate struct {
	mu      sync.Mutex
	in, max int
	want    int
	wait    time.Duration
}

type gatedEngine struct {
	*scripted.Engine
	g *trainGate
}

// enter counts a call in and waits (up to g.wait) until want calls have been in at once.
func (g *trainGate) enter() {
	g.mu.Lock()
	g.in++
	g.max = max(g.max, g.in)
	g.mu.Unlock()
	for end := time.Now().Add(g.wait); time.Now().Before(end); time.Sleep(time.Millisecond) {
		g.mu.Lock()
		met := g.max >= g.want
		g.mu.Unlock()
		if met {
			return
		}
	}
}

func (g *trainGate) leave() {
	g.mu.Lock()
	g.in--
	g.mu.Unlock()
}

func (e *gatedEngine) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	e.g.enter()
	defer e.g.leave()
	return e.Engine.Train(ctx, b)
}

const twoPolicyScript = `
def rollout(task):
    a = generate("a", task.prompt)
    b = generate("b", a.text)
    reward(a, 1.0)
    reward(b, 0.0)
    train([a, b])
`

// TestPoliciesOnDifferentEnginesTrainTogether: two policies on two engines train at the same time
// (one policy per GPU trained one after another before), while two policies given one engine
// still train one at a time.
func TestPoliciesOnDifferentEnginesTrainTogether(t *testing.T) {
	g := &trainGate{want: 2, wait: 20 * time.Second}
	a, b := &gatedEngine{scripted.New(answerLastChar), g}, &gatedEngine{scripted.New(answerLastChar), g}
	r := loadRun(t, twoPolicyScript, testConfig(4, "a", "b"), map[string]engines.Engine{"a": a, "b": b}, numberedTasks(4))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if g.max != 2 || len(a.Batches()) == 0 || len(b.Batches()) == 0 {
		t.Errorf("two policies on two engines: %d train calls at most in flight at once (want 2); batches %d and %d", g.max, len(a.Batches()), len(b.Batches()))
	}
	for _, m := range res.Policies {
		if _, ok := m["train_s"]; !ok {
			t.Errorf("policy %s has no train_s: %v", m.Policy(), m)
		}
	}

	one := &trainGate{want: 2, wait: 200 * time.Millisecond}
	shared := &gatedEngine{scripted.New(answerLastChar), one}
	r = loadRun(t, twoPolicyScript, testConfig(4, "a", "b"), map[string]engines.Engine{"a": shared, "b": shared}, numberedTasks(4))
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if one.max != 1 {
		t.Errorf("two policies given one engine: %d train calls in flight at once, want 1", one.max)
	}
}

// TestLoRAPoliciesShareALane: LoRA policies (adapters on one base) train one after another,
// full-weight policies each in their own lane.
func TestLoRAPoliciesShareALane(t *testing.T) {
	pol := func(name string, lora bool) *policy {
		p := &policy{name: name, eng: scripted.New(answerLastChar)}
		if lora {
			p.cfg.LoRA = &config.LoRAConfig{Rank: 8}
		}
		return p
	}
	var lanes [][]*policy
	for _, p := range []*policy{pol("a", true), pol("full1", false), pol("b", true), pol("full2", false)} {
		lanes = addToLane(lanes, p)
	}
	var got [][]string
	for _, l := range lanes {
		var names []string
		for _, p := range l {
			names = append(names, p.name)
		}
		got = append(got, names)
	}
	if d := cmp.Diff([][]string{{"a", "b"}, {"full1"}, {"full2"}}, got); d != "" {
		t.Errorf("lanes (-want +got):\n%s", d)
	}
}

// TestPoliciesOpenTogether: a run's start opens its policies' engines at the same time (eight
// torch workers started one after another before), LoRA policies one at a time, and registers
// them in config order.
func TestPoliciesOpenTogether(t *testing.T) {
	g := &trainGate{want: 2, wait: 20 * time.Second}
	lora := &trainGate{want: 2, wait: 200 * time.Millisecond}
	open := func(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
		gate := g
		if p.LoRA != nil {
			gate = lora
		}
		gate.enter()
		defer gate.leave()
		return scripted.New(answerLastChar), nil
	}
	cfg := testConfig(4, "a", "b", "la", "lb")
	cfg.Policies[2].LoRA = &config.LoRAConfig{Rank: 8}
	cfg.Policies[3].LoRA = &config.LoRAConfig{Rank: 8}
	r, err := Load(context.Background(), writeScript(t, twoPolicyScript), Options{Config: cfg, Tasks: numberedTasks(4), OpenEngine: open})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if g.max != 2 || lora.max != 1 {
		t.Errorf("engines opened at once: %d of the two full-weight policies (want 2), %d of the two LoRA ones (want 1)", g.max, lora.max)
	}
	if d := cmp.Diff([]string{"a", "b", "la", "lb"}, r.pols.order); d != "" {
		t.Errorf("policies registered out of config order (-want +got):\n%s", d)
	}
}

// A run folder that cannot be made is the caller's bad input (a ScriptError, exit status 2 in the
// CLI) that still carries the file system's error for errors.Is.
func TestRunFolderThatCannotBeMadeKeepsItsCause(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	_, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    pass\n"),
		Options{Config: testConfig(1, "p"), Engines: map[string]engines.Engine{"p": scripted.New(answerLastChar)},
			Tasks: numberedTasks(1), Out: filepath.Join(file, "run")})
	var se *ScriptError
	if !errors.As(err, &se) || !errors.Is(err, syscall.ENOTDIR) || !strings.Contains(err.Error(), "cannot be made") {
		t.Fatalf("Load into a folder under a file: %v (%T); want a ScriptError wrapping ENOTDIR", err, err)
	}
}
