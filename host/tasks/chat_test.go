package tasks

import (
	jsonstd "encoding/json"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"go.starlark.net/lib/json"
	"go.starlark.net/starlark"
	"go.starlark.net/syntax"

	"github.com/slimen/slimen/starlib"
)

// exampleGlobals executes an example script with stand-ins for what it loads and returns its
// top-level names.
func exampleGlobals(t *testing.T, path string) starlark.StringDict {
	t.Helper()
	f, err := (&syntax.FileOptions{}).Parse(path, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	loaded := map[string]starlark.StringDict{}
	for _, st := range f.Stmts {
		if l, ok := st.(*syntax.LoadStmt); ok {
			m := loaded[l.ModuleName()]
			if m == nil {
				m = starlark.StringDict{}
				loaded[l.ModuleName()] = m
			}
			for _, name := range l.From {
				m[name.Name] = starlark.None
			}
		}
	}
	thread := &starlark.Thread{Load: func(_ *starlark.Thread, module string) (starlark.StringDict, error) {
		return loaded[module], nil
	}}
	pre := starlark.StringDict{"json": json.Module}
	for _, name := range []string{"config", "chat", "generate", "reward", "train", "log", "parallel", "fail"} {
		pre[name] = starlark.None
	}
	g, err := starlark.ExecFileOptions(&syntax.FileOptions{}, thread, path, nil, pre)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return g
}

func starlarkString(t *testing.T, g starlark.StringDict, name string) string {
	t.Helper()
	s, ok := g[name].(starlark.String)
	if !ok {
		t.Fatalf("%s is %v, not a string", name, g[name])
	}
	return string(s)
}

// sameJSON says whether the Starlark value v encodes to the JSON text want (key order aside).
func sameJSON(t *testing.T, v starlark.Value, want string) bool {
	t.Helper()
	enc, err := starlark.Call(&starlark.Thread{}, json.Module.Members["encode"], starlark.Tuple{v}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var a, b any
	if err := jsonUnmarshal(string(enc.(starlark.String)), &a); err != nil {
		t.Fatal(err)
	}
	if err := jsonUnmarshal(want, &b); err != nil {
		t.Fatal(err)
	}
	return reflect.DeepEqual(a, b)
}

// TestChatCorpusMatchesExamples: the chat corpus holds the agent examples' own prompts and tool
// schemas, so a model pretrained on it meets in a run exactly what it learned. A changed prompt in
// a script fails here: change the corpus with it (and pretrain the model again).
func TestChatCorpusMatchesExamples(t *testing.T) {
	root := filepath.Join("..", "..", "examples")
	calc := exampleGlobals(t, filepath.Join(root, "calculator_agent", "calculator_agent.star"))
	if got := starlarkString(t, calc, "CHAT_SYSTEM"); got != CalcSystem {
		t.Errorf("calculator_agent's CHAT_SYSTEM is %q; the corpus has %q", got, CalcSystem)
	}
	if !sameJSON(t, calc["CALC"], CalcSchema) {
		t.Errorf("calculator_agent's CALC differs from the corpus's CalcSchema %s", CalcSchema)
	}
	orch := exampleGlobals(t, filepath.Join(root, "toolorchestra", "toolorchestra.star"))
	if got := starlarkString(t, orch, "CHAT_SYSTEM"); got != OrchestraSystem {
		t.Errorf("toolorchestra's CHAT_SYSTEM is %q; the corpus has %q", got, OrchestraSystem)
	}
	if !sameJSON(t, orch["TOOLS"], "["+CalcSchema+","+ExpertSchema+"]") {
		t.Errorf("toolorchestra's TOOLS differ from the corpus's [calc, expert]")
	}
	flow := exampleGlobals(t, filepath.Join(root, "agentflow", "agentflow.star"))
	if got := starlarkString(t, flow, "CHAT_SYSTEM"); got != PlannerSystem {
		t.Errorf("agentflow's CHAT_SYSTEM is %q; the corpus has %q", got, PlannerSystem)
	}
	if !sameJSON(t, flow["TOOLS"], "["+CalcSchema+","+AskSchema+"]") {
		t.Errorf("agentflow's TOOLS differ from the corpus's [calc, ask]")
	}
	mem := exampleGlobals(t, filepath.Join(root, "memagent", "memagent.star"))
	for name, want := range map[string]int{"CHAT_CHUNK": ChatChunk, "CHAT_MEMORY_CHARS": ChatMemoryChars} {
		if got, _ := starlark.AsInt32(mem[name]); got != want {
			t.Errorf("memagent's %s is %v; the corpus has %d", name, mem[name], want)
		}
	}
	prompt := mem["chat_prompt"].(starlark.Callable)
	for _, chunk := range []starlark.Value{starlark.None, starlark.String("Ann's desk is 12. A dog barked.")} {
		got, err := starlark.Call(&starlark.Thread{}, prompt, starlark.Tuple{starlark.String("What is Ann's desk?"), starlark.String("none"), chunk}, nil)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := starlark.AsString(chunk)
		if want := MemoryNotesPrompt("What is Ann's desk?", "none", c); string(got.(starlark.String)) != want {
			t.Errorf("memagent's chat_prompt gives\n%q\nthe corpus's MemoryNotesPrompt\n%q", got, want)
		}
	}
}

func TestChatCorpus(t *testing.T) {
	c := ChatCorpus{Seed: 1}
	kinds := map[string]int{}
	calls, guesses := 0, 0
	for i := range 2000 {
		e := c.Example(i)
		kinds[e.Kind]++
		if e2 := c.Example(i); !reflect.DeepEqual(e, e2) {
			t.Fatal("examples are not a function of (seed, index)")
		}
		if e.Response == "" || len(e.Context) == 0 || e.Context[len(e.Context)-1].Role == "assistant" {
			t.Fatalf("example %d (%s) is not a conversation before an assistant turn: %+v", i, e.Kind, e)
		}
		for _, s := range e.Tools {
			var v map[string]any
			if err := jsonUnmarshal(s, &v); err != nil {
				t.Fatalf("example %d: tool schema %s: %v", i, s, err)
			}
		}
		if strings.HasPrefix(e.Response, "<tool_call>") {
			var call struct {
				Name      string            `json:"name"`
				Arguments map[string]string `json:"arguments"`
			}
			body := strings.TrimSuffix(strings.TrimPrefix(e.Response, "<tool_call>\n"), "\n</tool_call>")
			if err := jsonUnmarshal(body, &call); err != nil || call.Name == "" || len(call.Arguments) != 1 {
				t.Fatalf("example %d: %q is not one Qwen tool call: %v", i, e.Response, err)
			}
			if e.Kind == "calc" && len(e.Context) == 2 {
				calls++
			}
		} else if e.Kind == "calc" && len(e.Context) == 2 {
			guesses++
		}
	}
	for kind, want := range map[string]int{"calc": 640, "orchestra": 440, "planner": 280, "verifier": 120, "memory": 400, "arith": 120} {
		if got := kinds[kind]; got < want*7/10 || got > want*13/10 {
			t.Errorf("%d %s examples of 2000; want about %d", got, kind, want)
		}
	}
	// The calculator agent's first turn calls the tool about 4 times in 7: room to learn.
	if calls < guesses || calls > 2*guesses {
		t.Errorf("first calc turns: %d calls, %d guesses; want about 4 to 3", calls, guesses)
	}
	if got := QwenToolCall("calc", [2]string{"expr", `4"2`}); got != "<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\": \"4\\\"2\"}}\n</tool_call>" {
		t.Errorf("QwenToolCall = %q", got)
	}
}

func jsonUnmarshal(s string, v any) error { return jsonstd.Unmarshal([]byte(s), v) }

// TestChatCorpusMemoryAndExpert checks the two skills issue 33's MemAgent and ToolOrchestra need
// to be taught: about half the MemAgent notes updates read the chunk that holds the fact, whose
// note fits the notes' size; and an expert call names a part of the question by its letter.
func TestChatCorpusMemoryAndExpert(t *testing.T) {
	c := ChatCorpus{Seed: 1}
	updates, holding, experts := 0, 0, 0
	for i := range 2000 {
		e := c.Example(i)
		last := e.Context[len(e.Context)-1].Content
		switch {
		case e.Kind == "memory" && strings.Contains(last, "\nChunk: "):
			updates++
			chunk := last[strings.Index(last, "\nChunk: ")+len("\nChunk: "):]
			if n := len(Sentences(chunk)); n > ChatChunk {
				t.Fatalf("example %d: a chunk of %d sentences; want at most %d", i, n, ChatChunk)
			}
			if e.Right && e.Response != "none" && !strings.HasPrefix(last[strings.Index(last, "Notes so far: "):], "Notes so far: "+e.Response) {
				holding++ // a note of the fact from this chunk
				if len(e.Response) > ChatMemoryChars {
					t.Errorf("example %d: note %q is longer than %d characters", i, e.Response, ChatMemoryChars)
				}
			}
		case e.Kind == "orchestra" && strings.Contains(e.Response, `"expert"`):
			experts++
			var call struct {
				Arguments map[string]string `json:"arguments"`
			}
			body := strings.TrimSuffix(strings.TrimPrefix(e.Response, "<tool_call>\n"), "\n</tool_call>")
			if err := jsonUnmarshal(body, &call); err != nil {
				t.Fatal(err)
			}
			if experts > 1 && call.Arguments["part"] == "" {
				continue // reported once
			}
			p := call.Arguments["part"]
			if len(p) != 1 || !strings.Contains(e.Context[1].Content, "("+p+") ") {
				t.Errorf("example %d: expert call %s does not name a part of %q by its letter", i, e.Response, e.Context[1].Content)
			}
		}
	}
	if updates < 100 || holding*10 < updates*4 {
		t.Errorf("%d of %d notes updates write the fact from their chunk; want about half", holding, updates)
	}
	if experts < 20 {
		t.Errorf("%d expert calls in 2000 examples; want more", experts)
	}
}

// VaryChunks gives the notes updates chunks of every size from 1 to ChatChunk sentences, each a
// run of the document's sentences whose note is the fact when the chunk holds it; every other
// example is the default corpus's.
func TestChatCorpusVaryChunks(t *testing.T) {
	plain, vary := ChatCorpus{Seed: 1}, ChatCorpus{Seed: 1, VaryChunks: true}
	sizes := map[int]int{}
	found := 0
	for i := range 3000 {
		a, b := plain.Example(i), vary.Example(i)
		last := b.Context[len(b.Context)-1].Content
		at := strings.Index(last, "\nChunk: ")
		if b.Kind != "memory" || at < 0 {
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("example %d (%s) differs from the default corpus's: %+v", i, b.Kind, b)
			}
			continue
		}
		chunk := Sentences(last[at+len("\nChunk: "):])
		sizes[len(chunk)]++
		q := last[strings.Index(last, "Question: What is ")+len("Question: What is ") : strings.Index(last, "?\nNotes")]
		for _, s := range chunk {
			if strings.HasPrefix(s, q+" is ") && b.Right {
				found++
				if b.Response != s {
					t.Errorf("example %d: the chunk holds %q but the note is %q", i, s, b.Response)
				}
			}
		}
	}
	for n := 1; n <= ChatChunk; n++ {
		if sizes[n] < 5 {
			t.Errorf("chunks of %d sentences: %d; want every size from 1 to %d (%v)", n, sizes[n], ChatChunk, sizes)
		}
	}
	if found < 50 {
		t.Errorf("%d notes updates find the fact in their chunk; want about half of them", found)
	}
}

// Every synthetic:arith problem's expression is the one its answer is: what the calculator tool
// (starlib.Calc, the examples' calc) gives for it is its label, at every difficulty; and the
// problem is Problem's.
func TestArithProblemExpr(t *testing.T) {
	for d := 1; d <= MaxDifficulty; d++ {
		a := Arith{Seed: 5, Difficulty: d}
		for i := range 300 {
			p, expr := a.ProblemExpr(i)
			if p != a.Problem(i) {
				t.Fatalf("difficulty %d, problem %d: %+v, Problem gives %+v", d, i, p, a.Problem(i))
			}
			if got := starlib.Calc(expr); got != p.Label {
				t.Fatalf("%q (label %s): expression %q gives %s", p.Prompt, p.Label, expr, got)
			}
		}
	}
}

// EasyCalc sends some easy parts to the calculator with their own expression, whose result the
// conversation then shows; every example other than the orchestrator's is the default corpus's.
func TestChatCorpusEasyCalc(t *testing.T) {
	plain, easy := ChatCorpus{Seed: 1}, ChatCorpus{Seed: 1, EasyCalc: true}
	calls := 0
	for i := range 3000 {
		a, b := plain.Example(i), easy.Example(i)
		if b.Kind != "orchestra" {
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("example %d (%s) differs from the default corpus's", i, b.Kind)
			}
			continue
		}
		_, parts := MultiPart{Seed: 1}.Problem(i)
		for j, m := range b.Context {
			if m.Role != "assistant" || !strings.Contains(m.Content, `"calc"`) {
				continue
			}
			for _, pt := range parts {
				if pt.Kind == "arith" && strings.Contains(m.Content, `"expr": "`+pt.arithExpr+`"`) {
					calls++
					if b.Context[j+1].Content != pt.Label {
						t.Fatalf("example %d: %s answered %q, want %s", i, m.Content, b.Context[j+1].Content, pt.Label)
					}
				}
			}
		}
	}
	if calls < 20 {
		t.Errorf("%d calculator calls for an easy part in 3,000 examples; want about a third of the easy parts'", calls)
	}
	for task, want := range map[string]ChatCorpus{
		"synthetic:chat":                                  {Seed: 3},
		"synthetic:chat?easy_calc=true":                   {Seed: 3, EasyCalc: true},
		"synthetic:chat?vary_chunks=true&easy_calc=false": {Seed: 3, VaryChunks: true},
		"synthetic:chat?easy_calc=true&vary_chunks=true":  {Seed: 3, VaryChunks: true, EasyCalc: true},
	} {
		if c, ok, err := ParseChatCorpus(task, 3); err != nil || !ok || c != want {
			t.Errorf("%s: %+v %v %v; want %+v", task, c, ok, err, want)
		}
	}
	for _, task := range []string{"synthetic:chat?seed=2", "synthetic:chat?easy_calc=yes", "synthetic:chat?easy_calc"} {
		if _, ok, err := ParseChatCorpus(task, 3); err == nil || !ok {
			t.Errorf("%s: no error", task)
		}
	}
	if _, ok, _ := ParseChatCorpus("synthetic:arith", 3); ok {
		t.Error("synthetic:arith read as the chat corpus")
	}
}
