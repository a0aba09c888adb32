package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestServePlanRefusals: each command line serve refuses before it binds or loads anything, with
// the message naming the flag to fix.
func TestServePlanRefusals(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("policies:\n  - name: p\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SLIMEN_TEST_EMPTY_TOKEN", "")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--engine", "nope"}, `unknown engine "nope"; this binary serves: tiny`},
		{[]string{"--policy", "p"}, "--policy names a policy of --config; give --config too"},
		{[]string{"--config", cfg, "--model", "m"}, "leave out --engine, --model and --threads"},
		{[]string{"--max-message-mb", "0"}, "--max-message-mb must be at least 1"},
		{[]string{"--root", filepath.Join(dir, "missing")}, "; create the folder first"},
		{[]string{"--token-env", "SLIMEN_TEST_EMPTY_TOKEN"}, "--token-env SLIMEN_TEST_EMPTY_TOKEN: the environment variable is empty or unset"},
	} {
		f := newServeFlags()
		if err := f.fs.Parse(tc.args); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		_, err := f.plan()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

// TestServePlanPolicy: --config with its only policy serves that policy's engine under the
// policy's name, and a relative --model becomes absolute (the name the engine reports).
func TestServePlanPolicy(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("policies:\n  - name: solver\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := newServeFlags()
	if err := f.fs.Parse([]string{"--config", cfg}); err != nil {
		t.Fatal(err)
	}
	p, err := f.plan()
	if err != nil {
		t.Fatal(err)
	}
	if p.kind != "policy" || p.model != "solver" || !p.policy {
		t.Errorf("plan serves %s engine %q (policy %v), want the policy solver", p.kind, p.model, p.policy)
	}
	f = newServeFlags()
	if err := f.fs.Parse([]string{"--model", "some/folder"}); err != nil {
		t.Fatal(err)
	}
	if p, err = f.plan(); err != nil {
		t.Fatal(err)
	}
	if !filepath.IsAbs(p.model) || !strings.HasSuffix(p.model, filepath.Join("some", "folder")) {
		t.Errorf("--model some/folder planned as %q, want it absolute", p.model)
	}
}
