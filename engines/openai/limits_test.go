package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
)

// apiError reads an error answer; it fails the test unless the answer is the API's error JSON
// with this status.
func wantError(t *testing.T, what string, status int, body string, wantStatus int, param, code, msg string) {
	t.Helper()
	var eb errorBody
	if err := json.Unmarshal([]byte(body), &eb); status != wantStatus || err != nil {
		t.Errorf("%s: %d %s; want %d", what, status, body, wantStatus)
		return
	}
	gotParam := ""
	if eb.Error.Param != nil {
		gotParam = *eb.Error.Param
	}
	gotCode, _ := eb.Error.Code.(string)
	if gotParam != param || gotCode != code || !strings.Contains(eb.Error.Message, msg) || eb.Error.Type == "" {
		t.Errorf("%s: %s; want param %q, code %q and a message saying %q", what, body, param, code, msg)
	}
}

// TestFrontClientMistakes: a client's mistake is a 400 in the API's error JSON, never a 500 or a
// dropped connection: a prompt past the context (code context_length_exceeded, chat and token
// prompts), max_tokens past the context or any integer range (2^63-1 panicked the handler;
// 4294967299 wrapped to 3 tokens through a remote engine), token ids outside the vocabulary, an
// empty token prompt.
func TestFrontClientMistakes(t *testing.T) {
	base := front(t, openTiny(t), HandlerOptions{})
	long := strings.Repeat("1+", 300) // 600 tokens: past tiny-arith's 512
	ids := make([]string, 600)
	for i := range ids {
		ids[i] = "10"
	}
	for _, tc := range []struct {
		name, path, body  string
		param, code, text string
	}{
		{"chat past the context", "/chat/completions", `{"messages":[{"role":"user","content":"` + long + `"}]}`, "messages", "context_length_exceeded", "maximum context length is 512 tokens"},
		{"max_tokens beside the prompt", "/chat/completions", `{"messages":[{"role":"user","content":"` + strings.Repeat("1", 100) + `"}],"max_tokens":500}`, "max_tokens", "context_length_exceeded", "you requested 603 tokens (103 in the messages, 500 in the completion)"},
		{"max_tokens 2^63-1", "/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":9223372036854775807}`, "max_tokens", "", "more than the model's context length of 512"},
		{"max_tokens past 2^32", "/completions", `{"prompt":[5,6],"max_tokens":4294967299}`, "max_tokens", "", "more than the model's context length of 512"},
		{"max_completion_tokens 0", "/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}`, "max_completion_tokens", "", "want at least 1"},
		{"token prompt past the context", "/completions", `{"prompt":[` + strings.Join(ids, ",") + `]}`, "prompt", "context_length_exceeded", "your prompt resulted in 600 tokens"},
		{"token outside the vocabulary", "/completions", `{"prompt":[[5,6],[7,100000]]}`, "prompt", "", "prompt 1: token id 100000 at index 1 is outside the model's vocabulary"},
		{"negative token", "/completions", `{"prompt":[5,-1]}`, "prompt", "", "token id -1 at index 1"},
		{"empty token prompt", "/completions", `{"prompt":[[5],[]]}`, "prompt", "", "prompt 1 is empty"},
	} {
		status, body := post(t, base+tc.path, tc.body)
		wantError(t, tc.name, status, body, 400, tc.param, tc.code, tc.text)
	}
	// Within the context, the default max_tokens is cut to the room left, as before.
	status, body := post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"`+strings.Repeat("1", 500)+`"}],"seed":1}`)
	if status != 200 {
		t.Fatalf("a prompt of 504 tokens with the default max_tokens: %d %s", status, body)
	}
}

// An engine of kind openai whose server refuses a request for what it asks (400) passes the
// refusal on as a 400 with the server's message, not as a 500 a client would retry.
func TestFrontPassesUpstreamRefusal(t *testing.T) {
	up, _ := fakeServer(t, func(_ int, w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			fmt.Fprint(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
			return
		}
		w.WriteHeader(400)
		fmt.Fprint(w, `{"error":{"message":"This model's maximum context length is 8 tokens.","type":"invalid_request_error","param":null,"code":"context_length_exceeded"}}`)
	})
	eng := newEngine(t, Options{BaseURL: up.URL + "/v1"})
	base := front(t, eng, HandlerOptions{Model: "m"})
	status, body := post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
	wantError(t, "upstream 400", status, body, 400, "", "", "maximum context length is 8 tokens")
}

// blocking is the tiny engine whose Generate waits for release (or its context), telling started
// when it begins and done how its context ended.
type blocking struct {
	*tiny.Engine
	started chan struct{}
	release chan struct{}
	done    chan error
}

func (b *blocking) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	b.started <- struct{}{}
	select {
	case <-b.release:
		return b.Engine.Generate(ctx, reqs)
	case <-ctx.Done():
		b.done <- ctx.Err()
		return nil, ctx.Err()
	}
}

func newBlocking(t *testing.T) *blocking {
	return &blocking{Engine: openTiny(t), started: make(chan struct{}, 8), release: make(chan struct{}), done: make(chan error, 8)}
}

// TestFrontTokenBudget: a request over the per-request caps (prompts × n × max_tokens, prompts ×
// n) is refused
// with a 400 before the engine sees it; past the tokens in flight, a request is answered 429 with
// Retry-After; once the first request is done, the tokens are free again.
func TestFrontTokenBudget(t *testing.T) {
	eng := newBlocking(t)
	base := front(t, eng, HandlerOptions{MaxRequestTokens: 1000, MaxTokensInFlight: 1500, MaxRequestSamples: 100})
	status, body := post(t, base+"/completions", `{"prompt":[[5,6],[7,8]],"n":2,"max_tokens":300}`)
	wantError(t, "over the per-request cap", status, body, 400, "max_tokens", "", "may make the engine hold 1204 tokens")
	status, body = post(t, base+"/completions", `{"prompt":[[5],[6]],"n":64,"max_tokens":1}`)
	wantError(t, "over the per-request samples", status, body, 400, "n", "", "asks for 128 samples (its prompts × n), more than this server takes in one request (100")

	first := make(chan int, 1)
	go func() {
		resp, err := http.Post(base+"/completions", "application/json", strings.NewReader(`{"prompt":[5,6],"n":2,"max_tokens":400}`))
		if err != nil {
			first <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-eng.started // 802 tokens held
	resp, err := http.Post(base+"/completions", "application/json", strings.NewReader(`{"prompt":[5,6],"n":2,"max_tokens":400}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	wantError(t, "past the tokens in flight", resp.StatusCode, string(b), 429, "", "rate_limit_exceeded", "802 of its 1500 tokens and 2 of its 400 samples in flight, and this one needs 802 and 2")
	if resp.Header.Get("Retry-After") == "" {
		t.Errorf("a 429 without Retry-After: %v", resp.Header)
	}
	close(eng.release)
	if s := <-first; s != 200 {
		t.Fatalf("the first request: %d", s)
	}
	if status, body := post(t, base+"/completions", `{"prompt":[5,6],"n":2,"max_tokens":400,"seed":1}`); status != 200 {
		t.Fatalf("after the first request ended: %d %s", status, body)
	}
}

// TestFrontCancelsWhenTheClientLeaves: a non-streamed request whose client goes away while the
// engine works has its engine call cancelled, even with a chunked body (which the JSON decoder
// alone does not read to its end, so the server never watched the connection).
func TestFrontCancelsWhenTheClientLeaves(t *testing.T) {
	eng := newBlocking(t)
	base := front(t, eng, HandlerOptions{})
	pr, pw := io.Pipe()
	go func() {
		pw.Write([]byte(`{"messages":[{"role":"user","content":"2+3="}],"max_tokens":4}`))
		pw.Close()
	}()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/chat/completions", pr) // no length: chunked
	errc := make(chan error, 1)
	go func() {
		_, err := http.DefaultClient.Do(req)
		errc <- err
	}()
	<-eng.started
	cancel()
	<-errc
	select {
	case err := <-eng.done:
		if err != context.Canceled {
			t.Fatalf("the engine's context ended with %v", err)
		}
	case <-time.After(20 * time.Second): // a guard, not a measurement: the cancel is immediate
		close(eng.release)
		t.Fatal("the engine call went on after the client left")
	}
}

// rawRequest writes head (and body) on a new connection to the front and returns the status line
// of the answer, or the read's error. The read has a guard deadline of 20 s.
func rawRequest(t *testing.T, addr, head, body string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, head+body)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err.Error()
	}
	return strings.TrimSpace(line)
}

// TestFrontSlowBodyAndKey: a body that does not arrive within BodyTimeout is answered 408 (it
// held a handler forever), and a request with a wrong key is answered 401 at once, without the
// server waiting for its body first.
func TestFrontSlowBodyAndKey(t *testing.T) {
	h, err := NewHandler(context.Background(), openTiny(t), HandlerOptions{Token: "sk-right", BodyTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	addr := strings.TrimPrefix(s.URL, "http://")
	head := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nAuthorization: %s\r\n\r\n"
	if got := rawRequest(t, addr, fmt.Sprintf(head, "Bearer sk-right"), `{"messages": [`); got != "HTTP/1.1 408 Request Timeout" {
		t.Errorf("a body that stopped arriving: %s", got)
	}
	if got := rawRequest(t, addr, fmt.Sprintf(head, "Bearer sk-wrong"), ""); got != "HTTP/1.1 401 Unauthorized" {
		t.Errorf("a wrong key with a body still to come: %s", got)
	}
}

// NewServer times out headers and idle connections (a front without them held a connection
// forever for a client that said nothing).
func TestNewServerTimeouts(t *testing.T) {
	s := NewServer(http.NotFoundHandler())
	if s.ReadHeaderTimeout <= 0 || s.IdleTimeout <= 0 || s.ReadTimeout != 0 || s.WriteTimeout != 0 {
		t.Fatalf("header %s, idle %s, read %s, write %s: want the first two set and no limit on a whole request or answer (a generation takes what it takes)",
			s.ReadHeaderTimeout, s.IdleTimeout, s.ReadTimeout, s.WriteTimeout)
	}
}

// TestFrontRolesKeysAndFields: the scheme "bearer" in any case; "developer" rendered as system;
// an unknown role refused; a schema feature constrained decoding does not have refused with a
// 400 naming its place, as is a tool_choice that asks for a tool the request does not offer;
// tool_choice "none" and "auto", parallel_tool_calls false and response_format json_object and
// json_schema honoured (the tiny engine constrains decoding).
func TestFrontRolesKeysAndFields(t *testing.T) {
	tn := openTiny(t)
	h, err := NewHandler(context.Background(), tn, HandlerOptions{Token: "sk-k"})
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	send := func(auth, body string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, s.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", auth)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	status, body := send("bearer sk-k", `{"messages":[{"role":"developer","content":"add"},{"role":"user","content":"1+1="}],"max_tokens":2,"return_token_ids":true,"seed":1}`)
	var resp chatResponse
	if status != 200 || json.Unmarshal([]byte(body), &resp) != nil {
		t.Fatalf("lowercase bearer, developer role: %d %s", status, body)
	}
	want := tn.Tokenizer().Encode("<|system|>add<|end|><|user|>1+1=<|end|><|assistant|>")
	if fmt.Sprint(resp.PromptTokenIDs) != fmt.Sprint(want) {
		t.Errorf("developer message rendered as %v, want the system's %v", resp.PromptTokenIDs, want)
	}
	tool := `"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]`
	for _, tc := range []struct{ name, extra, param, text string }{
		{"unknown role", `"messages":[{"role":"robot","content":"hi"}]`, "messages[0].role", `messages[0].role "robot"; want system, developer, user, assistant or tool`},
		{"tool_choice required without tools", `"messages":[{"role":"user","content":"hi"}],"tool_choice":"required"`, "tool_choice", "the request offers no tools"},
		{"tool_choice a function not offered", `"messages":[{"role":"user","content":"hi"}],"tool_choice":{"type":"function","function":{"name":"search"}},` + tool, "tool_choice", `names the function "search", which tools does not offer`},
		{"json_schema minimum", `"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{"age":{"type":"integer","minimum":0}}}}}`,
			"response_format.json_schema.schema", "response_format.json_schema.schema.properties.age.minimum is not supported"},
		{"response_format xml", `"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"xml"}`, "response_format.type", `response_format of type "xml"`},
		{"strict tool with a pattern", `"messages":[{"role":"user","content":"hi"}],"tool_choice":"required","tools":[{"type":"function","function":{"name":"f","strict":true,"parameters":{"type":"object","properties":{"s":{"type":"string","pattern":"a"}}}}}]`,
			"tools[0].function.parameters", "tools[0].function.parameters.properties.s.pattern is not supported"},
	} {
		status, body := send("Bearer sk-k", "{"+tc.extra+"}")
		wantError(t, tc.name, status, body, 400, tc.param, "", tc.text)
	}
	for _, extra := range []string{`"tool_choice":"none","parallel_tool_calls":false`, `"tool_choice":"auto","response_format":{"type":"text"}`,
		`"response_format":{"type":"json_object"}`, `"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{}}}`} {
		if status, body := send("Bearer sk-k", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,`+extra+`}`); status != 200 {
			t.Errorf("%s: %d %s", extra, status, body)
		}
	}
}

// TestFrontTools: serve takes tools. For a template without a tools variable (the tiny
// engine's) they are described in the system message by ToolsPrompt, as agent()'s
// tools_prompt="system" does; the policy's Hermes call comes back as tool_calls (streamed too);
// an assistant message with tool_calls and a tool message in the history are rendered as agent()
// renders them; tool_choice "none" leaves the call in the content.
func TestFrontTools(t *testing.T) {
	var prompts []string
	eng := scripted.New(func(r scripted.Request) string {
		prompts = append(prompts, r.Prompt)
		return `<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>`
	})
	base := front(t, eng, HandlerOptions{Model: "s", ToolsPrompt: func(tools []string) string { return "TOOLS " + strings.Join(tools, ";") }})
	tool := `"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]`
	status, body := post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"12*34?"},
		{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":"{\"expr\": \"1+1\"}"}}]},
		{"role":"tool","tool_call_id":"c1","content":"2"}],`+tool+`}`)
	var resp chatResponse
	if status != 200 || json.Unmarshal([]byte(body), &resp) != nil || len(resp.Choices) != 1 {
		t.Fatalf("%d %s", status, body)
	}
	ch := resp.Choices[0]
	if *ch.FinishReason != "tool_calls" || len(ch.Message.ToolCalls) != 1 || ch.Message.ToolCalls[0].Function.Name != "calc" ||
		string(ch.Message.ToolCalls[0].Function.Arguments) != `"{\"expr\":\"12*34\"}"` || ch.Message.Content != nil {
		t.Errorf("answer %s", body)
	}
	wantPrompt := scripted.RenderChat([]engines.Message{
		{Role: "system", Content: `TOOLS {"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}`},
		{Role: "user", Content: "12*34?"},
		{Role: "assistant", Content: HermesText("", []ToolCall{{Name: "calc", Arguments: `{"expr": "1+1"}`}})},
		{Role: "tool", Content: "2"}}, true)
	if len(prompts) != 1 || prompts[0] != wantPrompt {
		t.Errorf("the engine's prompt %q, want %q", prompts, wantPrompt)
	}
	status, body = post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"12*34?"}],"stream":true,`+tool+`}`)
	if status != 200 || !strings.Contains(body, `"tool_calls":[{"index":0,"id":"call_`) || !strings.Contains(body, `"finish_reason":"tool_calls"`) {
		t.Errorf("streamed: %d %s", status, body)
	}
	status, body = post(t, base+"/chat/completions", `{"messages":[{"role":"user","content":"12*34?"}],"tool_choice":"none",`+tool+`}`)
	if status != 200 || !strings.Contains(body, `"content":"\u003ctool_call\u003e`) || !strings.Contains(body, `"finish_reason":"stop"`) {
		t.Errorf("tool_choice none: %d %s", status, body)
	}
}

// TestFrontToolChoiceRequired: tool_choice "required" and a named function are honoured by
// sampling again until the answer makes the call (a policy that answers text at first and calls
// the tool later is answered with the call), and a policy that never makes it gets a 500 that
// says so: never an answer outside the request.
func TestFrontToolChoiceRequired(t *testing.T) {
	calls := 0
	eng := scripted.New(func(r scripted.Request) string {
		calls++
		if strings.Contains(r.Prompt, "never") || calls%3 != 0 {
			return "I will just answer."
		}
		return `<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>`
	})
	h, err := NewHandler(context.Background(), eng, HandlerOptions{ToolsPrompt: func(tools []string) string { return "TOOLS " + strings.Join(tools, ";") }})
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	tool := `"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]`
	for _, choice := range []string{`"required"`, `{"type":"function","function":{"name":"calc"}}`} {
		calls = 0
		resp, err := http.Post(s.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"messages":[{"role":"user","content":"add"}],"tool_choice":`+choice+`,`+tool+`}`))
		if err != nil {
			t.Fatal(err)
		}
		var out chatResponse
		json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		if resp.StatusCode != 200 || len(out.Choices) != 1 || out.Choices[0].Message == nil || len(out.Choices[0].Message.ToolCalls) != 1 || calls != 3 {
			t.Errorf("tool_choice %s: status %d, %+v after %d samples; want the call, on the third sample", choice, resp.StatusCode, out, calls)
		}
	}
	resp, err := http.Post(s.URL+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"messages":[{"role":"user","content":"never"}],"tool_choice":"required",`+tool+`}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 500 || !strings.Contains(string(b), "the model made none in 8 samples") {
		t.Errorf("a policy that never calls: %d %s", resp.StatusCode, b)
	}
}
