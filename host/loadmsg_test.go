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
			r, err := Load(context.Background(), writeScript(t, reloadScript), Options{Config: tc.cfg, Out: out, Tasks: numberedTasks(1),
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
