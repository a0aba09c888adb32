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
