package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// `slimen graph SCRIPT` writes its drawings into runs/NAME/ under the current folder, not beside
// the script (where they would land in a source tree), and prints their paths.
func TestGraphDefaultOutput(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(src, "pair.star")
	err := os.WriteFile(script, []byte(`def rollout(task):
    a = generate("solver", task.prompt, n = 2)
    b = generate("judge", "\n".join([c.text for c in a]))
    reward(a + [b], 1.0)
`), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(slimenBin, "graph", script)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("slimen graph: %v\n%s", err, out)
	}
	want := []string{filepath.Join("runs", "pair", "pair.mmd"), filepath.Join("runs", "pair", "pair.svg")}
	if got := strings.Fields(string(out)); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("printed %q, want %q", got, want)
	}
	for _, f := range want {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
	if mmd, _ := os.ReadFile(filepath.Join(dir, want[0])); !strings.Contains(string(mmd), "-->|2|") {
		t.Errorf("the arrow from the solver's 2 completions to the judge is not numbered 2:\n%s", mmd)
	}
	if entries, _ := os.ReadDir(src); len(entries) != 1 {
		t.Errorf("slimen graph wrote beside the script: %v", entries)
	}
}
