//go:build unix

package torchproc

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
)

// A worker killed with SIGKILL, or stopped (SIGSTOP: it hangs, its Health does not answer), is
// started again on its address, up to MaxRestarts times; its client reconnects, reports the new
// process to OnRestart and gets the same completions from it as from the first.
func TestWorkerKilledOrHungIsRestarted(t *testing.T) {
	py := python(t)
	model := tinyModel(t, py)
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var mu sync.Mutex
	var lines, restored []string
	logf := func(f string, a ...any) { mu.Lock(); lines = append(lines, fmt.Sprintf(f, a...)); mu.Unlock() }
	onRestart := func(_ context.Context, prev, cur string) error {
		mu.Lock()
		restored = append(restored, cur)
		mu.Unlock()
		return nil
	}
	e, err := Start(ctx, Options{Python: py, Model: model, Device: "cpu", Log: &strings.Builder{},
		Args: []string{"--slots", "4"}, MaxRestarts: 2, HangTimeout: 10 * time.Second, Logf: logf,
		Client: remote.Options{ReconnectTimeout: 2 * time.Minute, OnRestart: onRestart}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	gen := func(id string) []int32 {
		t.Helper()
		cs, err := e.Generate(ctx, []engines.GenerateRequest{{ID: id, PromptTokens: []int32{5, 6, 7},
			Sampling: engines.Sampling{MaxTokens: 6, Temperature: 1, Seed: 9}}})
		if err != nil || len(cs) != 1 {
			t.Fatalf("generate %s: %v, %v\nsupervisor: %q", id, cs, err, lines)
		}
		return cs[0].Tokens
	}
	want := gen("first")
	for i, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP} {
		pid := e.Pid()
		if err := syscall.Kill(pid, sig); err != nil {
			t.Fatal(err)
		}
		if got := gen(fmt.Sprintf("after-%v", sig)); !slices.Equal(got, want) {
			t.Errorf("after %v the worker sampled %v, before %v", sig, got, want)
		}
		if e.Restarts() != i+1 || e.Pid() == pid {
			t.Errorf("after %v: %d restarts, pid %d (was %d)", sig, e.Restarts(), e.Pid(), pid)
		}
	}
	// A third death is one too many: the worker stays dead and says so.
	pid := e.Pid()
	syscall.Kill(pid, syscall.SIGKILL)
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		done := len(lines) > 0 && strings.Contains(lines[len(lines)-1], "is not started again: it was restarted 2 times already")
		mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the supervisor did not give up after the third death: %q", lines)
		}
		time.Sleep(100 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(restored) != 2 {
		t.Errorf("OnRestart saw %d new processes, want 2: %q", len(restored), restored)
	}
	if !strings.Contains(strings.Join(lines, "\n"), "has not answered Health for 10s: killing it") {
		t.Errorf("the hang is not in the supervisor's lines: %q", lines)
	}
}
