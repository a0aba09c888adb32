package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Issue 21: `slimen serve` keeps the weights versions of the engine it serves, so a run whose
// policies are remote engines on `slimen serve` runs at rollout.max_staleness 1 with the versions
// kept in the servers (no rollout replicas, which the host cannot start for a server it does not
// own), and writes exactly the metrics of the same run on in-process engines.

// staleConfigs is remoteConfigs with rollout.max_staleness: k in both configs.
func staleConfigs(t *testing.T, steps, batch, k int, run string) remoteRun {
	t.Helper()
	rr := remoteConfigs(t, steps, batch, run, "")
	for _, cfg := range []string{rr.local, rr.remote} {
		b, err := os.ReadFile(cfg)
		if err != nil {
			t.Fatal(err)
		}
		y := strings.Replace(string(b), "max_response_len: 12}", "max_response_len: 12, max_staleness: "+strconv.Itoa(k)+"}", 1)
		if y == string(b) {
			t.Fatalf("%s has no rollout section to add max_staleness to:\n%s", cfg, b)
		}
		if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return rr
}

// checkServedVersions checks that a remote run kept its versions in the servers and sampled the
// steps after the first from weights one step old.
func checkServedVersions(t *testing.T, dir string) {
	t.Helper()
	ev := eventsLog(t, dir)
	for _, p := range []string{"generator", "critic"} {
		if want := `policy "` + p + `": its remote engine keeps rollout copies of its weights itself`; !strings.Contains(ev, want) {
			t.Errorf("events.log lacks %q:\n%s", want, ev)
		}
	}
	if strings.Contains(ev, "rollout replica") {
		t.Errorf("a server that keeps versions got rollout replicas:\n%s", ev)
	}
	stale := 0
	for _, m := range metricLines(t, dir) {
		if m["policy"] == "generator" && m["step"] == 3.0 {
			stale++
			if m["rollout_version"] != 1.0 || m["staleness_max"] != 1.0 {
				t.Errorf("step 3 of the generator: rollout_version %v, staleness_max %v; want 1 and 1 (sampled from the weights after step 1)", m["rollout_version"], m["staleness_max"])
			}
		}
	}
	if stale != 1 {
		t.Errorf("%d metrics lines of the generator's step 3, want 1", stale)
	}
}

func TestRemoteAsyncEqualsInProcess(t *testing.T) {
	rr := staleConfigs(t, 3, 4, 1, "")
	rr.serve(t, 0)
	rr.serve(t, 1)
	a, b := rr.execRun(t, rr.local, "local"), rr.execRun(t, rr.remote, "remote")
	assertTrained(t, a, 3)
	checkServedVersions(t, b)
	if ma, mb := metricsNoTimings(t, a), metricsNoTimings(t, b); ma != mb {
		t.Errorf("remote metrics at rollout.max_staleness 1 differ from in-process:\n%s\n---\n%s", ma, mb)
	}
}

// A server that restarts has lost the versions it kept: the host loads the last checkpoint into
// the new process and keeps again in it the versions the next steps sample (which the checkpoint
// holds), and the run writes the metrics of the run that never stopped.
func TestRemoteAsyncEngineKilledAndRestarted(t *testing.T) {
	rr := staleConfigs(t, 4, 4, 1, "save_interval: 1")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	clean := rr.execRun(t, rr.local, "clean")
	out, log, err := killGeneratorDuring(t, rr, gen, 1, 4)
	if err != nil {
		t.Fatalf("the run failed after the engine came back: %v\n%s", err, log)
	}
	checkServedVersions(t, out)
	events := eventsLog(t, out)
	if !strings.Contains(events, `policy "generator": its engine at `+rr.addrs[0]+" restarted") ||
		!strings.Contains(events, "loaded "+filepath.Join(out, "checkpoints", "step_1")) ||
		!strings.Contains(events, "in it again") {
		t.Errorf("events.log does not tell that the generator's engine restarted and got its checkpoint and versions back:\n%s", events)
	}
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("metrics differ from the fault-free in-process run's:\n%s\n---\n%s", ma, mb)
	}
}

// A server that restarts between checkpoints (run.save_interval 2, killed after step 3) at
// rollout.max_staleness 1: the host loads step 2's checkpoint, keeps its versions again, replays
// step 3's optimizer steps and keeps version 3 again, which the steps to come sample; the run
// writes the metrics of the run that never stopped. (Before: the run stopped.)
func TestRemoteAsyncRestartBetweenCheckpoints(t *testing.T) {
	rr := staleConfigs(t, 5, 4, 1, "save_interval: 2")
	gen := rr.serve(t, 0)
	rr.serve(t, 1)
	clean := rr.execRun(t, rr.local, "clean")
	out, log, err := killGeneratorDuring(t, rr, gen, 3, 5)
	if err != nil {
		t.Fatalf("the run failed after the engine came back: %v\n%s", err, log)
	}
	checkServedVersions(t, out)
	if events := eventsLog(t, out); !strings.Contains(events, "loaded "+filepath.Join(out, "checkpoints", "step_2", "generator")+" (step 2) into it, kept weights versions") ||
		!strings.Contains(events, "keeping weights versions [3] again") {
		t.Errorf("events.log does not tell that the generator's engine got step 2's checkpoint, the optimizer steps since and version 3 back:\n%s", events)
	}
	if ma, mb := metricsNoTimings(t, clean), metricsNoTimings(t, out); ma != mb {
		t.Errorf("metrics differ from the fault-free in-process run's:\n%s\n---\n%s", ma, mb)
	}
}
