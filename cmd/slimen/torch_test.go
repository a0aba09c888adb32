package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
)

// Issue 6, item 5: `engine: {kind: torch}` makes the host start a PyTorch worker per policy.

// torchPython finds an interpreter with the worker's requirements: $SLIMEN_TORCH_PYTHON, or the
// environment scripts/pyenv.sh keeps (CI builds it for the Python tests, so this test runs there).
func torchPython(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SLIMEN_TORCH_PYTHON"); p != "" {
		return p
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 on PATH and no $SLIMEN_TORCH_PYTHON: the torch worker cannot run here")
	}
	out, err := exec.Command(filepath.Join("..", "..", "scripts", "pyenv.sh")).Output()
	if err != nil {
		t.Fatalf("scripts/pyenv.sh: %v (set SLIMEN_TORCH_PYTHON to an interpreter with engines/torch/requirements.txt)", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "bin", "python")
}

// tinyTorchModel returns the folder of a random tiny Llama (the worker's make-model).
func tinyTorchModel(t *testing.T, py string) string {
	t.Helper()
	return torchModelOfShape(t, py, "tiny")
}

// torchModels holds the folders make-model wrote, one a shape, for all the tests of the package:
// make-model's weights are a function of its seed (0), so a folder written once is the one every
// test would write, and each test saves and loads only under its own folders. Writing one costs a
// Python start with torch.
var torchModels struct {
	sync.Mutex
	byShape map[string]string
}

// torchModelOfShape returns the folder of a random model of a make-model shape, written on first
// use under the package's temporary folder.
func torchModelOfShape(t *testing.T, py, shape string) string {
	t.Helper()
	torchModels.Lock()
	defer torchModels.Unlock()
	if model, ok := torchModels.byShape[shape]; ok {
		return model
	}
	model := filepath.Join(testRoot, "models", shape)
	mk := exec.Command(py, "-m", "slimen_torch", "make-model", "--shape", shape, "--out", model)
	mk.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join("..", "..", "engines", "torch"))
	if out, err := mk.CombinedOutput(); err != nil {
		os.RemoveAll(model)
		t.Fatalf("make-model: %v\n%s", err, out)
	}
	if torchModels.byShape == nil {
		torchModels.byShape = map[string]string{}
	}
	torchModels.byShape[shape] = model
	return model
}

// torchConfig writes a config of the debate's two policies on torch workers; gen holds extra
// lines of the generator ("    save: DIR\n"), run extra keys of run (", save_interval: 1").
func torchConfig(t *testing.T, dir, model, python, gen, run string) string {
	t.Helper()
	cfg := filepath.Join(dir, "torch.yaml")
	y := fmt.Sprintf(`policies:
  - name: generator
    hf_checkpoint: %s
    engine: {kind: torch, python: %q, device: cpu, args: [--max-seq-len, "512"]}
    train: {lr: 1.0e-3, global_batch_size: 0}
%s  - name: critic
    hf_checkpoint: %s
    sglang: {kind: torch, device: cpu, args: [--max-seq-len, "512"]}   # python from $SLIMEN_PYTHON
    train: {lr: 1.0e-3, global_batch_size: 0}
rollout: {batch_size: 4, max_response_len: 8}
run: {steps: 2, seed: 3%s}
`, model, python, gen, model, run)
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func TestTorchEngineDebate(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	out := filepath.Join(dir, "run")
	// The binary unpacks its embedded worker package under the user cache folder: keep it here.
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	// A checkpoint after every step, and the generator's save: folder outside the run directory:
	// the workers save and load only where the run lets them (the run directory, the save:
	// folder's parent).
	saved := filepath.Join(dir, "saves", "generator")
	cfg := torchConfig(t, dir, model, py, fmt.Sprintf("    save: %q\n", saved), ", save_interval: 1")
	log, err := slimen(t, env, "exec", debate, "--config", cfg, "--out", out)
	if err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	for _, f := range []string{filepath.Join(out, "checkpoints", "step_2", "generator", "config.json"),
		filepath.Join(out, "checkpoints", "step_2", "critic", "config.json"), filepath.Join(saved, "config.json")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("the workers' saves: %v", err)
		}
	}
	// Resuming loads the checkpoint into new workers, and the run goes on for a third step.
	if log, err := slimen(t, env, "exec", "--resume", out, "--steps", "3"); err != nil {
		t.Fatalf("resume: %v\n%s", err, log)
	}

	checkPolicySteps(t, out, []string{"generator@1", "generator@2", "generator@3", "critic@1", "critic@2", "critic@3"})

	// Both workers started, with their output in events.log.
	ev, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`policy "generator": starting a torch worker: ` + py,
		`policy "critic": starting a torch worker: ` + py,
		`policy "generator": torch worker ready`,
		`policy "critic": worker: `,
	} {
		if !strings.Contains(string(ev), want) {
			t.Errorf("events.log lacks %q:\n%s", want, ev)
		}
	}
}

// A worker that cannot start stops the run with the policy, its config line and what went wrong.
func TestTorchEngineStartErrors(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	os.Mkdir(empty, 0o755)
	model := filepath.Join(dir, "model")
	os.Mkdir(model, 0o755)
	os.WriteFile(filepath.Join(model, "config.json"), []byte("{}"), 0o644)
	env := []string{"XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	cfg := filepath.Join(dir, "torch.yaml")
	run := func(name, model, python string, env []string, wants ...string) {
		t.Helper()
		log, err := slimen(t, env, "exec", "examples/debate/debate.star", "--config", torchConfig(t, dir, model, python, "", ""), "--out", filepath.Join(dir, name))
		for _, want := range wants {
			if err == nil || !strings.Contains(log, want) {
				t.Errorf("%s: exit %v; output lacks %q:\n%s", name, err, want, log)
			}
		}
	}

	// Found in Go before any worker starts: no Python needed to see these.
	missing := filepath.Join(dir, "no-such-python")
	run("nopython", model, missing, env,
		fmt.Sprintf(`policy "generator" in %s:2: the torch worker did not start: torch engine: start %s`, cfg, missing),
		"the interpreter "+missing+" comes from engine.python; set engine.python (or $SLIMEN_PYTHON)")
	run("nomodel", filepath.Join(dir, "no-such-model"), missing, env,
		fmt.Sprintf(`policy "generator" in %s:2: hf_checkpoint %s does not exist; give a Hugging Face model folder`, cfg, filepath.Join(dir, "no-such-model")))
	run("emptymodel", empty, missing, env,
		fmt.Sprintf(`policy "generator" in %s:2: hf_checkpoint %s has no config.json`, cfg, empty))
	if py, err := exec.LookPath("python3"); err == nil {
		// An interpreter without the worker's requirements (-S: no site-packages).
		bare := filepath.Join(dir, "bare-python")
		os.WriteFile(bare, []byte("#!/bin/sh\nexec "+py+" -S \"$@\"\n"), 0o755)
		run("bare", model, bare, env, "lacks torch transformers safetensors tokenizers grpc",
			"install engines/torch/requirements.txt into its environment")
	}

	// A folder with a config.json the worker cannot read: the worker exits, and its last lines
	// say why.
	if testing.Short() {
		return
	}
	py := torchPython(t)
	run("badmodel", model, py, append(env, "SLIMEN_PYTHON="+py),
		fmt.Sprintf(`policy "generator" in %s:2: the torch worker did not start: torch engine for %s exited during start-up`, cfg, model))
}

// `slimen serve --config C --openai` serves a torch worker (engine kind torch, started as a run
// starts it) through the OpenAI API: a chat request samples from the PyTorch model, with its
// token ids, and the same seed samples the same tokens again.
func TestServeOpenAITorch(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := torchModelOfShape(t, py, "tiny-qwen3")
	cfg := filepath.Join(dir, "serve.yaml")
	y := fmt.Sprintf("policies:\n  - name: chatbot\n    hf_checkpoint: %s\n    engine: {kind: torch, python: %q, device: cpu, args: [--max-seq-len, \"512\"]}\n", model, py)
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	httpAddr := freeAddr(t)
	cmd := exec.Command(slimenBin, "serve", "--config", cfg, "--listen", freeAddr(t), "--openai", httpAddr)
	cmd.Env = append(os.Environ(), "XDG_CACHE_HOME="+filepath.Join(dir, "cache"))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ctx := context.Background()
	var c *openai.Engine
	var err error
	for deadline := time.Now().Add(180 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if c, err = openai.Open(ctx, openai.Options{BaseURL: "http://" + httpAddr + "/v1", Model: model}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slimen serve --config (torch) --openai %s did not come up: %v", httpAddr, err)
		}
	}
	defer c.Close()
	req := []engines.GenerateRequest{{ID: "a", Messages: []engines.Message{{Role: "user", Content: "Hello"}}, N: 2,
		Sampling: engines.Sampling{MaxTokens: 6, Temperature: 1, Seed: 11}}}
	first, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != 2 || len(first[0].Tokens) == 0 || len(first[0].Logprobs) != len(first[0].Tokens) {
		t.Fatalf("completions %+v; want 2 with tokens and a log-prob each", first)
	}
	for i := range first {
		if !slices.Equal(first[i].Tokens, again[i].Tokens) {
			t.Errorf("sample %d: the same seed sampled %v, then %v", i, first[i].Tokens, again[i].Tokens)
		}
	}
}

// Issue 19: LoRA policies on the torch engine share one worker (one copy of the base), each an
// adapter that trains, checkpoints as a PEFT folder and resumes. And the same policies with
// engine: {kind: remote} on a torch worker started by hand (python -m slimen_torch serve) are
// adapters on it as on the worker the run starts itself: the same metrics, and each adapter's
// checkpoint is a PEFT folder the worker wrote (the kind-torch run is the reference of both).
func TestTorchLoRAPoliciesShareOneWorker(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	out := filepath.Join(dir, "run")
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	cfg := loraTorchConfig(t, dir, model)
	if log, err := slimen(t, env, "exec", debate, "--config", cfg, "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	for _, p := range []string{"generator", "critic"} {
		for _, f := range []string{"adapter_config.json", "adapter_model.safetensors", "adapter_optimizer.safetensors"} {
			if _, err := os.Stat(filepath.Join(out, "checkpoints", "step_2", p, f)); err != nil {
				t.Errorf("%s's checkpoint: %v", p, err)
			}
		}
	}
	t.Run("remote", func(t *testing.T) { loraOnHandStartedWorker(t, py, model, cfg, metricsNoTimings(t, out)) })
	if log, err := slimen(t, env, "exec", "--resume", out, "--steps", "3"); err != nil {
		t.Fatalf("resume: %v\n%s", err, log)
	}
	ev, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	// One worker per run (two runs: the first and the resumed one), the second policy an adapter on it.
	if n := strings.Count(string(ev), "starting a torch worker"); n != 2 {
		t.Errorf("events.log: %d workers started, want 1 per run (2):\n%s", n, ev)
	}
	if !strings.Contains(string(ev), `policy "critic": a LoRA adapter on the torch worker of `) {
		t.Errorf("events.log does not say the critic shares the generator's worker:\n%s", ev)
	}
	checkPolicySteps(t, out, []string{"generator@1", "generator@2", "generator@3", "critic@1", "critic@2", "critic@3"})
}

// loraOnHandStartedWorker runs torchCfg (loraTorchConfig's two LoRA policies) with both on a
// torch worker started by hand, through engine: {kind: remote}: it must write want, the metrics
// of the run whose worker the host started.
func loraOnHandStartedWorker(t *testing.T, py, model, torchCfg, want string) {
	t.Helper()
	dir := t.TempDir()
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	addr := freeAddr(t)
	srv := exec.Command(py, "-m", "slimen_torch", "serve", "--model", model, "--listen", addr, "--device", "cpu", "--max-seq-len", "512", "--root", dir)
	srv.Dir = "../../engines/torch"
	srv.Env = append(os.Environ(), "XDG_CACHE_HOME="+filepath.Join(dir, "cache"))
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	b, err := os.ReadFile(torchCfg)
	if err != nil {
		t.Fatal(err)
	}
	y := strings.ReplaceAll(string(b), `engine: {kind: torch, device: cpu, args: [--max-seq-len, "512"]}`, fmt.Sprintf("engine: {kind: remote, address: %q}", addr))
	if strings.Count(y, "kind: remote") != 2 {
		t.Fatalf("want both policies on the worker:\n%s", y)
	}
	remoteCfg := filepath.Join(dir, "remote.yaml")
	os.WriteFile(remoteCfg, []byte(y), 0o644)
	served := filepath.Join(dir, "served")
	if log, err := slimen(t, env, "exec", debate, "--config", remoteCfg, "--out", served); err != nil {
		t.Fatalf("kind remote: %v\n%s", err, log)
	}
	checkPolicySteps(t, served, []string{"generator@1", "generator@2", "critic@1", "critic@2"})
	for _, p := range []string{"generator", "critic"} {
		if _, err := os.Stat(filepath.Join(served, "checkpoints", "step_2", p, "adapter_model.safetensors")); err != nil {
			t.Errorf("%s's checkpoint: %v", p, err)
		}
	}
	if got, want := withoutMismatch(t, metricsNoTimings(t, served)), withoutMismatch(t, want); got != want {
		t.Errorf("the adapters on the hand-started worker differ from those on the run's own:\n%s\n---\n%s", got, want)
	}
}

// withoutMismatch drops the rollout/trainer log-prob mismatch from metrics lines. In the torch
// worker's default mode a rollout's log-probs depend in their last bits on what else was in its
// batch, which the two workers of loraOnHandStartedWorker fill in their own order: the mismatch
// (~1e-8 on the CPU) differs between them while every trained number is equal.
func withoutMismatch(t *testing.T, jsonl string) string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(jsonl), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		for _, k := range []string{"logprob_diff_mean", "logprob_diff_max", "train_rollout_logprob_abs_diff"} {
			delete(m, k)
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, string(b))
	}
	return strings.Join(out, "\n")
}

// checkPolicySteps checks that a run's metrics.jsonl has a line for each "policy@step" of want,
// and that every line of the generator and the critic has samples and a finite loss.
func checkPolicySteps(t *testing.T, out string, want []string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		pol, _ := m["policy"].(string)
		if pol != "generator" && pol != "critic" {
			continue
		}
		key := fmt.Sprintf("%s@%v", pol, m["step"])
		seen[key] = true
		samples, _ := m["samples"].(float64)
		loss, ok := m["loss"].(float64)
		if samples <= 0 || !ok || math.IsNaN(loss) || math.IsInf(loss, 0) {
			t.Errorf("%s: samples %v, loss %v (%T): want samples > 0 and a finite loss\n%s", key, m["samples"], m["loss"], m["loss"], line)
		}
	}
	for _, k := range want {
		if !seen[k] {
			t.Errorf("metrics.jsonl has no line for %s:\n%s", k, b)
		}
	}
}

// loraTorchConfig writes a config of two LoRA policies (generator, critic) on one CPU torch
// worker, checkpointing every step.
func loraTorchConfig(t *testing.T, dir, model string) string {
	t.Helper()
	cfg := filepath.Join(dir, "lora.yaml")
	y := fmt.Sprintf(`policies:
  - name: generator
    hf_checkpoint: %[1]s
    engine: {kind: torch, device: cpu, args: [--max-seq-len, "512"]}
    lora: {rank: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}
    train: {lr: 1.0e-2, global_batch_size: 0}
  - name: critic
    hf_checkpoint: %[1]s
    engine: {kind: torch, device: cpu, args: [--max-seq-len, "512"]}
    lora: {rank: 2, alpha: 4, targets: [q_proj]}
    train: {lr: 1.0e-2, global_batch_size: 0}
rollout: {batch_size: 4, max_response_len: 8}
run: {steps: 2, seed: 3, save_interval: 1}
`, model)
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return cfg
}
