package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// slimen test counts a test that called skip() as skipped, not passed (issue 35: the openai
// agent's tests printed "skipped" and were counted as passed).
func TestSlimenTestCountsSkips(t *testing.T) {
	f := filepath.Join(t.TempDir(), "x_test.star")
	if err := os.WriteFile(f, []byte(`
def test_needs_a_package():
    skip("the openai package is missing")
def test_ok():
    assert.eq(1, 1)
`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := slimen(t, nil, "test", f)
	if code := exitCode(t, err); code != 0 || !strings.Contains(out, "1 passed, 0 failed, 1 skipped") ||
		!strings.Contains(out, "skip "+f+" test_needs_a_package: the openai package is missing") {
		t.Errorf("slimen test: status %d, output:\n%s", code, out)
	}
}
