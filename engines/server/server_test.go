package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

// gated is an engine whose requests finish when the test opens their gate (by request id; a
// request without a gate finishes at once). It records the ids of every engine call.
type gated struct {
	mu      sync.Mutex
	gates   map[string]chan struct{}
	calls   [][]string
	fail    map[string]bool // ids whose request makes the engine call fail
	started chan string
}

func newGated() *gated {
	return &gated{gates: map[string]chan struct{}{}, fail: map[string]bool{}, started: make(chan string, 100)}
}

func (g *gated) gate(id string) (open func()) {
	ch := make(chan struct{})
	g.mu.Lock()
	g.gates[id] = ch
	g.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func (g *gated) wait(ctx context.Context, id string) error {
	g.mu.Lock()
	ch, fail := g.gates[id], g.fail[id]
	g.mu.Unlock()
	g.started <- id
	if ch != nil {
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail {
		return fmt.Errorf("request %s is poison", id)
	}
	return nil
}

func (g *gated) record(reqs []engines.GenerateRequest) {
	ids := make([]string, len(reqs))
	for i, r := range reqs {
		ids[i] = r.ID
	}
	g.mu.Lock()
	g.calls = append(g.calls, ids)
	g.mu.Unlock()
}

func (g *gated) callsSoFar() [][]string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.calls)
}

func completion(r engines.GenerateRequest, i int) engines.Completion {
	return engines.Completion{RequestID: r.ID, Index: i, Text: fmt.Sprintf("%s#%d", r.ID, i), FinishReason: "stop"}
}

func (g *gated) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	g.record(reqs)
	var out []engines.Completion
	for _, r := range reqs {
		if err := g.wait(ctx, r.ID); err != nil {
			return nil, err
		}
		for i := range max(r.N, 1) {
			out = append(out, completion(r, i))
		}
	}
	return out, nil
}

func (g *gated) Info(context.Context) (engines.Info, error) { return engines.Info{Model: "gated"}, nil }
func (g *gated) Score(context.Context, []engines.ScoreRequest) ([]engines.Scores, error) {
	return nil, engines.ErrNotSupported
}
func (g *gated) Train(context.Context, engines.Batch) (engines.TrainStats, error) {
	return engines.TrainStats{}, engines.ErrNotSupported
}
func (g *gated) Tokenize(context.Context, []string) ([][]int32, error) {
	return nil, engines.ErrNotSupported
}
func (g *gated) Save(context.Context, string) error { return nil }
func (g *gated) Load(context.Context, string) error { return nil }
func (g *gated) Close() error                       { return nil }

// streaming samples the requests of a batch side by side and hands back each as it finishes.
type streaming struct{ *gated }

func (s streaming) GenerateStream(ctx context.Context, reqs []engines.GenerateRequest, emit func(engines.Completion)) error {
	s.record(reqs)
	var wg sync.WaitGroup
	errs := make([]error, len(reqs))
	for k, r := range reqs {
		wg.Go(func() {
			if errs[k] = s.wait(ctx, r.ID); errs[k] == nil {
				for i := range max(r.N, 1) {
					emit(completion(r, i))
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// start serves eng on a free loopback port and returns a raw protocol client.
func start(t *testing.T, eng engines.Engine, opts Options) enginepb.EngineClient {
	c, _ := startService(t, eng, opts)
	return c
}

// startService is start that also returns the service, for tests that look inside it.
func startService(t *testing.T, eng engines.Engine, opts Options) (enginepb.EngineClient, *service) {
	t.Helper()
	l, err := Listen("127.0.0.1:0", opts)
	if err != nil {
		t.Fatal(err)
	}
	opts = opts.withDefaults()
	svc := newService(eng, opts)
	s := newGRPCServer(svc, opts)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return enginepb.NewEngineClient(conn), svc
}

func open(t *testing.T, c enginepb.EngineClient) enginepb.Engine_GenerateClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	s, err := c.Generate(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func send(t *testing.T, s enginepb.Engine_GenerateClient, ids ...string) {
	t.Helper()
	msg := &enginepb.GenerateStreamRequest{}
	for _, id := range ids {
		msg.Requests = append(msg.Requests, &enginepb.GenerateRequest{Id: id, PromptTokens: []int32{1}, N: 1})
	}
	if err := s.Send(msg); err != nil {
		t.Fatal(err)
	}
}

// next receives one stream message and lists what it carries as "id#index" or "id!code".
func next(t *testing.T, s enginepb.Engine_GenerateClient) []string {
	t.Helper()
	resp, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range resp.GetCompletions() {
		got = append(got, fmt.Sprintf("%s#%d", c.GetRequestId(), c.GetIndex()))
	}
	for _, e := range resp.GetErrors() {
		got = append(got, fmt.Sprintf("%s!%s: %s", e.GetRequestId(), codes.Code(e.GetCode()), e.GetMessage()))
	}
	return got
}

func waitStarted(t *testing.T, g *gated, id string) {
	t.Helper()
	for {
		select {
		case got := <-g.started:
			if got == id {
				return
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("request %s never reached the engine", id)
		}
	}
}

// Requests sent in one message go to the engine together; an engine that streams hands back a
// fast request of the batch before a slow one.
func TestStreamingEngineAnswersEachRequestAsItFinishes(t *testing.T) {
	eng := streaming{newGated()}
	openSlow := eng.gate("slow")
	defer openSlow()
	s := open(t, start(t, eng, Options{}))
	send(t, s, "slow", "fast")
	if got := next(t, s); !slices.Equal(got, []string{"fast#0"}) {
		t.Fatalf("first answer: %v, want the fast request alone", got)
	}
	openSlow()
	if got := next(t, s); !slices.Equal(got, []string{"slow#0"}) {
		t.Fatalf("second answer: %v, want the slow request", got)
	}
	if calls := eng.callsSoFar(); len(calls) != 1 || len(calls[0]) != 2 {
		t.Errorf("engine calls %v, want one batch of both requests", calls)
	}
}

// Requests that arrive while every engine slot is busy are gathered into one batch.
func TestRequestsArrivingWhileBusyShareABatch(t *testing.T) {
	eng := newGated()
	openA := eng.gate("a")
	c, svc := startService(t, eng, Options{MaxConcurrentBatches: 1})
	s := open(t, c)
	send(t, s, "a")
	waitStarted(t, eng, "a")
	send(t, s, "b")
	send(t, s, "c", "d")
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		svc.gen.mu.Lock()
		queued := svc.gen.queued
		svc.gen.mu.Unlock()
		if queued == 3 {
			break // b, c and d wait behind a
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests queued, want 3", queued)
		}
	}
	openA()
	var got []string
	for len(got) < 4 {
		got = append(got, next(t, s)...)
	}
	want := [][]string{{"a"}, {"b", "c", "d"}}
	if calls := eng.callsSoFar(); !slices.EqualFunc(calls, want, slices.Equal) {
		t.Errorf("engine calls %v, want %v", calls, want)
	}
}

// With a batch window, requests sent separately but close together share a batch.
func TestBatchWindowGathersRequests(t *testing.T) {
	eng := newGated()
	s := open(t, start(t, eng, Options{BatchWindow: 200 * time.Millisecond}))
	send(t, s, "a")
	send(t, s, "b")
	var got []string
	for len(got) < 2 {
		got = append(got, next(t, s)...)
	}
	if calls := eng.callsSoFar(); len(calls) != 1 || len(calls[0]) != 2 {
		t.Errorf("engine calls %v, want one batch of a and b", calls)
	}
}

// A request that makes the engine fail fails alone, not the requests batched with it.
func TestFailingRequestDoesNotFailItsBatchMates(t *testing.T) {
	eng := newGated()
	eng.fail["poison"] = true
	s := open(t, start(t, eng, Options{}))
	send(t, s, "good", "poison", "fine")
	var got []string
	for len(got) < 3 {
		got = append(got, next(t, s)...)
	}
	slices.Sort(got)
	want := []string{"fine#0", "good#0", "poison!Unknown: request poison is poison"}
	if !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// A cancelled request that has not started never reaches the engine; a running batch nobody
// waits for any more is cancelled.
func TestCancel(t *testing.T) {
	eng := newGated()
	openA := eng.gate("a")
	defer openA()
	s := open(t, start(t, eng, Options{MaxConcurrentBatches: 1}))
	send(t, s, "a")
	waitStarted(t, eng, "a")
	send(t, s, "b")
	if err := s.Send(&enginepb.GenerateStreamRequest{Cancel: []string{"b", "a"}}); err != nil {
		t.Fatal(err)
	}
	send(t, s, "c")
	if got := next(t, s); !slices.Equal(got, []string{"c#0"}) {
		t.Fatalf("got %v, want only c answered", got)
	}
	if calls := eng.callsSoFar(); !slices.EqualFunc(calls, [][]string{{"a"}, {"c"}}, slices.Equal) {
		t.Errorf("engine calls %v: b was cancelled before it started and must not run", calls)
	}
}

// The protocol's checks on a request: an id, n ≥ 0, and one request per id.
func TestRequestChecks(t *testing.T) {
	eng := newGated()
	s := open(t, start(t, eng, Options{}))
	send(t, s, "x")
	if got := next(t, s); !slices.Equal(got, []string{"x#0"}) {
		t.Fatalf("got %v", got)
	}
	if err := s.Send(&enginepb.GenerateStreamRequest{Requests: []*enginepb.GenerateRequest{
		{Id: "", N: 1},
		{Id: "neg", N: -1},
		{Id: "x", PromptTokens: []int32{2}, N: 1},
	}}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for len(got) < 3 {
		got = append(got, next(t, s)...)
	}
	for i, want := range []string{
		"!InvalidArgument: generate request without an id",
		"neg!InvalidArgument: generate request \"neg\" asks for n = -1 samples",
		"x!AlreadyExists: generate request id \"x\" was already used for a different request",
	} {
		if !strings.HasPrefix(got[i], want) {
			t.Errorf("answer %d: %q, want it to start with %q", i, got[i], want)
		}
	}
}

// Drain ends an idle stream, so that GracefulStop does not wait on it.
func TestDrainEndsIdleStreams(t *testing.T) {
	drain := make(chan struct{})
	s := open(t, start(t, newGated(), Options{Drain: drain}))
	send(t, s, "x")
	next(t, s)
	close(drain)
	if _, err := s.Recv(); err != io.EOF {
		t.Errorf("after Drain: got %v, want the stream to end cleanly", err)
	}
}

func TestListenRefusesPlaintextOffLoopback(t *testing.T) {
	_, err := Listen("0.0.0.0:0", Options{})
	if err == nil || !strings.Contains(err.Error(), "listen address 0.0.0.0:0 is not loopback: serving an engine to the network needs TLS (--tls-cert and --tls-key) or --insecure") {
		t.Errorf("got %v", err)
	}
	l, err := Listen("0.0.0.0:0", Options{Insecure: true, Token: "t"})
	if err != nil {
		t.Fatalf("with Insecure and a token: %v", err)
	}
	l.Close()
	if _, err := Listen("7777", Options{}); err == nil || !strings.Contains(err.Error(), "write it as host:port") {
		t.Errorf("a bare port: got %v", err)
	}
}

func TestTrainLog(t *testing.T) {
	l := newTrainLog(2)
	ctx := context.Background()
	var applied atomic.Int32
	release := make(chan struct{})
	step := func(context.Context) (engines.TrainStats, error) {
		applied.Add(1)
		<-release
		return engines.TrainStats{Loss: 1.5}, nil
	}
	fp := [32]byte{1}

	// A repeat that arrives while the step runs waits for it and gets its stats.
	type result struct {
		stats engines.TrainStats
		dup   bool
		err   error
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			s, dup, err := l.apply(ctx, "s1", fp, step)
			results <- result{s, dup, err}
		}()
	}
	time.Sleep(20 * time.Millisecond)
	close(release)
	a, b := <-results, <-results
	if a.err != nil || b.err != nil || a.stats.Loss != 1.5 || b.stats.Loss != 1.5 || a.dup == b.dup {
		t.Errorf("two senders of s1: %+v and %+v; want the same stats, one marked duplicate", a, b)
	}
	if n := applied.Load(); n != 1 {
		t.Errorf("s1 applied %d times", n)
	}

	// A caller that stops waiting does not stop the step.
	slow := make(chan struct{})
	cctx, cancel := context.WithCancel(ctx)
	go func() { time.Sleep(20 * time.Millisecond); cancel() }()
	_, _, err := l.apply(cctx, "s2", fp, func(ctx context.Context) (engines.TrainStats, error) {
		<-slow
		return engines.TrainStats{Loss: 2}, ctx.Err()
	})
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), `step "s2" is still running on the engine and will be applied`) {
		t.Errorf("cancelled caller: got %v", err)
	}
	close(slow)
	if s, dup, err := l.apply(ctx, "s2", fp, step); err != nil || !dup || s.Loss != 2 {
		t.Errorf("resend of s2 after its caller left: %+v, dup=%v, %v; want its stats", s, dup, err)
	}

	// A failed step is forgotten, so a resend runs it again.
	_, _, err = l.apply(ctx, "s3", fp, func(context.Context) (engines.TrainStats, error) {
		return engines.TrainStats{}, errors.New("out of memory")
	})
	if err == nil {
		t.Fatal("want the step's error")
	}
	if _, dup, err := l.apply(ctx, "s3", fp, step); err != nil || dup {
		t.Errorf("resend of a failed step: dup=%v, %v; want it applied afresh", dup, err)
	}

	// Only the last max steps are remembered, and forget drops them all.
	if _, dup, _ := l.apply(ctx, "s1", fp, step); dup {
		t.Error("s1 is older than the last 2 steps and should have been forgotten")
	}
	l.forget()
	if _, dup, _ := l.apply(ctx, "s3", fp, step); dup {
		t.Error("s3 was remembered after forget")
	}
}

// Finished requests are kept for resends within the byte budget, oldest forgotten first.
func TestDedupKeepsTheNewestWithinItsBudget(t *testing.T) {
	eng := newGated()
	// Each completion is 16 bytes on the wire: the budget keeps the newest request only.
	s := open(t, start(t, eng, Options{DedupMaxBytes: 30}))
	for _, id := range []string{"r1", "r2", "r3"} {
		send(t, s, id)
		next(t, s)
	}
	send(t, s, "r3", "r1")
	var got []string
	for len(got) < 2 {
		got = append(got, next(t, s)...)
	}
	want := [][]string{{"r1"}, {"r2"}, {"r3"}, {"r1"}} // r3 answered from memory, r1 sampled again
	if calls := eng.callsSoFar(); !slices.EqualFunc(calls, want, slices.Equal) {
		t.Errorf("engine calls %v, want %v", calls, want)
	}
}

// Every answer names the server process in its header (the Generate stream's first thing), the
// same instance Health reports: that is how a client notices a restarted engine at once.
func TestAnswersNameTheInstance(t *testing.T) {
	c, svc := startService(t, newGated(), Options{})
	ctx := context.Background()
	var md metadata.MD
	h, err := c.Health(ctx, &enginepb.HealthRequest{}, grpc.Header(&md))
	if err != nil {
		t.Fatal(err)
	}
	if got := md.Get(enginepb.InstanceHeader); len(got) != 1 || got[0] != svc.instance || h.GetInstance() != svc.instance {
		t.Errorf("Health: header %q, body %q; want both %q", got, h.GetInstance(), svc.instance)
	}
	md = nil
	if _, err := c.Info(ctx, &enginepb.InfoRequest{}, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(enginepb.InstanceHeader); len(got) != 1 || got[0] != svc.instance {
		t.Errorf("Info: header %q, want %q", got, svc.instance)
	}
	s := open(t, c)
	if md, err = s.Header(); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(enginepb.InstanceHeader); len(got) != 1 || got[0] != svc.instance {
		t.Errorf("Generate: stream header %q, want %q", got, svc.instance)
	}
}
