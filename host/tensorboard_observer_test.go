package host

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/host/config"
)

// tensorBoardPython finds an interpreter with the tensorboard package: $SLIMEN_TORCH_PYTHON, or
// the environment scripts/pyenv.sh keeps (CI builds it for the Python tests).
func tensorBoardPython(t *testing.T) string {
	t.Helper()
	py := os.Getenv("SLIMEN_TORCH_PYTHON")
	if py == "" {
		if _, err := exec.LookPath("python3"); err != nil {
			t.Skip("no python3 on PATH and no $SLIMEN_TORCH_PYTHON: TensorBoard's reader cannot run here")
		}
		out, err := exec.Command(filepath.Join("..", "scripts", "pyenv.sh")).Output()
		if err != nil {
			t.Fatalf("scripts/pyenv.sh: %v (set SLIMEN_TORCH_PYTHON to an interpreter with engines/torch/requirements.txt)", err)
		}
		py = filepath.Join(strings.TrimSpace(string(out)), "bin", "python")
	}
	return py
}

// readTensorBoard is what TensorBoard's own EventAccumulator loads from dir.
type tensorBoardData struct {
	Scalars    map[string][][2]float64 `json:"scalars"`    // tag → [step, value]
	Histograms map[string][][4]float64 `json:"histograms"` // tag → [step, num, min, max]
	Texts      map[string][]struct {
		Step int    `json:"step"`
		Text string `json:"text"`
	} `json:"texts"`
	Plugins map[string][]string `json:"plugins"` // plugin → tags
}

const readTensorBoardPy = `
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
    "histograms": {t: [[e.step, e.histogram_value.num, e.histogram_value.min, e.histogram_value.max] for e in acc.Histograms(t)] for t in tags["histograms"]},
    "texts": {t: [{"step": e.step, "text": e.tensor_proto.string_val[0].decode()} for e in acc.Tensors(t)] for t in tags["tensors"]},
    "plugins": {"text": sorted(acc.PluginTagToContent("text"))},
}))
`

func readTensorBoard(t *testing.T, py, dir string) tensorBoardData {
	t.Helper()
	out, err := exec.Command(py, "-c", readTensorBoardPy, dir).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("TensorBoard's reader: %v\n%s", err, stderr)
	}
	var d tensorBoardData
	if err := json.Unmarshal(out, &d); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return d
}

// TestTensorBoardReadBack: TensorBoard's own reader loads what run.tensorboard writes: every
// metric of every line as policy/metric with metrics.jsonl's values, _run/ and eval/ lines,
// reward and advantage histograms per policy, a few rollouts as text; a resumed run's steps
// replace the first attempt's past the checkpoint.
func TestTensorBoardReadBack(t *testing.T) {
	py := tensorBoardPython(t)
	out, tb := t.TempDir(), t.TempDir()
	cfg := recordConfig(t)
	cfg.Run.TensorBoard = tb
	cfg.Run.EvalInterval = 2
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "arith", Path: "synthetic:arith", Limit: 2, NSamples: 1, InputKey: "prompt", LabelKey: "label", MaxResponseLen: 4, Temperature: 1, TopP: 1}}
	r, err := Load(context.Background(), writeScript(t, recordScript), Options{Config: cfg, Out: out, Tasks: numberedTasks(4)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Step(context.Background()); err != nil { // lost to the resume below
		t.Fatal(err)
	}
	r.Close()
	r2, err := Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Step(context.Background()); err != nil {
		t.Fatal(err)
	}
	r2.Close()

	d := readTensorBoard(t, py, tb)
	type at struct {
		step   int
		prefix string
	}
	lines := map[at]Metrics{} // the lines of metrics.jsonl
	for _, l := range strings.Split(strings.TrimSpace(readFile(t, filepath.Join(out, "metrics.jsonl"))), "\n") {
		var m Metrics
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatal(err)
		}
		step := int(m.Float("step"))
		key := m.Policy()
		if key == "_eval" {
			key = "eval/arith"
		}
		lines[at{step, key}] = m
	}
	for _, tag := range []string{"p/reward_mean", "p/loss", "p/samples", "_run/rollouts", "_run/failed", "eval/arith/tasks"} {
		i := strings.LastIndex(tag, "/")
		prefix, field := tag[:i], tag[i+1:]
		var steps []int
		for _, sv := range d.Scalars[tag] {
			steps = append(steps, int(sv[0]))
			m := lines[at{int(sv[0]), prefix}]
			if m == nil {
				t.Errorf("%s at step %v: no such line in metrics.jsonl", tag, sv[0])
				continue
			}
			if want := float64(float32(m.Float(field))); sv[1] != want {
				t.Errorf("%s at step %v = %v, metrics.jsonl says %v", tag, sv[0], sv[1], m.Float(field))
			}
		}
		want := []int{1, 2}
		if prefix == "eval/arith" {
			want = []int{0, 2}
		}
		if !slices.Equal(steps, want) {
			t.Errorf("%s: steps %v, want %v (each once, the resumed run's step 2 replacing the first's)", tag, steps, want)
		}
	}
	for _, tag := range []string{"p/reward", "p/advantage"} {
		h := d.Histograms[tag]
		if len(h) != 2 || h[0][1] != 9 || h[0][2] > h[0][3] {
			t.Errorf("histogram %s: %v; want steps 1 and 2 of 9 samples each", tag, h)
		}
	}
	if h := d.Histograms["p/reward"]; len(h) > 0 && (h[0][2] != 0 || h[0][3] != 1) {
		t.Errorf("p/reward ranges over [%v, %v]; the script rewards 0 and 1", h[0][2], h[0][3])
	}
	// (This reader drops the first attempt's scalars and histograms past the checkpoint but keeps
	// its text: its purge leaves tensors alone. TensorBoard's server reads with
	// plugin_event_accumulator, which drops them too.)
	texts := d.Texts["rollouts/0"]
	if len(texts) < 2 || texts[0].Step != 1 || texts[len(texts)-1].Step != 2 || !strings.Contains(texts[0].Text, "**task**") || !strings.Contains(texts[0].Text, "**p**") {
		t.Errorf("rollouts/0 texts: %+v", texts)
	}
	failed := false
	for tag, ts := range d.Texts {
		for _, x := range ts {
			failed = failed || strings.HasPrefix(tag, "rollouts/") && strings.Contains(x.Text, "fails on purpose")
		}
	}
	if !failed {
		t.Error("no rollout text shows the failed rollout's error")
	}
	if ts := d.Texts["eval_rollouts/arith/0"]; len(ts) < 2 || ts[0].Step != 0 || ts[len(ts)-1].Step != 2 {
		t.Errorf("eval rollout texts: %+v", d.Texts["eval_rollouts/arith/0"])
	}
	if !slices.Contains(d.Plugins["text"], "rollouts/0") {
		t.Errorf("the text plugin's tags: %v", d.Plugins["text"])
	}
	if math.IsNaN(d.Scalars["p/reward_mean"][0][1]) {
		t.Error("reward_mean is NaN")
	}
}

// A relative run.tensorboard is taken from the working directory the run started in.
func TestTensorBoardRelativeDir(t *testing.T) {
	wd := t.TempDir()
	o := newTensorBoardObserver("tb")
	if err := o.Start(RunInfo{WorkDir: wd}); err != nil {
		t.Fatal(err)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join(wd, "tb", "events.out.tfevents.*"))
	if len(files) != 1 {
		t.Errorf("event files in %s/tb: %v", wd, files)
	}
}
