package host

import (
	"os"
	"testing"
)

// TestMain lets the test binary serve as its own sandbox child, as the slimen binary does.
func TestMain(m *testing.M) {
	if os.Getenv(SandboxChildEnv) != "" {
		os.Exit(SandboxChildMain())
	}
	os.Exit(m.Run())
}
