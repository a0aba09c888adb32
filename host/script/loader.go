package script

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/syntax"
)

// fileOptions are the Starlark dialect of scripts: while loops, top-level if/for, sets and global
// reassignment are allowed; recursion stays off (Starlark's default), so a runaway script loops,
// which step limits catch, rather than overflowing the Go stack.
var fileOptions = &syntax.FileOptions{Set: true, While: true, TopLevelControl: true, GlobalReassign: true}

// loader resolves load() statements of one version of a script (docs/host.md, "Loading"):
//
//	load("@slimen//answers.star", …)  Go-native modules (starlib)
//	load("@std//json.star", …)        go.starlark.net's lib modules
//	load("@graphs//debate.star", …)   the topology library, Starlark files embedded in the binary
//	load("helpers.star", …)           a file beside the loading file, never outside the script's folder
//
// Every module is executed once; a module that loads itself (directly or not) is an error naming
// the cycle. A loader lives as long as one version of the script: a reload builds a new one.
type loader struct {
	root        string                                    // folder of the main script; relative loads stay inside it
	natives     map[string]map[string]starlark.StringDict // package → file → members
	starFS      map[string]fs.FS                          // package → Starlark sources (graphs, Options.Modules)
	fsys        fs.FS                                     // where files are read (Options.FS); nil: the OS's
	predeclared starlark.StringDict
	allowFiles  bool // false in the sandbox: only @packages may be loaded

	cache map[string]*loadEntry
	stack []string // modules being loaded, for cycle messages
	files []string // every file read, in order (the main script first), for --watch and hashing
	srcs  map[string][]byte
}

type loadEntry struct {
	globals starlark.StringDict
	err     error
	done    bool
}

const fileLocal = "slimen.loader.file" // thread-local: the module a thread executes

func newLoader(root string, predeclared starlark.StringDict, allowFiles bool) *loader {
	// Every rollout thread sees the predeclared values at once: they must be immutable (even
	// iterating a mutable list writes to it).
	predeclared.Freeze()
	return &loader{
		root:        root,
		natives:     nativeModules(),
		starFS:      bundledPackages(),
		predeclared: predeclared,
		allowFiles:  allowFiles,
		cache:       map[string]*loadEntry{},
		srcs:        map[string][]byte{},
	}
}

// execFile executes a script or library file and returns its globals.
func (l *loader) execFile(name string, src []byte) (starlark.StringDict, error) {
	l.srcs[name] = src
	if !strings.HasPrefix(name, "@") {
		l.files = append(l.files, name)
	}
	thread := &starlark.Thread{Name: "load " + name, Load: l.load}
	thread.SetLocal(fileLocal, name)
	return starlark.ExecFileOptions(fileOptions, thread, name, src, l.predeclared)
}

// load implements starlark.Thread.Load.
func (l *loader) load(thread *starlark.Thread, module string) (starlark.StringDict, error) {
	from, _ := thread.Local(fileLocal).(string)
	id, err := l.resolve(from, module)
	if err != nil {
		return nil, err
	}
	if e, ok := l.cache[id]; ok {
		if !e.done {
			return nil, fmt.Errorf("load cycle: %s → %s", strings.Join(l.stack, " → "), id)
		}
		return e.globals, e.err
	}
	e := &loadEntry{}
	l.cache[id] = e
	l.stack = append(l.stack, id)
	e.globals, e.err = l.loadModule(id)
	l.stack = l.stack[:len(l.stack)-1]
	e.done = true
	return e.globals, e.err
}

// resolve turns a load string into a module id: "@pkg//file" or a cleaned file path.
func (l *loader) resolve(from, module string) (string, error) {
	if strings.HasPrefix(module, "@") {
		pkg, file, ok := strings.Cut(module[1:], "//")
		if !ok || file == "" || strings.Contains(file, "..") {
			return "", fmt.Errorf("load %q: a package module is written @PACKAGE//FILE.star", module)
		}
		if _, ok := l.natives[pkg]; !ok {
			if _, ok := l.starFS[pkg]; !ok {
				return "", fmt.Errorf("load %q: unknown package @%s (known: @slimen, @std, @graphs)", module, pkg)
			}
		}
		return "@" + pkg + "//" + path.Clean(file), nil
	}
	if strings.HasPrefix(from, "@") {
		// A library file loads its siblings within its own package.
		pkg, file, _ := strings.Cut(from[1:], "//")
		return "@" + pkg + "//" + path.Join(path.Dir(file), module), nil
	}
	if !l.allowFiles {
		return "", fmt.Errorf("load %q: the sandbox only loads @slimen, @graphs and @std modules", module)
	}
	if filepath.IsAbs(module) || path.IsAbs(module) {
		return "", fmt.Errorf("load %q: absolute paths are not loadable; load files relative to the script", module)
	}
	if l.fsys != nil {
		p := path.Join(path.Dir(from), module)
		if !fs.ValidPath(p) || l.root != "." && !strings.HasPrefix(p, l.root+"/") {
			return "", fmt.Errorf("load %q: it escapes the script's folder %s; keep loaded files beside the script", module, l.root)
		}
		return p, nil
	}
	p := filepath.Clean(filepath.Join(filepath.Dir(from), module))
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	rel, err := filepath.Rel(l.root, abs)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "", fmt.Errorf("load %q: it escapes the script's folder %s; keep loaded files beside the script", module, l.root)
	}
	return p, nil
}

func (l *loader) loadModule(id string) (starlark.StringDict, error) {
	if strings.HasPrefix(id, "@") {
		pkg, file, _ := strings.Cut(id[1:], "//")
		if mods, ok := l.natives[pkg]; ok {
			if m, ok := mods[file]; ok {
				return m, nil
			}
			return nil, fmt.Errorf("load %q: @%s has no module %s (known: %s)", id, pkg, file, known(mods))
		}
		src, err := fs.ReadFile(l.starFS[pkg], file)
		if err != nil {
			return nil, fmt.Errorf("load %q: no such file in @%s", id, pkg)
		}
		return l.execModule(id, src)
	}
	var src []byte
	var err error
	if l.fsys != nil {
		src, err = fs.ReadFile(l.fsys, id)
	} else {
		src, err = os.ReadFile(id)
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("load %q: no such file", id)
		}
		return nil, fmt.Errorf("load %q: %w", id, err)
	}
	return l.execModule(id, src)
}

// execModule runs a loaded Starlark file. Its error keeps the loaded file's backtrace, so a
// failure inside a library shows file:line:col of both the load and the failing line.
func (l *loader) execModule(id string, src []byte) (starlark.StringDict, error) {
	g, err := l.execFile(id, src)
	if err != nil {
		var ee *starlark.EvalError
		if errors.As(err, &ee) {
			return nil, errors.New(ee.Backtrace())
		}
		return nil, err
	}
	g.Freeze()
	return g, nil
}

// slashDir is the folder of a slash-separated path of an fs.FS.
func slashDir(p string) string { return path.Dir(path.Clean(p)) }

func known[V any](m map[string]V) string {
	var names []string
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}
