package remote_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/internal/loopback/loopbacktest"
)

func chat(id, text string, n int) engines.GenerateRequest {
	return engines.GenerateRequest{
		ID:       id,
		Messages: []engines.Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: text}},
		N:        n,
		Sampling: engines.Sampling{MaxTokens: 16, Temperature: 1, TopP: 0.9, Stop: []string{"\n"}, Seed: 7},
	}
}

func batch(id string) engines.Batch {
	return engines.Batch{
		ID: id,
		Samples: []engines.Sample{{
			Prompt: []int32{1, 2}, Response: []int32{3, 4, 5}, LossMask: []float32{1, 1, 0},
			OldLogprobs: []float32{-1, -2, -3}, Advantages: []float32{0.5, 0.5, 0.5}, Group: "task-1",
		}},
		Loss: engines.LossConfig{LR: 1e-3, EpsClip: 0.2, EpsClipHigh: 0.28, KLLossType: "low_var_kl"},
	}
}

// Every method answers over the wire exactly what the engine answers in-process.
func TestEveryCallMatchesTheEngineInProcess(t *testing.T) {
	ctx := context.Background()
	local := newFake()
	c := dial(t, remote.Options{Address: serve(t, newFake(), server.Options{})})
	eq := cmpopts.EquateEmpty()

	wantInfo, _ := local.Info(ctx)
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(wantInfo, info, eq); d != "" {
		t.Errorf("Info (-in-process +remote):\n%s", d)
	}

	reqs := []engines.GenerateRequest{
		chat("a", "2+2?", 2),
		{ID: "b", PromptTokens: []int32{5, 6, 7}, Sampling: engines.Sampling{MaxTokens: 4}},
		chat("c", "3+3?", 3),
	}
	want, _ := local.Generate(ctx, reqs)
	got, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, got, eq); d != "" {
		t.Errorf("Generate (-in-process +remote):\n%s", d)
	}

	sreqs := []engines.ScoreRequest{
		{PromptTokens: []int32{1}, Tokens: []int32{2, 3}},
		{Messages: []engines.Message{{Role: "user", Content: "hi"}}, Tokens: []int32{4}},
	}
	wantScores, _ := local.Score(ctx, sreqs)
	scores, err := c.Score(ctx, sreqs)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(wantScores, scores, eq); d != "" {
		t.Errorf("Score (-in-process +remote):\n%s", d)
	}

	wantStats, _ := local.Train(ctx, batch("s1"))
	stats, err := c.Train(ctx, batch("s1"))
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(wantStats, stats); d != "" {
		t.Errorf("Train (-in-process +remote):\n%s", d)
	}

	wantToks, _ := local.Tokenize(ctx, []string{"ab", ""})
	toks, err := c.Tokenize(ctx, []string{"ab", ""})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(wantToks, toks, eq); d != "" {
		t.Errorf("Tokenize (-in-process +remote):\n%s", d)
	}

	if err := c.Save(ctx, "/ckpt/step_1"); err != nil {
		t.Fatal(err)
	}
	if err := c.Load(ctx, "/ckpt/step_1"); err != nil {
		t.Fatal(err)
	}
	err = c.Load(ctx, "/ckpt/missing")
	if err == nil || !strings.Contains(err.Error(), "load: load /ckpt/missing: no such checkpoint") {
		t.Errorf("Load of a missing checkpoint: got %v, want the engine's error", err)
	}

	h, err := c.Health(ctx)
	if err != nil || !h.Serving || h.Instance == "" || h.Instance != c.Instance() {
		t.Errorf("Health = %+v, %v; want serving, with the instance seen at Dial (%q)", h, err, c.Instance())
	}
}

// A fast request is answered while a slow one sent before it is still sampling.
func TestFastCompletionIsNotHeldBehindSlowOne(t *testing.T) {
	eng := newFake()
	release := eng.hold("slow")
	defer release()
	c := dial(t, remote.Options{Address: serve(t, eng, server.Options{})})
	ctx := context.Background()

	slowDone := make(chan error, 1)
	go func() {
		_, err := c.Generate(ctx, []engines.GenerateRequest{chat("slow-1", "slow", 1)})
		slowDone <- err
	}()
	eng.waitStarted(t, "slow-1")

	got, err := c.Generate(ctx, []engines.GenerateRequest{chat("fast-1", "fast", 2)})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Text != "fast→0" || got[1].Text != "fast→1" {
		t.Errorf("fast request: got %+v", got)
	}
	select {
	case err := <-slowDone:
		t.Fatalf("the slow request finished (%v) before it was released", err)
	default:
	}
	release()
	if err := <-slowDone; err != nil {
		t.Fatal(err)
	}
}

// A request id sent again, by the same client or another one, while sampling or after, is
// answered from the first sampling.
func TestResentGenerateIDIsSampledOnce(t *testing.T) {
	eng := newFake()
	release := eng.hold("held")
	addr := serve(t, eng, server.Options{})
	c1 := dial(t, remote.Options{Address: addr})
	c2 := dial(t, remote.Options{Address: addr})
	ctx := context.Background()

	results := make(chan []engines.Completion, 2)
	for _, c := range []*remote.Client{c1, c2} {
		go func() {
			got, err := c.Generate(ctx, []engines.GenerateRequest{chat("r-1", "held", 2)})
			if err != nil {
				t.Error(err)
			}
			results <- got
		}()
	}
	eng.waitStarted(t, "r-1")
	time.Sleep(50 * time.Millisecond) // let the second request reach the server while the first samples
	release()
	first, second := <-results, <-results
	if d := cmp.Diff(first, second); d != "" {
		t.Errorf("the two senders of r-1 got different answers:\n%s", d)
	}

	again, err := c1.Generate(ctx, []engines.GenerateRequest{chat("r-1", "held", 2)})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(first, again); d != "" {
		t.Errorf("a resend after the answer got a different answer:\n%s", d)
	}
	if n := eng.count(eng.sampled, "r-1"); n != 1 {
		t.Errorf("the engine sampled r-1 %d times, want once", n)
	}

	_, err = c1.Generate(ctx, []engines.GenerateRequest{chat("r-1", "something else", 2)})
	if err == nil || !strings.Contains(err.Error(), `generate request "r-1": generate request id "r-1" was already used for a different request`) {
		t.Errorf("reusing an id for another prompt: got %v", err)
	}
}

// An optimizer step sent twice with one id is applied once and both senders get its stats.
func TestTrainWithSameIDIsAppliedOnce(t *testing.T) {
	eng := newFake()
	c := dial(t, remote.Options{Address: serve(t, eng, server.Options{})})
	ctx := context.Background()
	first, err := c.Train(ctx, batch("step-7"))
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.Train(ctx, batch("step-7"))
	if err != nil {
		t.Fatal(err)
	}
	if first != second {
		t.Errorf("the repeat got %+v, want the first step's stats %+v", second, first)
	}
	if n := eng.count(eng.trained, "step-7"); n != 1 {
		t.Errorf("step-7 applied %d times, want once", n)
	}
	// A batch without an id gets a fresh one each time: two steps.
	for range 2 {
		if _, err := c.Train(ctx, batch("")); err != nil {
			t.Fatal(err)
		}
	}
	eng.mu.Lock()
	steps := len(eng.trained)
	eng.mu.Unlock()
	if steps != 3 {
		t.Errorf("%d distinct steps applied, want 3 (step-7 and two unnamed ones)", steps)
	}
	other := batch("step-7")
	other.Loss.LR = 1
	_, err = c.Train(ctx, other)
	if err == nil || !strings.Contains(err.Error(), `optimizer step id "step-7" was already used for a different batch`) {
		t.Errorf("reusing a step id for another batch: got %v", err)
	}
}

// The server dies in the middle of a generate call and comes back on the same address as a new
// process: the client reconnects, runs OnRestart (which loads a checkpoint) before the new
// process sees anything else, and then the requests in flight are answered; a step sent while
// the server is down goes through once it is back, applied once, after the load.
func TestServerRestartMidGenerate(t *testing.T) {
	old := newFake()
	defer old.hold("p")() // never answers: it dies first
	srv := serveAt(t, loopbacktest.Addr(t), old, server.Options{})
	var restarts atomic.Int32
	var c *remote.Client
	c = dial(t, remote.Options{
		Address:    srv.addr,
		MaxBackoff: 100 * time.Millisecond,
		OnRestart: func(ctx context.Context, prev, cur string) error {
			restarts.Add(1)
			if prev == cur || prev == "" || cur == "" {
				t.Errorf("OnRestart(%q, %q): want two different instances", prev, cur)
			}
			return c.Load(ctx, "/ckpt/step_1")
		},
	})
	ctx := context.Background()

	done := make(chan error, 1)
	var got []engines.Completion
	go func() {
		var err error
		got, err = c.Generate(ctx, []engines.GenerateRequest{chat("p-1", "p", 2), chat("q-1", "q", 1)})
		done <- err
	}()
	old.waitStarted(t, "p-1")
	srv.stop()

	trained := make(chan error, 1)
	go func() {
		_, err := c.Train(ctx, batch("during-outage"))
		trained <- err
	}()
	time.Sleep(300 * time.Millisecond) // the client is now retrying against a closed port

	fresh := newFake()
	serveAt(t, srv.addr, fresh, server.Options{})
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the generate call did not complete after the server came back")
	}
	if len(got) != 3 || got[0].Text != "p→0" || got[1].Text != "p→1" || got[2].Text != "q→0" {
		t.Errorf("after the restart: got %+v", got)
	}
	if n := fresh.count(fresh.sampled, "p-1"); n != 1 {
		t.Errorf("the new server sampled p-1 %d times, want once", n)
	}
	if err := <-trained; err != nil {
		t.Fatalf("a step sent during the outage: %v", err)
	}
	if n := fresh.count(fresh.trained, "during-outage"); n != 1 {
		t.Errorf("the step sent during the outage was applied %d times, want once", n)
	}
	if n := restarts.Load(); n != 1 {
		t.Errorf("OnRestart ran %d times, want once (the stream and the step both met the new process)", n)
	}
	if log := fresh.log(); len(log) == 0 || log[0] != "load /ckpt/step_1" {
		t.Errorf("the new process got %q; OnRestart's load must come before anything else", log)
	}
}

// A call that reaches a new server process without noticing an outage (the connection came back
// before the call was made) learns of it from the answer's header: OnRestart runs, and the call
// is made again on the restored engine instead of trusting the answer.
func TestRestartFoundInTheAnswer(t *testing.T) {
	srv := serveAt(t, loopbacktest.Addr(t), newFake(), server.Options{})
	var restarts atomic.Int32
	var c *remote.Client
	c = dial(t, remote.Options{
		Address:    srv.addr,
		MaxBackoff: 50 * time.Millisecond,
		OnRestart: func(ctx context.Context, prev, cur string) error {
			restarts.Add(1)
			return c.Load(ctx, "/ckpt/step_3")
		},
	})
	ctx := context.Background()
	if _, err := c.Train(ctx, batch("before")); err != nil {
		t.Fatal(err)
	}
	srv.stop()
	fresh := newFake()
	serveAt(t, srv.addr, fresh, server.Options{})
	if _, err := c.Train(ctx, batch("after")); err != nil {
		t.Fatal(err)
	}
	if n := restarts.Load(); n != 1 {
		t.Fatalf("OnRestart ran %d times before Train returned, want once", n)
	}
	// Either the call failed first and the client asked who answers before resending, or it
	// went through at once and the header told; either way the step that counts came after the
	// load.
	log := fresh.log()
	if len(log) < 2 || log[len(log)-2] != "load /ckpt/step_3" || log[len(log)-1] != "train after" {
		t.Errorf("the new process got %q; want the step applied after the load", log)
	}
	if got := c.Instance(); got == "" {
		t.Error("Instance is empty after the restart")
	}
}

// When OnRestart refuses the new process, the calls waiting for the engine fail with its error,
// and so does every later call: nothing is sampled or trained by an engine that lost its state.
func TestRefusedRestartStopsTheClient(t *testing.T) {
	old := newFake()
	defer old.hold("p")()
	srv := serveAt(t, loopbacktest.Addr(t), old, server.Options{})
	refusal := errors.New("no checkpoint of step 7 to load")
	c := dial(t, remote.Options{
		Address:    srv.addr,
		MaxBackoff: 50 * time.Millisecond,
		OnRestart:  func(context.Context, string, string) error { return refusal },
	})
	ctx := context.Background()
	done := make(chan error, 1)
	go func() {
		_, err := c.Generate(ctx, []engines.GenerateRequest{chat("p-1", "p", 1)})
		done <- err
	}()
	old.waitStarted(t, "p-1")
	srv.stop()
	fresh := newFake()
	serveAt(t, srv.addr, fresh, server.Options{})
	var err error
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the generate call did not end after the refused restart")
	}
	if !errors.Is(err, refusal) || !strings.Contains(err.Error(), "restarted as a new process") {
		t.Errorf("the waiting call: got %v, want an error wrapping OnRestart's", err)
	}
	if _, err := c.Train(ctx, batch("later")); !errors.Is(err, refusal) {
		t.Errorf("a later Train: got %v, want OnRestart's error", err)
	}
	if _, err := c.Generate(ctx, []engines.GenerateRequest{chat("q-1", "q", 1)}); !errors.Is(err, refusal) {
		t.Errorf("a later Generate: got %v, want OnRestart's error", err)
	}
	if log := fresh.log(); len(log) != 0 {
		t.Errorf("the refused process got %q; want nothing", log)
	}
}

// A caller that gives up gets a deadline error, and the server stops working on its request.
func TestDeadlineCancelsTheRemoteRequest(t *testing.T) {
	eng := newFake()
	defer eng.hold("forever")()
	c := dial(t, remote.Options{Address: serve(t, eng, server.Options{})})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := c.Generate(ctx, []engines.GenerateRequest{chat("f-1", "forever", 1)})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "generate (1 of 1 requests unanswered): no answer before the call's deadline") {
		t.Fatalf("got %v, want a deadline error that says what was unanswered", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		eng.mu.Lock()
		n := eng.canceled
		eng.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the engine kept sampling a request nobody waits for")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The stream is still usable.
	if _, err := c.Generate(context.Background(), []engines.GenerateRequest{chat("g-1", "go", 1)}); err != nil {
		t.Fatal(err)
	}
}

func TestUnreachableEngine(t *testing.T) {
	addr := serveAt(t, "127.0.0.1:0", newFake(), server.Options{})
	addr.stop() // a port where nothing listens any more
	start := time.Now()
	_, err := remote.Dial(context.Background(), remote.Options{Address: addr.addr, ReconnectTimeout: 300 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	if !errors.Is(err, remote.ErrUnavailable) || !strings.Contains(err.Error(), fmt.Sprintf("engine at %s is unreachable: health gave up after retrying", addr.addr)) {
		t.Fatalf("got %v, want an unreachable error naming the address", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("giving up took %v for a 300ms reconnect timeout", took)
	}
}

// GiveUpAt ends the wait for an unreachable engine at the time given, long before
// ReconnectTimeout: calls under way (a Save) and calls made after it (a Train) fail with
// ErrUnavailable, saying why. A stopping host sets it so that a dead server cannot hold up its
// exit for the reconnect timeout.
func TestGiveUpAtEndsTheWait(t *testing.T) {
	srv := serveAt(t, loopbacktest.Addr(t), newFake(), server.Options{})
	c := dial(t, remote.Options{Address: srv.addr, ReconnectTimeout: 10 * time.Minute})
	srv.stop()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- c.Save(context.Background(), "/ckpt/x") }()
	time.Sleep(300 * time.Millisecond) // the save is waiting for the engine (or about to)
	c.GiveUpAt(time.Now().Add(200 * time.Millisecond))
	c.GiveUpAt(time.Now().Add(time.Hour)) // a later time does not undo an earlier one
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the save still waits for the engine a minute after GiveUpAt")
	}
	if !errors.Is(err, remote.ErrUnavailable) || !strings.Contains(err.Error(), "its client stopped waiting for it") {
		t.Errorf("save: %v; want ErrUnavailable saying the client stopped waiting", err)
	}
	if _, err := c.Train(context.Background(), batch("after")); !errors.Is(err, remote.ErrUnavailable) {
		t.Errorf("train after GiveUpAt: %v; want ErrUnavailable at once", err)
	}
	if took := time.Since(start); took > time.Minute {
		t.Errorf("giving up took %v, for a reconnect timeout of 10m cut by GiveUpAt", took)
	}
}

func TestTokenChecks(t *testing.T) {
	addr := serve(t, newFake(), server.Options{Token: "s3cret"})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	t.Setenv("SLIMEN_TEST_TOKEN", "wrong")
	_, err := remote.Dial(ctx, remote.Options{Address: addr, TokenEnv: "SLIMEN_TEST_TOKEN"})
	want := fmt.Sprintf("engine at %s rejected the token from $SLIMEN_TEST_TOKEN: the bearer token does not match this engine server's", addr)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("wrong token: got %v\nwant %q", err, want)
	}

	_, err = remote.Dial(ctx, remote.Options{Address: addr})
	want = fmt.Sprintf("engine at %s rejected the token: this engine server requires a bearer token and the call carried none", addr)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("no token: got %v\nwant %q", err, want)
	}

	t.Setenv("SLIMEN_TEST_TOKEN", "")
	_, err = remote.Dial(ctx, remote.Options{Address: addr, TokenEnv: "SLIMEN_TEST_TOKEN"})
	if err == nil || !strings.Contains(err.Error(), "the token environment variable SLIMEN_TEST_TOKEN (engine.token_env) is empty or unset") {
		t.Errorf("empty token variable: got %v", err)
	}

	t.Setenv("SLIMEN_TEST_TOKEN", "s3cret")
	c := dial(t, remote.Options{Address: addr, TokenEnv: "SLIMEN_TEST_TOKEN"})
	if _, err := c.Generate(ctx, []engines.GenerateRequest{chat("t-1", "hi", 1)}); err != nil {
		t.Errorf("right token: %v", err)
	}

	// The token itself, as a program that holds it in memory gives it.
	c = dial(t, remote.Options{Address: addr, Token: "s3cret"})
	if _, err := c.Generate(ctx, []engines.GenerateRequest{chat("t-2", "hi", 1)}); err != nil {
		t.Errorf("right token in Options.Token: %v", err)
	}
	if _, err := remote.Dial(ctx, remote.Options{Address: addr, Token: "wrong"}); err == nil || !strings.Contains(err.Error(), "rejected the token: the bearer token does not match") {
		t.Errorf("wrong token in Options.Token: got %v", err)
	}
	if _, err := remote.Dial(ctx, remote.Options{Address: addr, Token: "s3cret", TokenEnv: "SLIMEN_TEST_TOKEN"}); err == nil || !strings.Contains(err.Error(), "set one") {
		t.Errorf("a token and a token variable: got %v", err)
	}
}

func TestPlaintextToNonLoopbackIsRefused(t *testing.T) {
	_, err := remote.Dial(context.Background(), remote.Options{Address: "10.1.2.3:7777"})
	want := "engine at 10.1.2.3:7777: refusing plaintext to a non-loopback address"
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "engine.insecure: true") {
		t.Errorf("got %v, want %q and how to allow it", err, want)
	}
}

func TestOversizedMessages(t *testing.T) {
	ctx := context.Background()
	big := batch("big")
	big.Samples[0].Prompt = make([]int32, 600_000) // 3-byte varints: ≈ 1.7 MiB on the wire
	for i := range big.Samples[0].Prompt {
		big.Samples[0].Prompt[i] = 1 << 20
	}

	// The client's own limit: refused before sending, saying which limit to raise.
	c := dial(t, remote.Options{Address: serve(t, newFake(), server.Options{}), MaxMessageBytes: 1 << 20})
	_, err := c.Train(ctx, big)
	if err == nil || !strings.Contains(err.Error(), "train: the request is 1.7 MiB, over the message limit of 1.0 MiB") {
		t.Errorf("over the client's limit: got %v", err)
	}
	long := chat("long", strings.Repeat("x", 2<<20), 1)
	_, err = c.Generate(ctx, []engines.GenerateRequest{long})
	if err == nil || !strings.Contains(err.Error(), `generate request "long": the request is 2.0 MiB, over the message limit of 1.0 MiB`) {
		t.Errorf("generate over the client's limit: got %v", err)
	}

	// The server's limit, lower than the client's.
	eng := newFake()
	c = dial(t, remote.Options{Address: serve(t, eng, server.Options{MaxMessageBytes: 1 << 20})})
	_, err = c.Train(ctx, big)
	if err == nil || !strings.Contains(err.Error(), "train: a message was over a size limit") || !strings.Contains(err.Error(), "--max-message-mb on the server") {
		t.Errorf("over the server's limit: got %v", err)
	}
	_, err = c.Generate(ctx, []engines.GenerateRequest{long})
	if err == nil || !strings.Contains(err.Error(), "generate: a message was over a size limit") {
		t.Errorf("generate over the server's limit: got %v", err)
	}
	if n := eng.count(eng.trained, "big"); n != 0 {
		t.Errorf("the oversized step was applied %d times", n)
	}
}

func TestEngineErrorsKeepTheirMeaning(t *testing.T) {
	eng := newFake()
	eng.failing["bad"] = "prompt too long for this model"
	c := dial(t, remote.Options{Address: serve(t, eng, server.Options{})})
	ctx := context.Background()
	_, err := c.Generate(ctx, []engines.GenerateRequest{chat("ok-1", "fine", 1), chat("bad-1", "bad", 1)})
	want := `generate request "bad-1": prompt too long for this model`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("got %v, want %q", err, want)
	}
	// The request that shared the failing one's batch was answered on its own.
	if got, err := c.Generate(ctx, []engines.GenerateRequest{chat("ok-1", "fine", 1)}); err != nil || got[0].Text != "fine→0" {
		t.Errorf("the good request: %+v, %v", got, err)
	}

	c = dial(t, remote.Options{Address: serve(t, noScore{newFake()}, server.Options{})})
	if _, err := c.Score(ctx, nil); !errors.Is(err, engines.ErrNotSupported) {
		t.Errorf("Score on an engine without it: got %v, want engines.ErrNotSupported", err)
	}
}

type noScore struct{ *fake }

func (noScore) Score(context.Context, []engines.ScoreRequest) ([]engines.Scores, error) {
	return nil, engines.ErrNotSupported
}
