package host

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// The first line of events.log says which policies the run starts with; a zero-config run has
// none yet and says that they are created as the script names them.
func TestLoadedLineNamesPolicies(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  *config.Config
		want string
	}{
		{"zero-config", nil, "; policies: created as the script names them"},
		{"config", testConfig(1, "generator", "critic"), "; policies: generator, critic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "run")
			src := reloadScript
			if tc.cfg != nil { // a script naming a policy the config lacks does not start
				src = strings.ReplaceAll(src, `"p"`, `"generator"`)
			}
			r, err := Load(context.Background(), writeScript(t, src), Options{Config: tc.cfg, Out: out, Tasks: numberedTasks(1),
				Engines: map[string]engines.Engine{"p": scripted.Echo("x"), "generator": scripted.Echo("x"), "critic": scripted.Echo("x")}})
			if err != nil {
				t.Fatal(err)
			}
			r.Close()
			b, _ := os.ReadFile(filepath.Join(out, "events.log"))
			first, _, _ := strings.Cut(string(b), "\n")
			if !strings.HasSuffix(first, tc.want) || !strings.Contains(first, "loaded ") {
				t.Errorf("first line of events.log:\n%s\nwant it to end in %q", first, tc.want)
			}
		})
	}
}

// A data file whose label is under another key is said at start-up, on the run's log and in
// events.log, naming data.label_key and the keys the lines have: every task.label would be None.
func TestStartupSaysNoLineHasTheLabelKey(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "qa.jsonl")
	if err := os.WriteFile(data, []byte(`{"prompt": "2+6=", "answer": "8"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(1, "p")
	cfg.Data.Path = data
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "held", Path: data, InputKey: "prompt", LabelKey: "label", NSamples: 1}}
	out := filepath.Join(dir, "run")
	var log strings.Builder
	r, err := Load(context.Background(), writeScript(t, reloadScript), Options{Config: cfg, Out: out, Log: &log,
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}})
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	want := `data: ` + data + `: no line has the label key "label", so every task.label is None (set data.label_key if the label is under another key; the lines have the keys answer, prompt)`
	if !strings.Contains(log.String(), want+"\n") {
		t.Errorf("the run's log:\n%s\nwant the line %q", log.String(), want)
	}
	if b, _ := os.ReadFile(filepath.Join(out, "events.log")); !strings.Contains(string(b), want) {
		t.Errorf("events.log:\n%s\nwant %q", b, want)
	}
	// An eval dataset's file is read at start-up too, and names its own setting.
	want = `eval held: ` + data + `: no line has the label key "label", so every task.label is None (set eval.datasets[0].label_key if the label is under another key; the lines have the keys answer, prompt)`
	if !strings.Contains(log.String(), want+"\n") {
		t.Errorf("the run's log:\n%s\nwant the line %q", log.String(), want)
	}
}
