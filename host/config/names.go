package config

import (
	"fmt"
	"strings"
)

// QuotePolicyNames lists policy names for messages: "a", "b" (or "no policies").
func QuotePolicyNames(names []string) string {
	if len(names) == 0 {
		return "no policies"
	}
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = fmt.Sprintf("%q", n)
	}
	return strings.Join(q, ", ")
}

// PolicyNames lists the names of the config's policies, in order.
func (c *Config) PolicyNames() []string {
	var out []string
	for _, p := range c.Policies {
		out = append(out, p.Name)
	}
	return out
}

// MaxPolicyNameLen bounds a policy's name: it names a folder of every checkpoint and of the run
// directory, and a file name has at most 255 bytes.
const MaxPolicyNameLen = 128

// CheckPolicyName checks the rule a policy's name meets, in a config and where a zero-config run
// creates a policy from the name a script passes. A name is not empty, has at most
// MaxPolicyNameLen bytes, no spaces, control characters or slashes, is not "." or ".." (it names
// folders, which must stay inside their step's), and not "_run" or "_eval" (the metrics lines of
// the run and of its evals).
func CheckPolicyName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("a policy needs a name")
	case len(name) > MaxPolicyNameLen:
		return fmt.Errorf("policy name %.20q… is %d bytes, more than %d (it names folders in the run directory)", name, len(name), MaxPolicyNameLen)
	case strings.ContainsFunc(name, func(r rune) bool { return r <= ' ' || r == 0x7f || r == '/' || r == '\\' }):
		return fmt.Errorf("policy name %q must not contain spaces, control characters or slashes (it names folders in the run directory)", name)
	case name == "." || name == "..":
		return fmt.Errorf("policy name %q would name the folder that holds the policies' folders, or the one above it", name)
	case name == "_run" || name == "_eval":
		return fmt.Errorf("policy name %q is the name of the run's own metrics lines; choose another", name)
	}
	return nil
}
