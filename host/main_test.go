package host

import (
	"os"
	"testing"

	"github.com/slimen/slimen/host/jail"
	"github.com/slimen/slimen/host/script/sandbox"
)

// TestMain lets the test binary serve as its own sandbox child and as a jail's init, as the
// slimen binary does.
func TestMain(m *testing.M) {
	if os.Getenv(jail.InitEnv) != "" {
		os.Exit(jail.Init())
	}
	if os.Getenv(sandbox.ChildEnv) != "" {
		os.Exit(sandbox.ChildMain())
	}
	os.Exit(m.Run())
}
