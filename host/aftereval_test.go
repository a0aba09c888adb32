package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// Options.AfterEval runs at each eval, once its metrics are written: the one before training and
// every eval_interval steps (the CLI redraws its charts there). Its error is logged, not fatal.
func TestAfterEvalAtEachEval(t *testing.T) {
	dir := t.TempDir()
	evalFile := filepath.Join(dir, "eval.jsonl")
	if err := os.WriteFile(evalFile, []byte(`{"prompt": "a", "label": "5"}`+"\n"+`{"prompt": "b", "label": "6"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(2, "p")
	cfg.Run.EvalInterval = 2
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "small", Path: evalFile, Temperature: 1, NSamples: 1}}
	out := filepath.Join(dir, "run")
	var at []int        // StepsDone at each call
	var evalLines []int // eval lines in metrics.jsonl at each call
	var log strings.Builder
	r, err := Load(context.Background(), writeScript(t, reloadScript), Options{Config: cfg, Out: out, Log: &log,
		Engines: map[string]engines.Engine{"p": scripted.Echo(`\boxed{5}`)}, Tasks: numberedTasks(2),
		AfterEval: func(r *Run) error {
			b, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
			at, evalLines = append(at, r.StepsDone()), append(evalLines, strings.Count(string(b), `"_eval"`))
			return errors.New("charts: out of ink")
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	step(t, r) // the eval before training, then step 1 (no eval after it)
	step(t, r) // step 2, then an eval
	if len(at) != 2 || at[0] != 0 || at[1] != 2 || evalLines[0] != 1 || evalLines[1] != 2 {
		t.Fatalf("AfterEval ran after steps %v with %v eval lines written; want after 0 and 2, with 1 and 2", at, evalLines)
	}
	if strings.Count(log.String(), "charts: out of ink") != 2 {
		t.Fatalf("the hook's error was not logged at each eval:\n%s", log.String())
	}
}
