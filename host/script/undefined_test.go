package script

import (
	"strings"
	"testing"
)

// An undefined name gets a hint that fits it, or none (issue 35: "undefined: sum (did you mean
// set?)", and "load("@slimen//answers.star", "CALC (did you mean call?)")" for a name no module
// defines).
func TestUndefinedNameHints(t *testing.T) {
	for _, tc := range []struct {
		src, want string
		not       []string
	}{
		{"x = sum([1, 2])\n", `undefined: sum (Starlark has no sum(); add in a loop, or load("@slimen//stats.star", "mean") for a mean)`, []string{"did you mean"}},
		{"x = CALC\n", "undefined: CALC (define it in the script, or load it from the file that defines it)", []string{"did you mean", "answers.star"}},
		{"x = boxed('a')\n", `undefined: boxed (load it: load("@slimen//answers.star", "boxed"))`, []string{"did you mean"}},
		{"x = mean([1.0])\n", `undefined: mean (load it: load("@slimen//stats.star", "mean"))`, nil},
		{"def rollout(task):\n    generat('p', task.prompt)\n", "undefined: generat (did you mean generate?)", nil},
		{"ROLLOUTS = 3\nx = ROLOUTS\n", "undefined: ROLOUTS (did you mean ROLLOUTS?)", nil},
	} {
		_, err := LoadSource("x.star", []byte(tc.src), Options{Library: true})
		if err == nil {
			t.Errorf("%q loaded", tc.src)
			continue
		}
		got := ErrorText(err)
		if !strings.Contains(got, tc.want) {
			t.Errorf("%q:\n%s\nwant %q", tc.src, got, tc.want)
		}
		for _, n := range tc.not {
			if strings.Contains(got, n) {
				t.Errorf("%q:\n%s\nsays %q", tc.src, got, n)
			}
		}
	}
}
