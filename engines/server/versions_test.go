package server

import (
	"context"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/tiny"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// versionReqs are sampled requests of the arithmetic model; tag makes their ids unique, since the
// server answers a known id from memory instead of sampling it again.
func versionReqs(tag string) []engines.GenerateRequest {
	var reqs []engines.GenerateRequest
	for i, p := range []string{"1+2=", "7*3=", "12-5="} {
		reqs = append(reqs, engines.GenerateRequest{ID: tag + p, Messages: []engines.Message{{Role: "user", Content: p}}, N: 2,
			Sampling: engines.Sampling{MaxTokens: 6, Temperature: 1, Seed: uint64(i)}})
	}
	return reqs
}

// samples strips what differs between two samplings of the same requests under other ids.
func samples(cs []engines.Completion) []engines.Completion {
	out := slices.Clone(cs)
	for i := range out {
		out[i].RequestID = ""
	}
	return out
}

// serveVersioned serves a tiny engine on loopback with Save confined to root, and dials it.
func serveVersioned(t *testing.T, eng engines.Engine, root string) *remote.Client {
	t.Helper()
	opts := Options{Roots: []string{root}}
	l, err := Listen("127.0.0.1:0", opts)
	if err != nil {
		t.Fatal(err)
	}
	s := New(eng, opts)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := remote.Dial(ctx, remote.Options{Address: l.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// serveTinyArith serves a tiny engine of builtin:tiny-arith (serveVersioned) with a fresh root.
func serveTinyArith(t *testing.T) (*remote.Client, string) {
	t.Helper()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	root := t.TempDir()
	return serveVersioned(t, eng, root), root
}

// A host reaches the weights versions of an engine served by `slimen serve` through the remote
// client: version 0, kept before an optimizer step, samples and scores over the protocol exactly
// what the engine did before the step (same seeds), while the current weights moved; a version
// saved on the server loads back into an engine that samples the same; a dropped version is an
// error that names it.
func TestServedEngineKeepsVersions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, root := serveTinyArith(t)
	info, err := c.Info(ctx)
	if err != nil || !slices.Contains(info.Capabilities, "versions") {
		t.Fatalf("Info: capabilities %v, %v; want \"versions\" for an engine that keeps them", info.Capabilities, err)
	}
	if keeps, err := c.KeepsVersions(ctx); err != nil || !keeps {
		t.Fatalf("KeepsVersions = %v, %v; want true", keeps, err)
	}

	before, err := c.Generate(ctx, versionReqs("before/"))
	if err != nil {
		t.Fatal(err)
	}
	score := []engines.ScoreRequest{{Messages: versionReqs("")[0].Messages, Tokens: before[0].Tokens}}
	scoreBefore, err := c.Score(ctx, score)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.KeepVersion(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Train(ctx, stepBatch("step1", before)); err != nil || st.Skipped {
		t.Fatalf("Train: %+v, %v", st, err)
	}

	after, err := c.Generate(ctx, versionReqs("after/"))
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(samples(after), samples(before)) {
		t.Fatal("the optimizer step did not change what the engine samples: the test shows nothing")
	}
	old, err := c.GenerateVersion(ctx, 0, versionReqs("v0/"))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(samples(old), samples(before)) {
		t.Errorf("version 0 sampled\n%+v\nafter the step; before it the engine sampled\n%+v", old, before)
	}
	if s, err := c.ScoreVersion(ctx, 0, score); err != nil || !reflect.DeepEqual(s, scoreBefore) {
		t.Errorf("version 0 scored %v (%v); the engine before the step %v", s, err, scoreBefore)
	}
	if s, err := c.Score(ctx, score); err != nil || reflect.DeepEqual(s, scoreBefore) {
		t.Errorf("the current weights scored %v (%v), as before the step", s, err)
	}

	// Saved on the server, version 0 is a model folder that samples what the engine did.
	if err := c.SaveVersion(ctx, 0, "v0"); err != nil {
		t.Fatal(err)
	}
	back, err := tiny.Open(filepath.Join(root, "v0"), tiny.Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	if got, err := back.Generate(ctx, versionReqs("before/")); err != nil || !reflect.DeepEqual(got, before) {
		t.Errorf("version 0 saved by the server and opened again samples differently (%v)", err)
	}
	if err := c.SaveVersion(ctx, 0, "../outside"); err == nil || !strings.Contains(err.Error(), "outside this server's root") {
		t.Errorf("saving a version outside the root: %v; want the root's refusal", err)
	}

	if err := c.DropVersions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	for name, call := range map[string]func() error{
		"GenerateVersion": func() error { _, err := c.GenerateVersion(ctx, 0, versionReqs("dropped/")); return err },
		"ScoreVersion":    func() error { _, err := c.ScoreVersion(ctx, 0, score); return err },
		"SaveVersion":     func() error { return c.SaveVersion(ctx, 0, "v0again") },
	} {
		if err := call(); err == nil || !strings.Contains(err.Error(), "no weights version 0 is kept") {
			t.Errorf("%s of a dropped version: %v; want an error naming version 0", name, err)
		}
	}
}

// The protocol's codes: a version not kept is FAILED_PRECONDITION naming it, on every call that
// names one; a negative version is INVALID_ARGUMENT.
func TestVersionCodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	c := start(t, eng, Options{Roots: []string{t.TempDir()}})
	v := func(n int32) *int32 { return &n }
	req := &enginepb.GenerateRequest{Id: "a", PromptTokens: []int32{1, 2}, N: 1, Sampling: &enginepb.Sampling{MaxTokens: 2}, Version: v(5)}
	s := open(t, c)
	if err := s.Send(&enginepb.GenerateStreamRequest{Requests: []*enginepb.GenerateRequest{req}}); err != nil {
		t.Fatal(err)
	}
	if got := next(t, s); len(got) != 1 || !strings.HasPrefix(got[0], "a!FailedPrecondition") || !strings.Contains(got[0], "no weights version 5 is kept") {
		t.Errorf("generate from a version not kept: %q; want FailedPrecondition naming version 5", got)
	}
	_, err = c.Score(ctx, &enginepb.ScoreBatchRequest{Requests: []*enginepb.ScoreRequest{{PromptTokens: []int32{1}, Tokens: []int32{2}}}, Version: v(5)})
	if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "version 5") {
		t.Errorf("score with a version not kept: %v", err)
	}
	_, err = c.Save(ctx, &enginepb.SaveRequest{Dir: "x", Version: v(5)})
	if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "version 5") {
		t.Errorf("save of a version not kept: %v", err)
	}
	_, err = c.KeepVersion(ctx, &enginepb.VersionRequest{Version: -1})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("keep version -1: %v; want InvalidArgument", err)
	}
	_, err = c.Score(ctx, &enginepb.ScoreBatchRequest{Version: v(-2)})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("score with version -2: %v; want InvalidArgument", err)
	}
}

// An engine without weights versions: Info lists no "versions" (as before), KeepVersion and
// DropVersions answer UNIMPLEMENTED with a message, and a request naming a version fails alone
// instead of being sampled from the current weights.
func TestEngineWithoutVersions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := start(t, newGated(), Options{})
	info, err := c.Info(ctx, &enginepb.InfoRequest{})
	if err != nil || slices.Contains(info.GetInfo().GetCapabilities(), "versions") {
		t.Fatalf("Info: %v, %v; want no \"versions\"", info.GetInfo().GetCapabilities(), err)
	}
	for name, call := range map[string]func() error{
		"KeepVersion":  func() error { _, err := c.KeepVersion(ctx, &enginepb.VersionRequest{}); return err },
		"DropVersions": func() error { _, err := c.DropVersions(ctx, &enginepb.VersionRequest{Version: 1}); return err },
		"Score":        func() error { _, err := c.Score(ctx, &enginepb.ScoreBatchRequest{Version: new(int32)}); return err },
		"Save":         func() error { _, err := c.Save(ctx, &enginepb.SaveRequest{Dir: "x", Version: new(int32)}); return err },
	} {
		if st := status.Convert(call()); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "keeps no weights versions") {
			t.Errorf("%s: %v; want Unimplemented saying the engine keeps no versions", name, st)
		}
	}
	s := open(t, c)
	err = s.Send(&enginepb.GenerateStreamRequest{Requests: []*enginepb.GenerateRequest{
		{Id: "old", PromptTokens: []int32{1}, N: 1, Version: new(int32)},
		{Id: "cur", PromptTokens: []int32{1}, N: 1},
	}})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for len(got) < 2 {
		got = append(got, next(t, s)...)
	}
	slices.Sort(got)
	if len(got) != 2 || got[0] != "cur#0" || !strings.HasPrefix(got[1], "old!Unimplemented: generate request \"old\" names weights version 0") {
		t.Errorf("got %q; want cur sampled and old refused", got)
	}
}

// keeping records the engine calls of a fake that keeps versions. Its Train, once training is
// set, holds until training is closed.
type keeping struct {
	*gated
	mu       sync.Mutex
	calls    []string // "vN: ids" or "cur: ids"
	training chan struct{}
	trains   chan struct{} // a Train call began
}

func (k *keeping) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	if k.training == nil {
		return k.gated.Train(ctx, b)
	}
	k.trains <- struct{}{}
	<-k.training
	return engines.TrainStats{Tokens: 1}, nil
}

func (k *keeping) note(v string, reqs []engines.GenerateRequest) {
	ids := make([]string, len(reqs))
	for i, r := range reqs {
		ids[i] = r.ID
	}
	k.mu.Lock()
	k.calls = append(k.calls, v+": "+strings.Join(ids, " "))
	k.mu.Unlock()
}

func (k *keeping) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	k.note("cur", reqs)
	return k.gated.Generate(ctx, reqs)
}

func (k *keeping) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	k.note("v"+strconv.Itoa(v), reqs)
	return k.gated.Generate(ctx, reqs)
}

func (k *keeping) KeepVersion(context.Context, int) error { return nil }
func (k *keeping) ScoreVersion(_ context.Context, _ int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return make([]engines.Scores, len(reqs)), nil
}
func (k *keeping) SaveVersion(context.Context, int, string) error { return nil }
func (k *keeping) DropVersions(context.Context, int) error        { return nil }

// Requests of different weights versions sent together never share an engine call: each call
// samples one version's requests, in the order they came.
func TestBatchesKeepVersionsApart(t *testing.T) {
	k := &keeping{gated: newGated()}
	release := k.gate("hold")
	c, svc := startService(t, k, Options{MaxConcurrentBatches: 1})
	s := open(t, c)
	send(t, s, "hold") // occupies the engine while the rest queue up
	waitStarted(t, k.gated, "hold")
	v := func(n int32) *int32 { return &n }
	var reqs []*enginepb.GenerateRequest
	for _, r := range []struct {
		id string
		v  *int32
	}{{"a", v(1)}, {"b", nil}, {"c", v(2)}, {"d", v(1)}, {"e", nil}, {"f", v(2)}} {
		reqs = append(reqs, &enginepb.GenerateRequest{Id: r.id, PromptTokens: []int32{1}, N: 1, Version: r.v})
	}
	if err := s.Send(&enginepb.GenerateStreamRequest{Requests: reqs}); err != nil {
		t.Fatal(err)
	}
	// The six requests reach the server's queue before the engine is freed.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		svc.gen.mu.Lock()
		queued := len(svc.gen.queue)
		svc.gen.mu.Unlock()
		if queued == 6 || time.Now().After(deadline) {
			break
		}
	}
	release()
	var got []string
	for len(got) < 7 {
		got = append(got, next(t, s)...)
	}
	k.mu.Lock()
	calls := slices.Clone(k.calls)
	k.mu.Unlock()
	want := []string{"cur: hold", "v1: a d", "cur: b e", "v2: c f"}
	if !slices.Equal(calls, want) {
		t.Errorf("engine calls %q; want %q", calls, want)
	}
}

// The new calls are guarded by the token like every other call.
func TestVersionCallsNeedTheToken(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	k := &keeping{gated: newGated()}
	c := start(t, k, Options{Token: "s3cret"})
	for name, call := range map[string]func(context.Context) error{
		"KeepVersion":  func(ctx context.Context) error { _, err := c.KeepVersion(ctx, &enginepb.VersionRequest{}); return err },
		"DropVersions": func(ctx context.Context) error { _, err := c.DropVersions(ctx, &enginepb.VersionRequest{}); return err },
	} {
		if err := call(ctx); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s without a token: %v; want Unauthenticated", name, err)
		}
		authed := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer s3cret")
		if err := call(authed); err != nil {
			t.Errorf("%s with the token: %v", name, err)
		}
	}
}

// A kept version samples and scores while an optimizer step runs on the server: nothing in the
// server makes a versioned call wait for Train (the engine's versions promise the same).
func TestVersionServedWhileTraining(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	k := &keeping{gated: newGated(), training: make(chan struct{}), trains: make(chan struct{}, 1)}
	c := start(t, k, Options{})
	trained := make(chan error, 1)
	go func() {
		_, err := c.Train(ctx, &enginepb.TrainRequest{Batch: &enginepb.Batch{Id: "step1"}})
		trained <- err
	}()
	<-k.trains
	s := open(t, c)
	one := int32(1)
	if err := s.Send(&enginepb.GenerateStreamRequest{Requests: []*enginepb.GenerateRequest{{Id: "a", PromptTokens: []int32{1}, N: 1, Version: &one}}}); err != nil {
		t.Fatal(err)
	}
	if got := next(t, s); !slices.Equal(got, []string{"a#0"}) {
		t.Errorf("generate from version 1 while training: %q", got)
	}
	if _, err := c.Score(ctx, &enginepb.ScoreBatchRequest{Requests: []*enginepb.ScoreRequest{{PromptTokens: []int32{1}, Tokens: []int32{2}}}, Version: &one}); err != nil {
		t.Errorf("score with version 1 while training: %v", err)
	}
	select {
	case err := <-trained:
		t.Fatalf("the step ended before it was let go: %v", err)
	default:
	}
	close(k.training)
	if err := <-trained; err != nil {
		t.Fatal(err)
	}
}

// without hides an engine's weights versions.
type without struct{ engines.Engine }

// A server whose engine is itself a remote client (what `slimen serve --config` serves for a
// remote policy) keeps versions exactly when the server behind it does: it asks the client
// (engines.VersionsProber) and passes the versions calls on.
func TestServedRemoteClientKeepsVersionsOfItsServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	eng, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	root := t.TempDir()
	for _, keeps := range []bool{true, false} {
		var served engines.Engine = eng
		if !keeps {
			served = without{eng}
		}
		front := serveVersioned(t, serveVersioned(t, served, root), root)
		info, err := front.Info(ctx)
		if err != nil || slices.Contains(info.Capabilities, "versions") != keeps {
			t.Fatalf("behind a server that keeps versions: %v; the front server's capabilities %v (%v)", keeps, info.Capabilities, err)
		}
		if got, err := front.KeepsVersions(ctx); err != nil || got != keeps {
			t.Fatalf("KeepsVersions = %v, %v; want %v", got, err, keeps)
		}
		if !keeps {
			continue
		}
		if err := front.KeepVersion(ctx, 4); err != nil {
			t.Fatal(err)
		}
		want, err := eng.GenerateVersion(ctx, 4, versionReqs("direct/"))
		if err != nil {
			t.Fatal(err)
		}
		got, err := front.GenerateVersion(ctx, 4, versionReqs("front/"))
		if err != nil || !reflect.DeepEqual(samples(got), samples(want)) {
			t.Errorf("version 4 through two servers: %v; want what the engine samples from it", err)
		}
		if err := front.DropVersions(ctx, 5); err != nil {
			t.Fatal(err)
		}
		if _, err := eng.GenerateVersion(ctx, 4, versionReqs("gone/")); err == nil {
			t.Error("DropVersions through two servers left version 4 in the engine")
		}
	}
}
