package host

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// noVersions hides the tiny engine's weights versions: a Go engine that keeps none.
type noVersions struct{ engines.Engine }

// A remote policy whose server keeps no weights versions (its engine has none, or the server is
// of an older release) cannot run at rollout.max_staleness > 0: the first step stops with an
// error that names the policy's config line and says which servers keep versions. (A server
// whose engine keeps them runs it: cmd/slimen/remote_async_test.go.)
func TestAsyncRemoteServerWithoutVersions(t *testing.T) {
	ctx := context.Background()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	l, err := server.Listen("127.0.0.1:0", server.Options{})
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	s := server.New(noVersions{eng}, server.Options{Roots: []string{out}}) // the run saves there
	go func() { _ = s.Serve(l) }()
	defer s.Stop()
	cfg, err := config.Parse([]byte(fmt.Sprintf("policies:\n  - {name: p, engine: {kind: remote, address: %q}}\nrollout: {batch_size: 2, max_response_len: 8, max_staleness: 1}\n", l.Addr())), "remote.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Eval.Datasets = nil
	r, err := Load(ctx, writeScript(t, tinyScript), Options{Config: cfg, Tasks: numberedTasks(10), Out: out})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	err = r.Steps(ctx, 1)
	for _, want := range []string{`policy "p" in remote.yaml:2: rollout.max_staleness is 1`, `its server lists no "versions" capability`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("a run at max_staleness 1 on a server without versions: %v; want an error with %q", err, want)
		}
	}
}
