package wandb

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
)

// A sidecar that stops reading its input fails the record that finds it stuck, after writeWait,
// instead of holding the run's observer forever; Close kills it after exitWait.
func TestSidecarStuck(t *testing.T) {
	defer func(w, e time.Duration) { writeWait, exitWait = w, e }(writeWait, exitWait)
	writeWait, exitWait = 200*time.Millisecond, 200*time.Millisecond
	py := filepath.Join(t.TempDir(), "python")
	// It answers init, then reads nothing more.
	if err := os.WriteFile(py, []byte("#!/bin/sh\nread line\necho '{\"type\": \"ready\", \"id\": \"x\", \"mode\": \"offline\"}'\nexec sleep 60\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default(nil)
	cfg.Run.Wandb = &config.WandbConfig{Mode: "offline", Python: py}
	l := New(Options{Log: new(strings.Builder)})
	if err := l.Open(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	// Each step's record is bigger than a pipe's buffer, so the second cannot go in whole.
	big := strings.Repeat("x", 40<<10)
	rec := host.StepRecord{Step: 1, Rollouts: []host.RolloutRecord{{Calls: []host.CallRecord{{Policy: "a", Response: big}}}}}
	start := time.Now()
	var err error
	for i := 0; i < 4 && err == nil; i++ {
		err = l.Step(rec)
	}
	if err == nil || !strings.Contains(err.Error(), "took no message for 200ms; it is stuck") {
		t.Fatalf("Step to a sidecar that reads nothing: got %v, want it stuck", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("finding it stuck took %v", d)
	}
	start = time.Now()
	if err := l.Close(); err == nil {
		t.Error("Close of a stuck sidecar succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Close of a stuck sidecar took %v, want about exitWait", d)
	}
}
