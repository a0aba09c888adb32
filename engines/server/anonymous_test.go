package server

import (
	"context"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/internal/loopback/loopbacktest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// A server that names itself only in Info and Health (as the PyTorch worker once did): no instance
// header, and the Generate stream's header comes with its first answer. The client must neither
// wait for that header before sending (it would wait forever) nor resend to a restarted process
// before OnRestart has run: after an outage it asks Health first.

// lateHeaders drops the stream's early header: it goes out with the first message instead.
type lateHeaders struct{ grpc.ServerStream }

func (lateHeaders) SendHeader(metadata.MD) error { return nil }

// serveAnonymous serves eng on addr without the instance header; stop ends it.
func serveAnonymous(t *testing.T, addr string, eng engines.Engine) (string, func()) {
	t.Helper()
	var l net.Listener
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if l, err = Listen(addr, Options{}); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Roots: []string{"/ckpt"}}.withDefaults() // the folder the test loads from
	svc := newService(eng, opts)
	s := grpc.NewServer(grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, lateHeaders{ss})
	}))
	enginepb.RegisterEngineServer(s, svc)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return l.Addr().String(), s.Stop
}

// ordered records the order of what reaches an engine.
type ordered struct {
	*gated
	mu  sync.Mutex
	log []string
}

func (o *ordered) note(s string) {
	o.mu.Lock()
	o.log = append(o.log, s)
	o.mu.Unlock()
}

func (o *ordered) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	for _, r := range reqs {
		o.note("gen " + r.ID)
	}
	return o.gated.Generate(ctx, reqs)
}

func (o *ordered) Load(ctx context.Context, dir string) error {
	o.note("load " + dir)
	return nil
}

func (o *ordered) events() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.log)
}

func TestClientOfServerThatDoesNotNameItself(t *testing.T) {
	first := newGated()
	open := first.gate("held") // never opened: the first process dies with it
	defer open()
	addr, stop := serveAnonymous(t, loopbacktest.Addr(t), first)
	var restarts atomic.Int32
	var c *remote.Client
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := remote.Dial(ctx, remote.Options{Address: addr, MaxBackoff: 50 * time.Millisecond,
		OnRestart: func(ctx context.Context, prev, cur string) error {
			restarts.Add(1)
			return c.Load(ctx, "/ckpt/step_2")
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The stream works although its header comes late.
	got, err := c.Generate(ctx, []engines.GenerateRequest{{ID: "warm", N: 1}})
	if err != nil || len(got) != 1 {
		t.Fatalf("generate on a server with late headers: %v, %v", got, err)
	}

	done := make(chan error, 1)
	go func() {
		_, err := c.Generate(ctx, []engines.GenerateRequest{{ID: "held", N: 2}})
		done <- err
	}()
	waitStarted(t, first, "held")
	stop()
	second := &ordered{gated: newGated()}
	serveAnonymous(t, addr, second)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the call in flight was not answered by the restarted server")
	}
	if n := restarts.Load(); n != 1 {
		t.Errorf("OnRestart ran %d times, want once", n)
	}
	if log := second.events(); len(log) != 2 || log[0] != "load /ckpt/step_2" || log[1] != "gen held" {
		t.Errorf("the restarted server got %q; want the load, then the resent request", log)
	}
}
