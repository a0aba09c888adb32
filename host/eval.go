package host

import (
	"context"
	"fmt"
	"math"
	"sort"
	"strings"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/tasks"
)

// Eval (docs/config.md, `eval:`): every run.eval_interval steps, and before the first step, each eval
// dataset's tasks go through the script's eval_rollout(task) — which returns a dict of numbers —
// or, when the script has none, through script.DefaultEval. The numbers are averaged per dataset
// and written as a metrics line with "policy": "_eval" and "dataset": NAME.

// openEval opens eval dataset i of cfg and takes its tasks.
func openEval(cfg *config.Config, i int) (tasks.Source, []Task, error) {
	ds := cfg.Eval.Datasets[i]
	src, err := tasks.Open(ds.Path, tasks.Options{InputKey: ds.InputKey, LabelKey: ds.LabelKey,
		Keys: fmt.Sprintf("eval.datasets[%d]", i), Seed: tasks.EvalSeed(cfg.Run.Seed)})
	if err != nil {
		return nil, nil, fmt.Errorf("eval dataset %q: %w", ds.Name, err)
	}
	ts, err := tasks.EvalTasks(src, ds.Limit)
	if err != nil {
		return nil, nil, &tasks.SourceError{Err: fmt.Errorf("eval dataset %q: %w", ds.Name, err)}
	}
	return src, ts, nil
}

// checkEvalData opens every eval dataset before the run starts: a path that does not exist stops
// the run at start-up (bad input), not after its first step's eval. It also says what the files'
// warnings are (a label under another key: the default eval grades against labels).
func (r *Run) checkEvalData() error {
	cfg := r.Config()
	for i, ds := range cfg.Eval.Datasets {
		src, _, err := openEval(cfg, i)
		if err != nil {
			return err
		}
		for _, w := range src.Warnings() {
			r.events.printf("eval %s: %s", ds.Name, w)
		}
	}
	return nil
}

// Eval runs every eval dataset of the config and returns one metrics line per dataset. It is part
// of Step when run.eval_interval is set; embedders may call it between steps.
func (r *Run) Eval(ctx context.Context) ([]Metrics, error) {
	cfg := r.Config()
	var out []Metrics
	for i, ds := range cfg.Eval.Datasets {
		_, tasks, err := openEval(cfg, i)
		if err != nil {
			return nil, err
		}
		n := max(ds.NSamples, 1)
		// (A sandboxed run's host parses the script only: its children run eval_rollout.)
		rf := rolloutFn{fn: r.script.EvalRollout(), name: "eval_rollout"}
		if !r.script.HasEvalRollout() {
			rf = rolloutFn{name: "default_eval", n: n}
			for _, p := range r.pols.list() {
				rf.policies = append(rf.policies, p.name)
			}
			if rf.fn, err = script.DefaultEval(rf.policies, n); err != nil {
				return nil, err
			}
		}
		s := engines.Sampling{MaxTokens: ds.MaxResponseLen, Temperature: ds.Temperature, TopP: ds.TopP, Stop: cfg.Rollout.Stop}
		if s.MaxTokens <= 0 {
			s.MaxTokens = cfg.Rollout.MaxResponseLen
		}
		ros, err := r.runRollouts(ctx, r.step, tasks, 1, rf, &s, -1)
		if err != nil {
			return nil, err
		}
		r.rec.noteEval(i, ds.Name, ros)
		m := newMetrics(r.step, "_eval")
		m.set("dataset", ds.Name)
		sums := map[string][2]float64{}
		failed := 0
		for _, ro := range ros {
			if ro.Err == nil {
				ro.Err = addEvalResult(sums, ro.Result)
			}
			if ro.Err != nil {
				failed++
				r.events.printf("eval %s: task %s failed:\n%s", ds.Name, ro.Task.ID, indent(script.ErrorText(ro.Err)))
			}
		}
		keys := make([]string, 0, len(sums))
		for k := range sums {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			m.set(k, sums[k][0]/sums[k][1])
		}
		m.set("tasks", len(tasks))
		m.set("failed", failed)
		out = append(out, m)
		r.events.printf("eval %s at step %d: %s", ds.Name, r.step, summarize(m, keys))
	}
	return out, nil
}

func summarize(m Metrics, keys []string) string {
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.3f", k, m.Float(k)))
	}
	if len(parts) == 0 {
		// The default eval of a run with no policy yet (names the script computes are created
		// as it runs), or an eval_rollout that returned {} every time.
		return "nothing to grade (no policy yet, or every result empty)"
	}
	return strings.Join(parts, ", ")
}

// addEvalResult adds an eval_rollout's dict of numbers to the running sums.
func addEvalResult(sums map[string][2]float64, v starlark.Value) error {
	d, ok := v.(*starlark.Dict)
	if !ok {
		return fmt.Errorf("eval_rollout returned a %s; return a dict of numbers, e.g. {\"accuracy\": 1.0}", v.Type())
	}
	for _, kv := range d.Items() {
		k, ok := kv[0].(starlark.String)
		x, isNum := starlark.AsFloat(kv[1])
		if b, isBool := kv[1].(starlark.Bool); isBool {
			x, isNum = 0, true
			if b {
				x = 1
			}
		}
		if !ok || !isNum || math.IsNaN(x) || math.IsInf(x, 0) {
			return fmt.Errorf("eval_rollout returned %s: %s; keys must be strings and values finite numbers", kv[0], kv[1])
		}
		a := sums[string(k)]
		sums[string(k)] = [2]float64{a[0] + x, a[1] + 1}
	}
	return nil
}

// afterEval runs Options.AfterEval once eval metrics are written; its error is reported, not
// fatal.
func (r *Run) afterEval() {
	if r.opts.AfterEval == nil {
		return
	}
	if err := r.opts.AfterEval(r); err != nil {
		r.events.printf("%v", err)
	}
}

// evalDue says whether, under config c, the eval datasets run after the given step (step 0: before
// training).
func evalDue(c *config.Config, step int) bool {
	return len(c.Eval.Datasets) > 0 && c.Run.EvalInterval > 0 && step%c.Run.EvalInterval == 0
}

// evalAndLog runs the eval datasets, writes their metrics and calls Options.AfterEval.
func (r *Run) evalAndLog(ctx context.Context) ([]Metrics, error) {
	evs, err := r.Eval(ctx)
	if err != nil {
		return nil, err
	}
	if err := r.metrics.writeLines(evs); err != nil {
		return nil, err
	}
	r.rec.eval(r.step, evs)
	r.afterEval()
	return evs, nil
}
