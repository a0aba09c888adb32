package host

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// versionSpy is a tiny engine that records which weights version each prompt was sampled from
// and which versions the run kept.
type versionSpy struct {
	*tiny.Engine
	mu   sync.Mutex
	seen map[string][]int
	kept []int
}

func (s *versionSpy) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	s.mu.Lock()
	for _, q := range reqs {
		if s.seen == nil {
			s.seen = map[string][]int{}
		}
		p := "continued" // a partial rollout's continuation: its prompt is tokens
		if len(q.Messages) > 0 {
			p = q.Messages[len(q.Messages)-1].Content
		}
		s.seen[p] = append(s.seen[p], v)
	}
	s.mu.Unlock()
	return s.Engine.GenerateVersion(ctx, v, reqs)
}

func (s *versionSpy) KeepVersion(ctx context.Context, v int) error {
	s.mu.Lock()
	s.kept = append(s.kept, v)
	s.mu.Unlock()
	return s.Engine.KeepVersion(ctx, v)
}

func newVersionSpy(t *testing.T, model string) *versionSpy {
	t.Helper()
	e, err := tiny.Open(model, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return &versionSpy{Engine: e}
}

// stepLines runs steps steps and returns each step's records without their timings, one JSON
// line per record.
func stepLines(t *testing.T, r *Run, steps int) []string {
	t.Helper()
	var lines []string
	for i := 0; i < steps; i++ {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Failed) > 0 {
			t.Fatal(res.Failed[0])
		}
		for _, m := range append(res.Policies, res.Run) {
			for _, k := range TimingFields {
				delete(m, k)
			}
			b, _ := json.Marshal(m)
			lines = append(lines, string(b))
		}
	}
	return lines
}

// TestAsyncVersionsAndDeterminism: with rollout.max_staleness 1, step s samples from the weights
// after max(0, s−2) steps (step 1 and 2 from the initial weights, step 3 from version 1, …), the
// metrics say so, and two runs with the same seed write the same metrics. Step 1, which both
// loops run from the initial weights, is the synchronous loop's step 1.
func TestAsyncVersionsAndDeterminism(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	run := func(k int) ([]string, *versionSpy) {
		spy := newVersionSpy(t, model)
		cfg := tinyConfig(model, nil)
		cfg.Rollout.MaxStaleness = k
		r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(100), Engines: map[string]engines.Engine{"p": spy}})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		return stepLines(t, r, 4), spy
	}
	a, spy := run(1)
	b, _ := run(1)
	if d := cmp.Diff(a, b); d != "" {
		t.Errorf("two runs at max_staleness 1 differ (-first +second):\n%s", d)
	}
	spy.mu.Lock()
	for i, want := range []int{0, 0, 0, 0, 1, 1, 2, 2} { // two tasks a step
		if got := spy.seen[fmt.Sprintf("q%d", i)]; !cmp.Equal(got, []int{want}) {
			t.Errorf("task q%d (step %d) sampled from versions %v, want [%d]", i, i/2+1, got, want)
		}
	}
	if !cmp.Equal(spy.kept, []int{0, 1, 2, 3}) {
		t.Errorf("kept versions %v, want 0 1 2 3", spy.kept)
	}
	spy.mu.Unlock()
	for s := 1; s <= 4; s++ {
		var m Metrics
		json.Unmarshal([]byte(a[2*(s-1)]), &m)
		trained, from := s-1, max(0, s-2)
		if m.Policy() != "p" || m.Float("trained_version") != float64(trained) || m.Float("rollout_version") != float64(from) ||
			m.Float("staleness_max") != float64(trained-from) || m.Float("staleness_mean") != float64(trained-from) {
			t.Errorf("step %d: %s; want trained_version %d, rollout_version %d, staleness %d", s, a[2*(s-1)], trained, from, trained-from)
		}
	}
	sync, _ := run(0)
	if strings.Contains(strings.Join(sync, "\n"), "staleness") {
		t.Errorf("the synchronous loop reports staleness: %s", sync[0])
	}
	strip := func(line string) string {
		var m Metrics
		json.Unmarshal([]byte(line), &m)
		for _, k := range []string{"trained_version", "rollout_version", "staleness_mean", "staleness_max"} {
			delete(m, k)
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	if strip(a[0]) != strip(sync[0]) {
		t.Errorf("step 1 differs between max_staleness 1 and 0, though both sample from the initial weights:\n%s\n%s", a[0], sync[0])
	}
	if strip(a[4]) == strip(sync[4]) {
		t.Errorf("step 3 is the same at max_staleness 1 and 0, though they sample from versions 1 and 2:\n%s", a[4])
	}
}

// TestAsyncResumeEqualsUninterrupted: a run at max_staleness K resumed from a checkpoint writes
// the metrics of the run that never stopped: the checkpoint holds the versions the next steps
// generate from, and the rollouts in flight when it was written run again from them.
func TestAsyncResumeEqualsUninterrupted(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	for _, k := range []int{1, 2} {
		t.Run(fmt.Sprint("K=", k), func(t *testing.T) {
			cfg := func() *config.Config {
				c := tinyConfig(model, nil)
				c.Rollout.MaxStaleness = k
				c.Run.KeepCheckpoints = 0
				return c
			}
			split, ck := resumeEqualsWhole(t, script, cfg, 3, 5, true)
			vers, _ := filepath.Glob(filepath.Join(ck, versionsDir, "p", "*"))
			if len(vers) != k {
				t.Errorf("checkpoint of step 3 holds weights versions %v, want %d", vers, k)
			}
			events, _ := os.ReadFile(filepath.Join(split, "events.log"))
			if want := fmt.Sprintf("the rollouts of steps %s in flight are not in it: a resume runs them again", span(4, 3+k)); !strings.Contains(string(events), want) {
				t.Errorf("events.log lacks %q:\n%s", want, events)
			}
		})
	}
}

// resumeEqualsWhole runs a tiny run of script whole for steps steps, and again with a checkpoint
// after step at (and, with lost, one more step that the resume must drop), resumed from it: the
// two must write the same metrics. It returns the second run's directory and its checkpoint.
func resumeEqualsWhole(t *testing.T, script string, cfg func() *config.Config, at, steps int, lost bool) (string, string) {
	t.Helper()
	whole := filepath.Join(t.TempDir(), "whole")
	r := loadTiny(t, script, whole, cfg())
	if err := r.Steps(context.Background(), steps); err != nil {
		t.Fatal(err)
	}
	r.Close()
	split := filepath.Join(t.TempDir(), "split")
	r = loadTiny(t, script, split, cfg())
	if err := r.Steps(context.Background(), at); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if lost {
		if _, err := r.Step(context.Background()); err != nil { // written, then lost in the "crash"
			t.Fatal(err)
		}
	}
	r.Close()
	r = loadTiny(t, script, split, cfg())
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), steps-at); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if got, want := metricsWithoutTimings(t, split), metricsWithoutTimings(t, whole); got != want {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", want, got)
	}
	return split, ck
}

// TestAsyncResumeWithLargerStaleness: a checkpoint holds the versions of its own K only.
func TestAsyncResumeWithLargerStaleness(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	out := filepath.Join(t.TempDir(), "run")
	cfg := tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = 1
	r := loadTiny(t, script, out, cfg)
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	cfg = tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = 2
	r = loadTiny(t, script, out, cfg)
	defer r.Close()
	if err := r.restore(context.Background(), ck); err == nil || !strings.Contains(err.Error(), "rollout.max_staleness at most 1") {
		t.Errorf("resume at a larger max_staleness: %v", err)
	}
}

// TestAsyncNeedsVersionedEngine: an engine that keeps no rollout copies is refused, by name.
func TestAsyncNeedsVersionedEngine(t *testing.T) {
	cfg := testConfig(2, "p")
	cfg.Rollout.MaxStaleness = 1
	r := loadRun(t, "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n", cfg,
		map[string]engines.Engine{"p": scripted.Echo("x")}, numberedTasks(2))
	_, err := r.Step(context.Background())
	if err == nil || !strings.Contains(err.Error(), `policy "p"`) || !strings.Contains(err.Error(), "rollout.max_staleness is 1") {
		t.Errorf("Step = %v; want a refusal naming the policy and rollout.max_staleness", err)
	}
}

// TestAsyncReload: a script reloaded at a step boundary runs that step's rollouts, though they
// were launched under the old version while the step before trained: they are discarded and run
// again, and events.log says so.
func TestAsyncReload(t *testing.T) {
	model := tinyModel(t, 1)
	dir := t.TempDir()
	script := filepath.Join(dir, "s.star")
	write := func(v int) {
		src := fmt.Sprintf("def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n    log(version = %d)\n", v)
		if err := os.WriteFile(script, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(1)
	out := filepath.Join(dir, "run")
	cfg := tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = 1
	r := loadTiny(t, script, out, cfg)
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
	write(2)
	if v := logged(); v != 2 {
		t.Fatalf("step 2 after the rewrite logged version %v, want 2", v)
	}
	if v := logged(); v != 2 {
		t.Fatalf("step 3 logged version %v, want 2", v)
	}
	r.Close()
	events, _ := os.ReadFile(filepath.Join(out, "events.log"))
	if want := "reload: the rollouts of steps 2, launched already, are discarded; they run again"; !strings.Contains(string(events), want) {
		t.Errorf("events.log lacks %q:\n%s", want, events)
	}
}

// TestAsyncSandboxed: a sandboxed run at max_staleness 1 writes the metrics of the same run in
// process.
func TestAsyncSandboxed(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	run := func(sandboxed bool) []string {
		cfg := tinyConfig(model, nil)
		cfg.Rollout.MaxStaleness = 1
		cfg.Sandbox.Train = []string{"p"}
		r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(100), Sandbox: sandboxed,
			Engines: map[string]engines.Engine{"p": newVersionSpy(t, model)}})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if sandboxed != (r.sandbox != nil) {
			t.Fatalf("sandboxed %v, but the run has sandbox %v", sandboxed, r.sandbox)
		}
		return stepLines(t, r, 3)
	}
	if d := cmp.Diff(run(false), run(true)); d != "" {
		t.Errorf("sandboxed run differs from the run in process (-in process +sandboxed):\n%s", d)
	}
}

// plainEngine hides every method of an engine but engines.Engine's: an engine that keeps no
// weights versions, as a torch worker.
type plainEngine struct{ engines.Engine }

// asyncSteps runs script for 4 steps at max_staleness k on tiny engines of model, each wrapped by
// wrap when it is given, and returns the metrics without timings and events.log.
func asyncSteps(t *testing.T, script, model string, k int, wrap func(*tiny.Engine) engines.Engine) (string, string) {
	t.Helper()
	cfg := tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = k
	out := filepath.Join(t.TempDir(), "run")
	opts := Options{Config: cfg, Tasks: numberedTasks(100), Out: out}
	if wrap != nil {
		opts.OpenEngine = func(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
			e, err := tiny.Open(p.HFCheckpoint, tiny.Options{Threads: 1})
			if err != nil {
				return nil, err
			}
			return wrap(e), nil
		}
	}
	r, err := Load(context.Background(), script, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	r.Close()
	events, _ := os.ReadFile(filepath.Join(out, "events.log"))
	return metricsWithoutTimings(t, out), string(events)
}

// TestAsyncReplicas: a policy whose engine keeps no weights versions samples from rollout
// replicas, which load the weights the trainer saves: the run writes the metrics of the run whose
// engine keeps its versions itself, with at most K replicas.
func TestAsyncReplicas(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	for _, k := range []int{1, 2} {
		t.Run(fmt.Sprint("K=", k), func(t *testing.T) {
			native, _ := asyncSteps(t, script, model, k, nil)
			replicated, events := asyncSteps(t, script, model, k, func(e *tiny.Engine) engines.Engine { return plainEngine{e} })
			if native != replicated {
				t.Errorf("with rollout replicas the metrics differ:\n%s\n---\n%s", native, replicated)
			}
			for _, want := range []string{"sample from rollout replicas", fmt.Sprintf("%d rollout replicas opened", k), "pushed to its rollout replica"} {
				if !strings.Contains(events, want) {
					t.Errorf("events.log lacks %q:\n%s", want, events)
				}
			}
			if strings.Contains(events, "rollout replica 1 opened") {
				t.Errorf("more than K = %d replicas:\n%s", k, events)
			}
		})
	}
}

// TestAsyncPartial: with rollout.partial, a generation of step s still running after half its
// max_tokens continues from the version after its step's (when the step before has made it):
// the runs are deterministic, the continuations sample versions 1, 2, 3 for steps 2, 3, 4 at
// K = 1, the metrics count the samples of two versions, and a resume reproduces the run.
func TestAsyncPartial(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	cfg := func() *config.Config {
		c := tinyConfig(model, nil)
		c.Rollout.MaxStaleness, c.Rollout.Partial = 1, true
		c.Run.KeepCheckpoints = 0
		return c
	}
	run := func() ([]string, *versionSpy) {
		spy := newVersionSpy(t, model)
		r, err := Load(context.Background(), script, Options{Config: cfg(), Tasks: numberedTasks(2), Engines: map[string]engines.Engine{"p": spy}})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		return stepLines(t, r, 4), spy
	}
	a, spy := run()
	b, _ := run()
	if d := cmp.Diff(a, b); d != "" {
		t.Errorf("two partial runs differ (-first +second):\n%s", d)
	}
	spy.mu.Lock()
	cont := map[int]bool{}
	for _, v := range spy.seen["continued"] {
		cont[v] = true
	}
	spy.mu.Unlock()
	if !cont[1] || !cont[2] || !cont[3] || cont[0] {
		t.Errorf("continuations sampled versions %v; want 1, 2 and 3 (steps 2–4), never 0", cont)
	}
	for s := 1; s <= 4; s++ {
		var m Metrics
		json.Unmarshal([]byte(a[2*(s-1)]), &m)
		n := m.Float("partial_samples")
		switch {
		case s == 1 && n != 0:
			t.Errorf("step 1 has %v samples of two versions; it has no version before its own", n)
		case s > 1 && (n == 0 || !(m.Float("staleness_mean") < m.Float("staleness_max"))):
			t.Errorf("step %d: %s; want samples of two versions, and a mean staleness below the max", s, a[2*(s-1)])
		}
	}

	resumeEqualsWhole(t, script, cfg, 2, 4, false)
}

// TestAsyncPartialChat: a chat's turns are split like generate calls under rollout.partial, and
// the conversation's sample records its sampled tokens' versions, so the metrics count the
// conversations of two versions and their mean staleness falls below the max.
func TestAsyncPartialChat(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, `
def rollout(task):
    c = chat("p")
    c.user(task.prompt)
    c.generate(max_tokens = 8)
    c.user("More.")
    c.generate(max_tokens = 8)
    reward(c, float(len(c.turns[-1].text) % 3))
    train(c)
`)
	run := func(partial bool) []string {
		cfg := tinyConfig(model, nil)
		cfg.Rollout.MaxStaleness, cfg.Rollout.Partial = 1, partial
		r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(4)})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		return stepLines(t, r, 3)
	}
	a := run(true)
	if d := cmp.Diff(a, run(true)); d != "" {
		t.Errorf("two partial chat runs differ (-first +second):\n%s", d)
	}
	for s := 2; s <= 3; s++ {
		var m Metrics
		json.Unmarshal([]byte(a[2*(s-1)]), &m)
		if m.Float("partial_samples") == 0 || !(m.Float("staleness_mean") < m.Float("staleness_max")) {
			t.Errorf("step %d: %s; want conversations of two versions, and a mean staleness below the max", s, a[2*(s-1)])
		}
	}
	// Without partial no conversation has a second version.
	var m Metrics
	json.Unmarshal([]byte(run(false)[2]), &m)
	if _, ok := m["partial_samples"]; ok || m.Float("staleness_mean") != m.Float("staleness_max") {
		t.Errorf("K = 1 without partial, step 2: %v", m)
	}
}

// TestAsyncWithTIS: truncated importance sampling corrects the stale samples of the asynchronous
// loop: at max_staleness 1 the samples of step 2 come from version 0 while the trainer holds
// version 1, so their TIS weights move off 1; the run stays deterministic.
func TestAsyncWithTIS(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	run := func() []string {
		cfg := tinyConfig(model, func(p *config.PolicyConfig) { p.Train.UseTIS = true })
		cfg.Rollout.MaxStaleness = 1
		r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(100)})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		return stepLines(t, r, 3)
	}
	a := run()
	if d := cmp.Diff(a, run()); d != "" {
		t.Errorf("two runs differ (-first +second):\n%s", d)
	}
	var m1, m2 Metrics
	json.Unmarshal([]byte(a[0]), &m1)
	json.Unmarshal([]byte(a[2]), &m2)
	if _, ok := m2["tis_weight"]; !ok || m1.Float("staleness_max") != 0 || m2.Float("staleness_max") != 1 {
		t.Fatalf("step 1: %s\nstep 2: %s", a[0], a[2])
	}
	if w := m2.Float("tis_weight"); w == 1 {
		t.Errorf("step 2's stale samples have TIS weight exactly 1: %s", a[2])
	}
}

// TestAsyncStop: Stop ends Train after the step in progress though the next step's rollouts are
// running, and the final checkpoint resumes.
func TestAsyncStop(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	cfg := tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = 1
	cfg.Run.Steps = 10
	out := filepath.Join(t.TempDir(), "run")
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
		AfterStep: func(r *Run, res *StepResult) {
			if res.Step == 2 {
				r.Stop()
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Train(context.Background()); err != nil {
		t.Fatal(err)
	}
	ck := r.LastCheckpoint()
	r.Close()
	if r.StepsDone() != 2 || ck == "" {
		t.Fatalf("stopped after %d steps, checkpoint %q; want 2 and one", r.StepsDone(), ck)
	}
	cfg = tinyConfig(model, nil)
	cfg.Rollout.MaxStaleness = 1
	r = loadTiny(t, script, out, cfg)
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
}

// TestAsyncPolicyCreatedByRollouts: a zero-config policy whose name the script computes is first
// met by step 1's rollouts, after the run kept its weights versions: it samples its current
// weights until it trains, then keeps the run's versions like the others (the run used to stop
// with "the engine keeps no weights versions"; a sandboxed zero-config run, whose policies all
// come this way, did so at once). Its metrics equal those of the same policy named in the script.
func TestAsyncPolicyCreatedByRollouts(t *testing.T) {
	run := func(script string) []string {
		cfg := config.Default(nil)
		cfg.Rollout.MaxStaleness = 1
		cfg.Rollout.BatchSize = 2
		cfg.Rollout.MaxResponseLen = 8
		cfg.Eval.Datasets = nil
		r, err := Load(context.Background(), writeScript(t, script), Options{Config: cfg, Tasks: numberedTasks(100)})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		return stepLines(t, r, 3)
	}
	named := run(tinyScript) // generate("p", …): opened at start-up
	computed := run(`NAME = "".join(["p"])` + strings.ReplaceAll(tinyScript, `"p"`, "NAME"))
	if d := cmp.Diff(named, computed); d != "" {
		t.Errorf("a policy created by the rollouts differs from one named in the script (-named +computed):\n%s", d)
	}
}

// savingEngine's Save reports whether its policy's busy meter had a call running during it.
type savingEngine struct {
	engines.Engine
	meter   *busyMeter
	running int
}

func (e *savingEngine) Save(ctx context.Context, dir string) error {
	e.meter.mu.Lock()
	e.running = e.meter.running
	e.meter.mu.Unlock()
	return nil
}

// A checkpoint's save is engine work: engine_busy counted it as idle time, which lowered it in
// runs that save every step.
func TestSaveCountsAsEngineBusy(t *testing.T) {
	m := &busyMeter{}
	e := &savingEngine{meter: m}
	p := &policy{name: "p", eng: e, busy: m}
	if err := p.save(context.Background(), t.TempDir()); err != nil {
		t.Fatal(err)
	}
	if e.running != 1 {
		t.Fatalf("the meter had %d calls running during the save, want 1", e.running)
	}
	if m.running != 0 || m.busy() <= 0 {
		t.Fatalf("after the save: %d running, %v busy; want 0 running and the save's time", m.running, m.busy())
	}
}

// slowGenerate is a tiny engine whose generate calls take 20 ms more (a model that takes its
// time) and that measures its own generating time and tokens.
type slowGenerate struct {
	*tiny.Engine
	mu     sync.Mutex
	busy   time.Duration // summed over the calls
	tokens int
}

func (s *slowGenerate) generate(gen func() ([]engines.Completion, error)) ([]engines.Completion, error) {
	t0 := time.Now()
	time.Sleep(20 * time.Millisecond)
	out, err := gen()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busy += time.Since(t0)
	for _, c := range out {
		s.tokens += len(c.Tokens)
	}
	return out, err
}

func (s *slowGenerate) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return s.generate(func() ([]engines.Completion, error) { return s.Engine.Generate(ctx, reqs) })
}

func (s *slowGenerate) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return s.generate(func() ([]engines.Completion, error) { return s.Engine.GenerateVersion(ctx, v, reqs) })
}

// TestAsyncTokensPerSecond: tokens_per_s is the engines' generation rate at max_staleness 1 as
// at 0 — tokens over the time the engine was generating them — though the rollouts spend most of
// their time on their own work (an agent() program's start-up, a tool: here a loop). Over the
// rollouts' wall time it read ~50 tok/s for an engine generating ~2,500 (2-core VM).
func TestAsyncTokensPerSecond(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, `
def rollout(task):
    cs = generate("p", task.prompt, n = 4)
    x = 0
    for i in range(200000):
        x += i
    for c in cs:
        reward(c, float(len(c.text) % 3))
    train(cs)
`)
	for _, k := range []int{0, 1} {
		e, err := tiny.Open(model, tiny.Options{Threads: 1})
		if err != nil {
			t.Fatal(err)
		}
		eng := &slowGenerate{Engine: e}
		cfg := tinyConfig(model, nil)
		cfg.Rollout.MaxStaleness = k
		r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(100), Engines: map[string]engines.Engine{"p": eng}})
		if err != nil {
			t.Fatal(err)
		}
		var reported []float64
		for range 3 {
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			reported = append(reported, res.Run.Float("tokens_per_s"))
		}
		r.Close()
		eng.mu.Lock()
		busy, tokens := eng.busy, eng.tokens
		eng.mu.Unlock()
		rate := float64(tokens) / busy.Seconds()
		for i, got := range reported {
			// The engine's own rate over the whole run; a step's may differ by what ran beside it
			// (training takes the CPU at max_staleness 1), never by a factor of four.
			if got < rate/4 || got > rate*4 {
				t.Errorf("max_staleness %d, step %d: tokens_per_s %.0f; the engine generated %.0f tok/s (%d tokens in %v)", k, i+1, got, rate, tokens, busy)
			}
		}
		e.Close()
	}
}

// TestAsyncLiveLineCountsItsPass: at max_staleness 2 the rollouts of two steps run at once; the
// live line counts the newest pass's rollouts against its own total. It counted the older pass's
// too and showed "rollouts 8/4".
func TestAsyncLiveLineCountsItsPass(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, `
def rollout(task):
    cs = generate("p", task.prompt, n = 4)
    x = 0
    for i in range(100000):
        x += i
    for c in cs:
        reward(c, float(len(c.text) % 3))
    train(cs)
`)
	e, err := tiny.Open(model, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	cfg := tinyConfig(model, nil)
	cfg.Rollout.BatchSize, cfg.Rollout.MaxStaleness = 4, 2
	r, err := Load(context.Background(), script, Options{Config: cfg, Tasks: numberedTasks(100), Engines: map[string]engines.Engine{"p": &slowGenerate{Engine: e}}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	stop, polled := make(chan struct{}), make(chan []LivePass)
	go func() {
		var over []LivePass
		for {
			select {
			case <-stop:
				polled <- over
				return
			case <-time.After(time.Millisecond):
				if l := r.Live(); l.Done > l.Total {
					over = append(over, l)
				}
			}
		}
	}()
	for range 8 {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	if over := <-polled; len(over) > 0 {
		t.Errorf("the live line showed more rollouts done than the pass has: %+v", over)
	}
}
