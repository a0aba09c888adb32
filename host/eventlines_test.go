package host

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// events.log says each thing once and makes sense read on its own (issue 35): the stop line said
// "the run stops: ...; the run stops. First failure:", and the file held "1 more rollouts failed
// (all in events.log)", the terminal's pointer to itself.
func TestEventsLogLinesReadOnTheirOwn(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	var term strings.Builder
	r, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    fail(\"boom\")\n"), Options{Config: testConfig(4, "p"), Out: out,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Tasks: numberedTasks(4), Log: &term})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Train(context.Background()); err == nil {
		t.Fatal("Train: no error")
	}
	b, err := os.ReadFile(filepath.Join(out, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	events := string(b)
	for _, line := range strings.Split(events, "\n") {
		if strings.Contains(line, "stop:") && strings.Count(line, "the run stops") != 1 {
			t.Errorf("the stop line says 'the run stops' %d times: %s", strings.Count(line, "the run stops"), line)
		}
	}
	if strings.Contains(events, "(all in events.log)") || !strings.Contains(events, "step 1: 4 rollouts failed in all, 3 of them shown on the terminal") {
		t.Errorf("events.log:\n%s", events)
	}
	if !strings.Contains(term.String(), "step 1: 1 more rollouts failed (all in events.log)") {
		t.Errorf("the terminal:\n%s", term.String())
	}
}
