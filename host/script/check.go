package script

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/syntax"

	"github.com/slimen/slimen/host/advantage"
	"github.com/slimen/slimen/host/config"
)

// Check finds what can be found without running a rollout: syntax errors, undefined names, a
// missing or mis-shaped rollout(task), loads that fail, and policy names written as string
// literals in generate/score calls and train(teacher=…) that the config does not define (cfg nil:
// any name is fine, as in a zero-config run). Each problem is a line "file:line:col: message".
func Check(path string, cfg *config.Config) []string {
	problems, _ := Lint(path, cfg)
	return problems
}

// Lint is Check with warnings: what runs but is likely not what was meant. Policy names one or
// two edits apart ("sovler" beside "solver": in a zero-config run a typo trains a second model)
// and a policy whose only generate call samples one completion a task under a group estimator
// (every group holds one sample, every advantage is 0, nothing trains).
func Lint(path string, cfg *config.Config) (problems, warnings []string) {
	s, err := Load(path, Options{Config: configValue{get: func() *config.Config { return cfg }}})
	if err != nil {
		var se *Error
		if errors.As(err, &se) {
			return []string{se.Msg}, nil
		}
		return []string{err.Error()}, nil
	}
	return LintScript(s, cfg)
}

// LintScript is Lint of a script already loaded (a new version --watch found).
func LintScript(s *Script, cfg *config.Config) (problems, warnings []string) {
	var names []string
	if cfg != nil {
		names = cfg.PolicyNames()
	}
	direct, files := scriptPolicies(s.Files)
	uses := append(slices.Clip(direct), reachedPolicies(files)...)
	problems = append(taskFields(files), builtinKeywords(files, s.own)...)
	for _, u := range uses {
		if cfg != nil && !slices.Contains(names, u.Name) {
			hint := ""
			if best := ClosestName(u.Name, names); best != "" {
				hint = fmt.Sprintf(" (did you mean %q?)", best)
			}
			problems = append(problems, fmt.Sprintf("%s: %s: unknown policy %q%s; %s defines %s — add it under policies: or fix the name",
				u.Pos, u.where(), u.Name, hint, cfgFile(cfg), config.QuotePolicyNames(names)))
		}
	}
	warnings = append(NearPolicyNames(uses), singleSamples(files, direct, cfg)...)
	warnings = append(warnings, singleChats(files, cfg)...)
	if w := neverTrains(files); w != "" {
		warnings = append(warnings, w)
	}
	sort.Strings(problems)
	return problems, warnings
}

// taskAttrs are the fields of the task a rollout gets (taskValue), sorted.
var taskAttrs = []string{"id", "label", "metadata", "prompt", "step"}

// taskFields finds task.X in rollout(task) and eval_rollout(task), X being no field of a task
// (task.promt): every rollout would fail there.
func taskFields(files []*syntax.File) []string {
	var out []string
	for _, f := range files {
		for _, st := range f.Stmts {
			def, ok := st.(*syntax.DefStmt)
			if !ok || (def.Name.Name != "rollout" && def.Name.Name != "eval_rollout") || len(def.Params) == 0 {
				continue
			}
			param, ok := def.Params[0].(*syntax.Ident)
			if !ok || assigns(def.Body, param.Name) {
				continue
			}
			var walk func(n syntax.Node)
			walk = func(n syntax.Node) {
				syntax.Walk(n, func(m syntax.Node) bool {
					switch m := m.(type) {
					case *syntax.DefStmt: // a nested function's own parameter of that name is another value
						if slices.Contains(paramNames(m.Params), param.Name) {
							return false
						}
					case *syntax.LambdaExpr:
						if slices.Contains(paramNames(m.Params), param.Name) {
							return false
						}
					case *syntax.Comprehension:
						return false // its loop variables may rebind the name; rare, and not worth a false alarm
					case *syntax.DotExpr:
						if id, ok := m.X.(*syntax.Ident); ok && id.Name == param.Name && !slices.Contains(taskAttrs, m.Name.Name) {
							hint := ""
							if best := ClosestName(m.Name.Name, taskAttrs); best != "" {
								hint = fmt.Sprintf(" (did you mean .%s?)", best)
							}
							out = append(out, fmt.Sprintf("%s: %s(%s): a task has no field .%s%s; its fields are .id, .prompt, .label, .metadata and .step",
								m.Name.NamePos, def.Name.Name, param.Name, m.Name.Name, hint))
						}
					}
					return true
				})
			}
			for _, b := range def.Body {
				walk(b)
			}
		}
	}
	return out
}

// keywordBuiltins are the built-ins whose keyword arguments check asks about.
var keywordBuiltins = []string{"generate", "chat", "train", "reward", "score", "agent", "parallel", "completion"}

// unknownKeyword is the built-in's own refusal of keyword kw ("" if it takes it): the built-in
// is called with kw alone on a rollout thread of no run, which its argument check refuses
// before it does anything, so check never keeps a second list of the parameters.
func unknownKeyword(name, kw string) string {
	b, ok := predeclared()[name].(*starlark.Builtin)
	if !ok {
		return ""
	}
	ro := &Rollout{Ctx: context.Background(), Task: Task{ID: "check"}}
	_, err := starlark.Call(ro.NewThread(nil), b, nil, []starlark.Tuple{{starlark.String(kw), starlark.None}})
	if err != nil && strings.Contains(err.Error(), "unexpected keyword argument") {
		return err.Error()
	}
	return ""
}

// builtinKeywords finds keyword arguments a built-in does not take (generate(…, max_token=5)):
// the call fails in every rollout. A name the script defines or loads for itself, or an
// embedder's Builtins replaced (replaced), is not the built-in.
func builtinKeywords(files []*syntax.File, replaced map[string]bool) []string {
	var out []string
	for _, f := range files {
		own := maps.Clone(replaced)
		if own == nil {
			own = map[string]bool{}
		}
		for _, st := range f.Stmts {
			switch st := st.(type) {
			case *syntax.DefStmt:
				own[st.Name.Name] = true
			case *syntax.LoadStmt:
				for _, to := range st.To {
					own[to.Name] = true
				}
			case *syntax.AssignStmt:
				if id, ok := st.LHS.(*syntax.Ident); ok {
					own[id.Name] = true
				}
			}
		}
		syntax.Walk(f, func(n syntax.Node) bool {
			call, ok := n.(*syntax.CallExpr)
			if !ok {
				return true
			}
			fn := callee(call)
			if !slices.Contains(keywordBuiltins, fn) || own[fn] {
				return true
			}
			for _, a := range call.Args {
				b, ok := a.(*syntax.BinaryExpr)
				if !ok || b.Op != syntax.EQ {
					continue
				}
				if k, ok := b.X.(*syntax.Ident); ok {
					if msg := unknownKeyword(fn, k.Name); msg != "" {
						out = append(out, fmt.Sprintf("%s: %s", k.NamePos, msg))
					}
				}
			}
			return true
		})
	}
	return out
}

// assigns reports whether body binds name other than as a parameter (name = …, a loop).
func assigns(body []syntax.Stmt, name string) bool {
	found := false
	for _, st := range body {
		syntax.Walk(st, func(n syntax.Node) bool {
			var target syntax.Expr
			switch n := n.(type) {
			case *syntax.AssignStmt:
				target = n.LHS
			case *syntax.ForStmt:
				target = n.Vars
			case *syntax.DefStmt, *syntax.LambdaExpr:
				return false
			}
			if target != nil {
				syntax.Walk(target, func(m syntax.Node) bool {
					if id, ok := m.(*syntax.Ident); ok && id.Name == name {
						found = true
					}
					return true
				})
			}
			return !found
		})
	}
	return found
}

// PolicyUse is a policy name written as a string literal in a script.
type PolicyUse struct {
	Pos  syntax.Position
	Fn   string // generate, score, train, chat or agent
	Name string
	Via  string // the script's function the name is passed to (ask in ask("solver", …)); "" when written in Fn's call
	// Default is the parameter of Via whose default the name is, for a call that leaves it out.
	Default string
	// Held is the variable or function call the name reaches the call through ("SOLVER",
	// "solver()"); "" when the literal is written in the call.
	Held string
	// Tools marks a chat() call given tool schemas (a tools argument other than None): a
	// zero-config run puts such a policy on the embedded chat model.
	Tools bool
}

// where is the call a use is written in: generate, or ask → generate for a name passed to ask,
// SOLVER → generate for one held in a variable.
func (u PolicyUse) where() string {
	if u.Held != "" {
		v := u
		v.Held = ""
		return u.Held + " → " + v.where()
	}
	switch {
	case u.Via == "":
		return u.Fn
	case u.Default != "":
		return fmt.Sprintf("%s (its default %s=%q) → %s", u.Via, u.Default, u.Name, u.Fn)
	}
	return u.Via + " → " + u.Fn
}

// call is a use as its call reads: generate("solver") or ask("solver") → generate, or
// SOLVER = "solver" → generate.
func (u PolicyUse) call() string {
	if u.Held != "" {
		return fmt.Sprintf("%s = %q → %s", u.Held, u.Name, u.where()[len(u.Held)+len(" → "):])
	}
	switch {
	case u.Via == "":
		return fmt.Sprintf("%s(%q)", u.Fn, u.Name)
	case u.Default != "":
		return fmt.Sprintf("%s(%s=%q by default) → %s", u.Via, u.Default, u.Name, u.Fn)
	}
	return fmt.Sprintf("%s(%q) → %s", u.Via, u.Name, u.Fn)
}

// PolicyUses lists every place a loaded script names a policy that check can follow: literals in
// the builtins' calls, and names passed through the script's functions, variables and returns.
func PolicyUses(s *Script) []PolicyUse {
	direct, files := scriptPolicies(s.Files)
	return append(direct, reachedPolicies(files)...)
}

// RenamedPolicies finds the uses of a name the run does not have (have: its policies) that is a
// letter or two from one it has and no use names any more: in a new version of a running
// script, the typo that would leave a trained model idle and start a fresh one under the typed
// name. Each is a line "file:line:col: message".
func RenamedPolicies(uses []PolicyUse, have []string) []string {
	used := map[string]bool{}
	for _, u := range uses {
		used[u.Name] = true
	}
	var out []string
	said := map[string]bool{}
	for _, u := range uses {
		if slices.Contains(have, u.Name) || said[u.Name] {
			continue
		}
		for _, h := range have {
			if nearNames(u.Name, h) && !used[h] {
				said[u.Name] = true
				out = append(out, fmt.Sprintf("%s: %s: policy %q is new to the run, "+
					"and this version no longer uses the run's policy %q, a letter or two away: "+
					"a new name starts a fresh, untrained model while the trained %q sits idle — fix the name if it is a typo; "+
					"for a new model, pick a name that is not one letter from an existing one or restart the run",
					u.Pos, u.where(), u.Name, h, h))
				break
			}
		}
	}
	return out
}

// PolicyNames lists the policy names a loaded script writes as string literals (generate,
// score, train(teacher=…)), each once, where it first appears.
func PolicyNames(s *Script) []PolicyUse {
	uses, _ := scriptPolicies(s.Files)
	var out []PolicyUse
	seen := map[string]bool{}
	for _, u := range uses {
		if !seen[u.Name] {
			seen[u.Name] = true
			out = append(out, u)
		}
	}
	return out
}

// ScoringUses lists every place a loaded script scores with a policy it names literally:
// score("p", …) and train(…, teacher="p"), each place (not each name) once.
func ScoringUses(s *Script) []PolicyUse {
	uses, _ := scriptPolicies(s.Files)
	var out []PolicyUse
	for _, u := range uses {
		if u.Fn == "score" || u.Fn == "train" {
			out = append(out, u)
		}
	}
	return out
}

// scriptPolicies parses a script's files (Load has reported their errors) and finds their
// policy literals.
func scriptPolicies(paths []string) ([]PolicyUse, []*syntax.File) {
	var uses []PolicyUse
	var files []*syntax.File
	for _, f := range paths {
		src, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		file, err := fileOptions.Parse(f, src, 0)
		if err != nil {
			continue
		}
		files = append(files, file)
		uses = append(uses, policyLiterals(file)...)
	}
	return uses, files
}

// NearPolicyNames warns about distinct policy names one edit apart (two for names longer than
// four letters), each pair once.
func NearPolicyNames(uses []PolicyUse) []string {
	first := map[string]PolicyUse{}
	var names []string
	for _, u := range uses {
		if _, ok := first[u.Name]; !ok {
			first[u.Name] = u
			names = append(names, u.Name)
		}
	}
	var out []string
	for i, a := range names {
		for _, b := range names[i+1:] {
			if nearNames(a, b) {
				ua, ub := first[a], first[b]
				out = append(out, fmt.Sprintf("%s: %s and %s: %s name two policies that differ by a letter or two; "+
					"in a zero-config run each is a model of its own — fix the name if one is a typo",
					ua.Pos, ua.call(), ub.Pos, ub.call()))
			}
		}
	}
	return out
}

func nearNames(a, b string) bool {
	limit := 2
	if min(len(a), len(b)) <= 4 {
		limit = 1
	}
	return a != b && config.EditDistance(a, b) <= limit
}

// ClosestName is the name of names nearest to s, if one is near.
func ClosestName(s string, names []string) string {
	for _, n := range names {
		if nearNames(s, n) {
			return n
		}
	}
	return ""
}

// singleSamples warns about policies whose only generate call, in rollout's own body (not in a
// loop, comprehension, lambda or another function), samples one completion, while no train()
// names a group or an advantage and the policy's estimator normalises within groups: every
// group then holds one sample.
func singleSamples(files []*syntax.File, uses []PolicyUse, cfg *config.Config) []string {
	calls := map[string][]*syntax.CallExpr{}
	once := map[string]bool{} // one completion, straight in rollout's body
	grouped := false
	for _, f := range files {
		syntax.Walk(f, func(n syntax.Node) bool {
			call, ok := n.(*syntax.CallExpr)
			if !ok {
				return true
			}
			switch callee(call) {
			case "generate":
				if name := literalArg(call); name != "" {
					calls[name] = append(calls[name], call)
				}
			case "train":
				grouped = grouped || keyword(call, "group") != nil || keyword(call, "advantage") != nil
			}
			return true
		})
		inRolloutBody(f, func(n *syntax.CallExpr) {
			if callee(n) == "generate" && !sampleCount(n) {
				once[literalArg(n)] = true
			}
		})
	}
	if grouped {
		return nil
	}
	var out []string
	seen := map[string]bool{}
	for _, u := range uses {
		if u.Fn != "generate" || seen[u.Name] || len(calls[u.Name]) != 1 || !once[u.Name] {
			continue
		}
		seen[u.Name] = true
		est, one := groupOfOne(cfg, u.Name)
		if !one {
			continue
		}
		out = append(out, fmt.Sprintf("%s: generate(%q, …) is the policy's only sample of a task, "+
			"so each %s group holds one sample and every advantage is 0: sample several (n=4), "+
			"run each task several times (n_samples_per_prompt: 4), or use advantage_estimator: reinforce_plus_plus",
			u.Pos, u.Name, est))
	}
	return out
}

// inRolloutBody calls visit for each call made straight in the body of f's rollout: not in a
// loop, comprehension, lambda or another function, so it runs once a task.
func inRolloutBody(f *syntax.File, visit func(*syntax.CallExpr)) {
	for _, st := range f.Stmts {
		def, ok := st.(*syntax.DefStmt)
		if !ok || def.Name.Name != "rollout" {
			continue
		}
		for _, body := range def.Body {
			syntax.Walk(body, func(n syntax.Node) bool {
				switch n := n.(type) {
				case *syntax.ForStmt, *syntax.WhileStmt, *syntax.Comprehension, *syntax.LambdaExpr, *syntax.DefStmt:
					return false
				case *syntax.CallExpr:
					visit(n)
				}
				return true
			})
		}
	}
}

// groupOfOne says whether one sample of policy name a task makes its advantage groups groups of
// one: its estimator (returned; grpo without a config) compares within groups and
// n_samples_per_prompt is 1.
func groupOfOne(cfg *config.Config, name string) (string, bool) {
	est, n := "grpo", 1
	if cfg != nil {
		if p, ok := cfg.Policy(name); ok {
			est, n = p.Train.AdvantageEstimator, p.Train.NSamplesPerPrompt
		}
	}
	return est, advantage.Grouped(est) && n <= 1
}

// singleChats warns about a chat("p", …) made straight in rollout's body (not in a loop,
// comprehension, lambda or another function), the script's only chat of that policy, when nothing
// in the script makes more conversations of it (no .fork(), no .generate(n=…) other than 1), no
// train() names a group or an advantage and the policy's estimator normalises within groups: one
// conversation per task is a group of one, every advantage is 0 and the chat trains nothing.
func singleChats(files []*syntax.File, cfg *config.Config) []string {
	count := map[string]int{}
	var once []*syntax.Literal // chat("p", …) straight in rollout's body
	for _, f := range files {
		more := false
		syntax.Walk(f, func(n syntax.Node) bool {
			call, ok := n.(*syntax.CallExpr)
			if !ok {
				return true
			}
			if dot, ok := call.Fn.(*syntax.DotExpr); ok {
				more = more || dot.Name.Name == "fork" || dot.Name.Name == "generate" && sampleCount(call)
			}
			switch callee(call) {
			case "chat":
				if lit := stringLit(policyArg(call)); lit != nil {
					count[lit.Value.(string)]++
				}
			case "train":
				more = more || keyword(call, "group") != nil || keyword(call, "advantage") != nil
			}
			return true
		})
		if more {
			return nil
		}
		inRolloutBody(f, func(n *syntax.CallExpr) {
			if lit := stringLit(policyArg(n)); callee(n) == "chat" && lit != nil {
				once = append(once, lit)
			}
		})
	}
	var out []string
	for _, lit := range once {
		name := lit.Value.(string)
		if count[name] != 1 {
			continue
		}
		est, one := groupOfOne(cfg, name)
		if !one {
			continue
		}
		out = append(out, fmt.Sprintf("%s: chat(%q, …) makes one conversation per task, so each %s group holds one sample and "+
			"every advantage is 0: nothing is learned from it. Run each task several times "+
			"(n_samples_per_prompt: 4 under the policy's train:), make several conversations in the "+
			"rollout (parallel(lambda i: talk(task), range(4)), or c.fork() one after its first "+
			"turns), sample a turn several times (c.generate(n=4) returns 4 forks), "+
			"or use advantage_estimator: reinforce_plus_plus",
			lit.TokenPos, name, est))
	}
	return out
}

// neverTrains warns about a script none of whose files names train (as a call or a value): its
// rollouts may reward every completion, but no policy learns. A script that loads a package's
// module (@graphs//…, whose topologies train) is not judged.
func neverTrains(files []*syntax.File) string {
	var rollout syntax.Position
	for _, f := range files {
		for _, st := range f.Stmts {
			if l, ok := st.(*syntax.LoadStmt); ok && strings.HasPrefix(l.ModuleName(), "@") &&
				!strings.HasPrefix(l.ModuleName(), "@slimen//") && !strings.HasPrefix(l.ModuleName(), "@std//") {
				return ""
			}
			if d, ok := st.(*syntax.DefStmt); ok && d.Name.Name == "rollout" && !rollout.IsValid() {
				rollout = d.Def
			}
		}
		named := false
		syntax.Walk(f, func(n syntax.Node) bool {
			if id, ok := n.(*syntax.Ident); ok && id.Name == "train" {
				named = true
			}
			return !named
		})
		if named {
			return ""
		}
	}
	if !rollout.IsValid() {
		return ""
	}
	return fmt.Sprintf("%s: the script never calls train(): its rewards are logged but no policy learns from them; queue what you reward with train(c)", rollout)
}

func callee(call *syntax.CallExpr) string {
	if id, ok := call.Fn.(*syntax.Ident); ok {
		return id.Name
	}
	return ""
}

func literalArg(call *syntax.CallExpr) string {
	if len(call.Args) > 0 {
		if lit := stringLit(call.Args[0]); lit != nil {
			return lit.Value.(string)
		}
	}
	return ""
}

// stringLit is e when it is a string literal, else nil.
func stringLit(e syntax.Expr) *syntax.Literal {
	if lit, ok := e.(*syntax.Literal); ok && lit.Token == syntax.STRING {
		return lit
	}
	return nil
}

// keyword is the value a call passes as name=…, nil if it passes none.
func keyword(call *syntax.CallExpr, name string) syntax.Expr {
	for _, a := range call.Args {
		if b, ok := a.(*syntax.BinaryExpr); ok && b.Op == syntax.EQ {
			if k, ok := b.X.(*syntax.Ident); ok && k.Name == name {
				return b.Y
			}
		}
	}
	return nil
}

// sampleCount reports whether a generate call asks for a number of samples other than a literal 1.
func sampleCount(call *syntax.CallExpr) bool {
	n := keyword(call, "n")
	if n == nil {
		return false
	}
	lit, ok := n.(*syntax.Literal)
	return !ok || lit.Value != 1
}

// policyLiterals finds policy names written literally: generate("p", …), score("p", …),
// chat("p", …), train(…, teacher="p"), agent(…, policy="p").
func policyLiterals(f *syntax.File) []PolicyUse {
	var out []PolicyUse
	syntax.Walk(f, func(n syntax.Node) bool {
		call, ok := n.(*syntax.CallExpr)
		if !ok {
			return true
		}
		var arg syntax.Expr
		switch fn := callee(call); fn {
		case "generate", "score":
			if len(call.Args) > 0 {
				arg = call.Args[0]
			}
		case "chat": // chat(policy, system=None, tools=None)
			if arg = keyword(call, "policy"); arg == nil && len(call.Args) > 0 {
				arg = call.Args[0]
			}
		case "train":
			arg = keyword(call, "teacher")
		case "agent": // agent(argv, task_input, policy=…)
			if arg = keyword(call, "policy"); arg == nil && len(call.Args) > 2 {
				arg = call.Args[2]
			}
		}
		if lit := stringLit(arg); lit != nil {
			out = append(out, PolicyUse{Pos: lit.TokenPos, Fn: callee(call), Name: lit.Value.(string), Tools: chatWithTools(call)})
		}
		return true
	})
	return out
}

// chatWithTools says whether call is chat(…) with a tools argument (keyword or third positional)
// other than the literal None.
func chatWithTools(call *syntax.CallExpr) bool {
	if callee(call) != "chat" {
		return false
	}
	arg := keyword(call, "tools")
	if arg == nil && len(call.Args) > 2 {
		arg = call.Args[2]
	}
	if id, ok := arg.(*syntax.Ident); arg == nil || ok && id.Name == "None" {
		return false
	}
	return true
}

func cfgFile(c *config.Config) string {
	if c.File != "" {
		return c.File
	}
	return "the config"
}
