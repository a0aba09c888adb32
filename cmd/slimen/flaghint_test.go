package main

import (
	"strings"
	"testing"
)

// TestFlagTypoHint: a flag a letter or two from one the command has gets a did-you-mean after
// the usage (the last line a user sees); a flag far from every one gets none.
func TestFlagTypoHint(t *testing.T) {
	for _, tc := range []struct{ arg, want string }{
		{"--stpes", "slimen exec: unknown flag -stpes; did you mean --steps?"},
		{"-batchsize", "slimen exec: unknown flag -batchsize; did you mean --batch-size?"},
		{"--confg", "slimen exec: unknown flag -confg; did you mean --config?"},
		{"--learning-rate", ""},
	} {
		f := newExecFlags()
		var out strings.Builder
		f.fs.SetOutput(&out)
		if _, err := parseInterleaved(f.fs, []string{"a.star", tc.arg, "3"}); err == nil {
			t.Fatalf("%s was taken", tc.arg)
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		last := lines[len(lines)-1]
		if tc.want == "" && strings.Contains(out.String(), "did you mean") || tc.want != "" && last != tc.want {
			t.Errorf("%s: the output ends %q, want %q", tc.arg, last, tc.want)
		}
	}
}
