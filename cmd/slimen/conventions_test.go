package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// exitCode is the status a finished command exited with.
func exitCode(t *testing.T, err error) int {
	t.Helper()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0
}

// TestHelpAndBadInput: every command answers --help with its usage once and status 0; a bad flag
// and a missing data file are bad input (status 2), not a failed run.
func TestHelpAndBadInput(t *testing.T) {
	for name := range commands {
		out, err := slimen(t, nil, name, "--help")
		if code := exitCode(t, err); code != 0 {
			t.Errorf("slimen %s --help: status %d, want 0", name, code)
		}
		if n := strings.Count(strings.ToLower(out), "usage: slimen "+name); n != 1 {
			t.Errorf("slimen %s --help prints its usage %d times, want once:\n%s", name, n, out)
		}
		if _, err := slimen(t, nil, name, "--no-such-flag"); exitCode(t, err) != 2 {
			t.Errorf("slimen %s --no-such-flag: status %d, want 2", name, exitCode(t, err))
		}
	}
	dir := filepath.Join(t.TempDir(), "run")
	out, err := slimen(t, nil, "exec", debate, "--data", "no/such/file.jsonl", "--out", dir)
	if code := exitCode(t, err); code != 2 || !strings.Contains(out, "no/such/file.jsonl does not exist") {
		t.Fatalf("a missing data file: status %d, want 2 and the path named:\n%s", code, out)
	}
	// The corrected command may use the folder the failed start left.
	out, err = slimen(t, nil, "exec", debate, "--steps", "1", "--batch-size", "2", "--out", dir)
	if err != nil {
		t.Fatalf("rerun in the folder of a run that never started: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "checkpoints")); err != nil {
		t.Fatalf("the rerun wrote no checkpoint: %v", err)
	}
	if _, err := slimen(t, nil, "exec", debate, "--steps", "1", "--out", dir); exitCode(t, err) != 2 {
		t.Fatalf("a folder that holds a run is refused with status 2, got %v", err)
	}
}
