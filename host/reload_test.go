package host

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// saveByRename replaces a file the way editors save: a temporary file beside it, renamed over it.
func saveByRename(t *testing.T, path, text string) {
	t.Helper()
	tmp := path + ".tmp~"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

const reloadScript = "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n"

// reloadConfig is a one-policy config; lr, temperature and batch size vary between versions.
func reloadConfig(lr, temperature string, batch int, policyExtra string) string {
	return `policies:
  - name: p
    hf_checkpoint: builtin:tiny-arith
    engine: {kind: tiny}
    train: {lr: ` + lr + `}` + policyExtra + `
rollout: {batch_size: ` + strconv.Itoa(batch) + `, temperature: ` + temperature + `, max_response_len: 8}
data: {path: synthetic:arith}
run: {steps: 10, seed: 1}
`
}

// watchedRun loads reloadScript with the config file cfgFile on a scripted engine, writes into a
// run directory and watches the config. override is what the CLI applies to every config.
func watchedRun(t *testing.T, cfgFile string, override func(*config.Config) error) (*Run, *scripted.Engine, string) {
	t.Helper()
	dir := filepath.Dir(cfgFile)
	script := filepath.Join(dir, "s.star")
	if err := os.WriteFile(script, []byte(reloadScript), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	if override != nil {
		if err := override(cfg); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(dir, "run")
	eng := scripted.Echo("x")
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out, ConfigOverride: override,
		Engines: map[string]engines.Engine{"p": eng}, Tasks: numberedTasks(8)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	if err := r.Watch(cfgFile); err != nil {
		t.Fatal(err)
	}
	return r, eng, out
}

func step(t *testing.T, r *Run) *StepResult {
	t.Helper()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// lastStepSettings is the lr of the newest training batch and the temperatures of the generate
// requests made since the engine had seenCalls calls.
func lastStepSettings(eng *scripted.Engine, seenCalls int) (lr float64, temps []float64) {
	b := eng.Batches()
	lr = b[len(b)-1].Loss.LR
	for _, c := range eng.Calls()[seenCalls:] {
		for _, req := range c {
			temps = append(temps, req.Temperature)
		}
	}
	return lr, temps
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A config edit to lr, temperature and batch size takes effect at the next step boundary.
func TestReloadConfigHyperparameters(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 2, ""))
	r, eng, out := watchedRun(t, cfgFile, nil)

	if res := step(t, r); res.Run.Float("rollouts") != 2 {
		t.Fatalf("step 1 ran %v rollouts, want 2", res.Run.Float("rollouts"))
	}
	lr, temps := lastStepSettings(eng, 0)
	if lr != 1e-3 || len(temps) == 0 || temps[0] != 1.0 {
		t.Fatalf("step 1: lr %v, temperatures %v; want 1e-3 and 1.0", lr, temps)
	}
	calls := len(eng.Calls())

	saveByRename(t, cfgFile, reloadConfig("5.0e-3", "0.5", 3, ""))
	res := step(t, r)
	if res.Run.Float("rollouts") != 3 {
		t.Errorf("step 2 after batch_size 3 ran %v rollouts", res.Run.Float("rollouts"))
	}
	lr, temps = lastStepSettings(eng, calls)
	if lr != 5e-3 {
		t.Errorf("step 2 trained with lr %v, want the reloaded 5e-3", lr)
	}
	for _, temp := range temps {
		if temp != 0.5 {
			t.Errorf("step 2 sampled at temperature %v, want the reloaded 0.5 (all: %v)", temp, temps)
			break
		}
	}
	if got := r.Config().Rollout.BatchSize; got != 3 {
		t.Errorf("Config().Rollout.BatchSize = %d after the reload", got)
	}
	if !strings.Contains(readFile(t, filepath.Join(out, "config.yaml")), "batch_size: 3") {
		t.Errorf("the run directory's config.yaml was not rewritten:\n%s", readFile(t, filepath.Join(out, "config.yaml")))
	}
	if ev := readFile(t, filepath.Join(out, "events.log")); !strings.Contains(ev, "config takes effect from step 2") {
		t.Errorf("events.log does not report the reload:\n%s", ev)
	}
}

// A change that only a new engine could apply is refused with a message, and the run keeps its
// config (its lr and temperature too: the file is taken whole or not at all).
func TestReloadRefusesNewEngine(t *testing.T) {
	for _, tc := range []struct {
		name, extra, why string
	}{
		{"checkpoint", "\n    hf_checkpoint: builtin:other", "policies[p].hf_checkpoint"},
		{"engine kind", "\n    engine: {kind: remote, address: \"127.0.0.1:9\"}", "policies[p].engine"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfgFile := filepath.Join(t.TempDir(), "config.yaml")
			saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 2, ""))
			r, eng, out := watchedRun(t, cfgFile, nil)
			step(t, r)
			calls := len(eng.Calls())
			// The later key wins in the policy's mapping: replace the original line instead.
			text := reloadConfig("5.0e-3", "0.5", 2, "")
			if tc.name == "checkpoint" {
				text = strings.Replace(text, "builtin:tiny-arith", "builtin:other", 1)
			} else {
				text = strings.Replace(text, "engine: {kind: tiny}", strings.TrimSpace(tc.extra), 1)
			}
			saveByRename(t, cfgFile, text)
			step(t, r)
			ev := readFile(t, filepath.Join(out, "events.log"))
			want := "changes " + tc.why + ", which needs a new engine; restart the run to apply it"
			if !strings.Contains(ev, want) {
				t.Errorf("events.log lacks %q:\n%s", want, ev)
			}
			if strings.Contains(ev, "config takes effect") {
				t.Errorf("a refused config took effect:\n%s", ev)
			}
			if lr, temps := lastStepSettings(eng, calls); lr != 1e-3 || temps[0] != 1.0 {
				t.Errorf("after a refused reload: lr %v, temperature %v; want the old 1e-3 and 1.0", lr, temps[0])
			}
		})
	}
}

// The command line's overrides (--batch-size, --seed, --data) hold for a reloaded config too:
// an edit of lr alone changes lr alone.
func TestReloadKeepsOverrides(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 4, ""))
	seed, data := uint64(77), "synthetic:arith?difficulty=2"
	override := func(c *config.Config) error {
		if err := c.Override(config.Overrides{Seed: &seed, Data: &data}); err != nil {
			return err
		}
		c.Rollout.BatchSize = 2
		return nil
	}
	r, eng, out := watchedRun(t, cfgFile, override)
	if res := step(t, r); res.Run.Float("rollouts") != 2 {
		t.Fatalf("step 1 ran %v rollouts, want the override's 2", res.Run.Float("rollouts"))
	}
	saveByRename(t, cfgFile, reloadConfig("5.0e-3", "0.5", 4, ""))
	res := step(t, r)
	if res.Run.Float("rollouts") != 2 {
		t.Errorf("step 2 ran %v rollouts: the reload lost --batch-size 2", res.Run.Float("rollouts"))
	}
	if lr, _ := lastStepSettings(eng, 0); lr != 5e-3 {
		t.Errorf("step 2 trained with lr %v, want the reloaded 5e-3", lr)
	}
	c := r.Config()
	if c.Run.Seed != seed || c.Data.Path != data {
		t.Errorf("after the reload: seed %d, data %q; want the overrides %d, %q", c.Run.Seed, c.Data.Path, seed, data)
	}
	ev := readFile(t, filepath.Join(out, "events.log"))
	if !strings.Contains(ev, "config takes effect from step 2") || strings.Contains(ev, "needs a new engine") {
		t.Errorf("the reload was not accepted:\n%s", ev)
	}
}

// The file watcher is what reports a broken edit while no step boundary comes (a long step):
// no Step is called here.
func TestWatcherReportsBetweenSteps(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 2, ""))
	_, _, out := watchedRun(t, cfgFile, nil)
	script := filepath.Join(filepath.Dir(cfgFile), "s.star")
	saveByRename(t, script, "def rollout(task):\n    this is not starlark\n")
	waitForText(t, filepath.Join(out, "events.log"), "s.star is broken; the run keeps version")
	saveByRename(t, script, reloadScript+"    log(v = 2)\n")
	waitForText(t, filepath.Join(out, "events.log"), "is valid; it takes over at the next step")
	saveByRename(t, cfgFile, "policies: [")
	waitForText(t, filepath.Join(out, "events.log"), "config.yaml is invalid; the run keeps its config")
}

// waitForText polls a file until it contains want (a minute at most: the machine may be loaded).
func waitForText(t *testing.T, path, want string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		b, _ := os.ReadFile(path)
		if strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never contained %q:\n%s", path, want, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Every accepted version keeps all its files: a reload caused by an edit of a loaded helper
// saves the helper's new code, and the hash covers it.
func TestSavedVersionsKeepLoadedFiles(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "s.star")
	helper := filepath.Join(dir, "lib", "helpers.star")
	os.MkdirAll(filepath.Dir(helper), 0o755)
	saveByRename(t, script, "load(\"lib/helpers.star\", \"value\")\n\ndef rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n    log(v = value())\n")
	helperV := func(v int) string { return "def value():\n    return " + strconv.Itoa(v) + "\n" }
	saveByRename(t, helper, helperV(1))
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
	h1 := r.Script().Hash
	if res := step(t, r); res.Run.Float("v") != 1 {
		t.Fatalf("step 1 logged %v", res.Run.Float("v"))
	}
	saveByRename(t, helper, helperV(2))
	if res := step(t, r); res.Run.Float("v") != 2 {
		t.Fatalf("step 2 after the helper's edit logged %v", res.Run.Float("v"))
	}
	h2 := r.Script().Hash
	if h1 == h2 {
		t.Fatal("the hash did not change with the helper")
	}
	for _, v := range []struct {
		step   int
		hash   string
		helper string
	}{{1, h1, helperV(1)}, {2, h2, helperV(2)}} {
		vdir := filepath.Join(out, "scripts", "step_"+strconv.Itoa(v.step)+"-"+v.hash[:12])
		if got := readFile(t, filepath.Join(vdir, "lib", "helpers.star")); got != v.helper {
			t.Errorf("%s: helpers.star = %q, want %q", vdir, got, v.helper)
		}
		if got := readFile(t, filepath.Join(vdir, "s.star")); !strings.Contains(got, "log(v = value())") {
			t.Errorf("%s: s.star = %q", vdir, got)
		}
	}
	entries, _ := os.ReadDir(filepath.Join(out, "scripts"))
	if len(entries) != 2 {
		t.Errorf("scripts/ holds %d entries, want the two versions", len(entries))
	}
}

// A config that lists no policies leaves them to the script; reloading it keeps the policies the
// script created instead of refusing the new list as a change of engines.
func TestReloadConfigWithoutPolicies(t *testing.T) {
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "config.yaml")
	saveByRename(t, cfgFile, "rollout: {batch_size: 2}\n")
	script := filepath.Join(dir, "s.star")
	if err := os.WriteFile(script, []byte(reloadScript), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "run")
	r, err := Load(context.Background(), script, Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(8)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Watch(cfgFile); err != nil {
		t.Fatal(err)
	}
	step(t, r)
	saveByRename(t, cfgFile, "rollout: {batch_size: 3}\n")
	if res := step(t, r); res.Run.Float("rollouts") != 3 {
		t.Errorf("step 2 ran %v rollouts, want the reloaded 3\n%s", res.Run.Float("rollouts"), readFile(t, filepath.Join(out, "events.log")))
	}
	if ps := r.Config().Policies; len(ps) != 1 || ps[0].Name != "p" {
		t.Errorf("policies after the reload: %+v", ps)
	}
}

// A reloaded batch size takes tasks on from where the last step stopped: none skipped, none
// repeated, and a checkpoint remembers the position.
func TestReloadedBatchSizeKeepsTheDataPosition(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 2, ""))
	r, eng, out := watchedRun(t, cfgFile, nil)
	prompts := func(from int) []string {
		var ps []string
		for _, c := range eng.Calls()[from:] {
			for _, req := range c {
				ps = append(ps, req.Messages[0].Content)
			}
		}
		return ps
	}
	step(t, r)
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 3, ""))
	step(t, r)
	got := prompts(0)
	slices.Sort(got) // the order within a step is the engine batches'; what matters is the set
	if want := []string{"q0", "q1", "q2", "q3", "q4"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("prompts of steps 1 (batch 2) and 2 (batch 3): %v, want %v", got, want)
	}
	if _, err := r.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.Close() // one writer per run folder

	// A run resumed from that checkpoint goes on at task 5.
	cfg, err := config.Load(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	eng2 := scripted.Echo("x")
	r2, err := Load(context.Background(), filepath.Join(filepath.Dir(cfgFile), "s.star"), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": eng2}, Tasks: numberedTasks(8)})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	dir, _, err := FindCheckpoint(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.restore(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	step(t, r2)
	var next []string
	for _, c := range eng2.Calls() {
		for _, req := range c {
			next = append(next, req.Messages[0].Content)
		}
	}
	slices.Sort(next)
	if want := []string{"q5", "q6", "q7"}; strings.Join(next, " ") != strings.Join(want, " ") {
		t.Fatalf("the resumed run's step 3: %v, want %v", next, want)
	}
}

// TestWatchRefusesAndRollsBack: an edit that names a policy the run does not have is refused
// before it is swapped in (the checks of slimen check --config), and an edit whose first step
// fails too many rollouts is rolled back: the last good version runs that step again, and the
// run goes on.
func TestWatchRefusesAndRollsBack(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s.star")
	write := func(src string) {
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	good := "def rollout(task):\n    c = generate(\"p\", task.prompt, n = 2)\n    reward(c, 1.0)\n    train(c)\n    log(version = 1)\n"
	write(good)
	out := filepath.Join(dir, "run")
	r, err := Load(deadline(t, time.Minute), path, Options{Config: testConfig(2, "p"), Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Watch(""); err != nil {
		t.Fatal(err)
	}
	stepOK(t, r)
	write(strings.ReplaceAll(good, `generate("p"`, `generate("q"`))
	if res := stepOK(t, r); res.Run.Float("version") != 1 {
		t.Fatalf("a version naming an unknown policy was swapped in")
	}
	write(strings.ReplaceAll(good, "log(version = 1)", "log(version = 2)\n    fail(\"broken\")"))
	res, err := r.Step(deadline(t, time.Minute))
	if err != nil {
		t.Fatalf("a version whose first step fails stopped the run: %v", err)
	}
	if res.Step != 3 || res.Run.Float("version") != 1 || len(res.Failed) != 0 {
		t.Fatalf("step %d ran version %v with %d failures; want step 3 on version 1, none failed", res.Step, res.Run["version"], len(res.Failed))
	}
	if res := stepOK(t, r); res.Run.Float("version") != 1 {
		t.Fatalf("the rolled-back version came back at step 4")
	}
	events := readFile(t, filepath.Join(out, "events.log"))
	for _, want := range []string{`unknown policy "q" (did you mean "p"?)`, "failed its first step (step 3), so the run goes back to version"} {
		if !strings.Contains(events, want) {
			t.Errorf("events.log lacks %q:\n%s", want, events)
		}
	}
}

// A reloaded config that turns use_tis on for a policy whose engine lacks the correction is
// refused, as it would be at start-up, and the run keeps training without it.
func TestReloadRefusesUseTISOnAnEngineWithoutIt(t *testing.T) {
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	saveByRename(t, cfgFile, reloadConfig("1.0e-3", "1.0", 2, ""))
	r, eng, out := watchedRun(t, cfgFile, nil)
	step(t, r)
	saveByRename(t, cfgFile, strings.Replace(reloadConfig("1.0e-3", "1.0", 2, ""), "{lr: 1.0e-3}", "{lr: 1.0e-3, use_tis: true}", 1))
	step(t, r)
	ev := readFile(t, filepath.Join(out, "events.log"))
	if want := `train.use_tis needs an engine that applies the off-policy correction`; !strings.Contains(ev, want) || !strings.Contains(ev, `policy "p"`) || strings.Contains(ev, "config takes effect") {
		t.Errorf("events.log lacks %q, or the config took effect:\n%s", want, ev)
	}
	if b := eng.Batches(); b[len(b)-1].Loss.UseTIS {
		t.Error("the refused use_tis reached the engine")
	}
}

// TestWatchRefusesARenamedPolicy: in a zero-config run, an edit whose only policy name is a
// letter from the trained one it no longer uses is a typo that would train a fresh model from
// scratch; the version is refused, naming both, and the trained policy keeps going. A version
// that adds a near name beside the old one, or a name far from any, is taken.
func TestWatchRefusesARenamedPolicy(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s.star")
	write := func(src string) {
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	good := "SOLVER = \"solver\"\n\ndef rollout(task):\n    c = generate(SOLVER, task.prompt, n = 2)\n    reward(c, 1.0)\n    train(c)\n    log(version = 1)\n"
	write(good)
	out := filepath.Join(dir, "run")
	r, err := Load(deadline(t, time.Minute), path, Options{Out: out, Tasks: numberedTasks(2),
		OpenEngine: func(context.Context, config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Watch(""); err != nil {
		t.Fatal(err)
	}
	stepOK(t, r)
	write(strings.ReplaceAll(strings.ReplaceAll(good, `"solver"`, `"sovler"`), "version = 1", "version = 2"))
	if res := stepOK(t, r); res.Run.Float("version") != 1 {
		t.Fatalf("a version that renames the trained policy by a typo was swapped in")
	}
	if ps := r.Config().Policies; len(ps) != 1 || ps[0].Name != "solver" {
		t.Errorf("policies after the refused edit: %+v, want solver alone", ps)
	}
	events := readFile(t, filepath.Join(out, "events.log"))
	if want := `s.star:1:10: SOLVER → generate: policy "sovler" is new to the run, and this version no longer uses the run's policy "solver"`; !strings.Contains(events, want) {
		t.Errorf("events.log lacks %q:\n%s", want, events)
	}
	write(strings.ReplaceAll(good, "log(version = 1)", "log(version = 3)\n    generate(\"solver2\", task.prompt)"))
	if res := stepOK(t, r); res.Run.Float("version") != 3 {
		t.Fatalf("a version that adds a policy beside the trained one was refused:\n%s", readFile(t, filepath.Join(out, "events.log")))
	}
	write(strings.ReplaceAll(strings.ReplaceAll(good, `"solver"`, `"writer"`), "version = 1", "version = 4"))
	if res := stepOK(t, r); res.Run.Float("version") != 4 {
		t.Fatalf("a version with a new name far from the old one was refused:\n%s", readFile(t, filepath.Join(out, "events.log")))
	}
}
