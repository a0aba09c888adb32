package wandb_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/wandb"
)

// testPython finds an interpreter with the wandb package: $SLIMEN_TORCH_PYTHON, or the
// environment scripts/pyenv.sh keeps (CI builds it for the Python tests, so these tests run there).
func testPython(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SLIMEN_TORCH_PYTHON"); p != "" {
		return p
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 on PATH and no $SLIMEN_TORCH_PYTHON: the W&B sidecar cannot run here")
	}
	out, err := exec.Command(filepath.Join("..", "..", "scripts", "pyenv.sh")).Output()
	if err != nil {
		t.Fatalf("scripts/pyenv.sh: %v (set SLIMEN_TORCH_PYTHON to an interpreter with engines/torch/requirements.txt)", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "bin", "python")
}

const script = `
def rollout(task):
    cs = generate("solver", task.prompt, n = 2)
    for i, c in enumerate(cs):
        reward(c, float(i))
    train(cs)
`

// load loads a short run on the embedded engine with run.wandb as given (a YAML flow mapping)
// and opens a Logger for it; it returns the run, the Logger's output and the run folder.
// syncBuffer is the run's log in these tests: the run and the sidecar's output copier write to it
// from different goroutines, as they do to the CLI's (locked) log writer.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func load(t *testing.T, wb string) (*host.Run, *wandb.Logger, *syncBuffer, string, error) {
	t.Helper()
	return loadScript(t, wb, script)
}

// loadScript is load with another rollout script.
func loadScript(t *testing.T, wb, src string) (*host.Run, *wandb.Logger, *syncBuffer, string, error) {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "solve.star"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	yaml := `policies:
  - name: solver
    hf_checkpoint: builtin:tiny-arith
    train: {global_batch_size: 4}
rollout: {batch_size: 2, max_response_len: 6}
eval: {datasets: [{name: held, path: synthetic:arith, limit: 2}]}
run: {steps: 3, eval_interval: 2, save_rollouts: 2, wandb: ` + wb + `}
`
	cfg, err := config.Parse([]byte(yaml), "wandb.yaml")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "run")
	cfg.Run.Out = out
	var log syncBuffer
	lg := wandb.New(wandb.Options{Log: &log})
	r, err := host.Load(context.Background(), filepath.Join(dir, "solve.star"), host.Options{Config: cfg, Out: out, Log: &log, Observers: []host.Observer{lg}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, lg, &log, out, lg.Open(context.Background(), r.Config())
}

// offlineRun is what testdata/read_wandb.py reads of an offline W&B run.
type offlineRun struct {
	Run     struct{ Project, Name, ID string }
	Config  map[string]any
	History []map[string]any
	Tables  map[string]struct {
		Columns []string
		Data    [][]any
	}
	ExitCode *int `json:"exit_code"`
}

// A short run logged offline is read back from the .wandb file the SDK wrote: its config, its
// metrics per step, the histograms, the eval, the rollout tables, and a clean finish.
func TestOfflineRun(t *testing.T) {
	py := testPython(t)
	t.Setenv("SLIMEN_PYTHON", py)
	wdir := t.TempDir()
	t.Setenv("WANDB_DIR", wdir)
	t.Setenv("WANDB_MODE", "") // restored at the end; unset meanwhile, so run.wandb.mode decides
	os.Unsetenv("WANDB_MODE")
	r, lg, log, out, err := load(t, "{project: t, mode: offline}")
	if err != nil {
		t.Fatalf("Open: %v\n%s", err, log)
	}
	if err := r.Train(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v\n%s", err, log)
	}
	if err := lg.Close(); err != nil { // closed by the run already: a second Close does nothing
		t.Errorf("second Close: %v", err)
	}
	cmd := exec.Command(py, filepath.Join("testdata", "read_wandb.py"), wdir)
	b, err := cmd.Output()
	if err != nil {
		t.Fatalf("read_wandb.py: %v\n%s", err, log)
	}
	var got offlineRun
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.Run.Project != "t" || got.Run.Name != "run" {
		t.Errorf("W&B run %+v, want project t named after the run folder (run)", got.Run)
	}
	if id, _ := os.ReadFile(filepath.Join(out, "wandb-run-id")); strings.TrimSpace(string(id)) != got.Run.ID {
		t.Errorf("wandb-run-id holds %q, want the W&B run's id %q", id, got.Run.ID)
	}
	runCfg, _ := got.Config["run"].(map[string]any)
	pols, _ := got.Config["policies"].([]any)
	if runCfg["steps"] != 3.0 || len(pols) != 1 {
		t.Errorf("W&B config run = %v, policies = %v; want the resolved config (steps 3, one policy)", runCfg, pols)
	}
	rows := map[float64]map[string]any{}
	for _, h := range got.History {
		if s, ok := h["_step"].(float64); ok {
			rows[s] = h
		}
	}
	for step := 1.0; step <= 3; step++ {
		row := rows[step]
		for _, k := range []string{"solver/reward_mean", "solver/samples", "solver/loss", "_run/rollout_s"} {
			if _, ok := row[k]; !ok {
				t.Errorf("step %v: no %s in the W&B history row %v", step, k, keys(row))
			}
		}
		if row["solver/reward/_type"] != "histogram" || row["solver/advantage/_type"] != "histogram" {
			t.Errorf("step %v: no reward and advantage histograms in %v", step, keys(row))
		}
	}
	if rows[1]["solver/reward_mean"] != 0.5 {
		t.Errorf("step 1 solver/reward_mean = %v, want 0.5 (rewards 0 and 1)", rows[1]["solver/reward_mean"])
	}
	for _, step := range []float64{0, 2} {
		if _, ok := rows[step]["eval/held/tasks"]; !ok {
			t.Errorf("the eval at step %v is not in its W&B row: %v", step, keys(rows[step]))
		}
	}
	path, _ := rows[2]["rollouts/path"].(string)
	table, ok := got.Tables[path]
	if !ok {
		t.Fatalf("step 2's rollouts table %q is not among the run's tables %v", path, got.Tables)
	}
	col := map[string]int{}
	for i, c := range table.Columns {
		col[c] = i
	}
	// Two rollouts saved, two samples each.
	if len(table.Data) != 4 {
		t.Fatalf("step 2's table has %d rows, want 4 (2 rollouts of 2 samples): %v", len(table.Data), table.Data)
	}
	for _, row := range table.Data {
		if row[col["step"]] != 2.0 || row[col["policy"]] != "solver" || row[col["prompt"]] == "" || row[col["trained"]] != true {
			t.Errorf("table row %v: want step 2, policy solver, its prompt, trained", row)
		}
		if rw := row[col["reward"]]; rw != 0.0 && rw != 1.0 {
			t.Errorf("table row reward %v, want 0 or 1", rw)
		}
	}
	if got.ExitCode == nil || *got.ExitCode != 0 {
		t.Errorf("the W&B run's exit code is %v, want 0 (finished)", got.ExitCode)
	}
}

// A run that fails is finished in W&B with exit code 1, so the W&B page shows it failed.
func TestOfflineRunFailed(t *testing.T) {
	py := testPython(t)
	t.Setenv("SLIMEN_PYTHON", py)
	wdir := t.TempDir()
	t.Setenv("WANDB_DIR", wdir)
	t.Setenv("WANDB_MODE", "")
	os.Unsetenv("WANDB_MODE")
	r, _, log, _, err := loadScript(t, "{project: t, mode: offline}", "def rollout(task):\n    fail(\"no way\")\n")
	if err != nil {
		t.Fatalf("Open: %v\n%s", err, log)
	}
	if err := r.Train(context.Background()); err == nil {
		t.Fatal("Train of a script whose rollouts all fail returned nil")
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v\n%s", err, log)
	}
	b, err := exec.Command(py, filepath.Join("testdata", "read_wandb.py"), wdir).Output()
	if err != nil {
		t.Fatalf("read_wandb.py: %v\n%s", err, log)
	}
	var got offlineRun
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.ExitCode == nil {
		t.Error("the failed run has no W&B exit code, want 1")
	} else if *got.ExitCode != 1 {
		t.Errorf("the failed run's W&B exit code is %d, want 1", *got.ExitCode)
	}
}

func keys(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// fakePython writes an executable that stands in for the sidecar's interpreter.
func fakePython(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "python")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// Without the wandb package the run does not start, and the error says how to get it.
func TestMissingPackage(t *testing.T) {
	py := testPython(t)
	// -S leaves site-packages out, as an environment without the SDK would be.
	noWandb := fakePython(t, `exec "`+py+`" -S "$@"`+"\n")
	_, _, _, _, err := load(t, "{project: t, mode: offline, python: "+noWandb+"}")
	if err == nil {
		t.Fatal("Open succeeded with an interpreter that has no wandb")
	}
	for _, want := range []string{"run.wandb:", noWandb + " (from run.wandb.python) has no wandb package", noWandb + " -m pip install wandb", "run.wandb.python (or $SLIMEN_PYTHON)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	_, _, _, _, err = load(t, "{project: t, python: "+filepath.Join(t.TempDir(), "nopython")+"}")
	if err == nil || !strings.Contains(err.Error(), "cannot start the W&B sidecar") || !strings.Contains(err.Error(), "set run.wandb.python") {
		t.Errorf("an interpreter that does not exist: got %v", err)
	}
}

// A refused login stops the run before its first step, saying how to log in or log offline.
func TestNoLogin(t *testing.T) {
	// The SDK's answer to wandb.init online with no API key.
	refuses := fakePython(t, `read line
echo '{"type": "error", "error": "wandb.init: UsageError: No API key configured. Use `+"`wandb login`"+` to log in."}'
exit 2
`)
	_, _, _, _, err := load(t, "{project: t, python: "+refuses+"}")
	if err == nil {
		t.Fatal("Open succeeded though wandb.init failed")
	}
	for _, want := range []string{"run.wandb: wandb.init: UsageError: No API key configured", "set WANDB_API_KEY", "run.wandb.mode: offline"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// A sidecar that dies mid-run is one warning in the run's log and events.log; the run goes on
// to its last step.
func TestSidecarDies(t *testing.T) {
	// It answers init, takes one message (step 1's), and exits.
	dies := fakePython(t, `read line
echo '{"type": "ready", "id": "x", "mode": "offline"}'
read line
echo "wandb: something broke" >&2
exit 7
`)
	r, _, log, out, err := load(t, "{project: t, mode: offline, python: "+dies+"}")
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Train(context.Background()); err != nil {
		t.Fatalf("the run stopped: %v", err)
	}
	if r.StepsDone() != 3 {
		t.Errorf("the run did %d steps, want all 3", r.StepsDone())
	}
	r.Close()
	events, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	for what, text := range map[string]string{"events.log": string(events), "the run's log": log.String()} {
		if n := strings.Count(text, "the W&B sidecar ("+dies+") exited: exit status 7"); n != 1 {
			t.Errorf("%s says %d times that the sidecar exited, want once:\n%s", what, n, text)
		}
		if !strings.Contains(text, "wandb: something broke") {
			t.Errorf("%s does not quote the sidecar's last line:\n%s", what, text)
		}
	}
}
