package config

import (
	"strings"
	"testing"
)

// TestPolicyNameRule: a config refuses the policy names that would break its run directory or
// its metrics (the rule a zero-config run applies to the names a script passes, host/run.go).
func TestPolicyNameRule(t *testing.T) {
	for name, want := range map[string]string{
		`".."`:                        `policies[0].name: policy name ".." would name the folder that holds the policies' folders`,
		`"."`:                         `policy name "." would name the folder`,
		strings.Repeat("x", 300):      `is 300 bytes, more than 128 (it names folders in the run directory)`,
		`_run`:                        `policy name "_run" is the name of the run's own metrics lines`,
		`"a b"`:                       `policy name "a b" must not contain spaces, control characters or slashes`,
		`"a/b"`:                       `must not contain spaces, control characters or slashes`,
		`"a\tb"`:                      `must not contain spaces, control characters or slashes`,
		strings.Repeat("y", 128) + "": "",
		`solver-1.5`:                  "",
	} {
		_, err := Parse([]byte("policies:\n  - name: "+name+"\n"), "p.yaml")
		switch {
		case want == "" && err != nil:
			t.Errorf("name %.40s: %v, want it accepted", name, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("name %.40s: %v, want an error containing %q", name, err, want)
		}
	}
}
