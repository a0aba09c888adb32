//go:build linux

package torchproc

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
)

// rankPid is the process of rank r among the children of torchrun (pid parent), or 0.
func rankPid(t *testing.T, parent, r int) int {
	t.Helper()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		// pid (comm) state ppid …: comm may hold spaces, so read after its closing parenthesis.
		fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(fields) < 2 || fields[1] != strconv.Itoa(parent) {
			continue
		}
		dir := filepath.Dir(f)
		env, _ := os.ReadFile(filepath.Join(dir, "environ"))
		if slices.Contains(strings.Split(string(env), "\x00"), fmt.Sprintf("RANK=%d", r)) {
			pid, _ := strconv.Atoi(filepath.Base(dir))
			return pid
		}
	}
	return 0
}

// A worker of two ranks whose rank 1 is SIGKILLed comes back without the supervisor: torchrun
// (the same process) starts its group again itself, up to MaxRestarts times, rank 0 listens
// where it did, and the client meets the new group as a new process (OnRestart) that gives the
// same completions; once torchrun has used its restarts it exits, and the supervisor does not
// start it again.
func TestRankKilledIsRestartedByTorchrun(t *testing.T) {
	py := python(t)
	model := tinyModel(t, py)
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sv := &supervised{}
	e, err := Start(ctx, Options{Python: py, Model: model, Device: "cpu", Log: &strings.Builder{},
		Ranks: 2, Args: []string{"--slots", "4"}, MaxRestarts: 1, HangTimeout: time.Minute, Logf: sv.logf,
		Client: remote.Options{ReconnectTimeout: 2 * time.Minute, OnRestart: sv.onRestart}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	gen := func(id string) []int32 {
		t.Helper()
		cs, err := e.Generate(ctx, []engines.GenerateRequest{{ID: id, PromptTokens: []int32{5, 6, 7},
			Sampling: engines.Sampling{MaxTokens: 6, Temperature: 1, Seed: 9}}})
		if err != nil || len(cs) != 1 {
			t.Fatalf("generate %s: %v, %v\nsupervisor: %q", id, cs, err, sv.lines)
		}
		return cs[0].Tokens
	}
	want := gen("first")
	torchrun := e.Pid()
	rank1 := rankPid(t, torchrun, 1)
	if rank1 == 0 {
		t.Fatalf("no rank 1 under torchrun (pid %d)", torchrun)
	}
	first := e.Client.Instance()
	syscall.Kill(rank1, syscall.SIGKILL)
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if h, err := e.Client.Health(ctx); err == nil && h.Instance != first {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new group answered within 2 minutes of the kill; supervisor: %q", sv.lines)
		}
	}
	if got := gen("after"); !slices.Equal(got, want) {
		t.Errorf("the restarted group sampled %v, the first %v", got, want)
	}
	sv.mu.Lock()
	if e.Restarts() != 0 || e.Pid() != torchrun || len(sv.restored) != 1 {
		t.Errorf("after the kill: %d restarts by the supervisor (want 0), pid %d (torchrun's %d), "+
			"OnRestart saw %q (want one new process); supervisor: %q", e.Restarts(), e.Pid(), torchrun, sv.restored, sv.lines)
	}
	sv.mu.Unlock()
	// torchrun's one restart is used: a second kill ends it, and the supervisor leaves it dead.
	if rank1 = rankPid(t, torchrun, 1); rank1 == 0 { // (kill(0) would be this test's own group)
		t.Fatalf("no rank 1 under torchrun (pid %d) after the restart; supervisor: %q", torchrun, sv.lines)
	}
	syscall.Kill(rank1, syscall.SIGKILL)
	deadline := time.Now().Add(time.Minute)
	for {
		if sv.lastHas("is not started again: torchrun restarted its group as often as it may (1 times)") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the supervisor did not give up after torchrun did: %q", sv.lines)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if e.Restarts() != 0 {
		t.Errorf("the supervisor started the worker again %d times, want 0", e.Restarts())
	}
}
