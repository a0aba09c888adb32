package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
)

// okChat is a vLLM-style chat answer with token ids for one sample.
const okChat = `{"id":"c","object":"chat.completion","created":1,"model":"m","prompt_token_ids":[1,2],
"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop","token_ids":[5,6],
"logprobs":{"content":[{"token":"token_id:5","logprob":-0.5,"bytes":[],"top_logprobs":[]},{"token":"token_id:6","logprob":-0.25,"bytes":[],"top_logprobs":[]}]}}]}`

func chatReq(id string) engines.GenerateRequest {
	return engines.GenerateRequest{ID: id, Messages: []engines.Message{{Role: "user", Content: "2+2?"}},
		Sampling: engines.Sampling{MaxTokens: 8, Temperature: 1, Seed: 3}}
}

// fakeServer answers every request with reply(attempt, w, r), attempt counting from 0.
func fakeServer(t *testing.T, reply func(attempt int, w http.ResponseWriter, r *http.Request)) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reply(int(n.Add(1)-1), w, r)
	}))
	t.Cleanup(s.Close)
	return s, &n
}

func newEngine(t *testing.T, o Options) *Engine {
	t.Helper()
	if o.Model == "" {
		o.Model = "m"
	}
	if o.MinBackoff == 0 {
		o.MinBackoff, o.MaxBackoff = time.Millisecond, 5*time.Millisecond
	}
	e, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func TestRetryAfter429(t *testing.T) {
	for _, tc := range []struct {
		header, value string
		want          time.Duration
	}{{"Retry-After-Ms", "150", 150 * time.Millisecond}, {"Retry-After", "1", time.Second}} {
		t.Run(tc.header, func(t *testing.T) {
			var first time.Time
			var gap time.Duration
			s, n := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
				if attempt == 0 {
					first = time.Now()
					w.Header().Set(tc.header, tc.value)
					w.WriteHeader(http.StatusTooManyRequests)
					io.WriteString(w, `{"error":{"message":"slow down","type":"rate_limit"}}`)
					return
				}
				gap = time.Since(first)
				io.WriteString(w, okChat)
			})
			e := newEngine(t, Options{BaseURL: s.URL + "/v1"})
			cs, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
			if err != nil {
				t.Fatal(err)
			}
			if n.Load() != 2 || gap < tc.want || gap > tc.want+2*time.Second {
				t.Fatalf("%d attempts, %s apart; want 2, %s apart (the backoff alone is ≤ 5ms)", n.Load(), gap, tc.want)
			}
			if cs[0].Text != "hi" {
				t.Fatalf("completion %+v", cs[0])
			}
		})
	}
}

func TestRetryServerErrorThenSuccess(t *testing.T) {
	s, n := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		if attempt < 2 {
			http.Error(w, "boom", http.StatusInternalServerError+attempt*3) // 500, then 503
			return
		}
		io.WriteString(w, okChat)
	})
	e := newEngine(t, Options{BaseURL: s.URL + "/v1"})
	cs, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
	if err != nil || n.Load() != 3 {
		t.Fatalf("after %d attempts: %v", n.Load(), err)
	}
	want := engines.Completion{RequestID: "a", PromptTokens: []int32{1, 2}, Tokens: []int32{5, 6}, Logprobs: []float32{-0.5, -0.25}, Text: "hi", FinishReason: "stop"}
	if fmt.Sprint(cs) != fmt.Sprint([]engines.Completion{want}) {
		t.Fatalf("got %+v\nwant %+v", cs, want)
	}

	// Retries run out: the last status is reported with the server's message and the count.
	s2, n2 := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadGateway)
		io.WriteString(w, `{"error":{"message":"upstream down"}}`)
	})
	e2 := newEngine(t, Options{BaseURL: s2.URL + "/v1", MaxRetries: 2})
	_, err = e2.Generate(context.Background(), []engines.GenerateRequest{chatReq("b")})
	want2 := fmt.Sprintf("openai engine at %s/v1: POST chat/completions: HTTP 502 Bad Gateway: upstream down (after 2 retries)", s2.URL)
	if err == nil || !strings.Contains(err.Error(), want2) || n2.Load() != 3 {
		t.Fatalf("after %d attempts: %v\nwant %s", n2.Load(), err, want2)
	}
}

func TestTimeoutOfAHangingServer(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	s, n := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", Timeout: 100 * time.Millisecond, MaxRetries: 1})
	began := time.Now()
	_, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
	if err == nil || !strings.Contains(err.Error(), s.URL) || !strings.Contains(err.Error(), "no complete answer within the timeout of 100ms") ||
		!strings.Contains(err.Error(), "after 1 retries") || n.Load() != 2 {
		t.Fatalf("after %d attempts: %v", n.Load(), err)
	}
	if d := time.Since(began); d > 3*time.Second {
		t.Fatalf("took %s", d)
	}

	// The caller's context ends the call too, and is named as the cause.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	e2 := newEngine(t, Options{BaseURL: s.URL + "/v1"})
	_, err = e2.Generate(ctx, []engines.GenerateRequest{chatReq("b")})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a call whose context ends: %v", err)
	}
}

func TestMalformedAnswers(t *testing.T) {
	for _, tc := range []struct {
		name, body, want string
	}{
		{"not JSON", `{"choices": [`, "the server's answer is not the JSON expected"},
		{"too few choices", `{"choices": []}`, "the server answered 0 choices for n = 1"},
		{"no message", `{"choices": [{"index": 0}]}`, "choice 0 has no message"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, n := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) { io.WriteString(w, tc.body) })
			e := newEngine(t, Options{BaseURL: s.URL + "/v1"})
			_, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "openai engine at "+s.URL+"/v1") || n.Load() != 1 {
				t.Fatalf("after %d attempts: %v", n.Load(), err)
			}
		})
	}
	// A client error is not retried, and says what to check.
	s, n := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"error":{"message":"Incorrect API key provided"}}`)
	})
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", APIKey: "k"})
	_, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
	if err == nil || !strings.Contains(err.Error(), "HTTP 401 Unauthorized: Incorrect API key provided; check the API key (engine.api_key_env)") || n.Load() != 1 {
		t.Fatalf("after %d attempts: %v", n.Load(), err)
	}
}

// A connection refused is retried: a server that comes up within the retries is used.
func TestRetryConnectionRefused(t *testing.T) {
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, okChat) }))
	addr := s.Listener.Addr().String()
	s.Listener.Close()
	e := newEngine(t, Options{BaseURL: "http://" + addr + "/v1", MaxRetries: 1})
	_, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq("a")})
	if err == nil || !strings.Contains(err.Error(), "openai engine at http://"+addr+"/v1: POST chat/completions:") || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a server that is down: %v", err)
	}
}

// The requests of one Generate run in parallel, never more than MaxConcurrency at once, and
// come back in request order.
func TestConcurrencyCap(t *testing.T) {
	var mu sync.Mutex
	in, peak := 0, 0
	s, _ := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		var req chatRequest
		json.NewDecoder(r.Body).Decode(&req)
		mu.Lock()
		in++
		peak = max(peak, in)
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		in--
		mu.Unlock()
		fmt.Fprintf(w, `{"choices":[{"index":0,"message":{"content":%q},"finish_reason":"length"}]}`, req.Messages[0].Content)
	})
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", MaxConcurrency: 3})
	var reqs []engines.GenerateRequest
	for i := range 12 {
		r := chatReq(fmt.Sprint(i))
		r.Messages[0].Content = fmt.Sprint("q", i)
		reqs = append(reqs, r)
	}
	cs, err := e.Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cs {
		if c.Text != fmt.Sprint("q", i) || c.RequestID != fmt.Sprint(i) || c.FinishReason != "length" || c.Tokens != nil || c.Logprobs != nil {
			t.Fatalf("completion %d: %+v", i, c)
		}
	}
	if peak != 3 {
		t.Fatalf("%d requests in flight at most; want the cap, 3", peak)
	}
}

// A server that refuses vLLM's fields by name (the OpenAI API does) is asked without them from
// then on, and its completions are text only; token ids written "token_id:N" in log-probs are
// read when token_ids is missing.
func TestTokenIDFields(t *testing.T) {
	var plainAsks atomic.Int64
	s, _ := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		var req map[string]any
		json.NewDecoder(r.Body).Decode(&req)
		if _, ok := req["return_token_ids"]; ok {
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"Unrecognized request argument supplied: return_token_ids","type":"invalid_request_error"}}`)
			return
		}
		plainAsks.Add(1)
		io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"4"},"finish_reason":"stop"}]}`)
	})
	var logged []string
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }})
	for i := range 2 {
		cs, err := e.Generate(context.Background(), []engines.GenerateRequest{chatReq(fmt.Sprint(i))})
		if err != nil || cs[0].Text != "4" || cs[0].Tokens != nil {
			t.Fatalf("call %d: %+v, %v", i, cs, err)
		}
	}
	if plainAsks.Load() != 2 || len(logged) != 1 || !strings.Contains(logged[0], "completions are text only") {
		t.Fatalf("%d plain asks; logged %q", plainAsks.Load(), logged)
	}
	if info, _ := e.Info(context.Background()); fmt.Sprint(info.Capabilities) != "[generate]" {
		t.Fatalf("capabilities %v", info.Capabilities)
	}

	// Text completions: ids from "token_id:N" log-prob tokens.
	s2, _ := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		var req completionRequest
		json.NewDecoder(r.Body).Decode(&req)
		if r.URL.Path != "/v1/completions" || len(req.Prompt) != 1 || fmt.Sprint(req.Prompt[0].ids) != "[7 8 9]" || req.Logprobs == nil || *req.Logprobs != 0 || *req.Seed != -1 {
			http.Error(w, fmt.Sprintf("unexpected request %s %+v", r.URL.Path, req), http.StatusBadRequest)
			return
		}
		io.WriteString(w, `{"choices":[{"index":1,"text":"b","finish_reason":"length","logprobs":{"tokens":["token_id:4"],"token_logprobs":[-2],"top_logprobs":null,"text_offset":[0]}},
		{"index":0,"text":"a","finish_reason":"stop","logprobs":{"tokens":["token_id:3","token_id:0"],"token_logprobs":[-1,-0.5],"top_logprobs":null,"text_offset":[0,1]}}]}`)
	})
	e2 := newEngine(t, Options{BaseURL: s2.URL + "/v1"})
	r := engines.GenerateRequest{ID: "t", PromptTokens: []int32{7, 8, 9}, N: 2, Sampling: engines.Sampling{MaxTokens: 4, Seed: 1<<64 - 1}}
	cs, err := e2.Generate(context.Background(), []engines.GenerateRequest{r})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(cs); got != "[{t 0 [7 8 9] [3 0] [-1 -0.5] a stop []} {t 1 [7 8 9] [4] [-2] b length []}]" {
		t.Fatalf("got %s", got)
	}
	if info, _ := e2.Info(context.Background()); fmt.Sprint(info.Capabilities) != "[generate token_ids logprobs]" {
		t.Fatalf("capabilities %v", info.Capabilities)
	}
}

func TestUnsupportedAndOpen(t *testing.T) {
	s, _ := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" || r.Header.Get("Authorization") != "Bearer sk-1" {
			http.Error(w, `{"error":{"message":"no"}}`, http.StatusNotFound)
			return
		}
		io.WriteString(w, `{"object":"list","data":[{"id":"judge","object":"model","max_model_len":4096},{"id":"other","object":"model"}]}`)
	})
	ctx := context.Background()
	if _, err := Open(ctx, Options{BaseURL: s.URL + "/v1", Model: "jugde", APIKey: "sk-1"}); err == nil ||
		!strings.Contains(err.Error(), `does not serve model "jugde"; its /v1/models lists: judge, other`) {
		t.Fatalf("a wrong model: %v", err)
	}
	if _, err := Open(ctx, Options{BaseURL: s.URL, Model: "judge", APIKey: "sk-1"}); err == nil ||
		!strings.Contains(err.Error(), "HTTP 404 Not Found") || !strings.Contains(err.Error(), "ends in /v1") {
		t.Fatalf("a base_url without /v1: %v", err)
	}
	e, err := Open(ctx, Options{BaseURL: s.URL + "/v1/", Model: "judge", APIKey: "sk-1"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	info, _ := e.Info(ctx)
	if info.MaxSeqLen != 4096 || info.Model != "judge" {
		t.Fatalf("info %+v", info)
	}
	_, err = e.Train(ctx, engines.Batch{})
	if !errors.Is(err, engines.ErrNotSupported) || !strings.Contains(err.Error(), "train") || !strings.Contains(err.Error(), s.URL) {
		t.Fatalf("train: %v", err)
	}
	if _, err := e.Score(ctx, nil); !errors.Is(err, engines.ErrNotSupported) {
		t.Fatalf("score: %v", err)
	}
	if err := e.Save(ctx, t.TempDir()); !errors.Is(err, engines.ErrNotSupported) {
		t.Fatalf("save: %v", err)
	}
	if _, err := e.Tokenize(ctx, []string{"x"}); !errors.Is(err, engines.ErrNotSupported) {
		t.Fatalf("tokenize on a server without /tokenize: %v", err)
	}
	for _, o := range []Options{{BaseURL: "127.0.0.1:8000", Model: "m"}, {BaseURL: "http://h/v1"}, {BaseURL: "http://h/v1", Model: "m", TokenIDs: "yes"}} {
		if _, err := New(o); err == nil {
			t.Fatalf("New(%+v) accepted", o)
		}
	}
	if _, err := e.Generate(ctx, []engines.GenerateRequest{{ID: "x", Sampling: engines.Sampling{MaxTokens: 1}}}); err == nil ||
		!strings.Contains(err.Error(), "exactly one of messages and prompt tokens") {
		t.Fatalf("a request without a prompt: %v", err)
	}
}

// A Generate that fails part-way, or whose caller has gone, gives back every slot of the concurrency cap: the next calls
// still run.
func TestFailedGenerateFreesTheCap(t *testing.T) {
	s, _ := fakeServer(t, func(attempt int, w http.ResponseWriter, r *http.Request) {
		var req chatRequest
		json.NewDecoder(r.Body).Decode(&req)
		if req.Messages[0].Content == "bad" {
			http.Error(w, `{"error":{"message":"bad prompt"}}`, http.StatusBadRequest)
			return
		}
		io.WriteString(w, okChat)
	})
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", MaxConcurrency: 1})
	bad := chatReq("bad")
	bad.Messages[0].Content = "bad"
	gone, cancelGone := context.WithCancel(context.Background())
	cancelGone()
	for i := range 30 {
		if _, err := e.Generate(context.Background(), []engines.GenerateRequest{bad, chatReq("a"), chatReq("b")}); err == nil || !strings.Contains(err.Error(), "bad prompt") {
			t.Fatalf("call %d: %v", i, err)
		}
		// A caller that has gone: a free slot and an ended context are both ready.
		if _, err := e.Generate(gone, []engines.GenerateRequest{chatReq("x")}); !errors.Is(err, context.Canceled) {
			t.Fatalf("call %d with an ended context: %v", i, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := e.Generate(ctx, []engines.GenerateRequest{chatReq("c")})
		cancel()
		if err != nil {
			t.Fatalf("after failed call %d: %v", i, err)
		}
	}
}

func TestRetryAfterHeader(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		h    http.Header
		want time.Duration
	}{
		{http.Header{"Retry-After": {"2"}}, 2 * time.Second},
		{http.Header{"Retry-After": {"0.5"}}, 500 * time.Millisecond},
		{http.Header{"Retry-After": {now.Add(7 * time.Second).Format(http.TimeFormat)}}, 7 * time.Second},
		{http.Header{"Retry-After": {now.Add(-time.Second).Format(http.TimeFormat)}}, 0},
		{http.Header{"Retry-After": {"soon"}}, 0},
		{http.Header{"Retry-After-Ms": {"250"}, "Retry-After": {"9"}}, 250 * time.Millisecond},
		{http.Header{}, 0},
	} {
		if got := retryAfter(tc.h, now); got != tc.want {
			t.Errorf("%v: %s; want %s", tc.h, got, tc.want)
		}
	}
}

// TestMaxCompletionTokens: a server that refuses max_tokens by name (OpenAI's reasoning models:
// "Unsupported parameter: 'max_tokens' … Use 'max_completion_tokens' instead.") is asked again
// with max_completion_tokens, once, and the engine remembers; MaxTokensField
// "max_completion_tokens" sends it from the start. Another 400 is not retried, and its error
// carries the server's message.
func TestMaxCompletionTokens(t *testing.T) {
	var mu sync.Mutex
	var sent []string
	s, _ := fakeServer(t, func(_ int, w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		json.NewDecoder(r.Body).Decode(&body)
		field := "max_tokens"
		if _, ok := body["max_completion_tokens"]; ok {
			field = "max_completion_tokens"
		}
		mu.Lock()
		sent = append(sent, field)
		mu.Unlock()
		if body["messages"].([]any)[0].(map[string]any)["content"] == "bad" {
			w.WriteHeader(400)
			fmt.Fprint(w, `{"error":{"message":"Invalid 'messages[0].content': too bad.","type":"invalid_request_error","param":"messages","code":null}}`)
			return
		}
		if field == "max_tokens" {
			w.WriteHeader(400)
			fmt.Fprint(w, `{"error":{"message":"Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.","type":"invalid_request_error","param":"max_tokens","code":"unsupported_parameter"}}`)
			return
		}
		if body["max_completion_tokens"].(float64) != 8 {
			w.WriteHeader(500)
			return
		}
		fmt.Fprint(w, okChat)
	})
	ctx := context.Background()
	e := newEngine(t, Options{BaseURL: s.URL + "/v1", TokenIDs: "none"})
	for i := range 2 {
		if _, err := e.Generate(ctx, []engines.GenerateRequest{chatReq("a")}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if fmt.Sprint(sent) != "[max_tokens max_completion_tokens max_completion_tokens]" {
		t.Fatalf("sent %v; want max_tokens once, then max_completion_tokens", sent)
	}
	sent = nil
	bad := chatReq("b")
	bad.Messages[0].Content = "bad"
	_, err := e.Generate(ctx, []engines.GenerateRequest{bad})
	if err == nil || !strings.Contains(err.Error(), "HTTP 400 Bad Request: Invalid 'messages[0].content': too bad.") || len(sent) != 1 {
		t.Fatalf("a 400: %v after %d attempts; want the server's message after one", err, len(sent))
	}
	sent = nil
	e2 := newEngine(t, Options{BaseURL: s.URL + "/v1", TokenIDs: "none", MaxTokensField: "max_completion_tokens"})
	if _, err := e2.Generate(ctx, []engines.GenerateRequest{chatReq("c")}); err != nil || fmt.Sprint(sent) != "[max_completion_tokens]" {
		t.Fatalf("max_tokens_field max_completion_tokens: sent %v, %v", sent, err)
	}
	if _, err := New(Options{BaseURL: s.URL + "/v1", Model: "m", MaxTokensField: "max_length"}); err == nil || !strings.Contains(err.Error(), "max_tokens_field \"max_length\"") {
		t.Fatalf("a wrong max_tokens_field: %v", err)
	}
}
