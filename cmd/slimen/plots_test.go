package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// `slimen exec` leaves the run's plots in RUN_DIR/plots: reward and loss of every policy and the
// eval accuracy, drawn at each eval and once more at the end.
func TestExecWritesPlots(t *testing.T) {
	dir := t.TempDir()
	files := map[string]string{
		"s.star":     "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n",
		"eval.jsonl": `{"prompt": "Ann has 2 pens and gets 3 more. How many pens?", "label": "5"}` + "\n",
		"config.yaml": `rollout: {batch_size: 2, max_response_len: 8}
eval: {datasets: [{name: small, path: eval.jsonl}]}
run: {steps: 2, eval_interval: 1, seed: 1}
`,
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(slimenBin, "exec", "s.star", "--config", "config.yaml", "--out", "run")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("slimen exec: %v\n%s", err, out)
	}
	metrics, _ := os.ReadFile(filepath.Join(dir, "run", "metrics.jsonl"))
	if n := strings.Count(string(metrics), `"_eval"`); n != 3 {
		t.Errorf("%d eval lines, want 3 (before training, after steps 1 and 2):\n%s", n, metrics)
	}
	for _, chart := range []string{"reward", "loss", "accuracy"} {
		for _, ext := range []string{".svg", ".png"} {
			if _, err := os.Stat(filepath.Join(dir, "run", "plots", chart+ext)); err != nil {
				t.Error(err)
			}
		}
	}
}
