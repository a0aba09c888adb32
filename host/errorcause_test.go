package host

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// TestResumeErrorKeepsCause checks that a ScriptError made of another error keeps it: the CLI
// exits 2 on the ScriptError, and a caller can still tell the error it came from with errors.Is,
// while the message stays the cause's.
func TestResumeErrorKeepsCause(t *testing.T) {
	script := writeScript(t, counterScript)
	out := filepath.Join(t.TempDir(), "run")
	r := counterRun(t, script, out, nil)
	if err := r.Steps(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.Close()

	refused := errors.New("--steps: refused by the override")
	_, err := Resume(context.Background(), out, "", Options{Tasks: numberedTasks(4),
		Engines:        map[string]engines.Engine{"p": scripted.Echo("a")},
		ConfigOverride: func(*config.Config) error { return refused }})
	var se *ScriptError
	if !errors.As(err, &se) {
		t.Fatalf("resume with a failing override: %v (%T), want a ScriptError", err, err)
	}
	if !errors.Is(err, refused) {
		t.Errorf("errors.Is does not see the override's error through the ScriptError %q", err)
	}
	if err.Error() != refused.Error() {
		t.Errorf("message %q, want the cause's %q", err, refused)
	}
}
