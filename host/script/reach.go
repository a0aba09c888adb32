package script

import (
	"io/fs"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"go.starlark.net/syntax"
)

// Policy names a script passes through its own functions: ask("sovler", q) where
// def ask(p, q): return generate(p, q). A parameter reaches a policy argument when the function
// passes it, by name, as the policy of generate/score/chat/agent or train(teacher=…), or as an
// argument of another function whose parameter reaches one (found to a fixed point, through
// lambdas and nested functions that use it). A string literal passed for such a parameter at a
// call in the script's files is a policy name, reported where it is written; a call that leaves
// such a parameter out reaches its default, reported at the call. A name passed as a variable
// (module-level, loaded from another file, or local to the calling function) or as the call of a
// function that returns it (def solver(): return "solver") is followed to the literals assigned
// or returned. This is constant propagation of literals only: a name computed (concatenated,
// formatted, read from a dict or a loop) is not followed.

// reachDef is one function of the script or of a package module it loads.
type reachDef struct {
	name     string
	params   []string
	defaults map[string]syntax.Expr
	body     []syntax.Stmt
	file     *reachFile
	policy   map[string]string // parameter → the builtin it reaches ("generate", …)
	// locals are the names the body binds (nested functions aside), each with the values
	// assigned to it by a plain name = value; a name bound otherwise (a loop, a tuple) has none.
	locals  map[string][]syntax.Expr
	returns []syntax.Expr // the values of the body's return statements
}

type reachFile struct {
	name  string
	user  bool                 // one of the script's own files (not a package module)
	defs  map[string]*reachDef // every def of the file, by name (top level first)
	loads map[string][2]string // local name → module id, name there
	top   map[string]*reachDef // top-level defs
	// globals are the values assigned to module-level names (NAME = value).
	globals map[string][]syntax.Expr
	stmts   map[*syntax.DefStmt]*reachDef
	ast     *syntax.File
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
			top: map[string]*reachDef{}, globals: map[string][]syntax.Expr{}, stmts: map[*syntax.DefStmt]*reachDef{}, ast: f}
		byName[name] = rf
		all = append(all, rf)
		for _, st := range f.Stmts {
			switch st := st.(type) {
			case *syntax.DefStmt:
				d := newReachDef(st.Name.Name, st.Params, st.Body, rf)
				rf.top[d.name], rf.defs[d.name], rf.stmts[st] = d, d, d
			case *syntax.AssignStmt:
				if id, ok := st.LHS.(*syntax.Ident); ok && st.Op == syntax.EQ {
					rf.globals[id.Name] = append(rf.globals[id.Name], st.RHS)
				}
			case *syntax.LoadStmt:
				id := moduleID(name, st.ModuleName())
				if pkg, file, ok := strings.Cut(strings.TrimPrefix(id, "@"), "//"); ok && strings.HasPrefix(id, "@") {
					if fsys, known := bundledPackages()[pkg]; known {
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
			if st, ok := n.(*syntax.DefStmt); ok && rf.stmts[st] == nil {
				d := newReachDef(st.Name.Name, st.Params, st.Body, rf)
				rf.stmts[st] = d
				if _, ok := rf.defs[st.Name.Name]; !ok {
					rf.defs[st.Name.Name] = d
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

	// Literals and defaults passed for such parameters at the script's own calls, and names
	// held in variables or returned by functions passed to the builtins themselves.
	var out []PolicyUse
	seen := map[PolicyUse]bool{}
	emit := func(u PolicyUse) {
		if !seen[u] {
			seen[u] = true
			out = append(out, u)
		}
	}
	for _, rf := range all {
		if !rf.user {
			continue
		}
		walkScoped(rf, func(call *syntax.CallExpr, scope []*reachDef) {
			g := resolve(rf, call)
			if g == nil {
				if e := policyArg(call); e != nil && stringLit(e) == nil { // literals: policyLiterals
					for _, v := range follow(rf, scope, e, byName, resolve, 0) {
						emit(PolicyUse{Pos: v.lit.TokenPos, Fn: callee(call), Name: v.lit.Value.(string), Held: v.held})
					}
				}
				return
			}
			bound := boundArgs(g, call)
			for _, q := range g.params {
				if g.policy[q] == "" {
					continue
				}
				via := callee(call)
				if e, ok := bound[q]; ok {
					for _, v := range follow(rf, scope, e, byName, resolve, 0) {
						emit(PolicyUse{Pos: v.lit.TokenPos, Fn: g.policy[q], Name: v.lit.Value.(string), Via: via, Held: v.held})
					}
				} else if lit := stringLit(g.defaults[q]); lit != nil {
					pos, _ := call.Span()
					emit(PolicyUse{Pos: pos, Fn: g.policy[q], Name: lit.Value.(string), Via: via, Default: q})
				} else if e := g.defaults[q]; e != nil {
					for _, v := range follow(g.file, nil, e, byName, resolve, 0) {
						emit(PolicyUse{Pos: v.lit.TokenPos, Fn: g.policy[q], Name: v.lit.Value.(string), Via: via, Held: v.held})
					}
				}
			}
		})
	}
	return out
}

// heldName is a string literal an expression evaluates to, with the variable or function that
// held it on the way ("SOLVER", "solver()"; "" for the literal itself).
type heldName struct {
	lit  *syntax.Literal
	held string
}

// follow finds the string literals an expression in rf, inside the functions scope (innermost
// first; nil at module level), can evaluate to: the literal, a variable's assigned values, a
// called function's returned values, both branches of a conditional. A parameter, a loop variable
// or anything computed gives none.
func follow(rf *reachFile, scope []*reachDef, e syntax.Expr, byName map[string]*reachFile,
	resolve func(*reachFile, *syntax.CallExpr) *reachDef, depth int) []heldName {
	if depth > 8 { // a cycle (def f(): return f()) or a very long chain
		return nil
	}
	hold := func(name string, vals []heldName) []heldName {
		for i := range vals {
			if vals[i].held == "" {
				vals[i].held = name
			}
		}
		return vals
	}
	switch e := e.(type) {
	case *syntax.Literal:
		if lit := stringLit(e); lit != nil {
			return []heldName{{lit: lit}}
		}
	case *syntax.ParenExpr:
		return follow(rf, scope, e.X, byName, resolve, depth)
	case *syntax.CondExpr:
		return append(follow(rf, scope, e.True, byName, resolve, depth+1), follow(rf, scope, e.False, byName, resolve, depth+1)...)
	case *syntax.Ident:
		for i, d := range scope {
			if slices.Contains(d.params, e.Name) || slices.Contains(d.params, "*"+e.Name) {
				return nil
			}
			if vals, ok := d.locals[e.Name]; ok {
				var out []heldName
				for _, v := range vals {
					out = append(out, follow(rf, scope[i:], v, byName, resolve, depth+1)...)
				}
				return hold(e.Name, out)
			}
		}
		if vals, ok := rf.globals[e.Name]; ok {
			var out []heldName
			for _, v := range vals {
				out = append(out, follow(rf, nil, v, byName, resolve, depth+1)...)
			}
			return hold(e.Name, out)
		}
		if l, ok := rf.loads[e.Name]; ok {
			if mf := byName[l[0]]; mf != nil {
				return hold(e.Name, follow(mf, nil, &syntax.Ident{Name: l[1]}, byName, resolve, depth+1))
			}
		}
	case *syntax.CallExpr:
		g := resolve(rf, e)
		if g == nil {
			return nil
		}
		var out []heldName
		for _, r := range g.returns {
			out = append(out, follow(g.file, []*reachDef{g}, r, byName, resolve, depth+1)...)
		}
		return hold(callee(e)+"()", out)
	}
	return nil
}

// walkScoped calls fn for every call in rf, with the functions it is inside (innermost first; a
// lambda is a function of parameters only).
func walkScoped(rf *reachFile, fn func(call *syntax.CallExpr, scope []*reachDef)) {
	var walk func(n syntax.Node, scope []*reachDef)
	walk = func(n syntax.Node, scope []*reachDef) {
		syntax.Walk(n, func(m syntax.Node) bool {
			var inner *reachDef
			var body []syntax.Node
			switch m := m.(type) {
			case *syntax.CallExpr:
				fn(m, scope)
				return true
			case *syntax.DefStmt:
				inner = rf.stmts[m]
				for _, st := range m.Body {
					body = append(body, st)
				}
			case *syntax.LambdaExpr:
				inner = &reachDef{name: "lambda", params: paramNames(m.Params)}
				body = []syntax.Node{m.Body}
			default:
				return true
			}
			if inner == nil {
				return false
			}
			in := append([]*reachDef{inner}, scope...)
			for _, b := range body {
				walk(b, in)
			}
			return false
		})
	}
	for _, st := range rf.ast.Stmts {
		walk(st, nil)
	}
}

// moduleID is the id a load statement in file from gives module, as the loader does: @pkg//file
// as written, a sibling within a package module's own package, or a file path beside from.
func moduleID(from, module string) string {
	if strings.HasPrefix(module, "@") {
		pkg, file, ok := strings.Cut(module[1:], "//")
		if !ok {
			return ""
		}
		return "@" + pkg + "//" + path.Clean(file)
	}
	if strings.HasPrefix(from, "@") {
		pkg, file, _ := strings.Cut(from[1:], "//")
		return "@" + pkg + "//" + path.Join(path.Dir(file), module)
	}
	return filepath.Clean(filepath.Join(filepath.Dir(from), module))
}

func newReachDef(name string, params []syntax.Expr, body []syntax.Stmt, rf *reachFile) *reachDef {
	d := &reachDef{name: name, defaults: map[string]syntax.Expr{}, body: body, file: rf, policy: map[string]string{},
		locals: map[string][]syntax.Expr{}}
	computed := map[string]bool{}
	for _, st := range body {
		syntax.Walk(st, func(n syntax.Node) bool {
			switch n := n.(type) {
			case *syntax.DefStmt:
				d.locals[n.Name.Name] = d.locals[n.Name.Name][:0:0]
				return false
			case *syntax.LambdaExpr, *syntax.Comprehension: // their names are their own
				return false
			case *syntax.ReturnStmt:
				if n.Result != nil {
					d.returns = append(d.returns, n.Result)
				}
			case *syntax.AssignStmt:
				if id, ok := n.LHS.(*syntax.Ident); ok && n.Op == syntax.EQ {
					d.locals[id.Name] = append(d.locals[id.Name], n.RHS)
				} else {
					bindNames(n.LHS, d.locals, computed)
				}
			case *syntax.ForStmt:
				bindNames(n.Vars, d.locals, computed)
			}
			return true
		})
	}
	for name := range computed {
		d.locals[name] = nil
	}
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

// bindNames marks the names an assignment target binds as locals with no known value.
// A name given another value (x += …) is marked too: what it holds is computed.
func bindNames(target syntax.Expr, locals map[string][]syntax.Expr, computed map[string]bool) {
	switch t := target.(type) {
	case *syntax.Ident:
		if _, known := locals[t.Name]; !known {
			locals[t.Name] = nil
		}
		computed[t.Name] = true
	case *syntax.ParenExpr:
		bindNames(t.X, locals, computed)
	case *syntax.TupleExpr:
		for _, x := range t.List {
			bindNames(x, locals, computed)
		}
	case *syntax.ListExpr:
		for _, x := range t.List {
			bindNames(x, locals, computed)
		}
	}
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
