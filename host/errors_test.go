package host

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

var update = flag.Bool("update", false, "rewrite golden files")

// TestErrorMessagesGolden runs each script of testdata/errors and compares the message a user
// sees (a load error, or the first failed rollout) with its .golden file. Every message names the
// place (file:line:col) and says what to do.
func TestErrorMessagesGolden(t *testing.T) {
	files, _ := filepath.Glob("../testdata/errors/*.star")
	if len(files) < 8 {
		t.Fatalf("found %d error scripts", len(files))
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".star")
		t.Run(name, func(t *testing.T) {
			cfg := testConfig(1, "solver", "judge")
			cfg.Policies[1].Trainable = false
			engs := map[string]engines.Engine{"solver": scripted.Echo(""), "judge": scripted.Echo("yes")}
			got := ""
			r, err := Load(context.Background(), f, Options{Config: cfg, Engines: engs, Tasks: numberedTasks(1)})
			if err != nil {
				got = err.Error()
			} else {
				defer r.Close()
				res, err := r.Step(context.Background())
				switch {
				case err != nil:
					got = err.Error()
				case len(res.Failed) > 0:
					got = res.Failed[0].Error()
				default:
					t.Fatal("the script ran without an error")
				}
			}
			got = strings.ReplaceAll(got, "../testdata/", "testdata/") + "\n"
			golden := strings.TrimSuffix(f, ".star") + ".golden"
			if *update {
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if d := cmp.Diff(string(want), got); d != "" {
				t.Errorf("message (-want +got):\n%s", d)
			}
		})
	}
}
