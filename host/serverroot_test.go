package host

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// TestRemoteServerRootCheckedAtStart: a trainable policy's engine server confined to another
// folder (slimen serve started elsewhere, with its default --root) would refuse the run's
// checkpoints only at the first one, after the training; the run refuses to start instead,
// naming the server, its root and the fix, and the server wrote nothing. A server whose root
// covers the run starts it; so does a frozen policy's, which saves nothing.
func TestRemoteServerRootCheckedAtStart(t *testing.T) {
	ctx := context.Background()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	elsewhere, runs := t.TempDir(), t.TempDir()
	serve := func(root string) string {
		l, err := server.Listen("127.0.0.1:0", server.Options{})
		if err != nil {
			t.Fatal(err)
		}
		s := server.New(eng, server.Options{Roots: []string{root}})
		go func() { _ = s.Serve(l) }()
		t.Cleanup(s.Stop)
		return l.Addr().String()
	}
	load := func(addr, extra, out string) error {
		cfg, err := config.Parse([]byte(fmt.Sprintf("policies:\n  - {name: p, engine: {kind: remote, address: %q, continue: true}%s}\nrollout: {batch_size: 2, max_response_len: 8}\n", addr, extra)), "remote.yaml")
		if err != nil {
			t.Fatal(err)
		}
		cfg.Eval.Datasets = nil
		r, err := Load(ctx, writeScript(t, tinyScript), Options{Config: cfg, Tasks: numberedTasks(4), Out: out})
		if err == nil {
			r.Close()
		}
		return err
	}
	out := filepath.Join(runs, "run")
	err = load(serve(elsewhere), "", out)
	for _, want := range []string{`policy "p"`, "would refuse to write the run's checkpoints (" + filepath.Join(out, "checkpoints") + ")",
		"is outside this server's root " + elsewhere, "--root covering " + out} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("a run whose server cannot save into it: %v\nwant it to say %q", err, want)
		}
	}
	if matches, _ := filepath.Glob(filepath.Join(out, "checkpoints", "*")); len(matches) > 0 {
		t.Errorf("the check wrote %v", matches)
	}
	if err := load(serve(runs), "", filepath.Join(runs, "run2")); err != nil {
		t.Errorf("a server whose root covers the run: %v", err)
	}
	if err := load(serve(elsewhere), ", trainable: false", filepath.Join(runs, "run3")); err != nil {
		t.Errorf("a frozen policy on a server elsewhere: %v", err)
	}
}

// TestRefusedRootLeavesTheServer: a run refused for its server's root does not reset the server
// first: what an earlier run trained there is still there.
func TestRefusedRootLeavesTheServer(t *testing.T) {
	ctx := context.Background()
	eng := &loadCounter{}
	var err error
	if eng.Engine, err = tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1}); err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	l, err := server.Listen("127.0.0.1:0", server.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := server.New(eng, server.Options{Roots: []string{t.TempDir()}})
	go func() { _ = s.Serve(l) }()
	defer s.Stop()
	cfg, err := config.Parse([]byte(fmt.Sprintf("policies:\n  - {name: p, engine: {kind: remote, address: %q}}\nrollout: {batch_size: 2, max_response_len: 8}\n", l.Addr())), "remote.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Eval.Datasets = nil
	r, err := Load(ctx, writeScript(t, tinyScript), Options{Config: cfg, Tasks: numberedTasks(4), Out: filepath.Join(t.TempDir(), "run")})
	if err == nil {
		r.Close()
		t.Fatal("a run whose server cannot save into it started")
	}
	if n := eng.loads.Load(); n != 0 {
		t.Errorf("the refused run reset the server's model (%d loads) before refusing", n)
	}
}

// loadCounter counts the Load calls an engine gets.
type loadCounter struct {
	engines.Engine
	loads atomic.Int32
}

func (e *loadCounter) Load(ctx context.Context, dir string) error {
	e.loads.Add(1)
	return e.Engine.Load(ctx, dir)
}
