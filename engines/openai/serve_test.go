package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
)

func openTiny(t testing.TB) *tiny.Engine {
	t.Helper()
	e, err := tiny.Open("builtin:tiny-arith", tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// front serves eng on a loopback httptest server and returns its API root.
func front(t testing.TB, eng engines.Engine, o HandlerOptions) string {
	t.Helper()
	h, err := NewHandler(context.Background(), eng, o)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s.URL + "/v1"
}

// The client talking to the front of the tiny engine gets what the tiny engine samples when
// called directly: the same prompt and response token ids, the same log-probabilities bit for
// bit, text and finish reasons, for chat and token-id prompts, several samples, stop strings and
// a seed with its top bit set.
func TestRoundTripTiny(t *testing.T) {
	ctx := context.Background()
	tn := openTiny(t)
	tok := tn.Tokenizer()
	c, err := Open(ctx, Options{BaseURL: front(t, tn, HandlerOptions{Token: "sk-test"}), Model: "builtin:tiny-arith", APIKey: "sk-test"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	reqs := []engines.GenerateRequest{
		{ID: "chat", Messages: []engines.Message{{Role: "user", Content: "12+30="}}, N: 3,
			Sampling: engines.Sampling{MaxTokens: 12, Temperature: 1, Seed: 7}},
		{ID: "tokens", PromptTokens: tok.Encode("<|user|>7*6=<|end|><|assistant|>"), N: 2,
			Sampling: engines.Sampling{MaxTokens: 10, Temperature: 0.8, TopP: 0.9, Seed: 1<<63 + 5}},
		{ID: "greedy", Messages: []engines.Message{{Role: "system", Content: "add"}, {Role: "user", Content: "1+1="}},
			Sampling: engines.Sampling{MaxTokens: 6, Seed: 1}},
		{ID: "stop", PromptTokens: tok.Encode("<|user|>99+1=<|end|><|assistant|>"), N: 2,
			Sampling: engines.Sampling{MaxTokens: 12, Temperature: 1.2, Stop: []string{"0", "}"}, Seed: 11}},
	}
	want, err := tn.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("through the front:\n%+v\ndirect:\n%+v", got, want)
	}
	sawStop := false
	for _, w := range want {
		sawStop = sawStop || (w.RequestID == "stop" && w.FinishReason == "stop" && tok.Decode(w.Tokens) != w.Text)
	}
	if !sawStop {
		t.Fatalf("no sample of the stop request ended on a stop string, so the case checks less than it should: %+v", want)
	}

	ids, err := c.Tokenize(ctx, []string{"<|user|>3+4"})
	if err != nil || fmt.Sprint(ids[0]) != fmt.Sprint(tok.Encode("<|user|>3+4")) {
		t.Fatalf("tokenize through the front: %v, %v", ids, err)
	}
	info, _ := c.Info(ctx)
	tinfo, _ := tn.Info(ctx)
	if fmt.Sprint(info.Capabilities) != "[generate token_ids logprobs]" || info.MaxSeqLen != tinfo.MaxSeqLen || info.MaxSeqLen == 0 {
		t.Fatalf("info through the front %+v; the tiny engine's context length is %d", info, tinfo.MaxSeqLen)
	}
}

func post(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// What a plain OpenAI client sees: the response shapes, a streamed chat, text prompts and the
// error JSON.
func TestFrontShapes(t *testing.T) {
	tn := openTiny(t)
	base := front(t, tn, HandlerOptions{Decode: func(id int32) string { return tn.Tokenizer().Decode([]int32{id}) }})
	ctx := context.Background()
	direct, err := tn.Generate(ctx, []engines.GenerateRequest{{Messages: []engines.Message{{Role: "user", Content: "2+3="}}, N: 2,
		Sampling: engines.Sampling{MaxTokens: 8, Temperature: 1, TopP: 1, Seed: 42}}})
	if err != nil {
		t.Fatal(err)
	}

	// A plain chat request: text, token strings of the model's vocabulary, usage.
	status, body := post(t, base+"/chat/completions", `{"model":"builtin:tiny-arith","messages":[{"role":"user","content":[{"type":"text","text":"2+"},{"type":"text","text":"3="}]}],
		"n":2,"max_tokens":8,"seed":42,"logprobs":true}`)
	var chat chatResponse
	if status != 200 || json.Unmarshal([]byte(body), &chat) != nil || len(chat.Choices) != 2 {
		t.Fatalf("chat: %d %s", status, body)
	}
	for i, ch := range chat.Choices {
		d := direct[i]
		if *ch.Message.Content != d.Text || *ch.FinishReason != d.FinishReason || len(ch.Logprobs.Content) != len(d.Tokens) || ch.TokenIDs != nil {
			t.Fatalf("choice %d: %s\ndirect %+v", i, body, d)
		}
		for k, lp := range ch.Logprobs.Content {
			if lp.Token != tn.Tokenizer().Decode(d.Tokens[k:k+1]) || float32(lp.Logprob) != d.Logprobs[k] {
				t.Fatalf("choice %d token %d: %+v; direct %d %v", i, k, lp, d.Tokens[k], d.Logprobs[k])
			}
		}
	}
	if chat.Usage.PromptTokens != len(direct[0].PromptTokens) || chat.Usage.CompletionTokens != len(direct[0].Tokens)+len(direct[1].Tokens) || chat.Object != "chat.completion" {
		t.Fatalf("usage %+v in %s", chat.Usage, body)
	}

	// The same streamed: a role chunk per choice, the content in deltas as the engine samples it,
	// a chunk with the rest and the token ids and a finish chunk per choice, usage, [DONE].
	resp, err := http.Post(base+"/chat/completions", "application/json", strings.NewReader(`{"messages":[{"role":"user","content":"2+3="}],
		"n":2,"max_tokens":8,"seed":42,"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	text, ids, finish := map[int]string{}, map[int][]int32{}, map[int]string{}
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		events = append(events, line)
		if line == "[DONE]" {
			break
		}
		var chunk chatResponse
		if err := json.Unmarshal([]byte(line), &chunk); err != nil || chunk.Object != "chat.completion.chunk" {
			t.Fatalf("chunk %s: %v", line, err)
		}
		for _, ch := range chunk.Choices {
			if ch.Delta.Content != nil {
				text[ch.Index] += *ch.Delta.Content
			}
			ids[ch.Index] = append(ids[ch.Index], ch.TokenIDs...)
			if ch.FinishReason != nil {
				finish[ch.Index] = *ch.FinishReason
			}
		}
		if chunk.Usage != nil && chunk.Usage.CompletionTokens != len(direct[0].Tokens)+len(direct[1].Tokens) {
			t.Fatalf("usage chunk %s", line)
		}
	}
	if len(events) <= 2+2*2+1+1 || events[len(events)-1] != "[DONE]" || !strings.Contains(events[len(events)-2], `"usage"`) {
		t.Fatalf("events:\n%s", strings.Join(events, "\n"))
	}
	for i, d := range direct {
		if text[i] != d.Text || fmt.Sprint(ids[i]) != fmt.Sprint(d.Tokens) || finish[i] != d.FinishReason {
			t.Fatalf("streamed choice %d: %q %v %q; direct %+v", i, text[i], ids[i], finish[i], d)
		}
	}

	// Text completions of a string prompt and a list of prompts: choices index prompt·n + sample.
	status, body = post(t, base+"/completions", `{"prompt":["<|user|>2+3=<|end|><|assistant|>", [3,4,5]],"n":2,"max_tokens":4,"seed":9,"logprobs":0,"return_token_ids":true,"return_tokens_as_token_ids":true}`)
	var cmpl completionResponse
	if status != 200 || json.Unmarshal([]byte(body), &cmpl) != nil || len(cmpl.Choices) != 4 {
		t.Fatalf("completions: %d %s", status, body)
	}
	for _, ch := range cmpl.Choices {
		wantPrompt := "[3 4 5]"
		if ch.Index < 2 {
			wantPrompt = fmt.Sprint(tn.Tokenizer().Encode("<|user|>2+3=<|end|><|assistant|>"))
		}
		if fmt.Sprint(ch.PromptTokenIDs) != wantPrompt || len(ch.Logprobs.Tokens) != len(ch.TokenIDs) || ch.Logprobs.Tokens[0] != tokenIDString(ch.TokenIDs[0]) {
			t.Fatalf("choice %d: %s", ch.Index, body)
		}
	}

	// Errors in the API's JSON: status, type, param, a message that says what to do.
	for _, tc := range []struct {
		path, body string
		status     int
		param      string
		msg        string
	}{
		{"/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`, 404, "model", `the model "gpt-4o" does not exist; this server serves "builtin:tiny-arith"`},
		{"/chat/completions", `{"messages":[]}`, 400, "messages", "messages is empty"},
		{"/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"temperature":-1}`, 400, "", "temperature -1; want a finite value ≥ 0"},
		{"/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":5}`, 400, "top_logprobs", "sampled token's log-prob only"},
		{"/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}`, 400, "tools", "tools are not supported"},
		{"/chat/completions", `{"messages":`, 400, "", "not the JSON expected"},
		{"/completions", `{"prompt":"1+1=","logprobs":5}`, 400, "logprobs", "send logprobs 0"},
		{"/completions", `{"prompt":[]}`, 400, "", "prompt"},
		{"/embeddings", `{}`, 404, "", "no such endpoint: POST /v1/embeddings"},
	} {
		status, body := post(t, base+tc.path, tc.body)
		var eb errorBody
		if status != tc.status || json.Unmarshal([]byte(body), &eb) != nil || !strings.Contains(eb.Error.Message, tc.msg) ||
			(tc.param != "" && (eb.Error.Param == nil || *eb.Error.Param != tc.param)) || eb.Error.Type == "" {
			t.Errorf("%s %s: %d %s", tc.path, tc.body, status, body)
		}
	}
	resp2, err := http.Get(base + "/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp2.Body)
	resp2.Body.Close()
	if !strings.Contains(string(b), `"data":[{"id":"builtin:tiny-arith","object":"model"`) {
		t.Fatalf("models: %s", b)
	}
}

// A front with a token refuses a request without it, in the API's words.
func TestFrontToken(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{Token: "sk-right"})
	_, err := Open(context.Background(), Options{BaseURL: base, Model: "builtin:tiny-arith", APIKey: "sk-wrong"})
	if err == nil || !strings.Contains(err.Error(), "HTTP 401") || !strings.Contains(err.Error(), "--token-env") {
		t.Fatalf("a wrong key: %v", err)
	}
}

// failing is an engine whose Generate fails.
type failing struct{ engines.Engine }

func (failing) Generate(context.Context, []engines.GenerateRequest) ([]engines.Completion, error) {
	return nil, fmt.Errorf("the GPU caught fire")
}

// An engine failure is a 500 in the API's error JSON, or, once a stream has begun, an error event
// before [DONE] (which the openai client raises).
func TestFrontEngineFailure(t *testing.T) {
	base := front(t, failing{openTiny(t)}, HandlerOptions{})
	status, body := post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
	var eb errorBody
	if status != 500 || json.Unmarshal([]byte(body), &eb) != nil || eb.Error.Message != "the GPU caught fire" || eb.Error.Type != "server_error" {
		t.Fatalf("%d %s", status, body)
	}
	status, body = post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true}`)
	events := strings.Split(strings.TrimSpace(body), "\n\n")
	if status != 200 || len(events) != 3 || !strings.Contains(events[0], `"role":"assistant"`) ||
		events[1] != `data: {"error":{"message":"the GPU caught fire","type":"server_error","param":null,"code":null}}` || events[2] != "data: [DONE]" {
		t.Fatalf("%d %q", status, events)
	}
}
