package script

import (
	"io/fs"
	"strings"

	"go.starlark.net/syntax"
)

// Policy names a script passes through its own functions: ask("sovler", q) where
// def ask(p, q): return generate(p, q). A parameter reaches a policy argument when the function
// passes it, by name, as the policy of generate/score/chat/agent or train(teacher=…), or as an
// argument of another function whose parameter reaches one (found to a fixed point, through
// lambdas and nested functions that use it). A string literal passed for such a parameter at a
// call in the script's files is a policy name, reported where it is written; a call that leaves
// such a parameter out reaches its default, reported at the call. This is constant propagation
// of literals only: a name computed, stored or returned is not followed.

// reachDef is one function of the script or of a package module it loads.
type reachDef struct {
	name     string
	params   []string
	defaults map[string]syntax.Expr
	body     []syntax.Stmt
	file     *reachFile
	policy   map[string]string // parameter → the builtin it reaches ("generate", …)
}

type reachFile struct {
	name  string
	user  bool                 // one of the script's own files (not a package module)
	defs  map[string]*reachDef // every def of the file, by name (top level first)
	loads map[string][2]string // local name → module id, name there
	top   map[string]*reachDef // top-level defs
	ast   *syntax.File
}

// reachedPolicies finds the policy names files pass through their functions (see above). files
// are the script's parsed files; the package modules they load are parsed from the binary.
func reachedPolicies(files []*syntax.File) []PolicyUse {
	byName := map[string]*reachFile{}
	var all []*reachFile
	var add func(name string, f *syntax.File, user bool)
	add = func(name string, f *syntax.File, user bool) {
		if _, ok := byName[name]; ok {
			return
		}
		rf := &reachFile{name: name, user: user, defs: map[string]*reachDef{}, loads: map[string][2]string{},
			top: map[string]*reachDef{}, ast: f}
		byName[name] = rf
		all = append(all, rf)
		for _, st := range f.Stmts {
			switch st := st.(type) {
			case *syntax.DefStmt:
				d := newReachDef(st.Name.Name, st.Params, st.Body, rf)
				rf.top[d.name], rf.defs[d.name] = d, d
			case *syntax.LoadStmt:
				mod := st.ModuleName()
				id := ""
				if strings.HasPrefix(mod, "@") {
					pkg, file, ok := strings.Cut(mod[1:], "//")
					if fsys, known := bundledPackages()[pkg]; ok && known {
						id = "@" + pkg + "//" + file
						if src, err := fs.ReadFile(fsys, file); err == nil {
							if pf, err := fileOptions.Parse(id, src, 0); err == nil {
								defer add(id, pf, false)
							}
						}
					}
				}
				for i, to := range st.To {
					rf.loads[to.Name] = [2]string{id, st.From[i].Name}
				}
			}
		}
		syntax.Walk(f, func(n syntax.Node) bool {
			if st, ok := n.(*syntax.DefStmt); ok {
				if _, ok := rf.defs[st.Name.Name]; !ok {
					rf.defs[st.Name.Name] = newReachDef(st.Name.Name, st.Params, st.Body, rf)
				}
			}
			return true
		})
	}
	for _, f := range files {
		add(f.Path, f, true)
	}

	// resolve is the function a call names, nil for a builtin or a value the script computes.
	resolve := func(rf *reachFile, call *syntax.CallExpr) *reachDef {
		name := callee(call)
		if name == "" {
			return nil
		}
		if l, ok := rf.loads[name]; ok {
			if mf := byName[l[0]]; mf != nil {
				return mf.top[l[1]]
			}
			return nil
		}
		return rf.defs[name]
	}

	// Parameters that reach a policy argument, to a fixed point.
	for changed := true; changed; {
		changed = false
		for _, rf := range all {
			for _, d := range rf.defs {
				walkParams(d, func(call *syntax.CallExpr, param func(syntax.Expr) string) {
					if g := resolve(rf, call); g != nil {
						for q, e := range boundArgs(g, call) {
							if p := param(e); p != "" && g.policy[q] != "" && d.policy[p] == "" {
								d.policy[p], changed = g.policy[q], true
							}
						}
						return
					}
					if p := param(policyArg(call)); p != "" && d.policy[p] == "" {
						d.policy[p], changed = callee(call), true
					}
				})
			}
		}
	}

	// Literals and defaults passed for such parameters at the script's own calls.
	var out []PolicyUse
	for _, rf := range all {
		if !rf.user {
			continue
		}
		syntax.Walk(rf.ast, func(n syntax.Node) bool {
			call, ok := n.(*syntax.CallExpr)
			if !ok {
				return true
			}
			g := resolve(rf, call)
			if g == nil {
				return true
			}
			bound := boundArgs(g, call)
			for _, q := range g.params {
				if g.policy[q] == "" {
					continue
				}
				via := callee(call)
				if e, ok := bound[q]; ok {
					if lit := stringLit(e); lit != nil {
						out = append(out, PolicyUse{Pos: lit.TokenPos, Fn: g.policy[q], Name: lit.Value.(string), Via: via})
					}
				} else if lit := stringLit(g.defaults[q]); lit != nil {
					pos, _ := call.Span()
					out = append(out, PolicyUse{Pos: pos, Fn: g.policy[q], Name: lit.Value.(string), Via: via, Default: q})
				}
			}
			return true
		})
	}
	return out
}

func newReachDef(name string, params []syntax.Expr, body []syntax.Stmt, rf *reachFile) *reachDef {
	d := &reachDef{name: name, defaults: map[string]syntax.Expr{}, body: body, file: rf, policy: map[string]string{}}
	for _, p := range params {
		switch p := p.(type) {
		case *syntax.Ident:
			d.params = append(d.params, p.Name)
		case *syntax.BinaryExpr: // name = default
			if id, ok := p.X.(*syntax.Ident); ok {
				d.params = append(d.params, id.Name)
				d.defaults[id.Name] = p.Y
			}
		case *syntax.UnaryExpr: // *args, **kwargs, or a bare * (no name)
			if id, ok := p.X.(*syntax.Ident); ok {
				d.params = append(d.params, "*"+id.Name)
			} else {
				d.params = append(d.params, "*")
			}
		}
	}
	return d
}

// paramNames are the names a parameter list binds.
func paramNames(params []syntax.Expr) []string {
	var out []string
	for _, p := range params {
		switch p := p.(type) {
		case *syntax.Ident:
			out = append(out, p.Name)
		case *syntax.BinaryExpr:
			if id, ok := p.X.(*syntax.Ident); ok {
				out = append(out, id.Name)
			}
		case *syntax.UnaryExpr:
			if id, ok := p.X.(*syntax.Ident); ok {
				out = append(out, id.Name)
			}
		}
	}
	return out
}

// walkParams calls fn for every call in d's body, nested lambdas and functions included, with a
// function that names the parameter of d an argument is (the parameter used by its name, not
// shadowed by a nested function's own parameter), "" for any other expression.
func walkParams(d *reachDef, fn func(call *syntax.CallExpr, param func(syntax.Expr) string)) {
	own := map[string]bool{}
	for _, p := range d.params {
		if !strings.HasPrefix(p, "*") {
			own[p] = true
		}
	}
	var walk func(n syntax.Node, shadow map[string]bool)
	walk = func(n syntax.Node, shadow map[string]bool) {
		param := func(e syntax.Expr) string {
			if id, ok := e.(*syntax.Ident); ok && own[id.Name] && !shadow[id.Name] {
				return id.Name
			}
			return ""
		}
		syntax.Walk(n, func(m syntax.Node) bool {
			var params []syntax.Expr
			var body []syntax.Node
			switch m := m.(type) {
			case *syntax.CallExpr:
				fn(m, param)
				return true
			case *syntax.LambdaExpr:
				params, body = m.Params, []syntax.Node{m.Body}
			case *syntax.DefStmt:
				params = m.Params
				for _, st := range m.Body {
					body = append(body, st)
				}
			default:
				return true
			}
			inner := map[string]bool{}
			for k := range shadow {
				inner[k] = true
			}
			for _, p := range paramNames(params) {
				inner[p] = true
			}
			for _, b := range body {
				walk(b, inner)
			}
			return false
		})
	}
	for _, st := range d.body {
		walk(st, map[string]bool{})
	}
}

// boundArgs maps the parameters of g a call passes to the expressions it passes for them.
func boundArgs(g *reachDef, call *syntax.CallExpr) map[string]syntax.Expr {
	out := map[string]syntax.Expr{}
	i := 0
	for _, a := range call.Args {
		if b, ok := a.(*syntax.BinaryExpr); ok && b.Op == syntax.EQ {
			if k, ok := b.X.(*syntax.Ident); ok {
				out[k.Name] = b.Y
			}
			continue
		}
		if _, ok := a.(*syntax.UnaryExpr); ok { // *args or **kwargs: positions unknown from here
			return out
		}
		if i < len(g.params) && !strings.HasPrefix(g.params[i], "*") {
			out[g.params[i]] = a
		}
		i++
	}
	return out
}

// policyArg is the expression a builtin call passes as its policy: generate(p, …), score(p, …),
// chat(p, …) or chat(policy=p), train(…, teacher=p), agent(argv, input, p) or agent(policy=p).
func policyArg(call *syntax.CallExpr) syntax.Expr {
	switch callee(call) {
	case "generate", "score":
		if len(call.Args) > 0 {
			return call.Args[0]
		}
	case "chat":
		if arg := keyword(call, "policy"); arg != nil {
			return arg
		}
		if len(call.Args) > 0 {
			return call.Args[0]
		}
	case "train":
		return keyword(call, "teacher")
	case "agent":
		if arg := keyword(call, "policy"); arg != nil {
			return arg
		}
		if len(call.Args) > 2 {
			return call.Args[2]
		}
	}
	return nil
}
