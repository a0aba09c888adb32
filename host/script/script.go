// Package script is slimen's Starlark runtime: loading a rollout script and the modules it loads,
// the built-ins (generate, reward, train, parallel, score, state, log, config, …), completions,
// the per-rollout budgets of sandboxed scripts and the static checker. It reaches the
// orchestration only through the Host interface, implemented by the host package in-process and
// by the sandbox child's pipe (host/script/sandbox).
//
// A built-in is one file (a function with Starlark's builtin signature that finds the rollout it
// runs in through the calling thread, stateOf, and asks the run for what it needs through
// Rollout.Host) and one line in predeclared.
package script

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"go.starlark.net/resolve"
	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
	"go.starlark.net/syntax"

	"github.com/slimen/slimen/host/config"
)

// Script is one version of a rollout script: its file and everything it loaded, executed once and
// frozen. rollout(task) is then called from many goroutines at once, each on its own thread.
type Script struct {
	Path    string              // as given by the user
	Globals starlark.StringDict // frozen top-level values
	Files   []string            // the script and every file it loaded (not @packages)
	Hash    string              // sha256 of the sources of Files, hex
	Source  []byte              // the main file
	Sources map[string][]byte   // every file of Files as it was loaded, the main file included

	rollout     *starlark.Function
	evalRollout *starlark.Function // nil when the script has none
	// declaresEval: a script parsed only (the host of a sandboxed run, whose children run it)
	// binds eval_rollout at its top level.
	declaresEval bool
	// own are the names Options.Builtins gave: an embedder's, with their own parameters.
	own map[string]bool
}

// Rollout is the script's rollout(task); nil for a Library.
func (s *Script) Rollout() *starlark.Function { return s.rollout }

// EvalRollout is the script's eval_rollout(task); nil when it has none.
func (s *Script) EvalRollout() *starlark.Function { return s.evalRollout }

// HasEvalRollout says whether the script defines eval_rollout: EvalRollout is not nil, or, for a
// script parsed only (a sandboxed run's host), its top level binds the name.
func (s *Script) HasEvalRollout() bool { return s.evalRollout != nil || s.declaresEval }

// declares says whether a file's top level binds name: a def, an assignment or a load.
func declares(f *syntax.File, name string) bool {
	for _, st := range f.Stmts {
		switch st := st.(type) {
		case *syntax.DefStmt:
			if st.Name.Name == name {
				return true
			}
		case *syntax.LoadStmt:
			for _, id := range st.To {
				if id.Name == name {
					return true
				}
			}
		case *syntax.AssignStmt:
			if id, ok := st.LHS.(*syntax.Ident); ok && id.Name == name {
				return true
			}
		}
	}
	return false
}

// Options configure how a script is loaded.
type Options struct {
	Sandbox bool           // only @packages may be loaded
	Config  starlark.Value // the script's `config` (ConfigValue); nil: none attached
	// ParseOnly checks syntax and names without running the top level: the host of a sandboxed
	// run must not execute untrusted code itself (its children do).
	ParseOnly bool
	// Builtins are predeclared names added to the built-ins (or replacing one): an embedder's
	// own functions and values. They are frozen, as every value rollouts share.
	Builtins starlark.StringDict
	// Modules are packages of Starlark files a script may load as @NAME//path.star, beside the
	// bundled @graphs.
	Modules map[string]fs.FS
	// Library loads a file of definitions that need not define rollout(task) (test files).
	Library bool
	// FS, when set, is where the script and its relative loads are read: path is a path in it
	// (io/fs's slash-separated form). nil: the operating system's files.
	FS fs.FS
}

// Load reads, executes and freezes a script.
func Load(path string, opts Options) (*Script, error) {
	var src []byte
	var err error
	if opts.FS != nil {
		src, err = fs.ReadFile(opts.FS, path)
	} else {
		src, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, Errorf("cannot read script: %w", err)
	}
	return LoadSource(path, src, opts)
}

// LoadSource loads a script whose text is already read (path names it in messages and anchors
// its relative loads).
func LoadSource(path string, src []byte, opts Options) (*Script, error) {
	abs := path
	if opts.FS == nil {
		var err error
		if abs, err = filepath.Abs(path); err != nil {
			return nil, err
		}
	}
	pre := predeclared()
	own := map[string]bool{}
	for name, v := range opts.Builtins {
		pre[name], own[name] = v, true
	}
	if opts.Config != nil {
		pre["config"] = opts.Config
	}
	if opts.ParseOnly {
		f, _, err := starlark.SourceProgramOptions(fileOptions, path, src, pre.Has)
		if err != nil {
			return nil, &Error{Msg: ErrorText(err), cause: err}
		}
		hash, _ := HashFiles([]string{path}, func(string) ([]byte, error) { return src, nil })
		return &Script{Path: path, Files: []string{path}, Source: src, Sources: map[string][]byte{path: src}, Hash: hash,
			declaresEval: declares(f, "eval_rollout"), own: own}, nil
	}
	root := filepath.Dir(abs)
	if opts.FS != nil {
		root = slashDir(path)
	}
	l := newLoader(root, pre, !opts.Sandbox)
	l.fsys = opts.FS
	for name, fsys := range opts.Modules {
		if _, taken := l.natives[name]; taken || l.starFS[name] != nil {
			return nil, &Error{Msg: fmt.Sprintf("module package @%s: the name is taken by a bundled package; choose another", name)}
		}
		l.starFS[name] = fsys
	}
	l.cache[filepath.Clean(path)] = &loadEntry{} // the main file loading itself is a cycle
	l.stack = []string{filepath.Clean(path)}
	globals, err := l.execFile(path, src)
	if err != nil {
		return nil, &Error{Msg: ErrorText(err), cause: err}
	}
	globals.Freeze()
	s := &Script{Path: path, Globals: globals, Files: l.files, Source: src, Sources: map[string][]byte{}, own: own}
	for _, f := range l.files {
		s.Sources[f] = l.srcs[f]
	}
	s.Hash, _ = HashFiles(l.files, func(f string) ([]byte, error) { return l.srcs[f], nil })
	if opts.Library {
		return s, nil
	}
	fn, err := entryPoint(globals, "rollout", path, true)
	if err != nil {
		return nil, err
	}
	s.rollout = fn
	if s.evalRollout, err = entryPoint(globals, "eval_rollout", path, false); err != nil {
		return nil, err
	}
	return s, nil
}

// entryPoint finds a one-parameter function the host calls with a task.
func entryPoint(g starlark.StringDict, name, path string, required bool) (*starlark.Function, error) {
	v, ok := g[name]
	if !ok {
		if required {
			return nil, &Error{Msg: fmt.Sprintf("%s: the script defines no %s(task) function; define one: the host calls it once per task", path, name)}
		}
		return nil, nil
	}
	fn, ok := v.(*starlark.Function)
	if !ok {
		return nil, &Error{Msg: fmt.Sprintf("%s: %s is a %s, not a function; define def %s(task): …", path, name, v.Type(), name)}
	}
	if fn.NumParams() != 1 || fn.NumKwonlyParams() != 0 {
		return nil, &Error{Msg: fmt.Sprintf("%s: %s: %s must take exactly one parameter (the task), it takes %d", path, fn.Position(), name, fn.NumParams())}
	}
	return fn, nil
}

// ErrorText renders a Starlark error with its backtrace (file:line:col of every frame) and,
// for syntax and resolve errors, a hint of what to do.
func ErrorText(err error) string {
	if e, ok := err.(*Error); ok {
		return e.Msg // already the text the user reads
	}
	var ee *starlark.EvalError
	if errors.As(err, &ee) {
		// Built-ins name themselves in their messages, as Starlark's own do; the backtrace's
		// "Error in f:" would say it twice.
		bt := ee.Backtrace()
		if ee.CallStack.At(0).Name != "" {
			name := ee.CallStack.At(0).Name
			bt = strings.Replace(bt, "Error in "+name+": "+name+": ", "Error in "+name+": ", 1)
		}
		return bt
	}
	var se syntax.Error
	if errors.As(err, &se) {
		return se.Error() + "\n  fix the syntax at this position (an unclosed bracket or quote on an earlier line often shows up here)"
	}
	var rl resolve.ErrorList
	if errors.As(err, &rl) {
		var b strings.Builder
		for i, e := range rl {
			if i > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(e.Pos.String() + ": ")
			rest, ok := strings.CutPrefix(e.Msg, "undefined: ")
			if !ok {
				b.WriteString(e.Msg)
				continue
			}
			// Starlark's resolver suggests a near name itself ("sum (did you mean set?)"), a
			// name in scope: undefinedHint weighs it with the built-ins and the libraries.
			name, near, _ := strings.Cut(rest, " (did you mean ")
			b.WriteString("undefined: " + name + undefinedHint(name, strings.TrimSuffix(near, "?)")))
		}
		return b.String()
	}
	return err.Error()
}

// pythonOnly are names a Python programmer reaches for that Starlark lacks, with what to do.
var pythonOnly = map[string]string{
	"sum":        `Starlark has no sum(); add in a loop, or load("@slimen//stats.star", "mean") for a mean`,
	"map":        "Starlark has no map(); use a list comprehension: [f(x) for x in xs]",
	"filter":     "Starlark has no filter(); use a list comprehension: [x for x in xs if p(x)]",
	"isinstance": `Starlark has no isinstance(); compare type(x) == "string" (or "int", "float", "list", "dict", ...)`,
	"round":      `Starlark has no round(); load("@std//math.star", "round")`,
	"open":       "a script cannot open files; read data through the task (data.path) or state",
}

// undefinedHint is what follows "undefined: name": where to load it from when a library defines
// it, a near name in scope, built-in or Starlark's (near, "" when it had none) when one is close
// enough to be a typo, or else where names come from.
func undefinedHint(name, near string) string {
	if h, ok := pythonOnly[name]; ok {
		return " (" + h + ")"
	}
	if load := libraryLoad(name); load != "" {
		return " (load it: " + load + ")"
	}
	names := []string{}
	if near != "" {
		names = append(names, near)
	}
	for n := range predeclared() {
		names = append(names, n)
	}
	for n := range starlark.Universe {
		names = append(names, n)
	}
	// A typo: one edit away, two for longer names (sum is not set, CALC is not call).
	limit := 1
	if len(name) >= 6 {
		limit = 2
	}
	if best := closest(name, names); best != "" && config.EditDistance(name, best) <= limit {
		return fmt.Sprintf(" (did you mean %s?)", best)
	}
	return " (define it in the script, or load it from the file that defines it)"
}

// libraryLoad is the load statement of the @slimen// or @std// file that defines name, "" when
// none does (the first by package and file name when several do).
func libraryLoad(name string) string {
	pkgs := nativeModules()
	for _, pkg := range slices.Sorted(maps.Keys(pkgs)) {
		for _, file := range slices.Sorted(maps.Keys(pkgs[pkg])) {
			if _, ok := pkgs[pkg][file][name]; ok {
				return fmt.Sprintf("load(%q, %q)", "@"+pkg+"//"+file, name)
			}
		}
	}
	return ""
}

// closest returns the name within edit distance 2 of s, if one is.
func closest(s string, names []string) string {
	best, bestD := "", 3
	sort.Strings(names)
	for _, n := range names {
		if d := config.EditDistance(s, n); d < bestD {
			best, bestD = n, d
		}
	}
	return best
}

// predeclared is the environment of every script: the built-ins (README.md lists them).
func predeclared() starlark.StringDict {
	return starlark.StringDict{
		"generate":   starlark.NewBuiltin("generate", builtinGenerate),
		"completion": starlark.NewBuiltin("completion", builtinCompletion),
		"chat":       starlark.NewBuiltin("chat", builtinChat),
		"agent":      starlark.NewBuiltin("agent", builtinAgent),
		"reward":     starlark.NewBuiltin("reward", builtinReward),
		"train":      starlark.NewBuiltin("train", builtinTrain),
		"parallel":   starlark.NewBuiltin("parallel", builtinParallel),
		"score":      starlark.NewBuiltin("score", builtinScore),
		"state":      stateModule,
		"log":        starlark.NewBuiltin("log", builtinLog),
		"config":     configValue{get: func() *config.Config { return nil }},
		"struct":     starlark.NewBuiltin("struct", starlarkstruct.Make),
	}
}

// HashFiles is the version of a script: the sha256 of its files (the script first, then the
// files it loads), each by its path relative to the script's folder and its contents, so that
// the same files give the same version from any working directory. read reads a file.
func HashFiles(files []string, read func(string) ([]byte, error)) (string, error) {
	h := sha256.New()
	var root string
	if len(files) > 0 {
		root = filepath.Dir(files[0])
	}
	for _, f := range files {
		b, err := read(f)
		if err != nil {
			return "", err
		}
		name := f
		if rel, err := filepath.Rel(root, f); err == nil {
			name = filepath.ToSlash(rel)
		}
		h.Write([]byte(name))
		h.Write([]byte{0})
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
