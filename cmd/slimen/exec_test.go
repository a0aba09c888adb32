package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/host"
)

// These tests run the slimen binary the way a user does.

var slimenBin string

// testRoot is the package's temporary folder: the binary, and what tests share (torchModels).
var testRoot string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "slimen-bin")
	if err != nil {
		panic(err)
	}
	testRoot = dir
	slimenBin = filepath.Join(dir, "slimen")
	if out, err := exec.Command("go", "build", "-o", slimenBin, ".").CombinedOutput(); err != nil {
		panic(string(out))
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// smallRun writes a two-policy debate config on builtin:tiny-arith that trains for real (the
// debate's answers disagree, so rewards vary within groups and the weights move every step) and
// stays fast: two tasks a step, responses of at most 12 tokens.
func smallRun(t *testing.T, steps string, extra string) (cfg string) {
	t.Helper()
	cfg = filepath.Join(t.TempDir(), "config.yaml")
	y := `policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}, train: {lr: 1.0e-3, global_batch_size: 0}}
  - {name: critic, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}, train: {lr: 1.0e-3, global_batch_size: 0}}
rollout: {batch_size: 2, max_response_len: 12}
run: {steps: ` + steps + `, seed: 3` + extra + `}
`
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// debate is the debate example under slime-n's agreement rule (see the file), run from the
// repository root.
const debate = "cmd/slimen/testdata/consensus_debate.star"

func slimen(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(slimenBin, args...)
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// signalled runs slimen and, when a line of its output starts with prefix, waits delay and sends
// it the signals (20 ms apart). It returns the output and the exit error. The delay puts the
// signal inside the step that starts after the line, whatever the scheduling of a loaded machine
// does to the moment the line is read.
func signalled(t *testing.T, prefix string, delay time.Duration, sigs []syscall.Signal, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(slimenBin, args...)
	cmd.Dir = "../.."
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	sent := false
	for sc.Scan() {
		line := sc.Text()
		log.WriteString(line + "\n")
		// The first signal goes when prefix shows; each further one once the run has said it is
		// stopping, so the kernel cannot merge two pending signals into one on a loaded machine.
		switch {
		case len(sigs) == 0:
		case !sent && strings.HasPrefix(line, prefix):
			time.Sleep(delay)
		case sent && strings.HasPrefix(line, "slimen: stopping"):
		default:
			continue
		}
		if len(sigs) > 0 {
			cmd.Process.Signal(sigs[0])
			sigs, sent = sigs[1:], true
		}
	}
	return log.String(), cmd.Wait()
}

func metricsNoTimings(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	return host.WithoutTimings(string(b))
}

// checkTrains fails unless every policy has a step among the first `by` with grad_norm > 0: a run
// whose weights never move cannot tell a restored checkpoint from a lost one.
func checkTrains(t *testing.T, dir string, by int) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	moved := map[string]bool{"generator": false, "critic": false}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m struct {
			Step     int     `json:"step"`
			Policy   string  `json:"policy"`
			GradNorm float64 `json:"grad_norm"`
		}
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		if _, ok := moved[m.Policy]; ok && m.Step <= by && m.GradNorm > 0 {
			moved[m.Policy] = true
		}
	}
	for p, ok := range moved {
		if !ok {
			t.Errorf("policy %s has grad_norm 0 in steps 1 to %d: the run does not train", p, by)
		}
	}
}

func steps(t *testing.T, dir string) int {
	return strings.Count(metricsNoTimings(t, dir), `"_run"`)
}

func TestSameSeedSameMetrics(t *testing.T) {
	cfg := smallRun(t, "3", "")
	a, b := filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")
	for _, out := range []string{a, b} {
		if log, err := slimen(t, nil, "exec", debate, "--config", cfg, "--out", out); err != nil {
			t.Fatalf("%v\n%s", err, log)
		}
	}
	ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b)
	if ma != mb {
		t.Errorf("same seed, different metrics:\n%s\n---\n%s", ma, mb)
	}
	if n := steps(t, a); n != 3 {
		t.Errorf("%d steps, want 3:\n%s", n, ma)
	}
	checkTrains(t, a, 3)
}

// TestResumeAfterSIGTERM is issue 9's acceptance: the debate example for 6 steps in one go, and
// for 3 steps stopped by SIGTERM, then resumed for 3 more, write the same metrics apart from
// timings. The runs train, so a resume that lost the weights or the optimizer would differ.
func TestResumeAfterSIGTERM(t *testing.T) {
	cfg := smallRun(t, "6", "")
	whole, split := filepath.Join(t.TempDir(), "whole"), filepath.Join(t.TempDir(), "split")
	if log, err := slimen(t, nil, "exec", debate, "--config", cfg, "--out", whole); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	checkTrains(t, whole, 3)
	// SIGTERM once step 2 is done: the step in progress (3, or none if the signal comes between
	// steps) finishes, is checkpointed, and the run stops; a step takes a tenth of a second, so
	// which one it is depends on the machine.
	log, err := signalled(t, "step 2/6", 0, []syscall.Signal{syscall.SIGTERM}, "exec", debate, "--config", cfg, "--out", split)
	if err != nil {
		t.Fatalf("SIGTERM: exit %v, want 0\n%s", err, log)
	}
	m := regexp.MustCompile(`stopped after (\d+) steps`).FindStringSubmatch(log)
	if m == nil || m[1] == "6" {
		t.Fatalf("the run did not stop early:\n%s", log)
	}
	n, _ := strconv.Atoi(m[1])
	if ck, skipped, err := host.FindCheckpoint(split); err != nil || filepath.Base(ck) != fmt.Sprintf("step_%d", n) || len(skipped) > 0 {
		t.Fatalf("FindCheckpoint = %q, %v, %v; want step_%d", ck, skipped, err, n)
	}
	if got := steps(t, split); got != n {
		t.Fatalf("%d steps in metrics when stopped after %d", got, n)
	}
	out, err := slimen(t, nil, "exec", "--resume", split)
	if err != nil {
		t.Fatalf("resume: %v\n%s", err, out)
	}
	if !strings.Contains(out, fmt.Sprintf("(steps %d to 6,", n+1)) {
		t.Errorf("the resumed run does not go on at step %d:\n%s", n+1, out)
	}
	if a, b := metricsNoTimings(t, whole), metricsNoTimings(t, split); a != b {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", a, b)
	}
}

// stateDebate is the debate with a `state` counter bumped as each rollout starts and logged.
// Step 2's rollouts dawdle after the bump, so that a signal sent as step 2 starts lands in them.
const stateDebate = `load("@graphs//debate.star", "debate")

def rollout(task):
    n = state.update("calls", lambda n: n + 1, 0)
    if task.step == 2:
        for i in range(2000000):
            pass
    debate(task, generator = "generator", critic = "critic", agents = 3, rounds = 2)
    log(calls = n)
`

// TestAbandonOnSignal: with run.on_signal: abandon, SIGTERM as step 2 starts cuts it short; the
// run exits 0 with a checkpoint of step 1 that holds none of step 2's state writes, and resuming
// it equals a run that never stopped.
func TestAbandonOnSignal(t *testing.T) {
	cfg := smallRun(t, "3", ", on_signal: abandon")
	script := filepath.Join(t.TempDir(), "debate.star")
	if err := os.WriteFile(script, []byte(stateDebate), 0o644); err != nil {
		t.Fatal(err)
	}
	whole, split := filepath.Join(t.TempDir(), "whole"), filepath.Join(t.TempDir(), "split")
	if log, err := slimen(t, nil, "exec", script, "--config", cfg, "--out", whole); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	log, err := signalled(t, "step 1/3", 50*time.Millisecond, []syscall.Signal{syscall.SIGTERM}, "exec", script, "--config", cfg, "--out", split)
	if err != nil {
		t.Fatalf("SIGTERM: exit %v, want 0\n%s", err, log)
	}
	if !strings.Contains(log, "abandoning the step in progress") || !strings.Contains(log, "stopped after 1 steps") {
		t.Fatalf("step 2 was not abandoned:\n%s", log)
	}
	ck, _, err := host.FindCheckpoint(split)
	if err != nil || filepath.Base(ck) != "step_1" {
		t.Fatalf("FindCheckpoint = %q, %v; want step_1", ck, err)
	}
	st, err := os.ReadFile(filepath.Join(ck, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(st), `"int": "2"`) {
		t.Errorf("step_1's state.json should count step 1's two rollouts only:\n%s", st)
	}
	if out, err := slimen(t, nil, "exec", "--resume", split); err != nil {
		t.Fatalf("resume: %v\n%s", err, out)
	}
	if a, b := metricsNoTimings(t, whole), metricsNoTimings(t, split); a != b {
		t.Errorf("resumed run's metrics differ:\n%s\n---\n%s", a, b)
	}
}

// TestSecondSignal: a second signal exits at once with a nonzero status, and the last good
// checkpoint is intact and resumes.
func TestSecondSignal(t *testing.T) {
	cfg := smallRun(t, "4", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	// Both signals land in step 3: the first as it starts, the second once the run says it stops.
	log, err := signalled(t, "step 2/4", 0, []syscall.Signal{syscall.SIGTERM, syscall.SIGTERM}, "exec", debate, "--config", cfg, "--out", out)
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 130 {
		t.Fatalf("exit %v, want status 130\n%s", err, log)
	}
	if !strings.Contains(log, "second signal: exiting now") || strings.Contains(log, "stopped after") {
		t.Fatalf("the second signal did not exit at once:\n%s", log)
	}
	ck, skipped, err := host.FindCheckpoint(out)
	if err != nil || filepath.Base(ck) != "step_2" || len(skipped) > 0 {
		t.Fatalf("FindCheckpoint = %q, %v, %v; want an intact step_2", ck, skipped, err)
	}
	if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
		t.Fatalf("resume: %v\n%s", err, log)
	}
	if n := steps(t, out); n != 4 {
		t.Errorf("%d steps in metrics after resume, want 4", n)
	}
}

// TestResumeFromChosenCheckpoint: --resume RUN_DIR/checkpoints/step_N goes back to step N, and
// --resume RUN_DIR with a corrupt newest checkpoint warns, naming it, and goes on from the one
// before; both end where the uninterrupted run ended.
func TestResumeFromChosenCheckpoint(t *testing.T) {
	cfg := smallRun(t, "3", ", save_interval: 1, keep_checkpoints: 0")
	out := filepath.Join(t.TempDir(), "run")
	if log, err := slimen(t, nil, "exec", debate, "--config", cfg, "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	checkTrains(t, out, 1)
	want := metricsNoTimings(t, out)
	root := filepath.Join(out, "checkpoints")

	log, err := slimen(t, nil, "exec", "--resume", filepath.Join(root, "step_1"))
	if err != nil {
		t.Fatalf("resume from step_1: %v\n%s", err, log)
	}
	if !strings.Contains(log, "(steps 2 to 3,") {
		t.Errorf("the run does not go on at step 2:\n%s", log)
	}
	if got := metricsNoTimings(t, out); got != want {
		t.Errorf("after resuming from step_1:\n%s\nwant\n%s", got, want)
	}

	state := filepath.Join(root, "step_3", "state.json")
	if err := os.WriteFile(state, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	log, err = slimen(t, nil, "exec", "--resume", out)
	if err != nil {
		t.Fatalf("resume with a corrupt newest checkpoint: %v\n%s", err, log)
	}
	if !strings.Contains(log, "warning: checkpoint "+filepath.Join(root, "step_3")+": file state.json has 0 bytes") ||
		!strings.Contains(log, "resuming from "+filepath.Join(root, "step_2")) || !strings.Contains(log, "(steps 3 to 3,") {
		t.Errorf("no warning naming the corrupt step_3, or not resumed from step_2:\n%s", log)
	}
	if got := metricsNoTimings(t, out); got != want {
		t.Errorf("after resuming past the corrupt step_3:\n%s\nwant\n%s", got, want)
	}
	if err := host.VerifyCheckpoint(filepath.Join(root, "step_3")); err != nil {
		t.Errorf("step_3 was not written again: %v", err)
	}
}

// TestSIGKILLDuringCheckpoint kills the process halfway through writing step 2's checkpoint: the
// partial write is never taken for a checkpoint, resume goes on from step 1's and removes the
// partial write.
func TestSIGKILLDuringCheckpoint(t *testing.T) {
	cfg := smallRun(t, "3", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	_, err := slimen(t, []string{"SLIMEN_TEST_SIGKILL_IN_CHECKPOINT=2"}, "exec", debate, "--config", cfg, "--out", out)
	if ee, ok := err.(*exec.ExitError); !ok || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the run was not killed: %v", err)
	}
	ck, _, err := host.FindCheckpoint(out)
	if err != nil || filepath.Base(ck) != "step_1" {
		t.Fatalf("FindCheckpoint = %q, %v; want step_1", ck, err)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoints", "step_2")); err == nil {
		t.Fatal("a half-written step_2 exists")
	}
	partial, _ := filepath.Glob(filepath.Join(out, "checkpoints", ".step_2.tmp-*"))
	if len(partial) != 1 {
		t.Fatalf("partial writes %v, want one .step_2.tmp-* folder", partial)
	}
	if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
		t.Fatalf("resume: %v\n%s", err, log)
	}
	if n := steps(t, out); n != 3 {
		t.Errorf("%d steps in metrics after resume, want 3", n)
	}
	if _, err := os.Stat(partial[0]); err == nil {
		t.Errorf("the partial write %s is still there after resume", partial[0])
	}
}

// TestResumeFromAnotherDirectory (issue 15): a run started with a relative script and data path
// resumes from any working directory — the script and data.path are found where the run started
// (run.json's dir) — and ends where the uninterrupted run ended.
func TestResumeFromAnotherDirectory(t *testing.T) {
	proj := t.TempDir()
	src, err := os.ReadFile(filepath.Join("../..", debate))
	if err != nil {
		t.Fatal(err)
	}
	var data strings.Builder
	for i := range 16 {
		fmt.Fprintf(&data, "{\"prompt\": \"What is %d + %d?\", \"label\": \"%d\"}\n", i, 2*i+1, 3*i+1)
	}
	y := `policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}, train: {lr: 1.0e-3, global_batch_size: 0}}
  - {name: critic, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}, train: {lr: 1.0e-3, global_batch_size: 0}}
rollout: {batch_size: 2, max_response_len: 12}
data: {path: data/tasks.jsonl}
run: {steps: 3, seed: 3, save_interval: 1, keep_checkpoints: 0}
`
	for name, b := range map[string]string{"debate.star": string(src), "data/tasks.jsonl": data.String(), "config.yaml": y} {
		os.MkdirAll(filepath.Dir(filepath.Join(proj, name)), 0o755)
		if err := os.WriteFile(filepath.Join(proj, name), []byte(b), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run := func(dir string, args ...string) string {
		t.Helper()
		cmd := exec.Command(slimenBin, args...)
		cmd.Dir = dir
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("slimen %s in %s: %v\n%s", strings.Join(args, " "), dir, err, b)
		}
		return string(b)
	}
	out := filepath.Join(t.TempDir(), "run")
	run(proj, "exec", "debate.star", "--config", "config.yaml", "--out", out)
	checkTrains(t, out, 2)
	want := metricsNoTimings(t, out)

	// Neither the script nor the data is reachable by its relative path from here.
	log := run(t.TempDir(), "exec", "--resume", filepath.Join(out, "checkpoints", "step_1"))
	if !strings.Contains(log, "(steps 2 to 3,") {
		t.Errorf("the run does not go on at step 2:\n%s", log)
	}
	if got := metricsNoTimings(t, out); got != want {
		t.Errorf("after resuming from another directory:\n%s\nwant\n%s", got, want)
	}
}

// loopingDebate is the debate until step %d (a format verb), from which every other rollout loops forever.
const loopingDebate = `load("@graphs//debate.star", "debate")

def rollout(task):
    debate(task, generator = "generator", critic = "critic", agents = 2, rounds = 1)
    n = state.update("rollouts", lambda n: n + 1, 0)
    if task.step >= %d and n %% 2 == 0:
        while True:
            pass
`

// loopingRun writes loopingDebate, looping from step from, and a config with the given rollout:
// and run: settings.
func loopingRun(t *testing.T, from int, rollout, run string) (script, cfg string) {
	t.Helper()
	dir := t.TempDir()
	script, cfg = filepath.Join(dir, "loop.star"), filepath.Join(dir, "config.yaml")
	y := `policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
  - {name: critic, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
rollout: {batch_size: 2, max_response_len: 8` + rollout + `}
run: {steps: 3, seed: 3` + run + `}
`
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(script, []byte(fmt.Sprintf(loopingDebate, from)), 0o644); err != nil {
		t.Fatal(err)
	}
	return script, cfg
}

// TestSignalEndsEndlessLoop: SIGTERM while a rollout loops forever (no --sandbox, no time limit)
// ends the step once rollout.stop_grace_s has passed: the looping rollout is cancelled, and the
// step, no longer whole, is neither trained nor checkpointed (issue 39: it used to train the other
// rollout and save the cut step as complete); the checkpoint is step 1's and the run exits 0.
func TestSignalEndsEndlessLoop(t *testing.T) {
	script, cfg := loopingRun(t, 2, ", timeout_s: 0, stop_grace_s: 1", "")
	out := filepath.Join(t.TempDir(), "run")
	t0 := time.Now()
	log, err := signalled(t, "step 1/3", 50*time.Millisecond, []syscall.Signal{syscall.SIGTERM}, "exec", script, "--config", cfg, "--out", out)
	if err != nil {
		t.Fatalf("SIGTERM: exit %v, want 0\n%s", err, log)
	}
	if took := time.Since(t0); took > 60*time.Second {
		t.Errorf("the run took %v to stop with a 1s grace", took)
	}
	for _, want := range []string{"rollouts still running in 1s are cancelled", "step 2 was cut by the stop: 1 of its 2 rollouts were still running 1s after it (rollout.stop_grace_s)",
		"the checkpoint holds step 1, the last whole step", "stopped after 1 steps"} {
		if !strings.Contains(log, want) {
			t.Fatalf("no %q in the output:\n%s", want, log)
		}
	}
	if ck, _, err := host.FindCheckpoint(out); err != nil || filepath.Base(ck) != "step_1" {
		t.Fatalf("FindCheckpoint = %q, %v; want step_1", ck, err)
	}
	if !strings.Contains(log, "checkpoint in "+filepath.Join(out, "checkpoints", "step_1")) {
		t.Errorf("the last line does not name the checkpoint:\n%s", log)
	}
}

// TestAbandonClaimsNoCheckpoint: with run.on_signal: abandon, a signal during the first step
// leaves no checkpoint, and the CLI does not claim one.
func TestAbandonClaimsNoCheckpoint(t *testing.T) {
	script, cfg := loopingRun(t, 1, "", ", on_signal: abandon")
	out := filepath.Join(t.TempDir(), "run")
	log, err := signalled(t, "slimen: "+script, 50*time.Millisecond, []syscall.Signal{syscall.SIGTERM}, "exec", script, "--config", cfg, "--out", out)
	if err != nil {
		t.Fatalf("SIGTERM: exit %v, want 0\n%s", err, log)
	}
	if !strings.Contains(log, "stopped after 0 steps") || !strings.Contains(log, "no checkpoint (no step completed)") ||
		strings.Contains(log, "checkpoint in") {
		t.Fatalf("the output claims a checkpoint, or the run did not stop in step 1:\n%s", log)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoints")); err == nil {
		t.Errorf("a checkpoints folder was written")
	}
}
