//go:build linux

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// torchWorkers are the slimen_torch processes whose parent is pid.
func torchWorkers(t *testing.T, pid int) []int {
	t.Helper()
	var out []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		stat, err := os.ReadFile(filepath.Join(d, "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …: comm may hold spaces, so split after its closing parenthesis.
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		if len(fields) < 2 || fields[1] != strconv.Itoa(pid) {
			continue
		}
		if cmdline, _ := os.ReadFile(filepath.Join(d, "cmdline")); strings.Contains(string(cmdline), "slimen_torch") {
			n, _ := strconv.Atoi(filepath.Base(d))
			out = append(out, n)
		}
	}
	return out
}

// Issue 18: a local torch worker killed with SIGKILL in the middle of a step is started again on
// its address, gets the run's last checkpoint and the optimizer steps since, and the run
// completes with the metrics of one that was never interrupted.
func TestTorchWorkerKilledMidStep(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	cfg := torchConfig(t, dir, model, py, "", ", save_interval: 1")
	script := parityScript(t)
	clean := filepath.Join(dir, "clean")
	if log, err := slimen(t, env, "exec", script, "--config", cfg, "--steps", "3", "--out", clean); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}

	faulty := filepath.Join(dir, "faulty")
	killed := execKilling(t, env, faulty, func(slimen int) []int { return torchWorkers(t, slimen) },
		"exec", script, "--config", cfg, "--steps", "3", "--out", faulty)
	if len(killed) != 2 {
		t.Fatalf("killed %v, want the two workers' processes", killed)
	}
	events := eventsLog(t, faulty)
	for _, p := range []string{"generator", "critic"} {
		for _, want := range []string{
			fmt.Sprintf(`policy %q: the torch worker (pid `, p),
			fmt.Sprintf(`policy %q: the torch worker is started again on 127.0.0.1:`, p),
			fmt.Sprintf(`policy %q: its torch worker restarted as a new process`, p),
			"; the run goes on",
		} {
			if !strings.Contains(events, want) {
				t.Errorf("events.log lacks %q:\n%s", want, events)
			}
		}
	}
	// Which state each new worker got depends on where in step 2 the kill landed (the step's
	// checkpoint and replayed optimizer steps, or nothing to restore yet); the metrics below say
	// whether it was the right one.
	sameMetrics(t, untimed(t, clean), untimed(t, faulty))
}

// Issue 19: the one worker of two LoRA policies, killed mid-step, comes back with both adapters,
// each restored by its policy's rule, and the run's metrics are the uninterrupted run's.
func TestTorchLoRAWorkerKilledMidStep(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	model := tinyTorchModel(t, py)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	cfg := loraTorchConfig(t, dir, model)
	script := parityScript(t)
	clean := filepath.Join(dir, "clean")
	if log, err := slimen(t, env, "exec", script, "--config", cfg, "--steps", "3", "--out", clean); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	faulty := filepath.Join(dir, "faulty")
	killed := execKilling(t, env, faulty, func(slimen int) []int { return torchWorkers(t, slimen) },
		"exec", script, "--config", cfg, "--steps", "3", "--out", faulty)
	if len(killed) != 1 {
		t.Fatalf("killed %v, want the one shared worker's process", killed)
	}
	events := eventsLog(t, faulty)
	for _, want := range []string{
		`policy "generator": the torch worker (pid `,
		`policy "generator": the torch worker is started again on 127.0.0.1:`,
		`policy "generator": its torch worker (shared by the run's LoRA policies on`,
		`policy "critic": its torch worker (shared by the run's LoRA policies on`,
		"; the run goes on",
	} {
		if !strings.Contains(events, want) {
			t.Errorf("events.log lacks %q:\n%s", want, events)
		}
	}
	sameMetrics(t, untimed(t, clean), untimed(t, faulty))
}

// parityScript is the path of engines/torch/parity.star, the rollout script for the generator
// and critic whose reward is the parity of a sample's first token (a random model's answers are
// never right): it varies within groups and the weights move every step (a restore that lost them
// would show in the metrics).
func parityScript(t *testing.T) string {
	t.Helper()
	script, err := filepath.Abs("../../engines/torch/parity.star")
	if err != nil {
		t.Fatal(err)
	}
	return script
}

// execKilling runs slimen with args and, once step 1's checkpoint in out is complete (step 2 is
// then under way), SIGKILLs the processes victims(slimen's pid) names; it returns them once the
// run has completed, and fails the test if the run does not.
func execKilling(t *testing.T, env []string, out string, victims func(slimen int) []int, args ...string) []int {
	t.Helper()
	cmd := exec.Command(slimenBin, args...)
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), env...)
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	var killed []int
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if killed == nil && strings.HasPrefix(sc.Text(), "step 1/") {
			for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				if _, err := os.Stat(filepath.Join(out, "checkpoints", "step_1", "MANIFEST.json")); err == nil {
					break
				}
			}
			time.Sleep(200 * time.Millisecond)
			killed = victims(cmd.Process.Pid)
			for _, pid := range killed {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the run failed after %v were killed: %v\n%s", killed, err, log.String())
	}
	return killed
}

// sameMetrics compares two runs' untimed metrics lines. The CPU worker's sums are not
// bit-reproducible from one process to the next (two uninterrupted runs differ in the 8th
// digit), so numbers are compared to a tolerance. At least 3 policy-steps after step 1 must have
// had a gradient, or equal metrics would say nothing about the weights.
func sameMetrics(t *testing.T, want, got []map[string]any) {
	t.Helper()
	if len(want) != len(got) {
		t.Fatalf("%d metric lines, the uninterrupted run has %d", len(got), len(want))
	}
	moved := 0
	for i, w := range want {
		for k, wv := range w {
			gv := got[i][k]
			wf, wok := wv.(float64)
			gf, gok := gv.(float64)
			if wok && gok {
				if math.Abs(wf-gf) > 1e-6+1e-4*math.Abs(wf) {
					t.Errorf("step %v %v: %s = %v, the uninterrupted run had %v", w["step"], w["policy"], k, gv, wv)
				}
			} else if fmt.Sprint(wv) != fmt.Sprint(gv) {
				t.Errorf("step %v %v: %s = %v, the uninterrupted run had %v", w["step"], w["policy"], k, gv, wv)
			}
		}
		if g, _ := w["grad_norm"].(float64); g > 0 && w["step"] != 1.0 {
			moved++
		}
	}
	if moved < 3 {
		t.Errorf("only %d policy-steps after step 1 had a gradient: the test needs the weights to move", moved)
	}
}

// untimed is a run's metrics lines without their timing fields.
func untimed(t *testing.T, dir string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(metricsNoTimings(t, dir)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}
