package host

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// A run with an output folder redraws its plots at each eval: the one before training (which
// alone has numbers to plot before step 1 trains) and every eval_interval steps.
func TestPlotsRedrawnAtEachEval(t *testing.T) {
	dir := t.TempDir()
	evalFile := filepath.Join(dir, "eval.jsonl")
	if err := os.WriteFile(evalFile, []byte(`{"prompt": "a", "label": "5"}`+"\n"+`{"prompt": "b", "label": "6"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(2, "p")
	cfg.Run.EvalInterval = 2
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "small", Path: evalFile, Temperature: 1, NSamples: 1}}
	out := filepath.Join(dir, "run")
	r, err := Load(context.Background(), writeScript(t, reloadScript), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo(`\boxed{5}`)}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	plots := filepath.Join(out, "plots")
	exists := func(name string) bool { _, err := os.Stat(filepath.Join(plots, name)); return err == nil }

	step(t, r) // the eval before training, then step 1 (no eval after it)
	for _, f := range []string{"accuracy.svg", "accuracy.png"} {
		if !exists(f) {
			t.Errorf("no plots/%s after the eval before training", f)
		}
	}
	if exists("reward.svg") {
		t.Errorf("plots/reward.svg after step 1: plots are drawn at evals, and the last one came before step 1")
	}
	before, _ := os.ReadFile(filepath.Join(plots, "accuracy.svg"))

	step(t, r) // step 2, then an eval
	for _, f := range []string{"reward.svg", "reward.png", "loss.svg", "loss.png"} {
		if !exists(f) {
			t.Errorf("no plots/%s after the eval at step 2", f)
		}
	}
	if after, _ := os.ReadFile(filepath.Join(plots, "accuracy.svg")); string(after) == string(before) {
		t.Errorf("plots/accuracy.svg was not redrawn with the eval at step 2")
	}
}
