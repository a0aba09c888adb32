package host

import (
	"context"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// TestAdapterServersBelongToTheirRun checks that two runs in one process share no adapter server,
// even when their LoRA policies reach one engine client: a policy that joins a server of its run
// joins that run's adapters (which a restarted server gets back together), not the other run's.
func TestAdapterServersBelongToTheirRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1})
	if err != nil {
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
	client, err := remote.Dial(ctx, remote.Options{Address: l.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	shared := keepOpen{client} // one engine value for both runs; each run's last policy closes it
	srv := AdapterServer{Key: "one-server", Engine: "its engine", Joined: "joined",
		Open:   func(EngineEnv) (engines.Engine, error) { return shared, nil },
		Client: func(e engines.Engine) *remote.Client { return e.(keepOpen).Client }}
	open := func(env EngineEnv, name string) *serverAdapter {
		t.Helper()
		p := config.PolicyConfig{Name: name, LoRA: &config.LoRAConfig{Rank: 2, Alpha: 4, Targets: []string{"q_proj"}}}
		e, err := OpenAdapter(ctx, p, env, srv)
		if err != nil {
			t.Fatal(err)
		}
		return e.(*serverAdapter)
	}
	runX := EngineEnv{Logf: t.Logf, bases: &loraBases{}}
	runY := EngineEnv{Logf: t.Logf, bases: &loraBases{}}
	a := open(runX, "a")
	defer a.Close()
	b := open(runY, "b")
	defer b.Close()
	c := open(runX, "c") // joins run X's server
	defer c.Close()
	if c.as != a.as {
		t.Errorf("policy c joined another adapter server than policy a of its run")
	}
	if c.as == b.as || a.as == b.as {
		t.Errorf("two runs share an adapter server")
	}
}

// keepOpen is an engine client whose Close leaves it open, for a test that closes it itself.
type keepOpen struct{ *remote.Client }

func (keepOpen) Close() error { return nil }
