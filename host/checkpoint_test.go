package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

const counterScript = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0 if c.text == "a" else 0.0)
    train(c)
    n = state.update("calls", lambda n: n + 1, 0)
    log(calls = n)
`

func metricsWithoutTimings(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	return WithoutTimings(string(b))
}

// counterRun loads counterScript on a scripted policy "p" whose answers depend on the seed.
func counterRun(t *testing.T, script, out string, edit func(*config.Config)) *Run {
	t.Helper()
	seeded := func(r scripted.Request) string { return []string{"a", "b"}[r.Seed%2] }
	cfg := testConfig(4, "p")
	cfg.Run.KeepCheckpoints = 0
	if edit != nil {
		edit(cfg)
	}
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(4),
		Engines: map[string]engines.Engine{"p": scripted.New(seeded)}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// wholeCounterRun runs counterScript for steps steps in one go and returns its metrics.
func wholeCounterRun(t *testing.T, script string, steps int) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "whole")
	r := counterRun(t, script, out, nil)
	defer r.Close()
	if err := r.Steps(context.Background(), steps); err != nil {
		t.Fatal(err)
	}
	return metricsWithoutTimings(t, out)
}

func TestCheckpointResumeEqualsUninterrupted(t *testing.T) {
	script := writeScript(t, counterScript)
	whole := wholeCounterRun(t, script, 6)

	split := filepath.Join(t.TempDir(), "split")
	r := counterRun(t, script, split, nil)
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Step 4 runs and is written before the "crash": resume must drop it.
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.Close()
	found, skipped, err := FindCheckpoint(split)
	if err != nil || found != ck || len(skipped) > 0 {
		t.Fatalf("FindCheckpoint = %q, %v, %v; want %q", found, skipped, err, ck)
	}
	r = counterRun(t, script, split, nil)
	if err := r.restore(context.Background(), found); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if got := metricsWithoutTimings(t, split); got != whole {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", whole, got)
	}
}

func TestCorruptCheckpoints(t *testing.T) {
	script := writeScript(t, counterScript)
	out := t.TempDir()
	r := counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1 })
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	r.Close()
	root := filepath.Join(out, "checkpoints")
	if got := checkpointSteps(root); fmt.Sprint(got) != "[3 2 1]" {
		t.Fatalf("checkpoints: %v", got)
	}
	// A truncated file: an explicit --resume of that checkpoint is an error naming the file and
	// offering the previous checkpoint.
	f := filepath.Join(root, "step_3", "state.json")
	b, _ := os.ReadFile(f)
	os.WriteFile(f, b[:len(b)/2], 0o644)
	_, _, err := FindCheckpoint(filepath.Join(root, "step_3"))
	if err == nil || !strings.Contains(err.Error(), "file state.json has") || !strings.Contains(err.Error(), "--resume "+filepath.Join(root, "step_2")) {
		t.Fatalf("truncated: %v", err)
	}
	// The run directory resumes from the newest valid checkpoint and reports the corrupt one.
	found, skipped, err := FindCheckpoint(out)
	if err != nil || found != filepath.Join(root, "step_2") {
		t.Fatalf("FindCheckpoint(run dir) = %q, %v; want step_2", found, err)
	}
	if len(skipped) != 1 || !strings.Contains(skipped[0].Error(), filepath.Join(root, "step_3")) || !strings.Contains(skipped[0].Error(), "state.json") {
		t.Errorf("skipped = %v; want the truncated step_3 named", skipped)
	}
	// A checkpoint whose write never finished (no manifest) is refused.
	os.Remove(filepath.Join(root, "step_2", manifestFile))
	if err := VerifyCheckpoint(filepath.Join(root, "step_2")); err == nil || !strings.Contains(err.Error(), "incomplete") {
		t.Errorf("no manifest: %v", err)
	}
	found, skipped, err = FindCheckpoint(out)
	if err != nil || found != filepath.Join(root, "step_1") || len(skipped) != 2 {
		t.Errorf("FindCheckpoint = %q, %v, %v; want step_1 with two skipped", found, skipped, err)
	}
	os.Remove(filepath.Join(root, "step_1", manifestFile))
	if _, _, err := FindCheckpoint(out); err == nil || !strings.Contains(err.Error(), "none of its 3 checkpoints is valid") {
		t.Errorf("no valid checkpoint: %v", err)
	}
}

// TestResumeAfterCorruptNewest: the newest checkpoint is truncated; resuming the run directory
// takes the previous one, runs the remaining steps, and ends as a run that never stopped.
func TestResumeAfterCorruptNewest(t *testing.T) {
	script := writeScript(t, counterScript)
	whole := wholeCounterRun(t, script, 4)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1 })
	if err := r.Steps(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	r.Close()
	root := filepath.Join(out, "checkpoints")
	f := filepath.Join(root, "step_3", "p", "scripted.txt")
	os.WriteFile(f, nil, 0o644)

	found, skipped, err := FindCheckpoint(out)
	if err != nil || filepath.Base(found) != "step_2" || len(skipped) != 1 {
		t.Fatalf("FindCheckpoint = %q, %v, %v", found, skipped, err)
	}
	r = counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1 })
	defer r.Close()
	if err := r.restore(context.Background(), found); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "step_3")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the corrupt step_3 is still there after resuming from step_2 (%v)", err)
	}
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, out); got != whole {
		t.Errorf("metrics after resuming from step_2:\n%s\nwant\n%s", got, whole)
	}
	if got := fmt.Sprint(checkpointSteps(root)); got != "[4 3 2 1]" {
		t.Errorf("checkpoints %s, want [4 3 2 1]", got)
	}
	for _, s := range []int{3, 4} {
		if err := VerifyCheckpoint(filepath.Join(root, stepName(s))); err != nil {
			t.Errorf("step_%d after the resumed run: %v", s, err)
		}
	}
}

// TestResumeFromOlderCheckpoint resumes from an explicit checkpoint older than the newest: the
// later checkpoints go (their steps are run again) and the run ends as one that never stopped.
func TestResumeFromOlderCheckpoint(t *testing.T) {
	script := writeScript(t, counterScript)
	whole := wholeCounterRun(t, script, 4)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1 })
	if err := r.Steps(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	r.Close()
	root := filepath.Join(out, "checkpoints")
	r = counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1; c.Run.KeepCheckpoints = 1 })
	defer r.Close()
	if err := r.restore(context.Background(), filepath.Join(root, "step_2")); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(checkpointSteps(root)); got != "[2 1]" {
		t.Errorf("checkpoints after resuming from step_2: %s, want [2 1]", got)
	}
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, out); got != whole {
		t.Errorf("metrics:\n%s\nwant\n%s", got, whole)
	}
	// keep_checkpoints: 1 keeps the one just written, not a later one of the stopped run.
	if got := fmt.Sprint(checkpointSteps(root)); got != "[4]" {
		t.Errorf("checkpoints %s, want [4]", got)
	}
}

func TestKeepCheckpoints(t *testing.T) {
	script := writeScript(t, counterScript)
	out := t.TempDir()
	r := counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 1; c.Run.KeepCheckpoints = 2 })
	defer r.Close()
	root := filepath.Join(out, "checkpoints")
	for step, want := range []string{"[1]", "[2 1]", "[3 2]", "[4 3]", "[5 4]"} {
		if _, err := r.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(checkpointSteps(root)); got != want {
			t.Errorf("after step %d: checkpoints %s, want %s", step+1, got, want)
		}
	}
	for _, s := range []int{4, 5} {
		if err := VerifyCheckpoint(filepath.Join(root, stepName(s))); err != nil {
			t.Error(err)
		}
	}
}

// TestCheckpointNotRewritten: the end-of-run checkpoint of a step that save_interval already saved
// leaves that checkpoint alone (a rewrite would remove it first, and a crash then would lose it).
func TestCheckpointNotRewritten(t *testing.T) {
	script := writeScript(t, counterScript)
	out := t.TempDir()
	r := counterRun(t, script, out, func(c *config.Config) { c.Run.SaveInterval = 2 })
	defer r.Close()
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	final := filepath.Join(out, "checkpoints", "step_2")
	before, err := os.Stat(final)
	if err != nil {
		t.Fatal(err)
	}
	got, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(final)
	if err != nil {
		t.Fatal(err)
	}
	if got != final || !os.SameFile(before, after) {
		t.Errorf("Checkpoint() = %q: step_2 was written again", got)
	}
	if n := strings.Count(readFile(t, filepath.Join(out, "events.log")), "checkpoint: step 2 saved"); n != 1 {
		t.Errorf("events.log says %d times that step 2 was saved, want 1", n)
	}
	// A resumed run does not rewrite the checkpoint it resumed from either.
	r.Close() // one writer per run folder
	r2 := counterRun(t, script, out, nil)
	defer r2.Close()
	if err := r2.restore(context.Background(), final); err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	if again, err := os.Stat(final); err != nil || !os.SameFile(before, again) {
		t.Errorf("the checkpoint resumed from was written again (%v)", err)
	}
}

// TestStrayTemporaryFolders: a resume removes the temporary folders of interrupted checkpoint
// writes, and nothing else.
func TestStrayTemporaryFolders(t *testing.T) {
	script := writeScript(t, counterScript)
	out := t.TempDir()
	r := counterRun(t, script, out, nil)
	if err := r.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	root := filepath.Join(out, "checkpoints")
	strays := []string{".step_2.tmp-123456", ".step_7.old-42"}
	kept := []string{".step_2.tmp-abc", "step_2.tmp-1", ".step_x.tmp-1", "notes"}
	for _, d := range append(append([]string(nil), strays...), kept...) {
		if err := os.MkdirAll(filepath.Join(root, d, "p"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(root, ".step_3.tmp-99"), []byte("a file, not a folder"), 0o644)
	kept = append(kept, ".step_3.tmp-99")
	r = counterRun(t, script, out, nil)
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	for _, d := range strays {
		if _, err := os.Stat(filepath.Join(root, d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s was not removed (%v)", d, err)
		}
	}
	for _, d := range kept {
		if _, err := os.Stat(filepath.Join(root, d)); err != nil {
			t.Errorf("%s, not a temporary folder of the host's, was removed: %v", d, err)
		}
	}
}

// TestAbandonedStepState: a step abandoned in its rollouts (on_signal: abandon) leaves the state
// store as the last completed step left it, so its checkpoint and a resumed run are as if the
// abandoned step had never started.
func TestAbandonedStepState(t *testing.T) {
	const src = `
def rollout(task):
    n = state.update("calls", lambda n: n + 1, 0)
    c = generate("p", task.prompt)
    reward(c, 1.0 if c.text == "a" else 0.0)
    train(c)
    log(calls = n)
`
	script := writeScript(t, src)
	whole := wholeCounterRun(t, script, 3)

	out := filepath.Join(t.TempDir(), "run")
	ctx, abandon := context.WithCancel(context.Background())
	defer abandon()
	var requests atomic.Int32
	eng := scripted.New(func(r scripted.Request) string {
		if requests.Add(1) > 4 { // step 2: the signal arrives while its rollouts run
			abandon()
		}
		return []string{"a", "b"}[r.Seed%2]
	})
	r, err := Load(context.Background(), script, Options{Config: testConfig(4, "p"), Out: out, Tasks: numberedTasks(4),
		Engines: map[string]engines.Engine{"p": eng}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned step: err = %v, want context.Canceled", err)
	}
	calls, _ := r.State().Get("calls")
	if r.StepsDone() != 1 || calls == nil || calls.String() != "4" {
		t.Fatalf("after the abandoned step: %d steps done, state calls = %v; want 1 and 4 (the first step's four rollouts)", r.StepsDone(), calls)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	if st := readFile(t, filepath.Join(ck, stateFile)); !strings.Contains(st, `"int": "4"`) {
		t.Errorf("the checkpoint's state.json holds the abandoned step's writes:\n%s", st)
	}
	r = counterRun(t, script, out, nil)
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, out); got != whole {
		t.Errorf("metrics after the abandoned step and a resume:\n%s\nwant\n%s", got, whole)
	}
}

// diskEngine is a scripted engine whose Save and Load use the disk of another machine: paths are
// taken under root (a folder standing for that machine's file system; "" is this machine's).
type diskEngine struct {
	*scripted.Engine
	root  string
	saves atomic.Int32
}

func (e *diskEngine) Save(ctx context.Context, dir string) error {
	e.saves.Add(1)
	return e.Engine.Save(ctx, filepath.Join(e.root, dir))
}

func (e *diskEngine) Load(ctx context.Context, dir string) error {
	return e.Engine.Load(ctx, filepath.Join(e.root, dir))
}

func remoteConfig(c *config.Config) {
	c.Policies[0].Engine.Kind = "remote"
	c.Policies[0].Engine.Address = "gpu7:50051"
}

// TestRemoteEngineCheckpoint: a remote engine on a disk the host cannot see saves into the final
// checkpoint path on its server, the manifest names it, and resume loads it from there; a copy
// the server lost is a clear error at resume. On a shared disk the state is moved into the
// checkpoint and checksummed like the rest.
func TestRemoteEngineCheckpoint(t *testing.T) {
	script := writeScript(t, counterScript)
	load := func(out string, eng engines.Engine) *Run {
		cfg := testConfig(4, "p")
		remoteConfig(cfg)
		r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(4),
			Engines: map[string]engines.Engine{"p": eng}})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	t.Run("server disk", func(t *testing.T) {
		server := t.TempDir()
		out := filepath.Join(t.TempDir(), "run")
		r := load(out, &diskEngine{Engine: scripted.Echo("a"), root: server})
		if err := r.Steps(context.Background(), 2); err != nil {
			t.Fatal(err)
		}
		ck, err := r.Checkpoint(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
		absCk, _ := filepath.Abs(ck)
		m, err := readManifest(ck)
		if err != nil {
			t.Fatal(err)
		}
		want := externalState{Dir: filepath.Join(absCk, "p"), Address: "gpu7:50051"}
		if m.External["p"] != want {
			t.Errorf("manifest external = %+v, want p: %+v", m.External, want)
		}
		if _, err := os.Stat(filepath.Join(server, want.Dir, "scripted.txt")); err != nil {
			t.Errorf("the server has no state at the path the manifest names: %v", err)
		}
		if !strings.Contains(readFile(t, filepath.Join(out, "events.log")), `policy "p": its engine at gpu7:50051 saves on its own disk`) {
			t.Error("events.log does not say where the remote policy's state is")
		}
		r = load(out, &diskEngine{Engine: scripted.Echo("a"), root: server})
		if err := r.restore(context.Background(), ck); err != nil {
			t.Fatalf("resume: %v", err)
		}
		r.Close()
		// The server lost its copy: resume fails, naming the policy, the folder and the server.
		os.RemoveAll(filepath.Join(server, want.Dir))
		r = load(out, &diskEngine{Engine: scripted.Echo("a"), root: server})
		defer r.Close()
		err = r.restore(context.Background(), ck)
		if err == nil || !strings.Contains(err.Error(), `policy "p"`) || !strings.Contains(err.Error(), want.Dir) ||
			!strings.Contains(err.Error(), "gpu7:50051") || !strings.Contains(err.Error(), "restore that folder on the server") {
			t.Errorf("resume without the server's copy: %v", err)
		}
	})
	t.Run("shared disk", func(t *testing.T) {
		out := filepath.Join(t.TempDir(), "run")
		r := load(out, &diskEngine{Engine: scripted.Echo("a")})
		if err := r.Steps(context.Background(), 2); err != nil {
			t.Fatal(err)
		}
		ck, err := r.Checkpoint(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
		m, err := readManifest(ck)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.External) != 0 || !m.holds("p") {
			t.Errorf("manifest: external %v, files %v; want p's files checksummed in the checkpoint", m.External, m.Files)
		}
		// Truncating the engine's file is caught: it is covered by the manifest.
		os.WriteFile(filepath.Join(ck, "p", "scripted.txt"), nil, 0o644)
		if err := VerifyCheckpoint(ck); err == nil || !strings.Contains(err.Error(), "p/scripted.txt") {
			t.Errorf("truncated engine file: %v", err)
		}
	})
	t.Run("local kind writing elsewhere", func(t *testing.T) {
		// A tiny-kind policy whose engine does not write on this disk: the checkpoint fails at once
		// rather than recording state that is not there.
		out := filepath.Join(t.TempDir(), "run")
		r, err := Load(context.Background(), script, Options{Config: testConfig(4, "p"), Out: out, Tasks: numberedTasks(4),
			Engines: map[string]engines.Engine{"p": &diskEngine{Engine: scripted.Echo("a"), root: t.TempDir()}}})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if err := r.Steps(context.Background(), 1); err != nil {
			t.Fatal(err)
		}
		_, err = r.Checkpoint(context.Background())
		if err == nil || !strings.Contains(err.Error(), "holds no files") {
			t.Errorf("Checkpoint = %v, want an error saying the engine wrote nothing here", err)
		}
		if steps := checkpointSteps(filepath.Join(out, "checkpoints")); len(steps) > 0 {
			t.Errorf("checkpoints %v were left in place", steps)
		}
	})
}

// TestFrozenPolicyNotSaved: a frozen policy's engine is never asked to save, and its checkpoints
// and resume work without it.
func TestFrozenPolicyNotSaved(t *testing.T) {
	const src = `
def rollout(task):
    j = generate("judge", task.prompt)
    c = generate("p", task.prompt)
    reward(c, 1.0 if j.text == c.text else 0.0)
    train(c)
`
	script := writeScript(t, src)
	out := t.TempDir()
	judge := &diskEngine{Engine: scripted.Echo("a")}
	cfg := testConfig(2, "p", "judge")
	cfg.Policies[1].Trainable = false
	cfg.Policies[1].Save = filepath.Join(t.TempDir(), "judge-save")
	cfg.Run.SaveInterval = 1
	open := func() *Run {
		r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(2),
			Engines: map[string]engines.Engine{"p": scripted.Echo("a"), "judge": judge}})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	r := open()
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if n := judge.saves.Load(); n != 0 {
		t.Errorf("the frozen judge's engine was asked to save %d times", n)
	}
	ck := filepath.Join(out, "checkpoints", "step_2")
	if _, err := os.Stat(filepath.Join(ck, "judge")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the checkpoint has a folder for the frozen judge (%v)", err)
	}
	if _, err := os.Stat(filepath.Join(ck, "p", "scripted.txt")); err != nil {
		t.Errorf("the trainable policy is not in the checkpoint: %v", err)
	}
	if _, err := os.Stat(cfg.Policies[1].Save); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the frozen judge's save: folder was written (%v)", err)
	}
	if ev := readFile(t, filepath.Join(out, "events.log")); !strings.Contains(ev, `policy "judge" is frozen (trainable: false): its save: folder`) {
		t.Errorf("no start-up warning about the frozen policy's save: folder:\n%s", ev)
	}
	r = open()
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
}

// tinyModel writes a small random tiny model folder.
func tinyModel(t *testing.T, seed uint64) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), fmt.Sprintf("model-%d", seed))
	e, err := tiny.New(tiny.ModelConfig{Hidden: 32, Intermediate: 64, Layers: 1, Heads: 2, KVHeads: 1, MaxSeqLen: 128}, seed, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Save(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	return dir
}

// tinyScript rewards the length of what the policy says, so every step trains.
const tinyScript = `
def rollout(task):
    cs = generate("p", task.prompt, n = 4)
    for c in cs:
        reward(c, float(len(c.text) % 3))
    train(cs)
`

func tinyConfig(model string, edit func(*config.PolicyConfig)) *config.Config {
	cfg := testConfig(2, "p")
	cfg.Policies[0].HFCheckpoint = model
	cfg.Policies[0].Engine.Threads = 1
	cfg.Rollout.MaxResponseLen = 8
	if edit != nil {
		edit(&cfg.Policies[0])
	}
	return cfg
}

func loadTiny(t *testing.T, script, out string, cfg *config.Config) *Run {
	t.Helper()
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestSaveFolder: a policy's save: folder holds its model folder (what its engine saves) as of
// the last checkpoint, with the step in latest_checkpointed_iteration.txt, and loads back.
func TestSaveFolder(t *testing.T) {
	script := writeScript(t, tinyScript)
	model := tinyModel(t, 1)
	save := filepath.Join(t.TempDir(), "ckpt", "actor")
	cfg := tinyConfig(model, func(p *config.PolicyConfig) { p.Save = save })
	cfg.Run.SaveInterval = 1
	out := t.TempDir()
	r := loadTiny(t, script, out, cfg)
	defer r.Close()
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	step1 := readFile(t, filepath.Join(save, "model.safetensors"))
	if got := readFile(t, filepath.Join(save, saveMarker)); got != "1\n" {
		t.Errorf("%s = %q after step 1", saveMarker, got)
	}
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	weights := readFile(t, filepath.Join(save, "model.safetensors"))
	if weights == step1 || weights == readFile(t, filepath.Join(model, "model.safetensors")) {
		t.Error("the save: folder does not follow training")
	}
	if want := readFile(t, filepath.Join(out, "checkpoints", "step_2", "p", "model.safetensors")); weights != want {
		t.Error("the save: folder's weights differ from step 2's checkpoint")
	}
	if got := readFile(t, filepath.Join(save, saveMarker)); got != "2\n" {
		t.Errorf("%s = %q after step 2", saveMarker, got)
	}
	if _, err := tiny.Open(save, tiny.Options{Threads: 1}); err != nil {
		t.Errorf("the save: folder does not load: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(save), ".actor.*")); len(left) > 0 {
		t.Errorf("temporary folders left beside the save: folder: %v", left)
	}

	// slime-n's idiom, load: and save: the same folder: the run starts from it and replaces it.
	cfg = tinyConfig(model, func(p *config.PolicyConfig) { p.Load, p.Save = save, save })
	cfg.Run.SaveInterval = 1
	r2 := loadTiny(t, script, t.TempDir(), cfg)
	defer r2.Close()
	if _, err := r2.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(save, saveMarker)); got != "1\n" || readFile(t, filepath.Join(save, "model.safetensors")) == weights {
		t.Errorf("load: = save: — the folder was not replaced by the new run's step 1 (%s = %q)", saveMarker, got)
	}

	// A save: folder that holds something other than a model folder is refused at start-up.
	other := t.TempDir()
	os.WriteFile(filepath.Join(other, "notes.txt"), []byte("mine"), 0o644)
	_, err := Load(context.Background(), script, Options{Config: tinyConfig(model, func(p *config.PolicyConfig) { p.Save = other }), Tasks: numberedTasks(2)})
	if err == nil || !strings.Contains(err.Error(), "not a model folder") || !strings.Contains(err.Error(), other) {
		t.Errorf("save: on a folder of other files: %v", err)
	}
	if _, err := os.Stat(filepath.Join(other, "notes.txt")); err != nil {
		t.Errorf("the folder's own file is gone: %v", err)
	}
}

// TestResumeWinsOverLoad: a policy with load: starts from that folder, but a resumed run takes
// the checkpoint's weights even when the load: folder has changed since.
func TestResumeWinsOverLoad(t *testing.T) {
	script := writeScript(t, tinyScript)
	loadDir := filepath.Join(t.TempDir(), "load")
	if err := os.Rename(tinyModel(t, 1), loadDir); err != nil {
		t.Fatal(err)
	}
	cfg := func() *config.Config {
		return tinyConfig("builtin:tiny-arith", func(p *config.PolicyConfig) { p.Load = loadDir })
	}
	whole := filepath.Join(t.TempDir(), "whole")
	r := loadTiny(t, script, whole, cfg())
	if err := r.Steps(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	r.Close()
	ms := metricsWithoutTimings(t, whole)
	if !strings.Contains(ms, `"grad_norm"`) || strings.Count(ms, `"grad_norm":0,`) == 4 {
		t.Fatalf("the policy did not train:\n%s", ms)
	}

	split := filepath.Join(t.TempDir(), "split")
	r = loadTiny(t, script, split, cfg())
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	ck, err := r.Checkpoint(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	// The load: folder now holds another model of the same shape.
	os.RemoveAll(loadDir)
	if err := os.Rename(tinyModel(t, 2), loadDir); err != nil {
		t.Fatal(err)
	}
	r = loadTiny(t, script, split, cfg())
	defer r.Close()
	if err := r.restore(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if err := r.Steps(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if got := metricsWithoutTimings(t, split); got != ms {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", ms, got)
	}
}

func TestStateRoundTrip(t *testing.T) {
	s := script.NewState()
	d := starlark.NewDict(2)
	d.SetKey(starlark.MakeInt(1), starlark.Tuple{starlark.String("x"), starlark.Float(0.1)})
	d.SetKey(starlark.String("big"), starlark.MakeInt64(1<<62))
	for k, v := range map[string]starlark.Value{"d": d, "l": starlark.NewList([]starlark.Value{starlark.None, starlark.True}), "f": starlark.Float(1.0)} {
		if err := s.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	b, err := script.EncodeState(s)
	if err != nil {
		t.Fatal(err)
	}
	s2 := script.NewState()
	if err := script.DecodeState(b, s2); err != nil {
		t.Fatal(err)
	}
	for _, k := range s.Keys() {
		a, _ := s.Get(k)
		c, _ := s2.Get(k)
		if a.String() != c.String() || a.Type() != c.Type() {
			t.Errorf("%s: %s (%s) became %s (%s)", k, a, a.Type(), c, c.Type())
		}
	}
}

// TestResumeScriptFallsBackToCopies: the recorded script is taken from the directory the run
// started in; when it is gone, the run directory's copy of the version the checkpoint ran, else
// the checkpoint's script.star.
func TestResumeScriptFallsBackToCopies(t *testing.T) {
	start, run := t.TempDir(), t.TempDir()
	ckpt := filepath.Join(run, "checkpoints", "step_2")
	hash := "0123456789abcdef"
	info := runInfo{Script: "ex/main.star", ScriptHash: hash, Dir: start}
	if err := os.MkdirAll(filepath.Join(start, "ex"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(start, "ex", "main.star"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, note := resumeScript(ckpt, info, false); got != filepath.Join(start, "ex", "main.star") || note != "" {
		t.Errorf("with the file in place: %q (%q)", got, note)
	}
	os.RemoveAll(filepath.Join(start, "ex"))
	if got, note := resumeScript(ckpt, info, false); got != filepath.Join(ckpt, "script.star") || !strings.Contains(note, "cannot be read") {
		t.Errorf("without the file or a kept version: %q (%q)", got, note)
	}
	kept := filepath.Join(run, "scripts", "step_1-"+hash[:12], "main.star")
	if err := os.MkdirAll(filepath.Dir(kept), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kept, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, _ := resumeScript(ckpt, info, false); got != kept {
		t.Errorf("with a kept version: %q, want %q", got, kept)
	}
}

// TestRebasePaths: a resumed run takes the config's relative local paths from the directory the
// run started in; names with a scheme, absolute paths and a remote engine's folders (paths on its
// server) stay as written.
func TestRebasePaths(t *testing.T) {
	c := config.Default([]string{"local", "far"})
	c.Data.Path = "data/train.jsonl"
	c.Eval.Datasets = []config.EvalDataset{{Name: "a", Path: "data/eval.jsonl"}, {Name: "b", Path: "synthetic:arith"}}
	c.Policies[0].HFCheckpoint, c.Policies[0].Save = "models/base", "/abs/save"
	c.Policies[1].Engine = config.EngineConfig{Kind: "remote", Address: "127.0.0.1:1", TLS: &config.TLSConfig{CA: "ca.pem"}}
	c.Policies[1].Save, c.Policies[1].HFCheckpoint = "ckpts/far", "builtin:tiny-arith"
	rebasePaths(c, "/start")
	for got, want := range map[*string]string{
		&c.Data.Path:                 "/start/data/train.jsonl",
		&c.Eval.Datasets[0].Path:     "/start/data/eval.jsonl",
		&c.Eval.Datasets[1].Path:     "synthetic:arith",
		&c.Policies[0].HFCheckpoint:  "/start/models/base",
		&c.Policies[0].Save:          "/abs/save",
		&c.Policies[1].Engine.TLS.CA: "/start/ca.pem",
		&c.Policies[1].Save:          "ckpts/far",
		&c.Policies[1].HFCheckpoint:  "builtin:tiny-arith",
	} {
		if *got != want {
			t.Errorf("got %q, want %q", *got, want)
		}
	}
}
