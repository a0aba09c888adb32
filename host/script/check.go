package script

import (
	"errors"
	"fmt"
	"os"
	"sort"

	"go.starlark.net/syntax"

	"github.com/slimen/slimen/host/config"
)

// Check finds what can be found without running a rollout: syntax errors, undefined names, a
// missing or mis-shaped rollout(task), loads that fail, and policy names written as string
// literals in generate/score calls and train(teacher=…) that the config does not define (cfg nil:
// any name is fine, as in a zero-config run). Each problem is a line "file:line:col: message".
func Check(path string, cfg *config.Config) []string {
	s, err := Load(path, Options{Config: configValue{get: func() *config.Config { return cfg }}})
	if err != nil {
		var se *Error
		if errors.As(err, &se) {
			return []string{se.Msg}
		}
		return []string{err.Error()}
	}
	if cfg == nil {
		return nil
	}
	known := map[string]bool{}
	for _, p := range cfg.Policies {
		known[p.Name] = true
	}
	var problems []string
	for _, f := range s.Files {
		src, err := os.ReadFile(f)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", f, err))
			continue
		}
		file, err := fileOptions.Parse(f, src, 0)
		if err != nil {
			continue // Load already reported it
		}
		for _, u := range policyLiterals(file) {
			if !known[u.name] {
				problems = append(problems, fmt.Sprintf("%s: %s: unknown policy %q; %s defines %s — add it under policies: or fix the name",
					u.pos, u.fn, u.name, cfgFile(cfg), config.QuotePolicyNames(cfg.PolicyNames())))
			}
		}
	}
	sort.Strings(problems)
	return problems
}

type policyUse struct {
	pos  syntax.Position
	fn   string
	name string
}

// policyLiterals finds policy names written literally: generate("p", …), score("p", …),
// train(…, teacher="p").
func policyLiterals(f *syntax.File) []policyUse {
	var out []policyUse
	syntax.Walk(f, func(n syntax.Node) bool {
		call, ok := n.(*syntax.CallExpr)
		if !ok {
			return true
		}
		id, ok := call.Fn.(*syntax.Ident)
		if !ok {
			return true
		}
		switch id.Name {
		case "generate", "score":
			if len(call.Args) > 0 {
				if lit, ok := call.Args[0].(*syntax.Literal); ok && lit.Token == syntax.STRING {
					out = append(out, policyUse{lit.TokenPos, id.Name, lit.Value.(string)})
				}
			}
		case "train":
			for _, a := range call.Args {
				if b, ok := a.(*syntax.BinaryExpr); ok && b.Op == syntax.EQ {
					if k, ok := b.X.(*syntax.Ident); ok && k.Name == "teacher" {
						if lit, ok := b.Y.(*syntax.Literal); ok && lit.Token == syntax.STRING {
							out = append(out, policyUse{lit.TokenPos, "train", lit.Value.(string)})
						}
					}
				}
			}
		}
		return true
	})
	return out
}

func cfgFile(c *config.Config) string {
	if c.File != "" {
		return c.File
	}
	return "the config"
}
