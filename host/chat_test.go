package host

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// chatScript runs one conversation of three sampled turns with a tool result, an injected
// assistant turn and user messages between them, trains it as one sample and stores what the
// test checks.
const chatScript = `
def rollout(task):
    c = chat("p", system = "Be exact.")
    c.user(task.prompt)
    c.generate(max_tokens = 6)
    c.tool("42")
    c.user("Again?")
    c.generate(max_tokens = 24)
    c.assistant("Injected.")
    c.user("Last.")
    c.generate(max_tokens = 24)
    reward(c, 1.0)
    train(c)
    out = {
        "tokens": c.tokens, "mask": c.loss_mask, "messages": c.messages,
        "turns": [t.tokens for t in c.turns], "prompts": [t.prompt_tokens for t in c.turns],
        "logprobs": [t.logprobs for t in c.turns],
    }
    state.update(task.id, lambda _: out, None)
`

type chatOut struct {
	tokens, mask []int32
	msgs         []engines.Message
	turns        [][]int32
	prompts      []int
	logprobs     [][]float32
}

func readChat(t *testing.T, r *Run, id string) chatOut {
	t.Helper()
	v, ok := r.State().Get(id)
	if !ok {
		t.Fatalf("task %s stored nothing", id)
	}
	d := v.(*starlark.Dict)
	get := func(k string) starlark.Value {
		x, _, _ := d.Get(starlark.String(k))
		return x
	}
	var o chatOut
	o.tokens, o.mask = starlarkInts(t, get("tokens")), starlarkInts(t, get("mask"))
	for _, m := range listOf(get("messages")) {
		md := m.(*starlark.Dict)
		role, _, _ := md.Get(starlark.String("role"))
		content, _, _ := md.Get(starlark.String("content"))
		o.msgs = append(o.msgs, engines.Message{Role: string(role.(starlark.String)), Content: string(content.(starlark.String))})
	}
	for _, x := range listOf(get("turns")) {
		o.turns = append(o.turns, starlarkInts(t, x))
	}
	for _, x := range listOf(get("prompts")) {
		n, _ := starlark.AsInt32(x)
		o.prompts = append(o.prompts, n)
	}
	for _, x := range listOf(get("logprobs")) {
		o.logprobs = append(o.logprobs, starlarkFloats(t, x))
	}
	return o
}

// checkSpans: every turn's sampled ids lie in the conversation where its prompt ended, and the
// mask is 1 exactly there.
func checkSpans(t *testing.T, o chatOut) {
	t.Helper()
	if len(o.mask) != len(o.tokens) {
		t.Fatalf("loss_mask has %d entries for %d tokens", len(o.mask), len(o.tokens))
	}
	want := make([]int32, len(o.tokens))
	for k, turn := range o.turns {
		p := o.prompts[k]
		if p+len(turn) > len(o.tokens) {
			t.Fatalf("turn %d (prompt %d + %d tokens) runs past the conversation's %d tokens", k, p, len(turn), len(o.tokens))
		}
		if d := cmp.Diff(turn, o.tokens[p:p+len(turn)]); d != "" {
			t.Errorf("turn %d's sampled ids are not in the conversation as sampled (-turn +conversation):\n%s", k, d)
		}
		for i := p; i < p+len(turn); i++ {
			want[i] = 1
		}
	}
	if d := cmp.Diff(want, o.mask); d != "" {
		t.Errorf("loss_mask is not 1 exactly at the sampled ids (-want +got):\n%s", d)
	}
}

// tinyTemplate is the tiny engine's chat template applied to a conversation's messages, as
// tokens: what its tokens must be. When its last turn ran out of max_tokens nothing closes it yet,
// so the template's final <|end|> is left off.
func tinyTemplate(t *testing.T, eng *tiny.Engine, o chatOut) []int32 {
	t.Helper()
	var text strings.Builder
	for _, m := range o.msgs {
		text.WriteString("<|" + m.Role + "|>" + m.Content + "<|end|>")
	}
	enc, err := eng.Tokenize(context.Background(), []string{text.String()})
	if err != nil {
		t.Fatal(err)
	}
	want := enc[0]
	if last := o.turns[len(o.turns)-1]; len(last) == 0 || last[len(last)-1] != want[len(want)-1] {
		want = want[:len(want)-1]
	}
	return want
}

// TestChatTokenExactTiny: on the tiny engine (a character tokenizer, so re-encoding the text of
// a conversation gives the ids back) the conversation's tokens are the template applied to its
// messages, whatever each turn ended with: EOS sampled, or max_tokens (then the template's <|end|>
// was injected, mask 0). The mask is 1 exactly at the sampled ids, and the log-probs the engine
// computes for the trained sample are the rollout's.
func TestChatTokenExactTiny(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	cfg := testConfig(2, "p")
	r := loadRun(t, chatScript, cfg, map[string]engines.Engine{"p": eng},
		listTasks{{ID: "a", Prompt: "What is 3 + 4?"}, {ID: "b", Prompt: "Ann has 2 pens."}})
	ctx := context.Background()
	res, err := r.Step(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	endings := map[bool]int{} // turns that sampled EOS, turns cut by max_tokens
	eos := eosOf(t, eng)
	for _, id := range []string{"a", "b"} {
		o := readChat(t, r, id)
		checkSpans(t, o)
		for _, turn := range o.turns {
			endings[len(turn) > 0 && turn[len(turn)-1] == eos]++
		}
		if d := cmp.Diff(tinyTemplate(t, eng, o), o.tokens); d != "" {
			t.Errorf("task %s: the conversation's tokens are not the template applied to its messages (-template +chat):\n%s", id, d)
		}
		if len(o.msgs) != 9 || o.msgs[3].Role != "tool" || o.msgs[6].Content != "Injected." {
			t.Errorf("task %s: messages %v", id, o.msgs)
		}
	}
	if endings[true] == 0 || endings[false] == 0 {
		t.Errorf("turns ending in EOS: %d, cut by max_tokens: %d; the test must see both", endings[true], endings[false])
	}
	if n := res.Policies[0].Float("samples"); n != 2 {
		t.Errorf("%v samples trained, want 2 (one per conversation)", n)
	}
}

// TestChatLogprobsMatchTrainer: the log-probs that the engine computes for the trained sample
// (prompt = the tokens before the first turn, response = the rest) at the masked positions are the
// rollout's; the policy is frozen so the weights are the rollout's when scored.
func TestChatLogprobsMatchTrainer(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	src := strings.Replace(chatScript, "    reward(c, 1.0)\n    train(c)\n", "", 1)
	cfg := testConfig(1, "p")
	cfg.Policies[0].Trainable = false
	r := loadRun(t, src, cfg, map[string]engines.Engine{"p": eng}, listTasks{{ID: "a", Prompt: "What is 5 + 2?"}})
	stepOK(t, r)
	o := readChat(t, r, "a")
	first := o.prompts[0]
	sc, err := eng.Score(context.Background(), []engines.ScoreRequest{{PromptTokens: o.tokens[:first], Tokens: o.tokens[first:]}})
	if err != nil {
		t.Fatal(err)
	}
	lp := sc[0].Logprobs
	for k, turn := range o.turns {
		for i := range turn {
			pos := o.prompts[k] + i - first
			if d := math.Abs(float64(lp[pos] - o.logprobs[k][i])); d > 1e-4 {
				t.Errorf("turn %d token %d: trainer log-prob %v, rollout %v", k, i, lp[pos], o.logprobs[k][i])
			}
		}
	}
}

// TestChatSample: train(chat) sends one sample whose prompt is the tokens before the first
// turn, whose response is the rest, with mask 1 and the rollout log-probs at exactly the sampled
// ids (0 elsewhere); a turn trained on its own is a plain sample; the chat's reward is reward_mean.
func TestChatSample(t *testing.T) {
	eng := scripted.Echo("ok")
	cfg := testConfig(1, "p")
	r := loadRun(t, `
def rollout(task):
    c = chat("p")
    c.user("hi")
    c.generate()
    c.tool("result")
    c.generate()
    reward(c, 2.0)
    train(c)
    t = c.turns[0]
    reward(t, 1.0)
    train(t)
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(1))
	res := stepOK(t, r)
	b := eng.Batches()
	if len(b) != 1 || len(b[0].Samples) != 2 {
		t.Fatalf("batches %d, want 1 with 2 samples", len(b))
	}
	var conv engines.Sample
	for _, s := range b[0].Samples {
		if len(s.Response) > 3 {
			conv = s
		}
	}
	ok := append(scripted.Encode("ok"), scripted.EOS)
	wantPrompt := scripted.Encode("user: hi\nassistant: ")
	wantResp := append(append(append([]int32(nil), ok...), scripted.Encode("\ntool: result\nassistant: ")...), ok...)
	if d := cmp.Diff(wantPrompt, conv.Prompt); d != "" {
		t.Errorf("prompt (-want +got):\n%s", d)
	}
	if d := cmp.Diff(wantResp, conv.Response); d != "" {
		t.Errorf("response (-want +got):\n%s", d)
	}
	var wantMask, wantLp []float32
	for i := range wantResp {
		sampled := i < len(ok) || i >= len(wantResp)-len(ok)
		m, lp := float32(0), float32(0)
		if sampled {
			m, lp = 1, eng.Logprob
		}
		wantMask, wantLp = append(wantMask, m), append(wantLp, lp)
	}
	if d := cmp.Diff(wantMask, conv.LossMask); d != "" {
		t.Errorf("loss mask (-want +got):\n%s", d)
	}
	if d := cmp.Diff(wantLp, conv.OldLogprobs); d != "" {
		t.Errorf("old log-probs (-want +got):\n%s", d)
	}
	if got := res.Policies[0].Float("reward_mean"); got != 1.5 {
		t.Errorf("reward_mean %v, want 1.5 (the conversation's 2 and the turn's 1)", got)
	}
}

// TestChatErrors: misuse fails the rollout with a message naming the script's line.
func TestChatErrors(t *testing.T) {
	cases := []struct{ name, body, want string }{
		{"tool first", `c = chat("p")
    c.user("q")
    c.tool("r")`, "has no assistant turn yet"},
		{"non-string", `c = chat("p")
    c.user(3)`, "text must be a string, got int"},
		{"frozen", `c = chat("judge")
    c.user("q")
    c.generate()
    reward(c, 1)
    train(c)`, `policy "judge" is frozen`},
		{"no turn", `c = chat("p")
    c.user("q")
    reward(c, 1)`, "no sampled turn"},
		{"grew", `c = chat("p")
    c.user("q")
    c.generate()
    reward(c, 1)
    c.user("more")
    c.generate()
    train(c)`, "more tokens than when reward() was given it"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(1, "p", "judge")
			cfg.Policies[1].Trainable = false
			cfg.Rollout.MaxFailedFraction = 1
			r := loadRun(t, "def rollout(task):\n    "+tc.body+"\n", cfg,
				map[string]engines.Engine{"p": scripted.Echo("a"), "judge": scripted.Echo("b")}, numberedTasks(1))
			res, err := r.Step(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			msg := failures(res)["t0"]
			if !strings.Contains(msg, tc.want) || !strings.Contains(msg, "script.star:") {
				t.Errorf("got %q, want a failure naming script.star:LINE and %q", msg, tc.want)
			}
		})
	}
}

// TestChatContextFull: a conversation that fills the policy's context ends its turn with
// finish_reason "length" and no tokens, not an engine error, and says so in the run's log.
func TestChatContextFull(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	info, _ := eng.Info(context.Background())
	cfg := testConfig(1, "p")
	r := loadRun(t, `
def rollout(task):
    c = chat("p")
    c.user("x" * `+fmt.Sprint(info.MaxSeqLen)+`)
    t = c.generate()
    if t.finish_reason != "length" or len(t.tokens) != 0:
        fail("got %s %s" % (t.finish_reason, t.tokens))
`, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(1))
	stepOK(t, r)
}

func listOf(v starlark.Value) []starlark.Value {
	var out []starlark.Value
	it := starlark.Iterate(v)
	defer it.Done()
	var x starlark.Value
	for it.Next(&x) {
		out = append(out, x)
	}
	return out
}

// TestChatSandboxMatchesInProcess: a sandboxed run trains the same conversation samples as an
// in-process run; the host rebuilds each from its own copies of the turns.
func TestChatSandboxMatchesInProcess(t *testing.T) {
	src := `
def rollout(task):
    c = chat("p", system = "sys")
    c.user(task.prompt)
    c.generate(max_tokens = 4)
    c.tool("42")
    forks = c.generate(n = 2)
    for i, f in enumerate(forks):
        f.user("again")
        f.generate()
        reward(f, float(i))
    train(forks)
    reward(c.turns[0], 0.5)
    train(c.turns[0])
`
	run := func(sandbox bool) []engines.Batch {
		cfg := testConfig(2, "p")
		cfg.Sandbox.Train = []string{"p"}
		eng := scripted.New(func(r scripted.Request) string { return []string{"alpha", "beta"}[r.Seed%2] })
		r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Tasks: numberedTasks(2),
			Engines: map[string]engines.Engine{"p": eng}, Sandbox: sandbox})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		stepOK(t, r)
		return eng.Batches()
	}
	in, sb := run(false), run(true)
	if len(in) != 1 || len(in[0].Samples) != 6 {
		t.Fatalf("in-process run trained %d batches, want 1 of 6 samples", len(in))
	}
	masked := 0
	for _, s := range in[0].Samples {
		for _, m := range s.LossMask {
			if m == 0 {
				masked++
			}
		}
	}
	if masked == 0 {
		t.Error("no sample has injected tokens: the conversations were not trained as conversations")
	}
	in[0].ID, sb[0].ID = "", ""
	if d := cmp.Diff(in, sb); d != "" {
		t.Errorf("sandboxed run trains other samples (-in-process +sandboxed):\n%s", d)
	}
}

// TestChatToolsFallback: for a template without a tools variable the tool schemas reach the
// model in the system message, after the chat's own system text.
func TestChatToolsFallback(t *testing.T) {
	var prompt string
	eng := scripted.New(func(r scripted.Request) string { prompt = r.Prompt; return "ok" })
	r := loadRun(t, `
def rollout(task):
    c = chat("p", system = "Be exact.", tools = [{"type": "function", "function": {"name": "calc"}}])
    c.user("hi")
    c.generate()
`, testConfig(1, "p"), map[string]engines.Engine{"p": eng}, numberedTasks(1))
	stepOK(t, r)
	want := "system: Be exact.\n\n# Tools"
	if !strings.HasPrefix(prompt, want) || !strings.Contains(prompt, `<tools>`+"\n"+`{"function":{"name":"calc"},"type":"function"}`+"\n</tools>") || !strings.HasSuffix(prompt, "user: hi\nassistant: ") {
		t.Errorf("prompt %q; want the system text, then the tools, then the user's message", prompt)
	}
}

// BenchmarkChatTurn is the host's cost of a conversation turn compared with a plain generate
// of the same conversation as messages: 32 rollouts of 8 turns a step on a scripted engine, so
// the numbers are the host's (batching, rendering, bookkeeping), not a model's.
func BenchmarkChatTurn(b *testing.B) {
	scripts := map[string]string{
		"generate": `
def rollout(task):
    msgs = []
    for i in range(8):
        msgs.append({"role": "user", "content": "step %d of %s" % (i, task.prompt)})
        c = generate("p", msgs, max_tokens = 16)
        msgs.append({"role": "assistant", "content": c.text})
`,
		"chat": `
def rollout(task):
    c = chat("p")
    for i in range(8):
        c.user("step %d of %s" % (i, task.prompt))
        c.generate(max_tokens = 16)
`,
	}
	for _, name := range []string{"generate", "chat"} {
		b.Run(name, func(b *testing.B) {
			cfg := testConfig(32, "p")
			path := filepath.Join(b.TempDir(), "script.star")
			if err := os.WriteFile(path, []byte(scripts[name]), 0o644); err != nil {
				b.Fatal(err)
			}
			r, err := Load(context.Background(), path, Options{Config: cfg, Tasks: numberedTasks(32),
				Engines: map[string]engines.Engine{"p": scripted.Echo("the answer is 42")}})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				res, err := r.Step(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				if len(res.Failed) > 0 {
					b.Fatal(res.Failed[0])
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/(32*8), "µs/turn")
		})
	}
}

// TestChatBudgets: in a sandboxed run a chat's turns count against generate_calls like generate
// calls do.
func TestChatBudgets(t *testing.T) {
	cfg := testConfig(1, "p")
	cfg.Sandbox = config.DefaultSandbox()
	cfg.Sandbox.Train, cfg.Sandbox.GenerateCalls = []string{"p"}, 2
	cfg.Rollout.MaxFailedFraction = 1
	r, err := Load(context.Background(), writeScript(t, `
def rollout(task):
    c = chat("p")
    for i in range(3):
        c.user("turn %d" % i)
        c.generate()
`), Options{Config: cfg, Tasks: numberedTasks(1), Engines: map[string]engines.Engine{"p": scripted.Echo("ok")}, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if msg := failures(res)["t0"]; !strings.Contains(msg, "generate_calls") || !strings.Contains(msg, "chat.generate call 3") {
		t.Errorf("third turn with generate_calls 2: %q", msg)
	}
}

func eosOf(t *testing.T, e engines.Engine) int32 {
	t.Helper()
	info, err := e.Info(context.Background())
	if err != nil || len(info.EOSTokens) == 0 {
		t.Fatalf("no EOS token: %v", err)
	}
	return info.EOSTokens[0]
}

// TestChatTrace: `slimen graph`'s trace sees a chat's turns as calls whose prompts hold the
// conversation so far, so an earlier turn's output links to the turns after it.
func TestChatTrace(t *testing.T) {
	calls, err := Trace(context.Background(), writeScript(t, `
def rollout(task):
    c = chat("agent")
    c.user(task.prompt)
    first = c.generate()
    c.tool("result of " + first.text)
    c.generate()
`), nil, Task{ID: "a", Prompt: "2+3?"})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 2 || calls[0].Policy != "agent" || len(calls[0].Outputs) != 1 {
		t.Fatalf("traced %+v, want the chat's two turns", calls)
	}
	if !strings.Contains(calls[1].Prompt, calls[0].Outputs[0]) || !strings.Contains(calls[1].Prompt, "result of "+calls[0].Outputs[0]) {
		t.Errorf("the second turn's prompt %q does not hold the first turn's output %q and the tool result", calls[1].Prompt, calls[0].Outputs[0])
	}
}

// infoCounter is the tiny engine with its Info calls counted.
type infoCounter struct {
	*tiny.Engine
	infos atomic.Int32
}

func (e *infoCounter) Info(ctx context.Context) (engines.Info, error) {
	e.infos.Add(1)
	return e.Engine.Info(ctx)
}

// A chat asks its policy's engine for its Info (template, EOS, context) once, not at every turn,
// and again after the engine restarted as a new process.
func TestChatInfoCached(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	e := &infoCounter{Engine: eng}
	r := loadRun(t, `
def rollout(task):
    c = chat("p")
    for i in range(3):
        c.user("Ann has %d pens and gets 2 more. How many pens?" % i)
        c.generate(max_tokens = 4)
`, testConfig(2, "p"), map[string]engines.Engine{"p": e}, numberedTasks(2))
	stepOK(t, r)
	after1 := e.infos.Load()
	stepOK(t, r)
	if got := e.infos.Load(); got != after1 || after1 > 2 {
		t.Fatalf("Info calls: %d after a step of 2 conversations × 3 turns, %d after the next; want it asked once", after1, got)
	}
	if err := r.engineRestarted(context.Background(), restartEvent{policy: "p", engine: "its engine", prev: "a", cur: "b"}); err != nil {
		t.Fatal(err)
	}
	stepOK(t, r)
	if got := e.infos.Load(); got != after1+1 {
		t.Fatalf("Info calls after a restart and a step: %d, want %d", got, after1+1)
	}
}

// randomChatScript plays the operations a task carries in its metadata ("user", "tool",
// "assistant", "gen N") on one conversation and stores it like chatScript.
const randomChatScript = `
def rollout(task):
    c = chat("p")
    for k, op in enumerate(task.metadata["ops"]):
        if op == "user":
            c.user("Ann has %d pens and gets 2 more. How many pens?" % k)
        elif op == "tool":
            c.tool("%d" % (k * 37))
        elif op == "assistant":
            c.assistant("\\boxed{%d}" % k)
        else:
            c.generate(max_tokens = int(op.split(" ")[1]), temperature = 1.0)
    reward(c, 1.0)
    train(c)
    out = {
        "tokens": c.tokens, "mask": c.loss_mask, "messages": c.messages,
        "turns": [t.tokens for t in c.turns], "prompts": [t.prompt_tokens for t in c.turns],
        "logprobs": [t.logprobs for t in c.turns],
    }
    state.update(task.id, lambda _: out, None)
`

// TestChatTokensProperty: over random conversations (user, tool and injected assistant messages
// and turns of random lengths in random order) on the tiny engine, the tokens are the prompt,
// every turn's sampled ids and the rendered injections in order, i.e. the template applied to the
// messages; the mask is 1 exactly at the sampled ids; and the trained sample is the conversation.
func TestChatTokensProperty(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	rng := rand.New(rand.NewPCG(16, 1))
	var tasks listTasks
	for i := range 12 {
		ops := []any{"user"}
		gens, canTool := 0, false
		for len(ops) < 10 && gens < 5 {
			switch k := rng.IntN(6); {
			case k < 3:
				ops = append(ops, fmt.Sprintf("gen %d", 1+rng.IntN(12)))
				gens++
				canTool = true
			case k == 3 && canTool:
				ops = append(ops, "tool")
			case k == 4:
				ops = append(ops, "user")
			case k == 5:
				ops = append(ops, "assistant")
				canTool = true
			}
		}
		if gens == 0 || ops[len(ops)-1].(string)[:3] != "gen" {
			ops = append(ops, "gen 6")
		}
		tasks = append(tasks, Task{ID: fmt.Sprintf("t%d", i), Prompt: "x", Metadata: map[string]any{"ops": ops}})
	}
	r := loadRun(t, randomChatScript, testConfig(len(tasks), "p"), map[string]engines.Engine{"p": eng}, tasks)
	ctx := context.Background()
	res, err := r.Step(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Failed {
		t.Fatalf("rollout failed: %v", f)
	}
	for _, task := range tasks {
		o := readChat(t, r, task.ID)
		checkSpans(t, o)
		if d := cmp.Diff(tinyTemplate(t, eng, o), o.tokens); d != "" {
			t.Errorf("task %s %v: the tokens are not the template applied to the messages (-template +chat):\n%s", task.ID, task.Metadata["ops"], d)
		}
	}
	if n := res.Policies[0].Float("samples"); n != float64(len(tasks)) {
		t.Errorf("%v samples trained, want one per conversation (%d)", n, len(tasks))
	}
}

// TestChatPastContextIsNotTrained is issue 33's item 2: a conversation that outgrew the model's
// context (512 positions on the embedded model) is not fatal. Its last turn samples nothing, the
// sample is left out of training and counted (overflow, one warning a run), the
// conversations that fit are trained, and the run goes on: it used to stop at training with
// "the engine of policy failed".
func TestChatPastContextIsNotTrained(t *testing.T) {
	eng, err := tiny.Open(config.BuiltinCheckpoint, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(2, "p")
	cfg.Rollout.MaxResponseLen = 8
	src := `
def rollout(task):
    c = chat("p")
    c.user("What is 1 + 1?" if task.id == "short" else "What is 1 + 1? " * 60)
    c.generate()
    for i in range(6 if task.id == "long" else 0):
        c.user("And again, what is 1 + 1? " * 20)
        c.generate()
    reward(c, 1.0)
    train(c)
`
	var log strings.Builder
	r, err := Load(context.Background(), writeScript(t, src), Options{Config: cfg, Engines: map[string]engines.Engine{"p": eng},
		Tasks: listTasks{{ID: "short", Prompt: "q"}, {ID: "long", Prompt: "q"}}, Out: t.TempDir(), Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for step := 1; step <= 2; step++ {
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if len(res.Failed) != 0 {
			t.Fatalf("step %d: failed rollouts %v", step, res.Failed)
		}
		m := res.Policies[0]
		if _, trained := m["loss"]; m.Float("overflow") != 1 || m.Float("samples") != 2 || !trained {
			t.Errorf("step %d: overflow %v of %v samples, trained %v; want 1 of 2, the other trained", step, m.Float("overflow"), m.Float("samples"), trained)
		}
	}
	if n := strings.Count(log.String(), "longer than its model's context of 512 tokens and are not trained"); n != 1 {
		t.Errorf("the warning was given %d times, want once:\n%s", n, log.String())
	}
}
