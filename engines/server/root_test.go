package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// folders is an engine that records the folders it is asked to save into and load from, and
// creates the folder it saves into, as real engines do.
type folders struct {
	*gated
	mu    sync.Mutex
	calls []string
}

func (f *folders) Save(_ context.Context, dir string) error {
	f.mu.Lock()
	f.calls = append(f.calls, "save "+dir)
	f.mu.Unlock()
	return os.MkdirAll(dir, 0o755)
}

func (f *folders) Load(_ context.Context, dir string) error {
	f.mu.Lock()
	f.calls = append(f.calls, "load "+dir)
	f.mu.Unlock()
	return nil
}

func (f *folders) seen() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// Hostile Save and Load requests (parent references, absolute paths elsewhere, symbolic links out
// of the root, one that points nowhere outside it, a loop of links) are refused before they reach
// the engine, with an error that names the root; folders inside it reach the engine as clean
// absolute paths with their links resolved.
func TestSaveAndLoadStayInsideTheRoot(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	root, outside := filepath.Join(base, "root"), filepath.Join(base, "outside")
	for _, d := range []string{root, filepath.Join(outside, "model")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for link, target := range map[string]string{
		filepath.Join(root, "escape"):   outside,
		filepath.Join(root, "dangling"): filepath.Join(base, "nowhere"),
		filepath.Join(base, "alias"):    root, // the server is given its root through a link
		filepath.Join(root, "inner"):    filepath.Join(root, "ckpt"),
		filepath.Join(root, "later"):    "made", // points nowhere yet, inside the root
		filepath.Join(root, "loop"):     "loop",
	} {
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
	}
	eng := &folders{gated: newGated()}
	c := start(t, eng, Options{Roots: []string{filepath.Join(base, "alias")}})
	ctx := context.Background()
	call := func(what, dir string) error {
		if what == "save" {
			_, err := c.Save(ctx, &enginepb.SaveRequest{Dir: dir})
			return err
		}
		_, err := c.Load(ctx, &enginepb.LoadRequest{Dir: dir})
		return err
	}

	for _, dir := range []string{
		"../outside/model",
		filepath.Join(outside, "model"),
		"/etc",
		"/",
		"ckpt/../../outside",
		filepath.Join(root, "..", "outside"),
		"escape",
		"escape/model",
		"escape/new",
		"dangling",
		"dangling/x",
		"loop/x",
		"builtin:x/../../outside/model", // not a built-in model's name but a path, and outside
	} {
		for _, what := range []string{"save", "load"} {
			err := call(what, dir)
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "outside this server's root "+root) && !strings.Contains(err.Error(), "links; this server's root "+root+" refuses it") {
				t.Errorf("%s %q: got %v, want PERMISSION_DENIED naming the root %s", what, dir, err, root)
			}
		}
	}
	for _, what := range []string{"save", "load"} {
		if err := call(what, ""); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), root) {
			t.Errorf("%s of no folder: got %v, want INVALID_ARGUMENT naming the root", what, err)
		}
	}
	if got := eng.seen(); len(got) != 0 {
		t.Fatalf("refused requests reached the engine: %q", got)
	}
	entries, _ := os.ReadDir(outside)
	if len(entries) != 1 {
		t.Errorf("the folder outside the root holds %d entries after the hostile saves, want its 1", len(entries))
	}
	if _, err := os.Lstat(filepath.Join(base, "nowhere")); err == nil {
		t.Error("a save through the dangling link created its target outside the root")
	}

	// Inside the root: relative to it, absolute through the link it was given as, and through a
	// link that stays inside.
	for _, dir := range []string{"ckpt/step_1", filepath.Join(base, "alias", "a", "..", "b"), filepath.Join(root, "c"), "inner/step_2", ".", "later/x"} {
		if err := call("save", dir); err != nil {
			t.Errorf("save %q: %v", dir, err)
		}
	}
	if err := call("load", "inner/step_2"); err != nil {
		t.Errorf("load: %v", err)
	}
	// A model built into the engine names no folder: it reaches the engine as it is (a host
	// resets a trained server to the model it started with this way).
	if err := call("load", "builtin:tiny-arith"); err != nil {
		t.Errorf("load builtin:tiny-arith: %v", err)
	}
	want := []string{
		"save " + filepath.Join(root, "ckpt", "step_1"),
		"save " + filepath.Join(root, "b"),
		"save " + filepath.Join(root, "c"),
		"save " + filepath.Join(root, "ckpt", "step_2"),
		"save " + root,
		"save " + filepath.Join(root, "made", "x"),
		"load " + filepath.Join(root, "ckpt", "step_2"),
		"load builtin:tiny-arith",
	}
	if got := eng.seen(); !slices.Equal(got, want) {
		t.Errorf("the engine got\n%q\nwant\n%q", got, want)
	}
}

// Several roots: a request may name a folder in any, and relative paths are taken from the first.
func TestSeveralRoots(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	run, models := filepath.Join(base, "run"), filepath.Join(base, "models") // neither exists yet
	eng := &folders{gated: newGated()}
	c := start(t, eng, Options{Roots: []string{run, models}})
	ctx := context.Background()
	for _, dir := range []string{"checkpoints/step_1", filepath.Join(models, "m")} {
		if _, err := c.Save(ctx, &enginepb.SaveRequest{Dir: dir}); err != nil {
			t.Errorf("save %q: %v", dir, err)
		}
	}
	_, err = c.Load(ctx, &enginepb.LoadRequest{Dir: base})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "this server's roots "+run+", "+models) {
		t.Errorf("load of the roots' parent: got %v", err)
	}
	want := []string{"save " + filepath.Join(run, "checkpoints", "step_1"), "save " + filepath.Join(models, "m")}
	if got := eng.seen(); !slices.Equal(got, want) {
		t.Errorf("the engine got %q, want %q", got, want)
	}
}

// The default root is the working directory, but not when that is the file system's root.
func TestDefaultRoot(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	if got, err := ResolveRoots(nil); err != nil || !slices.Equal(got, []string{dir}) {
		t.Errorf("ResolveRoots() in %s = %q, %v", dir, got, err)
	}
	t.Chdir("/")
	if _, err := ResolveRoots(nil); err == nil || !strings.Contains(err.Error(), "--root DIR") {
		t.Errorf("ResolveRoots() in /: got %v, want a refusal that says how to give a root", err)
	}
	if got, err := ResolveRoots([]string{"/"}); err != nil || !slices.Equal(got, []string{"/"}) {
		t.Errorf("an explicit root /: %q, %v", got, err)
	}
	// A server that cannot resolve its root refuses every Save and Load.
	c := start(t, &folders{gated: newGated()}, Options{})
	if _, err := c.Save(context.Background(), &enginepb.SaveRequest{Dir: "x"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("save on a server without a root: got %v", err)
	}
}

// Off loopback a server needs TLS or an explicit Insecure, and a way to know its clients: a token
// or client certificates. TLS alone is refused.
func TestListenOffLoopbackNeedsAuthentication(t *testing.T) {
	server := &tls.Config{}
	mutual := &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: x509.NewCertPool()}
	for _, tc := range []struct {
		name string
		opts Options
		want string // "" is accepted
	}{
		{"plaintext", Options{}, "needs TLS (--tls-cert and --tls-key) or --insecure"},
		{"insecure without a token", Options{Insecure: true}, "must authenticate its clients"},
		{"TLS without a token", Options{TLS: server}, "set a bearer token (--token-env VAR) or require client certificates (--tls-client-ca)"},
		{"insecure with a token", Options{Insecure: true, Token: "t"}, ""},
		{"TLS with a token", Options{TLS: server, Token: "t"}, ""},
		{"mutual TLS", Options{TLS: mutual}, ""},
	} {
		l, err := Listen("0.0.0.0:0", tc.opts)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), "listen address 0.0.0.0:0 is not loopback") || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: got %v, want an error with %q", tc.name, err, tc.want)
		}
		if l != nil {
			l.Close()
		}
	}
	// Loopback needs neither.
	l, err := Listen("127.0.0.1:0", Options{})
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
}
