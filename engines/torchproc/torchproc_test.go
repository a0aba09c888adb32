package torchproc

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
)

// python finds an interpreter with the worker's requirements: $SLIMEN_TORCH_PYTHON, or the
// environment scripts/pyenv.sh keeps (which CI builds for the Python tests anyway).
func python(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SLIMEN_TORCH_PYTHON"); p != "" {
		return p
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 on PATH: the torch worker cannot run here")
	}
	out, err := exec.Command(filepath.Join("..", "..", "scripts", "pyenv.sh")).Output()
	if err != nil {
		t.Fatalf("scripts/pyenv.sh: %v (set SLIMEN_TORCH_PYTHON to an interpreter with engines/torch/requirements.txt)", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "bin", "python")
}

// tinyModel writes a random tiny Llama folder with the worker's own make-model command.
func tinyModel(t *testing.T, py string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tiny")
	cmd := exec.Command(py, "-m", "slimen_torch", "make-model", "--shape", "tiny", "--out", dir)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join("..", "torch"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make-model: %v\n%s", err, out)
	}
	return dir
}

func TestStartServeAndClose(t *testing.T) {
	py := python(t)
	model := tinyModel(t, py)
	t.Setenv("XDG_CACHE_HOME", t.TempDir()) // the embedded package is unpacked here
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var log strings.Builder
	saves := t.TempDir()
	e, err := Start(ctx, Options{Python: py, Model: model, Device: "cpu", Log: &log,
		Roots: []string{saves}, Args: []string{"--slots", "8"}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	info, err := e.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Architecture != "LlamaForCausalLM" || info.VocabSize == 0 || len(info.EOSTokens) == 0 {
		t.Fatalf("info = %+v", info)
	}
	reqs := []engines.GenerateRequest{
		{ID: "a", Messages: []engines.Message{{Role: "user", Content: "Ann has 3 pens."}}, N: 2,
			Sampling: engines.Sampling{MaxTokens: 8, Temperature: 1, Seed: 4}},
		{ID: "b", PromptTokens: []int32{5, 6, 7}, Sampling: engines.Sampling{MaxTokens: 5, Seed: 1}},
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) != 3 || cs[0].RequestID != "a" || cs[2].RequestID != "b" {
		t.Fatalf("completions %+v", cs)
	}
	for _, c := range cs {
		if len(c.Tokens) == 0 || len(c.Tokens) != len(c.Logprobs) {
			t.Fatalf("completion %+v", c)
		}
	}
	sc, err := e.Score(ctx, []engines.ScoreRequest{{PromptTokens: cs[2].PromptTokens, Tokens: cs[2].Tokens}})
	if err != nil {
		t.Fatal(err)
	}
	for i, lp := range sc[0].Logprobs {
		if d := lp - cs[2].Logprobs[i]; d > 1e-4 || d < -1e-4 {
			t.Fatalf("score %v, generation log-probs %v", sc[0].Logprobs, cs[2].Logprobs)
		}
	}
	// A critic's value head is created on first use: every value starts at 0.
	vals, err := e.Values(ctx, []engines.ScoreRequest{{PromptTokens: cs[2].PromptTokens, Tokens: cs[2].Tokens}})
	if err != nil || len(vals) != 1 || len(vals[0]) != len(cs[2].Tokens) || vals[0][0] != 0 {
		t.Fatalf("values %v, %v", vals, err)
	}
	n := len(cs[0].Tokens)
	ones := make([]float32, n)
	for i := range ones {
		ones[i] = 1
	}
	st, err := e.Train(ctx, engines.Batch{ID: "step-1", Samples: []engines.Sample{{
		Prompt: cs[0].PromptTokens, Response: cs[0].Tokens, LossMask: ones,
		OldLogprobs: cs[0].Logprobs, Advantages: ones}}, Loss: engines.LossConfig{LR: 1e-3, EpsClip: 0.2}})
	if err != nil || st.Tokens != n || st.Skipped {
		t.Fatalf("train: %+v, %v", st, err)
	}
	if err := e.Save(ctx, filepath.Join(saves, "saved")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(saves, "saved", "config.json")); err != nil {
		t.Errorf("the save is not in the worker's root: %v", err)
	}
	// Other processes of this machine cannot use the worker: it wants the token Start made.
	addr, err := os.ReadFile(filepath.Join(e.tmp, "address"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"", "guess"} {
		c, err := remote.Dial(ctx, remote.Options{Address: strings.TrimSpace(string(addr)), Token: tok})
		if err == nil {
			c.Close()
		}
		if err == nil || !strings.Contains(err.Error(), "rejected the token") {
			t.Errorf("a client with token %q: got %v, want a rejection", tok, err)
		}
	}
	// The worker keeps its clients to its root.
	elsewhere := t.TempDir()
	real, _ := filepath.EvalSymlinks(saves)
	if err := e.Save(ctx, elsewhere); err == nil || !strings.Contains(err.Error(), "outside this server's root "+real) {
		t.Errorf("a save outside the root: got %v, want a refusal naming the root", err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-e.proc.exited:
	default:
		t.Fatal("the worker still runs after Close")
	}
}

func TestStartReportsWorkerErrors(t *testing.T) {
	py := python(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := Start(ctx, Options{Python: py, Model: t.TempDir(), Device: "cpu",
		PackageDir: filepath.Join("..", "torch"), Log: &strings.Builder{}})
	if err == nil || !strings.Contains(err.Error(), "no config.json") {
		t.Fatalf("Start on an empty folder: %v", err)
	}
}

// The worker's client retries a worker it cannot reach every LocalMaxBackoff at most (a restarted
// one is met as soon as it serves), unless the options say otherwise; and a worker of several
// ranks runs torchrun through slimen_torch.launch (it exits as soon as torchrun returns).
func TestClientOptionsAndLauncher(t *testing.T) {
	c := clientOptions(Options{TokenEnv: "T"}, "127.0.0.1:9", "tok")
	if c.MaxBackoff != LocalMaxBackoff || c.Address != "127.0.0.1:9" || c.TokenEnv != "T" || c.Token != "tok" {
		t.Errorf("client options %+v", c)
	}
	if c := clientOptions(Options{Client: remote.Options{MaxBackoff: time.Second}}, "a:1", ""); c.MaxBackoff != time.Second {
		t.Errorf("MaxBackoff %v, want the options' 1s", c.MaxBackoff)
	}
	if got := strings.Join(launcher(4, 0), " "); got != "-m slimen_torch.launch torch.distributed.run --standalone --nproc-per-node 4" {
		t.Errorf("launcher(4, 0) = %q", got)
	}
	if got := strings.Join(launcher(2, 3), " "); got != "-m slimen_torch.launch torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 3" {
		t.Errorf("launcher(2, 3) = %q", got)
	}
	if launcher(1, 3) != nil {
		t.Errorf("launcher(1, 3) = %q, want none", launcher(1, 3))
	}
}
