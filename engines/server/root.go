package server

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// roots confine the folders that Save and Load requests name: a client may only make the engine
// write or read model folders inside them.
type roots struct {
	dirs []string // absolute, symbolic links resolved; dirs[0] anchors relative paths
	err  error    // why the roots could not be resolved: every Save and Load fails with it
}

// ResolveRoots returns the folders a server with Options.Roots dirs confines Save and Load to:
// absolute, cleaned, with symbolic links resolved (a root need not exist yet). No dirs is the
// working directory, refused when that is the file system's root (a server started by a service
// manager from /), since it would let clients write anywhere the process can.
func ResolveRoots(dirs []string) ([]string, error) {
	if len(dirs) == 0 {
		wd, err := os.Getwd()
		if err != nil {
			return nil, fmt.Errorf("root: the working directory: %w; give the root folder explicitly (--root)", err)
		}
		if filepath.Dir(wd) == wd {
			return nil, fmt.Errorf("root: the working directory is %s, so by default clients could save and load model folders "+
				"anywhere this process can; give the folder to confine them to (--root DIR; --root %s to allow it)", wd, wd)
		}
		dirs = []string{wd}
	}
	out := make([]string, 0, len(dirs))
	for _, d := range dirs {
		if d == "" {
			return nil, errors.New("root: an empty folder name")
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return nil, fmt.Errorf("root %s: %w", d, err)
		}
		real, err := resolveExisting(abs)
		if err != nil {
			return nil, fmt.Errorf("root %s: %w", d, err)
		}
		if fi, err := os.Stat(real); err == nil && !fi.IsDir() {
			return nil, fmt.Errorf("root %s is a file, not a folder", d)
		}
		out = append(out, real)
	}
	return out, nil
}

func newRoots(dirs []string) roots {
	d, err := ResolveRoots(dirs)
	return roots{dirs: d, err: err}
}

// describe names the roots for an error message.
func (r roots) describe() string {
	if len(r.dirs) == 1 {
		return "this server's root " + r.dirs[0]
	}
	return "this server's roots " + strings.Join(r.dirs, ", ")
}

// resolve turns the folder of a Save or Load request (what: "save", "load") into the path the
// engine gets: relative paths are taken relative to the first root, the result is cleaned and its
// symbolic links resolved, and it must lie inside a root. The error is a gRPC status:
// INVALID_ARGUMENT for an empty path, PERMISSION_DENIED for a path outside the roots.
func (r roots) resolve(what, dir string) (string, error) {
	if r.err != nil {
		return "", status.Errorf(codes.FailedPrecondition, "%s: this server cannot confine model folders to a root, so it refuses to save or load: %v", what, r.err)
	}
	if dir == "" {
		return "", status.Errorf(codes.InvalidArgument, "%s: no folder given; name a folder inside %s", what, r.describe())
	}
	p := dir
	if !filepath.IsAbs(p) {
		p = filepath.Join(r.dirs[0], p)
	}
	p = filepath.Clean(p)
	real, err := resolveExisting(p)
	if err != nil {
		return "", status.Errorf(codes.PermissionDenied, "%s: folder %q: %v; %s refuses it", what, dir, err, r.describe())
	}
	if !r.contains(real) {
		where := ""
		if real != dir {
			where = " (" + real + ")"
		}
		return "", status.Errorf(codes.PermissionDenied,
			"%s: folder %q%s is outside %s: a client may only save and load model folders under the root the server was started "+
				"with; give a path inside it (relative paths are taken from %s), "+
				"or start the server with --root covering the folder",
			what, dir, where, r.describe(), r.dirs[0])
	}
	return real, nil
}

// contains reports whether the clean absolute path p is one of the roots or inside one.
func (r roots) contains(p string) bool {
	for _, d := range r.dirs {
		if within(d, p) {
			return true
		}
	}
	return false
}

// within reports whether the clean absolute path p is dir or lies under it.
func within(dir, p string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator)) && !filepath.IsAbs(rel)
}

// resolveExisting resolves the symbolic links of the clean absolute path p as the file system
// will when the engine creates what is missing: those of the longest part that exists, and a link
// whose target does not exist yet, followed to that target.
func resolveExisting(p string) (string, error) {
	return resolveLinks(p, 0)
}

// maxLinks bounds the dangling links followed in one path (a loop of them never ends otherwise).
const maxLinks = 40

func resolveLinks(p string, links int) (string, error) {
	rest := ""
	for d := p; ; d = filepath.Dir(d) {
		real, err := filepath.EvalSymlinks(d)
		if err == nil {
			return filepath.Join(real, rest), nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		if fi, lerr := os.Lstat(d); lerr == nil && fi.Mode()&fs.ModeSymlink != 0 {
			// A link to a path that does not exist: the engine would create its target.
			if links >= maxLinks {
				return "", fmt.Errorf("%s: too many levels of symbolic links", p)
			}
			target, err := os.Readlink(d)
			if err != nil {
				return "", err
			}
			if !filepath.IsAbs(target) {
				dir, err := filepath.EvalSymlinks(filepath.Dir(d)) // it exists: d does
				if err != nil {
					return "", err
				}
				target = filepath.Join(dir, target)
			}
			return resolveLinks(filepath.Join(filepath.Clean(target), rest), links+1)
		}
		if filepath.Dir(d) == d {
			return p, nil
		}
		rest = filepath.Join(filepath.Base(d), rest)
	}
}
