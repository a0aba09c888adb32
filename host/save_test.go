package host

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// TestSaveMinutes: by default a run checkpoints by wall time (run.save_minutes), so a crash keeps
// the work of all but the last few minutes, and it says so at start-up.
func TestSaveMinutes(t *testing.T) {
	if d := testConfig(1, "p").Run; d.SaveMinutes <= 0 || d.SaveInterval != 0 {
		t.Fatalf("defaults save_minutes %v, save_interval %d: want checkpoints by wall time by default", d.SaveMinutes, d.SaveInterval)
	}
	cfg := testConfig(2, "p")
	cfg.Run.SaveMinutes, cfg.Run.KeepCheckpoints = 0.001, 0 // 60 ms
	out := filepath.Join(t.TempDir(), "run")
	src := "def rollout(task):\n    c = generate(\"p\", task.prompt, n = 2)\n    reward(c, 1.0)\n    train(c)\n"
	r, err := Load(deadline(t, time.Minute), writeScript(t, src), Options{Config: cfg, Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(2)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	stepOK(t, r) // within 60 ms of the start: no checkpoint
	time.Sleep(70 * time.Millisecond)
	stepOK(t, r) // past it: a checkpoint
	stepOK(t, r) // right after one: none
	entries, _ := os.ReadDir(filepath.Join(out, "checkpoints"))
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != "step_2" {
		t.Errorf("checkpoints %v, want step_2 only", names)
	}
	b, _ := os.ReadFile(filepath.Join(out, "events.log"))
	if !strings.Contains(string(b), "checkpoints: after the first step past 0.001 minutes since the last (run.save_minutes), at the end or on a signal; all kept") {
		t.Errorf("no checkpoint plan at start-up:\n%s", b)
	}
}
