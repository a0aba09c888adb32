package script

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/host/config"
)

var update = flag.Bool("update", false, "rewrite golden files")

// TestCheckGolden: `slimen check` on the error scripts. Static problems (syntax, names, unknown
// policies, a top-level generate, no rollout) are found without running; the others are "ok".
func TestCheckGolden(t *testing.T) {
	cfg, err := config.Load("../../testdata/errors/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob("../../testdata/errors/*.star")
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".star")
		t.Run(name, func(t *testing.T) {
			got := "ok\n"
			if problems := Check(f, cfg); len(problems) > 0 {
				got = strings.ReplaceAll(strings.Join(problems, "\n"), "../../testdata/", "testdata/") + "\n"
			}
			golden := strings.TrimSuffix(f, ".star") + ".check"
			if *update {
				os.WriteFile(golden, []byte(got), 0o644)
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if d := cmp.Diff(string(want), got); d != "" {
				t.Errorf("check (-want +got):\n%s", d)
			}
		})
	}
}
