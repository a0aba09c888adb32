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

// supervised records what a supervisor says (Options.Logf) and the new processes its client
// meets (remote.Options.OnRestart), for the tests that kill workers.
type supervised struct {
	mu              sync.Mutex
	lines, restored []string
}

func (s *supervised) logf(f string, a ...any) {
	s.mu.Lock()
	s.lines = append(s.lines, fmt.Sprintf(f, a...))
	s.mu.Unlock()
}

func (s *supervised) onRestart(_ context.Context, prev, cur string) error {
	s.mu.Lock()
	s.restored = append(s.restored, cur)
	s.mu.Unlock()
	return nil
}

// lastHas reports whether the supervisor's last line so far contains text.
func (s *supervised) lastHas(text string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.lines) > 0 && strings.Contains(s.lines[len(s.lines)-1], text)
}

// A worker killed with SIGKILL, or stopped (SIGSTOP: it hangs, its Health does not answer), is
// started again on its address, up to MaxRestarts times; its client reconnects, reports the new
// process to OnRestart and gets the same completions from it as from the first.
func TestWorkerKilledOrHungIsRestarted(t *testing.T) {
	py := python(t)
	model := tinyModel(t, py)
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sv := &supervised{}
	e, err := Start(ctx, Options{Python: py, Model: model, Device: "cpu", Log: &strings.Builder{},
		Args: []string{"--slots", "4"}, MaxRestarts: 2, HangTimeout: 10 * time.Second, Logf: sv.logf,
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
		if sv.lastHas("is not started again: it was restarted 2 times already") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the supervisor did not give up after the third death: %q", sv.lines)
		}
		time.Sleep(100 * time.Millisecond)
	}
	sv.mu.Lock()
	defer sv.mu.Unlock()
	if len(sv.restored) != 2 {
		t.Errorf("OnRestart saw %d new processes, want 2: %q", len(sv.restored), sv.restored)
	}
	if !strings.Contains(strings.Join(sv.lines, "\n"), "has not answered Health for 10s: killing it") {
		t.Errorf("the hang is not in the supervisor's lines: %q", sv.lines)
	}
}
