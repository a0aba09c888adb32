package remote_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/internal/loopback/loopbacktest"
)

// A server that does not list "versions" (here `slimen serve` of an engine without them; an older
// torch worker alike) gives a client whose KeepsVersions says no, and whose versioned calls fail
// with a message that says why instead of sampling the current weights: the host then keeps
// rollout replicas for it (host/async.go).
func TestVersionsNeedTheServersCapability(t *testing.T) {
	ctx := context.Background()
	c := dial(t, remote.Options{Address: serve(t, newFake(), server.Options{})})
	var _ engines.VersionsProber = c
	keeps, err := c.KeepsVersions(ctx)
	if err != nil || keeps {
		t.Fatalf("KeepsVersions = %v, %v; want false for a server without the capability", keeps, err)
	}
	req := []engines.GenerateRequest{{ID: "a", PromptTokens: []int32{1}, Sampling: engines.Sampling{MaxTokens: 2}}}
	for name, call := range map[string]func() error{
		"KeepVersion":     func() error { return c.KeepVersion(ctx, 0) },
		"GenerateVersion": func() error { _, err := c.GenerateVersion(ctx, 0, req); return err },
		"ScoreVersion":    func() error { _, err := c.ScoreVersion(ctx, 0, nil); return err },
		"SaveVersion":     func() error { return c.SaveVersion(ctx, 0, "/ckpt/v0") },
		"DropVersions":    func() error { return c.DropVersions(ctx, 1) },
	} {
		if err := call(); err == nil || !strings.Contains(err.Error(), `does not keep weights versions (no "versions" in its capabilities)`) {
			t.Errorf("%s: %v; want the capability's refusal", name, err)
		}
	}
}

// forgetful is a fake whose Score fails until a Load gave it its state: a new server process that
// lost what the old one kept (a torch worker's kept weights versions).
type forgetful struct{ *fake }

func (f forgetful) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	f.mu.Lock()
	n := len(f.loaded)
	f.mu.Unlock()
	if n == 0 {
		return nil, errors.New("weights version 1 is not kept by this worker")
	}
	return f.fake.Score(ctx, reqs)
}

// An error answered by a new server process is not trusted any more than an answer: OnRestart
// runs first (here it loads the state the new process lacks) and the call is made again.
func TestErrorFromANewProcessRunsOnRestartFirst(t *testing.T) {
	srv := serveAt(t, loopbacktest.Addr(t), newFake(), server.Options{})
	var restarts atomic.Int32
	var c *remote.Client
	c = dial(t, remote.Options{Address: srv.addr, MaxBackoff: 50 * time.Millisecond,
		OnRestart: func(ctx context.Context, prev, cur string) error {
			restarts.Add(1)
			return c.Load(ctx, "/ckpt/step_1")
		}})
	ctx := context.Background()
	srv.stop()
	serveAt(t, srv.addr, forgetful{newFake()}, server.Options{})
	// The channel reconnects in the background: the next call reaches the new process at once,
	// with no outage for the client to notice first.
	time.Sleep(500 * time.Millisecond)
	got, err := c.Score(ctx, []engines.ScoreRequest{{PromptTokens: []int32{1}, Tokens: []int32{2, 3}}})
	if err != nil || len(got) != 1 {
		t.Fatalf("Score after the restart: %v, %v; want the answer given once OnRestart loaded the state", got, err)
	}
	if n := restarts.Load(); n != 1 {
		t.Errorf("OnRestart ran %d times, want 1", n)
	}
}
