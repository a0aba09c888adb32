package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines/tiny"
)

// Issue 5's acceptance: the debate example against `slimen serve` engines over real gRPC on
// loopback writes the same metrics as in-process, and survives an engine killed mid-run.

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startServe starts `slimen serve` on addr and waits until it accepts connections.
func startServe(t *testing.T, model, addr string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(slimenBin, "serve", "--engine", "tiny", "--model", model, "--listen", addr)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return cmd
		}
	}
	t.Fatalf("slimen serve on %s did not come up", addr)
	return nil
}

func remoteConfigs(t *testing.T, steps int) (model, local, remote string, addrs [2]string) {
	t.Helper()
	dir := t.TempDir()
	model = filepath.Join(dir, "model")
	e, err := tiny.New(tiny.ModelConfig{Hidden: 32, Intermediate: 64, Layers: 1, Heads: 2, KVHeads: 1, MaxSeqLen: 256}, 11, tiny.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Save(context.Background(), model); err != nil {
		t.Fatal(err)
	}
	addrs = [2]string{freeAddr(t), freeAddr(t)}
	tail := fmt.Sprintf("rollout: {batch_size: 4, max_response_len: 6}\nrun: {steps: %d, seed: 5}\n", steps)
	pol := func(name, engine string) string {
		return fmt.Sprintf("  - {name: %s, hf_checkpoint: %s, engine: %s, train: {lr: 1.0e-2, global_batch_size: 0}}\n", name, model, engine)
	}
	local = filepath.Join(dir, "local.yaml")
	os.WriteFile(local, []byte("policies:\n"+pol("generator", "{kind: tiny}")+pol("critic", "{kind: tiny}")+tail), 0o644)
	remote = filepath.Join(dir, "remote.yaml")
	os.WriteFile(remote, []byte("policies:\n"+
		pol("generator", fmt.Sprintf("{kind: remote, address: %q}", addrs[0]))+
		pol("critic", fmt.Sprintf("{kind: remote, address: %q}", addrs[1]))+tail), 0o644)
	return
}

func TestRemoteEqualsInProcess(t *testing.T) {
	model, local, remote, addrs := remoteConfigs(t, 3)
	startServe(t, model, addrs[0])
	startServe(t, model, addrs[1])
	a, b := filepath.Join(t.TempDir(), "local"), filepath.Join(t.TempDir(), "remote")
	for _, c := range [][2]string{{local, a}, {remote, b}} {
		if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", c[0], "--out", c[1]); err != nil {
			t.Fatalf("%v\n%s", err, log)
		}
	}
	if ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b); ma != mb {
		t.Errorf("remote metrics differ from in-process:\n%s\n---\n%s", ma, mb)
	}
}

// samplesPerStep reads "policy@step" → samples from a run's metrics.
func samplesPerStep(t *testing.T, dir string) map[string]float64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		if s, ok := m["samples"].(float64); ok {
			out[fmt.Sprintf("%v@%v", m["policy"], m["step"])] = s
		}
	}
	return out
}

func TestRemoteEngineKilledAndRestarted(t *testing.T) {
	model, local, remote, addrs := remoteConfigs(t, 4)
	gen := startServe(t, model, addrs[0])
	startServe(t, model, addrs[1])
	clean := filepath.Join(t.TempDir(), "clean")
	if log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", local, "--out", clean); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	out := filepath.Join(t.TempDir(), "faulty")
	cmd := exec.Command(slimenBin, "exec", "examples/debate/debate.star", "--config", remote, "--out", out)
	cmd.Dir = "../.."
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Once step 1 is done, SIGKILL the generator's engine (step 2 is starting, its generate calls
	// in flight), then start a new engine on the same port a moment later.
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(sc.Text(), "step 1/4") {
			gen.Process.Kill()
			gen.Wait()
			time.Sleep(700 * time.Millisecond) // the run's stderr waits in the pipe meanwhile
			startServe(t, model, addrs[0])
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the run failed after the engine came back: %v\n%s", err, log.String())
	}
	want, got := samplesPerStep(t, clean), samplesPerStep(t, out)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %v samples, the fault-free run had %v", k, got[k], v)
		}
	}
}
