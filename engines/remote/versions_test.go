package remote_test

import (
	"context"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
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
