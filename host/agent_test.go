package host

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	starlarkjson "go.starlark.net/lib/json"
	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/jail"
)

// agentScript runs host/testdata/agent_client.py (a chat-completions client on Python's standard
// library) in the mode the task's label names, rewards and trains what it recorded, and stores
// what the tests check.
const agentScript = `
LIMITS = {"hang": {"timeout": 1}, "flood": {"max_calls": 3}, "constrained": {"max_tokens": 600}}

def rollout(task):
    mode = task.label
    r = agent(["python3", %q, mode], task.prompt, policy = "p", tools_prompt = "system",
              check = task.id != "unchecked", **LIMITS.get(mode, {}))
    for c in r.chats:
        reward(c, 1.0)
        train(c)
    state.update(task.id, lambda _: {
        "output": r.output, "exit": r.exit_code, "stderr": r.stderr, "calls": r.calls,
        "chats": [{"tokens": c.tokens, "mask": c.loss_mask, "turns": [t.tokens for t in c.turns],
                   "roles": [m["role"] for m in c.messages]} for c in r.chats],
    }, None)
`

type agentOut struct {
	Output string `json:"output"`
	Exit   int    `json:"exit"`
	Stderr string `json:"stderr"`
	Calls  int    `json:"calls"`
	Chats  []struct {
		Tokens []int32   `json:"tokens"`
		Mask   []int32   `json:"mask"`
		Turns  [][]int32 `json:"turns"`
		Roles  []string  `json:"roles"`
	} `json:"chats"`
}

func needPython(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 is not installed: agent() has no program to run in this test")
	}
}

func agentRun(t *testing.T, eng engines.Engine, tasks listTasks) (*Run, *StepResult) {
	t.Helper()
	needPython(t)
	prog, err := filepath.Abs("testdata/agent_client.py")
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(len(tasks), "p")
	cfg.Rollout.MaxFailedFraction, cfg.Rollout.MaxResponseLen = 1, 128
	r := loadRun(t, fmt.Sprintf(agentScript, prog), cfg, map[string]engines.Engine{"p": eng}, tasks)
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return r, res
}

func readAgent(t *testing.T, r *Run, id string) agentOut {
	t.Helper()
	v, ok := r.State().Get(id)
	if !ok {
		t.Fatalf("task %s stored nothing", id)
	}
	enc, err := starlark.Call(&starlark.Thread{}, starlarkjson.Module.Members["encode"], starlark.Tuple{v}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var o agentOut
	if err := json.Unmarshal([]byte(enc.(starlark.String)), &o); err != nil {
		t.Fatal(err)
	}
	return o
}

// TestAgentTokenExactTiny: a program that sends its whole history back at each call (the last
// call streamed) makes one conversation of three turns on the embedded engine. The token ids it
// received are the turns' tokens, which are the conversation's tokens at loss mask 1 and nowhere
// else; the conversation is the template applied to its messages, so each call continued the
// recorded tokens instead of starting over.
func TestAgentTokenExactTiny(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	r, res := agentRun(t, eng, listTasks{{ID: "a", Prompt: "What is 3 + 4?", Label: "turns", HasLabel: true}})
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	o := readAgent(t, r, "a")
	var got [][]int32
	if err := json.Unmarshal([]byte(o.Output), &got); err != nil {
		t.Fatalf("program output %q: %v", o.Output, err)
	}
	if len(o.Chats) != 1 || o.Calls != 3 {
		t.Fatalf("%d calls made %d chats, want 3 calls continuing one chat", o.Calls, len(o.Chats))
	}
	c := o.Chats[0]
	if !slices.EqualFunc(got, c.Turns, slices.Equal[[]int32]) {
		t.Errorf("the program received %v, the chat recorded the turns %v", got, c.Turns)
	}
	var sampled, masked []int32
	for _, turn := range c.Turns {
		sampled = append(sampled, turn...)
	}
	for i, m := range c.Mask {
		if m == 1 {
			masked = append(masked, c.Tokens[i])
		}
	}
	if !slices.Equal(sampled, masked) || len(sampled) == 0 {
		t.Errorf("tokens at loss mask 1 %v, sampled %v", masked, sampled)
	}
	want := []string{"system", "user", "assistant", "user", "assistant", "user", "assistant"}
	if !slices.Equal(c.Roles, want) {
		t.Errorf("roles %v, want %v", c.Roles, want)
	}
	if n := res.Policies[0].Float("samples"); n != 1 {
		t.Errorf("%v samples trained, want 1 (the conversation)", n)
	}
	// The same run again samples the same tokens: each call's seed comes from its position.
	eng2, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng2.Close()
	r2, _ := agentRun(t, eng2, listTasks{{ID: "a", Prompt: "What is 3 + 4?", Label: "turns", HasLabel: true}})
	if again := readAgent(t, r2, "a"); len(again.Chats) != 1 || !slices.Equal(again.Chats[0].Tokens, c.Tokens) {
		t.Errorf("a second run recorded %+v, the first %v", again.Chats, c.Tokens)
	}
}

// TestAgentToolCalls: the policy's Hermes tool call reaches the program as the API's tool_calls
// (finish_reason "tool_calls"), the program's assistant message with tool_calls and its tool
// message continue the same conversation, and the streamed answer is the policy's.
func TestAgentToolCalls(t *testing.T) {
	call := `<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>`
	eng := scripted.New(func(req scripted.Request) string {
		if last := scripted.LastMessage(req.Prompt); strings.Contains(req.Prompt, "\ntool: ") {
			return `\boxed{` + last + `}`
		}
		return call
	})
	r, res := agentRun(t, eng, listTasks{{ID: "a", Prompt: "Ann has 12 bags of 34 pens.", Label: "tools", HasLabel: true}})
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	o := readAgent(t, r, "a")
	if strings.TrimSpace(o.Output) != `\boxed{408}` {
		t.Errorf("the program printed %q; stderr: %s", o.Output, o.Stderr)
	}
	if len(o.Chats) != 1 || len(o.Chats[0].Turns) != 2 {
		t.Fatalf("chats %+v, want one of two turns", o.Chats)
	}
	if want := []string{"system", "user", "assistant", "tool", "assistant"}; !slices.Equal(o.Chats[0].Roles, want) {
		t.Errorf("roles %v, want %v (tools_prompt=\"system\" describes the tools in a system message)", o.Chats[0].Roles, want)
	}
}

// TestAgentResponses: a program on the Responses API (POST /v1/responses, the openai-agents
// SDK's default) gets the policy's Hermes tool call as a function_call item, sends the items back
// with the call's output and gets the streamed answer; its calls continue one conversation,
// recorded token for token as the same conversation on chat completions records it.
func TestAgentResponses(t *testing.T) {
	call := `<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>`
	eng := scripted.New(func(req scripted.Request) string {
		if last := scripted.LastMessage(req.Prompt); strings.Contains(req.Prompt, "\ntool: ") {
			return `\boxed{` + last + `}`
		}
		return call
	})
	prompt := "Ann has 12 bags of 34 pens."
	r, res := agentRun(t, eng, listTasks{{ID: "chat", Prompt: prompt, Label: "tools", HasLabel: true}, {ID: "responses", Prompt: prompt, Label: "responses", HasLabel: true}})
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	chat, resp := readAgent(t, r, "chat"), readAgent(t, r, "responses")
	if strings.TrimSpace(resp.Output) != `\boxed{408}` || resp.Calls != 2 {
		t.Fatalf("the program printed %q after %d calls; stderr: %s", resp.Output, resp.Calls, resp.Stderr)
	}
	if len(resp.Chats) != 1 || len(resp.Chats[0].Turns) != 2 {
		t.Fatalf("chats %+v, want one of two turns", resp.Chats)
	}
	c := resp.Chats[0]
	if want := []string{"system", "user", "assistant", "tool", "assistant"}; !slices.Equal(c.Roles, want) {
		t.Errorf("roles %v, want %v", c.Roles, want)
	}
	if len(chat.Chats) != 1 || !slices.Equal(c.Tokens, chat.Chats[0].Tokens) || !slices.Equal(c.Mask, chat.Chats[0].Mask) {
		t.Errorf("the Responses conversation recorded %v (mask %v), the chat one %+v", c.Tokens, c.Mask, chat.Chats)
	}
	var sampled, masked []int32
	for _, turn := range c.Turns {
		sampled = append(sampled, turn...)
	}
	for i, m := range c.Mask {
		if m == 1 {
			masked = append(masked, c.Tokens[i])
		}
	}
	if !slices.Equal(sampled, masked) || len(sampled) == 0 {
		t.Errorf("tokens at loss mask 1 %v, sampled %v", masked, sampled)
	}
}

// TestAgentFailures: a program that exits non-zero, runs past its timeout or floods the endpoint
// fails its rollout alone, with a message that says which; with check=False a non-zero exit is
// returned with the program's stderr and chats; a history asked twice makes two
// conversations; conversations held at once by concurrent calls stay apart.
func TestAgentFailures(t *testing.T) {
	eng := scripted.New(func(req scripted.Request) string { return "ok" })
	r, res := agentRun(t, eng, listTasks{
		{ID: "crash", Prompt: "x", Label: "crash", HasLabel: true}, {ID: "hang", Prompt: "x", Label: "hang", HasLabel: true},
		{ID: "flood", Prompt: "x", Label: "flood", HasLabel: true}, {ID: "branch", Prompt: "x", Label: "branch", HasLabel: true},
		{ID: "parallel", Prompt: "x", Label: "parallel", HasLabel: true}, {ID: "unchecked", Prompt: "x", Label: "crash", HasLabel: true},
	})
	msgs := map[string]string{}
	for _, f := range res.Failed {
		msgs[f.TaskID] = f.Msg
	}
	for id, want := range map[string]string{
		"crash": "exited with status 3; its stderr ends:\nsomething broke",
		"hang":  "ran past its timeout of 1s and was killed",
		"flood": "made more than 3 chat-completions calls (max_calls)",
	} {
		if !strings.Contains(msgs[id], want) {
			t.Errorf("task %s: failure %q, want it to say %q", id, msgs[id], want)
		}
	}
	if len(res.Failed) != 3 {
		t.Fatalf("failures %v; want crash, hang and flood alone", msgs)
	}
	if o := readAgent(t, r, "branch"); len(o.Chats) != 2 {
		t.Errorf("the same history asked twice made %d chats, want 2", len(o.Chats))
	}
	if o := readAgent(t, r, "unchecked"); o.Exit != 3 || o.Stderr != "something broke\n" || len(o.Chats) != 1 {
		t.Errorf("with check=False: exit %d, stderr %q, %d chats; want 3, its stderr and the chat of its call", o.Exit, o.Stderr, len(o.Chats))
	}
	// Four conversations at once, each continued by its own second call.
	o := readAgent(t, r, "parallel")
	if len(o.Chats) != 4 || o.Calls != 8 {
		t.Fatalf("4 concurrent conversations of 2 calls made %d chats of %d calls", len(o.Chats), o.Calls)
	}
	for _, c := range o.Chats {
		if len(c.Turns) != 2 {
			t.Errorf("a concurrent conversation has %d turns, want 2", len(c.Turns))
		}
	}
}

// TestAgentSandboxPrograms: a sandboxed script starts a program only when the operator's config
// lists it under sandbox.programs; the refusal names the script's line. Listed, the program runs
// in the sandbox's child process and its calls come back to the host like generate's.
func TestAgentSandboxPrograms(t *testing.T) {
	needPython(t)
	prog, err := filepath.Abs("testdata/agent_client.py")
	if err != nil {
		t.Fatal(err)
	}
	step := func(programs []string) *StepResult {
		cfg := testConfig(1, "p")
		cfg.Rollout.MaxFailedFraction, cfg.Rollout.MaxResponseLen = 1, 16
		cfg.Sandbox.Programs = programs
		cfg.Sandbox.Train = []string{"p"}
		cfg.Sandbox.AgentRead = []string{filepath.Dir(prog)} // the program's file, for its jail
		echo := func(_ context.Context, p config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }
		r, err := Load(context.Background(), writeScript(t, fmt.Sprintf(agentScript, prog)),
			Options{Config: cfg, Tasks: listTasks{{ID: "a", Prompt: "q", Label: "turns", HasLabel: true}}, OpenEngine: echo, Sandbox: true})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := step(nil)
	if len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Msg, "script.star:6:14: agent: a sandboxed script starts only the programs the operator's config grants, and sandbox.programs lists none, which does not match") {
		t.Errorf("unlisted program: failures %v", res.Failed)
	}
	if err := jail.Available(); err != nil {
		t.Skipf("no jail on this host for the listed program: %v", err)
	}
	res = step([]string{"python3"})
	if len(res.Failed) != 0 {
		t.Fatalf("listed program: failures %v", res.Failed)
	}
	if n := res.Policies[0].Float("samples"); n != 1 {
		t.Errorf("%v samples trained, want 1", n)
	}
}

// TestAgentClientMistakes: a call past the policy's context is answered 400
// context_length_exceeded (it was a 200 with empty content, and the run stopped at training),
// and the rollout goes on: the conversation of that call ends with it, the program's next call
// is answered and trained. The endpoint lists the name the program was given ($OPENAI_MODEL),
// takes the scheme "bearer" in lower case, answers tool_choice "required" (cut by max_tokens here:
// answered cut, as the front does), parallel_tool_calls false and response_format (the tiny
// engine constrains decoding; TestAgentToolChoiceRequired has the resampling of an engine that
// does not), refuses an unknown role, and renders "developer" as system.
func TestAgentClientMistakes(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	r, res := agentRun(t, eng, listTasks{{ID: "o", Prompt: "2+3=", Label: "overflow", HasLabel: true}, {ID: "a", Prompt: "2+3=", Label: "api", HasLabel: true}})
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	o := readAgent(t, r, "o")
	if strings.TrimSpace(o.Output) != `{"long": [400, "messages", "context_length_exceeded"], "short": "length"}` && strings.TrimSpace(o.Output) != `{"long": [400, "messages", "context_length_exceeded"], "short": "stop"}` {
		t.Errorf("overflow: the program printed %q; stderr %s", o.Output, o.Stderr)
	}
	if len(o.Chats) != 1 || len(o.Chats[0].Turns) != 1 || o.Calls != 2 {
		t.Errorf("overflow: %d calls made %d chats (%+v); want 2 calls and the short one's chat alone", o.Calls, len(o.Chats), o.Chats)
	}
	if n := res.Policies[0].Float("samples"); n != 5 {
		t.Errorf("%v samples trained, want 5 (the short call's and the api task's four answered calls)", n)
	}
	a := readAgent(t, r, "a")
	want := `{"models": ["p"], "model_env": "p", "required": "answered", "parallel": "answered", ` +
		`"json": "answered", "robot": [400, "messages[0].role", null], "developer": "answered"}`
	if strings.TrimSpace(a.Output) != want {
		t.Errorf("api: the program printed\n%s\nwant\n%s\nstderr: %s", a.Output, want, a.Stderr)
	}
	if len(a.Chats) != 4 || !slices.Equal(a.Chats[3].Roles, []string{"system", "user", "assistant"}) {
		t.Errorf("api: chats %+v; want one whose first message is the developer's as system", a.Chats)
	}
}

// TestAgentConstrained: inside agent(), response_format json_schema and tool_choice "required"
// with parallel_tool_calls false are kept by constrained decoding on the tiny engine, whose
// arithmetic policy writes neither JSON nor calls by itself, and the turns recorded (and trained)
// are the constrained ones: the JSON answer and the one call, each sampled once.
func TestAgentConstrained(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	r, res := agentRun(t, eng, listTasks{{ID: "c", Prompt: "2+3=", Label: "constrained", HasLabel: true}})
	if len(res.Failed) != 0 {
		t.Fatalf("failed: %v", res.Failed)
	}
	o := readAgent(t, r, "c")
	if got := strings.TrimSpace(o.Output); got != `["stop", ["answer"], "tool_calls", [["go", []]]]` {
		t.Fatalf("the program printed %q (stderr %s)", got, o.Stderr)
	}
	if len(o.Chats) != 2 || len(o.Chats[0].Turns) != 1 || len(o.Chats[1].Turns) != 1 {
		t.Fatalf("recorded %+v; want two conversations of one turn each", o.Chats)
	}
	answer := strings.TrimSuffix(eng.Tokenizer().Decode(o.Chats[0].Turns[0]), "<|end|>")
	var v map[string]int
	if err := json.Unmarshal([]byte(answer), &v); err != nil || len(v) != 1 {
		t.Errorf("the recorded answer %q is not the schema's JSON (%v)", answer, err)
	}
	if turn := eng.Tokenizer().Decode(o.Chats[1].Turns[0]); strings.Count(turn, "<tool_call>") != 1 || !strings.HasPrefix(strings.TrimSpace(turn), "<tool_call>") {
		t.Errorf("the recorded turn %q is not one call", turn)
	}
	if n := res.Policies[0].Float("samples"); n != 2 {
		t.Errorf("%v samples trained, want the two constrained turns", n)
	}
}

// TestAgentToolChoiceRequired: inside agent(), tool_choice "required" is sampled again until the
// answer calls a tool (the policy answers text twice, then calls), and only that answer is
// recorded: one conversation of one turn, the call's, trained.
func TestAgentToolChoiceRequired(t *testing.T) {
	n := 0
	eng := scripted.New(func(scripted.Request) string {
		n++
		if n < 3 {
			return "no tool for now"
		}
		return `<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>`
	})
	r, res := agentRun(t, eng, listTasks{{ID: "q", Prompt: "2+3=", Label: "required", HasLabel: true}})
	if len(res.Failed) != 0 {
		t.Fatalf("failed: %v", res.Failed)
	}
	o := readAgent(t, r, "q")
	if strings.TrimSpace(o.Output) != `["tool_calls", ["calc"]]` || n != 3 {
		t.Fatalf("the program printed %q after %d samples (stderr %s); want the call, on the third", o.Output, n, o.Stderr)
	}
	if len(o.Chats) != 1 || len(o.Chats[0].Turns) != 1 || !strings.Contains(bytesOf(o.Chats[0].Turns[0]), "<tool_call>") {
		t.Errorf("recorded %+v; want one conversation whose one turn is the call", o.Chats)
	}
}

// bytesOf is a scripted engine's tokens (one a byte) as text.
func bytesOf(toks []int32) string {
	b := make([]byte, 0, len(toks))
	for _, t := range toks {
		if t < 256 {
			b = append(b, byte(t))
		}
	}
	return string(b)
}
