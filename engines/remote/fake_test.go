package remote_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
)

// fake is an in-memory engine with canned, deterministic answers. It counts how often each
// request id is sampled and each step id trained, and can hold back requests by prompt text to
// play a slow generation.
type fake struct {
	started chan string // request ids as their sampling starts

	mu       sync.Mutex
	sampled  map[string]int           // request id → times sampled
	trained  map[string]int           // step id → times applied
	holds    map[string]chan struct{} // prompt → closed when the request may finish
	failing  map[string]string        // prompt → the error its request fails with
	canceled int                      // Generate calls that ended by their context
	saved    []string
	loaded   []string
	events   []string // "gen ID", "train ID", "load DIR", in the order they reached the engine
}

func newFake() *fake {
	return &fake{
		started: make(chan string, 1000),
		sampled: map[string]int{},
		trained: map[string]int{},
		holds:   map[string]chan struct{}{},
		failing: map[string]string{},
	}
}

// hold makes requests with this prompt wait until release is called.
func (f *fake) hold(prompt string) (release func()) {
	ch := make(chan struct{})
	f.mu.Lock()
	f.holds[prompt] = ch
	f.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func prompt(r engines.GenerateRequest) string {
	if len(r.Messages) > 0 {
		return r.Messages[len(r.Messages)-1].Content
	}
	return fmt.Sprint(r.PromptTokens)
}

func tokens(s string) []int32 {
	out := make([]int32, len(s))
	for i, b := range []byte(s) {
		out[i] = int32(b)
	}
	return out
}

func (f *fake) Info(context.Context) (engines.Info, error) {
	return engines.Info{
		Model: "fake", Architecture: "FakeForTests", VocabSize: 257, MaxSeqLen: 512,
		ChatTemplate: "{{ messages }}", EOSTokens: []int32{256}, Params: 42,
		Devices: []string{"cpu"}, Capabilities: []string{"generate", "score", "train"},
	}, nil
}

func (f *fake) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	var out []engines.Completion
	for _, r := range reqs {
		p := prompt(r)
		f.mu.Lock()
		f.sampled[r.ID]++
		f.events = append(f.events, "gen "+r.ID)
		hold, fail := f.holds[p], f.failing[p]
		f.mu.Unlock()
		select {
		case f.started <- r.ID:
		default: // nobody watches (a benchmark): don't block
		}
		if hold != nil {
			select {
			case <-hold:
			case <-ctx.Done():
				f.mu.Lock()
				f.canceled++
				f.mu.Unlock()
				return nil, ctx.Err()
			}
		}
		if fail != "" {
			return nil, errors.New(fail)
		}
		for i := range max(r.N, 1) {
			text := fmt.Sprintf("%s→%d", p, i)
			out = append(out, engines.Completion{
				RequestID:    r.ID,
				Index:        i,
				PromptTokens: tokens(p),
				Tokens:       append(tokens(text), 256),
				Logprobs:     []float32{-0.5, float32(-i)},
				Text:         text,
				FinishReason: "stop",
			})
		}
	}
	return out, nil
}

func (f *fake) Score(_ context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	out := make([]engines.Scores, len(reqs))
	for i, r := range reqs {
		for j := range r.Tokens {
			out[i].Logprobs = append(out[i].Logprobs, -float32(j)-0.5)
		}
	}
	return out, nil
}

func (f *fake) Train(_ context.Context, b engines.Batch) (engines.TrainStats, error) {
	f.mu.Lock()
	f.trained[b.ID]++
	f.events = append(f.events, "train "+b.ID)
	f.mu.Unlock()
	n := 0
	for _, s := range b.Samples {
		n += len(s.Response)
	}
	return engines.TrainStats{Loss: 0.25 * float64(n), PGLoss: 0.2, KL: 0.01, ClipFrac: 0.1, Entropy: 1.5, GradNorm: 3, Tokens: n}, nil
}

func (f *fake) Tokenize(_ context.Context, texts []string) ([][]int32, error) {
	out := make([][]int32, len(texts))
	for i, t := range texts {
		out[i] = tokens(t)
	}
	return out, nil
}

func (f *fake) Save(_ context.Context, dir string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.saved = append(f.saved, dir)
	return nil
}

func (f *fake) Load(_ context.Context, dir string) error {
	if strings.Contains(dir, "missing") {
		return fmt.Errorf("load %s: no such checkpoint", dir)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.loaded = append(f.loaded, dir)
	f.events = append(f.events, "load "+dir)
	return nil
}

func (f *fake) Close() error { return nil }

// log returns what reached the engine so far, in order.
func (f *fake) log() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.events...)
}

func (f *fake) count(m map[string]int, id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return m[id]
}

// waitStarted waits until the engine has started sampling request id.
func (f *fake) waitStarted(t *testing.T, id string) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case got := <-f.started:
			if got == id {
				return
			}
		case <-timeout:
			t.Fatalf("request %q never reached the engine", id)
		}
	}
}

// serve starts a server for eng on a free loopback port and returns its address.
func serve(t testing.TB, eng engines.Engine, opts server.Options) string {
	t.Helper()
	return serveAt(t, "127.0.0.1:0", eng, opts).addr
}

type running struct {
	addr string
	stop func()
}

func serveAt(t testing.TB, addr string, eng engines.Engine, opts server.Options) running {
	t.Helper()
	if opts.Roots == nil {
		opts.Roots = []string{"/ckpt"} // the folders the tests save and load (the fake writes nothing)
	}
	l, err := server.Listen(addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	s := server.New(eng, opts)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return running{addr: l.Addr().String(), stop: s.Stop}
}

func dial(t testing.TB, opts remote.Options) *remote.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := remote.Dial(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}
