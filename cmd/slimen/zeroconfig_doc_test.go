package main

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestZeroConfigEvalSizeInDocs: what the docs say a zero-config run evaluates (examples/debate's
// script and README, the top-level README) is the number of problems zeroConfig's eval takes
// (debate.star said 100 while the run evaluated 200).
func TestZeroConfigEvalSizeInDocs(t *testing.T) {
	c, err := zeroConfig(true)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Eval.Datasets) != 1 {
		t.Fatalf("zero-config eval: %d datasets, want 1", len(c.Eval.Datasets))
	}
	limit := c.Eval.Datasets[0].Limit
	said := regexp.MustCompile(`(?s)(?:evaluates|on|and) (\d+)\s+(?:#\s*)?(?:held-out problems|of them)`)
	for _, f := range []string{"../../examples/debate/debate.star", "../../examples/debate/README.md", "../../README.md"} {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		ms := said.FindAllSubmatch(src, -1)
		if len(ms) == 0 {
			t.Errorf("%s says nowhere how many held-out problems a zero-config run evaluates", strings.TrimPrefix(f, "../../"))
		}
		for _, m := range ms {
			if n, _ := strconv.Atoi(string(m[1])); n != limit {
				t.Errorf("%s: %q, but a zero-config run evaluates %d", strings.TrimPrefix(f, "../../"), m[0], limit)
			}
		}
	}
}
