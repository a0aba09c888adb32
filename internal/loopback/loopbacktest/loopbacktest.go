// Package loopbacktest is loopback for tests: an address a test's server can be killed and
// served on again, or the test's end.
package loopbacktest

import (
	"testing"

	"github.com/slimen/slimen/internal/loopback"
)

// Addr is loopback.Addr, failing t where there is none.
func Addr(t testing.TB) string {
	t.Helper()
	a, err := loopback.Addr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}
