package host

import (
	"fmt"
	"math"
	"path/filepath"
	"sort"
	"strings"

	"github.com/slimen/slimen/host/tensorboard"
)

// This file defines the Observer that run.tensorboard (--tensorboard) adds: every metric of every
// line as a scalar, reward and advantage histograms per policy, and a few saved rollouts as text.

// tensorBoardTexts is how many of a step's saved rollouts go to TensorBoard's Text tab.
const tensorBoardTexts = 3

// tensorBoardObserver writes a run's records as TensorBoard events in dir.
type tensorBoardObserver struct {
	dir string
	w   *tensorboard.Writer
}

func newTensorBoardObserver(dir string) *tensorBoardObserver { return &tensorBoardObserver{dir: dir} }

func (o *tensorBoardObserver) String() string { return "tensorboard " + o.dir }

// Start opens a new event file; a relative run.tensorboard is taken from the working directory
// the run started in. A resumed run marks its restart, so TensorBoard drops what the first
// attempt wrote past the checkpoint.
func (o *tensorBoardObserver) Start(info RunInfo) error {
	dir := o.dir
	if !filepath.IsAbs(dir) && info.WorkDir != "" {
		dir = filepath.Join(info.WorkDir, dir)
	}
	w, err := tensorboard.Create(dir)
	if err != nil {
		return fmt.Errorf("run.tensorboard %s: %w", o.dir, err)
	}
	o.w = w
	if info.Resumed {
		w.SessionStart(int64(info.Step + 1))
	}
	return w.Flush()
}

// Step writes the step's scalars (policy/metric, _run/metric), its histograms (policy/reward,
// policy/advantage) and a few rollouts (rollouts/i), then flushes.
func (o *tensorBoardObserver) Step(s StepRecord) error {
	step := int64(s.Step)
	for _, m := range s.Metrics {
		o.scalars(step, m.Policy(), m)
	}
	for _, p := range sortedKeys(s.Rewards) {
		o.w.Histogram(step, p+"/reward", s.Rewards[p])
	}
	for _, p := range sortedKeys(s.Advantages) {
		o.w.Histogram(step, p+"/advantage", s.Advantages[p])
	}
	for i, rec := range s.Rollouts {
		if i == tensorBoardTexts {
			break
		}
		o.w.Text(step, fmt.Sprintf("rollouts/%d", i), rolloutMarkdown(rec))
	}
	return o.w.Flush()
}

// Eval writes each dataset's numbers as eval/dataset/metric and a few rollouts as
// eval_rollouts/dataset/i.
func (o *tensorBoardObserver) Eval(e EvalRecord) error {
	step := int64(e.Step)
	for _, m := range e.Metrics {
		ds, _ := m["dataset"].(string)
		o.scalars(step, "eval/"+ds, m)
	}
	n := map[string]int{}
	for _, rec := range e.Rollouts {
		if n[rec.Dataset] < tensorBoardTexts {
			o.w.Text(step, fmt.Sprintf("eval_rollouts/%s/%d", rec.Dataset, n[rec.Dataset]), rolloutMarkdown(rec))
			n[rec.Dataset]++
		}
	}
	return o.w.Flush()
}

func (o *tensorBoardObserver) Close() error {
	if o.w == nil {
		return nil
	}
	return o.w.Close()
}

// scalars writes every numeric field of a metrics line (step and policy aside) as prefix/field.
func (o *tensorBoardObserver) scalars(step int64, prefix string, m Metrics) {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if k == "step" || k == "policy" {
			continue
		}
		switch v := m[k].(type) {
		case float64:
			if !math.IsNaN(v) && !math.IsInf(v, 0) {
				o.w.Scalar(step, prefix+"/"+k, v)
			}
		case int:
			o.w.Scalar(step, prefix+"/"+k, float64(v))
		}
	}
}

// rolloutMarkdown shows a rollout as TensorBoard's text plugin renders markdown: the task, then
// each call's policy, reward and response, or the error.
func rolloutMarkdown(rec RolloutRecord) string {
	var b strings.Builder
	fmt.Fprintf(&b, "**task** `%s`", rec.Task.ID)
	if rec.Task.Label != nil {
		fmt.Fprintf(&b, " (label `%s`)", *rec.Task.Label)
	}
	b.WriteString("\n\n")
	if rec.Task.Prompt != "" {
		b.WriteString(quoteBlock(rec.Task.Prompt))
	}
	for _, m := range rec.Task.Messages {
		b.WriteString(quoteBlock(m.Role + ": " + m.Content))
	}
	for _, c := range rec.Calls {
		reward := "no reward"
		if c.Reward != nil {
			reward = fmt.Sprintf("reward %.4g", *c.Reward)
		}
		trained := ""
		if c.Trained {
			trained = ", trained"
		}
		fmt.Fprintf(&b, "**%s** (%s, %s%s, %s)\n\n", c.Policy, c.Kind, reward, trained, c.FinishReason)
		b.WriteString(codeBlock(c.Response))
	}
	if rec.Error != "" {
		b.WriteString("**failed**\n\n")
		b.WriteString(codeBlock(rec.Error))
	}
	return b.String()
}

func quoteBlock(s string) string {
	return "> " + strings.ReplaceAll(s, "\n", "\n> ") + "\n\n"
}

// codeBlock fences s, with more backticks than any run of them in s.
func codeBlock(s string) string {
	fence := "```"
	for strings.Contains(s, fence) {
		fence += "`"
	}
	return fence + "\n" + s + "\n" + fence + "\n\n"
}
