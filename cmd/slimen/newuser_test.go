package main

import (
	"os"
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
