package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The traps of issue 35, run the way a user meets them.

// Bad input is exit status 2, said before the run starts: an --out that cannot be made, an eval
// file that does not exist (found at start-up, not after the first step's training).
func TestBadInputExitsTwoBeforeTheRun(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "afile")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(`policies:
  - {name: generator, hf_checkpoint: builtin:tiny-arith}
  - {name: critic, hf_checkpoint: builtin:tiny-arith}
rollout: {batch_size: 2, max_response_len: 8}
run: {steps: 1}
eval: {datasets: [{name: held, path: `+filepath.Join(dir, "nowhere.jsonl")+`}]}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"--out under a file", []string{"exec", debate, "--steps", "1", "--out", filepath.Join(file, "run")},
			"run directory " + filepath.Join(file, "run") + " cannot be made"},
		{"a missing eval file", []string{"exec", debate, "--config", cfg, "--out", filepath.Join(dir, "run")},
			`eval dataset "held": data: ` + filepath.Join(dir, "nowhere.jsonl") + " does not exist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := slimen(t, nil, tc.args...)
			if code := exitCode(t, err); code != 2 || !strings.Contains(out, tc.want) {
				t.Errorf("exit status %d, output:\n%s\nwant 2 and %q", code, out, tc.want)
			}
			if strings.Contains(out, "(steps 1 to") || strings.Contains(out, "eval ") && strings.Contains(out, " at step 0") {
				t.Errorf("the run started before the bad input was found:\n%s", out)
			}
		})
	}
}

// Resume's traps: a finished run is said to be finished, with the way to run more steps (it
// printed "steps 3 to 2" and exited 0); a checkpoint that does not exist is said not to exist,
// naming those that do (it was "incomplete: no MANIFEST.json"); the same script from another
// folder is the same version (it was "the script differs").
func TestResumeTraps(t *testing.T) {
	dir := t.TempDir()
	src, err := os.ReadFile("../../" + debate)
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "elsewhere", filepath.Base(debate))
	if err := os.MkdirAll(filepath.Dir(other), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(other, src, 0o644); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(dir, "run")
	if out, err := slimen(t, nil, "exec", debate, "--config", smallRun(t, "1", ""), "--out", run); err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	out, err := slimen(t, nil, "exec", "--resume", run)
	if want := run + " is finished: it ran 1 of its 1 steps (run.steps); to run more, resume with --steps N, N > 1"; exitCode(t, err) != 2 || !strings.Contains(out, want) || strings.Contains(out, "steps 2 to 1") {
		t.Errorf("resuming a finished run: status %d, output:\n%s\nwant status 2 and %q", exitCode(t, err), out, want)
	}
	out, err = slimen(t, nil, "exec", "--resume", filepath.Join(run, "checkpoints", "step_7"))
	if want := "resume " + filepath.Join(run, "checkpoints", "step_7") + ": it does not exist (give a run folder or one of its checkpoints/step_N); " + filepath.Join(run, "checkpoints") + " holds step_1"; exitCode(t, err) != 2 || !strings.Contains(out, want) {
		t.Errorf("resuming a checkpoint that does not exist: status %d, output:\n%s\nwant status 2 and %q", exitCode(t, err), out, want)
	}
	out, err = slimen(t, nil, "exec", "--resume", run, other, "--steps", "2")
	if err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if strings.Contains(out, "differs") {
		t.Errorf("the same script from another folder is called another version:\n%s", out)
	}
	if entries, _ := os.ReadDir(filepath.Join(run, "scripts")); len(entries) != 1 {
		t.Errorf("scripts/ holds %d versions of one script, want 1", len(entries))
	}
}

// Help asked for is an answer, on stdout (slimen exec --help | less), and --version exists; a
// bare slimen is still the usage on stderr and status 2 (issue 35).
func TestHelpOnStdoutAndVersion(t *testing.T) {
	run := func(args ...string) (stdout, stderr string, code int) {
		cmd := exec.Command(slimenBin, args...)
		var o, e strings.Builder
		cmd.Stdout, cmd.Stderr = &o, &e
		err := cmd.Run()
		return o.String(), e.String(), exitCode(t, err)
	}
	for _, args := range [][]string{{"--help"}, {"help"}, {"exec", "--help"}, {"check", "-h"}, {"export", "--help"}} {
		o, e, code := run(args...)
		if code != 0 || !strings.Contains(o, "usage: slimen") || e != "" {
			t.Errorf("slimen %s: status %d, stdout %q, stderr %q; want the usage on stdout", strings.Join(args, " "), code, o, e)
		}
	}
	if o, _, code := run("--version"); code != 0 || !strings.HasPrefix(o, "slimen ") || !strings.Contains(o, "go1.") {
		t.Errorf("slimen --version: status %d, %q", code, o)
	}
	if o, e, code := run(); code != 2 || o != "" || !strings.Contains(e, "usage: slimen COMMAND") {
		t.Errorf("slimen: status %d, stdout %q, stderr %q", code, o, e)
	}
}

// slimen check --config says the config's warnings, as a run says them at start-up: a
// learning_rate that slimen does not read is found before the run (issue 35).
func TestCheckSaysConfigWarnings(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "lr.yaml")
	if err := os.WriteFile(cfg, []byte("policies:\n  - {name: generator, hf_checkpoint: builtin:tiny-arith, train: {learning_rate: 1.0e-3}}\n  - {name: critic, hf_checkpoint: builtin:tiny-arith}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := slimen(t, nil, "check", debate, "--config", cfg)
	if exitCode(t, err) != 0 || !strings.Contains(out, "warning: "+cfg+":2: policies[0].train.learning_rate: passed through to the engine as it is not a key slimen reads; did you mean lr?") {
		t.Errorf("slimen check --config: status %d, output:\n%s", exitCode(t, err), out)
	}
}
