package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// slimen gpus answers in one line and exits 0 where there is no NVML: on a machine without the
// driver, and in a binary built without cgo.
func TestGPUsWithoutNVML(t *testing.T) {
	out, err := slimen(t, nil, "gpus")
	if err != nil {
		t.Fatalf("slimen gpus: %v\n%s", err, out)
	}
	if !strings.HasPrefix(out, "GPU 0  ") && !strings.HasPrefix(out, "no NVIDIA GPUs visible: ") {
		t.Errorf("slimen gpus printed %q", out)
	}
	bin := filepath.Join(t.TempDir(), "slimen")
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("policies:\n  - {name: g, trainable: true, hf_checkpoint: testdata/tiny_compat/gqa_untied, num_gpus_per_node: 1}\n"), 0o644)
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("CGO_ENABLED=0 go build: %v\n%s", err, b)
	}
	b, err := exec.Command(bin, "gpus").CombinedOutput()
	if err != nil {
		t.Fatalf("slimen gpus built without cgo: %v\n%s", err, b)
	}
	if lines := strings.Split(strings.TrimSpace(string(b)), "\n"); len(lines) != 1 || !strings.Contains(lines[0], "built without cgo") {
		t.Errorf("slimen gpus built without cgo printed %q, want one line that says so", b)
	}
	// With a config it says that nothing is placed, as slimen exec does without NVML.
	with := exec.Command(bin, "gpus", "--config", cfg)
	with.Dir = "../.."
	if b, err := with.CombinedOutput(); err != nil || !strings.Contains(string(b), "no placement: slimen exec starts each torch worker on the device it finds") {
		t.Errorf("slimen gpus --config without NVML: %v\n%s", err, b)
	}
}

// --machine places a config against a saved inventory: two torch policies pinned to one GPU share
// it, a train-only critic and an engine-only judge share GPU 0 when colocated, and a config that
// needs more GPUs than there are is refused naming the policy.
func TestGPUsPlacement(t *testing.T) {
	dir := t.TempDir()
	machine := filepath.Join(dir, "machine.json")
	os.WriteFile(machine, []byte(`[{"Index": 0, "UUID": "GPU-1234", "Name": "NVIDIA H200", "MemTotal": 150754820096, "MemUsed": 1073741824, "Util": 3, "Processes": [{"PID": 4242, "Used": 1073741824}]}]`), 0o644)
	model := "testdata/tiny_compat/gqa_untied"
	write := func(name, y string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	shared := write("shared.yaml", `policies:
  - {name: critic, trainable: true, hf_checkpoint: `+model+`, num_gpus_per_node: 1, megatron_num_nodes: 1, sglang_num_nodes: 0, train: {advantage_estimator: ppo}}
  - {name: judge, trainable: false, hf_checkpoint: `+model+`, num_gpus_per_node: 1, megatron_num_nodes: 0, sglang_num_nodes: 1}
  - {name: tinyone, hf_checkpoint: builtin:tiny-arith}
run: {colocate: true}
`)
	out, err := slimen(t, nil, "gpus", "--machine", machine, "--config", shared)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{
		"GPU 0  NVIDIA H200  GPU-1234  memory 1.0 GiB used of 140.4 GiB (139.4 GiB free)  utilisation 3%",
		"processes: pid 4242 (1.0 GiB)",
		"placement: actor 1 GPUs, rollout 1, total 1 = the larger of actor and rollout (colocated); this machine has 1",
		"critic: GPU 0 (placement), CUDA_VISIBLE_DEVICES=0",
		`shares GPU 0 with "judge"`,
		"judge: GPU 0 (placement)",
		`shares GPU 0 with "critic"`,
		"not placed: tinyone (engine kind tiny",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// LoRA policies on one base are one worker: the first is placed, the others are its adapters.
	lora := write("lora.yaml", `policies:
  - {name: a0, hf_checkpoint: `+model+`, engine: {kind: torch, gpus: ["0"]}, lora: {rank: 4, alpha: 8}}
  - {name: a1, hf_checkpoint: `+model+`, engine: {kind: torch, gpus: ["0"]}, lora: {rank: 4, alpha: 8}}
  - {name: a2, hf_checkpoint: `+model+`, engine: {kind: torch, gpus: ["0"]}, lora: {rank: 4, alpha: 8}}
`)
	if out, err = slimen(t, nil, "gpus", "--machine", machine, "--config", lora); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"a0: GPU 0 (engine.gpus)", `LoRA adapters in it: "a1", "a2"`} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "a1: GPU") {
		t.Errorf("an adapter is placed as a worker of its own:\n%s", out)
	}
	apart := write("apart.yaml", `policies:
  - {name: solver, trainable: true, hf_checkpoint: `+model+`, num_gpus_per_node: 1}
`)
	out, err = slimen(t, nil, "gpus", "--machine", machine, "--config", apart)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("a config needing 2 GPUs on 1: err = %v, want exit 1\n%s", err, out)
	}
	if want := `cannot run on this machine: policy "solver" needs GPUs 0–1`; !strings.Contains(out, want) {
		t.Errorf("output lacks %q:\n%s", want, out)
	}
	// On two GPUs the solver trains on GPU 0; its rollout replicas go on its rollout slice, GPU 1.
	two := filepath.Join(dir, "two.json")
	os.WriteFile(two, []byte(`[{"Index": 0, "UUID": "GPU-a", "Name": "NVIDIA H100", "MemTotal": 85899345920}, {"Index": 1, "UUID": "GPU-b", "Name": "NVIDIA H100", "MemTotal": 85899345920}]`), 0o644)
	out, err = slimen(t, nil, "gpus", "--machine", two, "--config", apart)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{
		"solver: GPU 0,1 (placement)",
		"rollout replicas (rollout.max_staleness > 0: its worker keeps no versions): GPU 1, weights pushed by NCCL broadcast",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
