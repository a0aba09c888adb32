package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines"
)

// The chat corpus teaches an embedded chat model the conversations of the agent examples in the
// form a chat model gets them: a system prompt, the tools' JSON schemas (rendered into the system
// prompt by the model's chat template, as Qwen3's does) and Qwen3's tool-call format. Its prompts
// are the examples' own (examples/*/*.star; TestChatCorpusMatchesExamples keeps the two equal), so
// one script speaks one format to the embedded model and to a torch or OpenAI chat model.

// Tool schemas of the agent examples, as the scripts pass them to chat(tools = …).
var (
	CalcSchema = toolSchema("calc", "Evaluates integer arithmetic with + - * and returns the result.", "expr")
	// ExpertSchema is ToolOrchestra's expert: another policy answers a part of the question, named
	// by its letter (a short argument the orchestrator can learn to write, where a copied
	// sub-question is a long one it writes badly).
	ExpertSchema = toolSchema("expert", "Has an expert model answer one part of the question (its letter) and returns its answer.", "part")
	// AskSchema is AgentFlow's executor: another policy answers a sub-question.
	AskSchema = toolSchema("ask", "Asks the executor model a sub-question and returns its answer.", "question")
)

// System prompts of the agent examples' chat form.
const (
	CalcSystem = `Solve the problem. Call the calc tool for the arithmetic, then give the final answer as \boxed{N}.`
	// OrchestraSystem is ToolOrchestra's orchestrator.
	OrchestraSystem = "You are an orchestrator. Answer every part of the question. For a part, call calc(expr) " +
		"for arithmetic or expert(part) to have an expert model answer that part, or answer it yourself. " +
		"Finally reply without a tool call, with the answers of all parts in order, separated " +
		`by commas, in one \boxed{}: \boxed{12, 7}.`
	// PlannerSystem is AgentFlow's planner.
	PlannerSystem = "You are the planner of a planner-executor-verifier loop. Each turn, plan the next " +
		"action as one tool call: calc(expr) for arithmetic, ask(question) to ask the executor " +
		"a sub-question. The result comes back with a verifier's note. When you know the " +
		`answer, reply without a tool call and give it as \boxed{N}.`
)

// MemAgent's chat form (examples/memagent): synthetic:facts documents of ChatFacts facts (about
// 500 characters, eight times the notes), read in chunks of ChatChunk sentences into notes of at
// most ChatMemoryChars characters.
const (
	ChatFacts       = 20
	ChatChunk       = 10
	ChatMemoryChars = 64
)

// toolSchema is the OpenAI-style schema of a tool with one required string argument, as the
// examples write it in Starlark; its JSON is what json.encode gives for that dict.
func toolSchema(name, description, arg string) string {
	return `{"type":"function","function":{"name":"` + name + `","description":"` + description +
		`","parameters":{"type":"object","properties":{"` + arg + `":{"type":"string"}},"required":["` + arg + `"]}}}`
}

// QwenToolCall is an assistant turn's call of a tool with string arguments in Qwen3's format:
// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, the JSON as Python's json.dumps
// writes it (the chat template's tojson).
func QwenToolCall(name string, args ...[2]string) string {
	var b strings.Builder
	b.WriteString("<tool_call>\n{\"name\": ")
	b.WriteString(jsonString(name))
	b.WriteString(", \"arguments\": {")
	for k, a := range args {
		if k > 0 {
			b.WriteString(", ")
		}
		b.WriteString(jsonString(a[0]) + ": " + jsonString(a[1]))
	}
	b.WriteString("}}\n</tool_call>")
	return b.String()
}

func jsonString(s string) string {
	b, _ := json.Marshal(s) // a string always encodes
	return string(b)
}

// MemoryNotesPrompt is the user message of a MemAgent turn in the chat form: with chunk "" the
// final answer from the notes, else a notes update from the next chunk.
func MemoryNotesPrompt(question, notes, chunk string) string {
	if chunk == "" {
		return "Answer the question from your notes alone. Give the answer as \\boxed{answer}.\n\n" +
			"Question: " + question + "\nNotes: " + notes
	}
	return "You are reading a long document in chunks to answer a question. Keep notes of what " +
		"helps answer it. Reply with the new notes only, at most " + strconv.Itoa(ChatMemoryChars) + " characters: the notes so " +
		"far with whatever in this chunk answers the question.\n\nQuestion: " + question +
		"\nNotes so far: " + notes + "\nChunk: " + chunk
}

// ChatExample is one example of the chat corpus: the tools the conversation offers (JSON schemas),
// the conversation before an assistant turn, and that turn. Kind names the part of the corpus it
// comes from (calc, orchestra, planner, verifier, memory, arith).
type ChatExample struct {
	Kind string
	// Right marks a response that is what the task wants (a guess, a sloppy note or a call
	// of the wrong tool is not): held-out evaluation compares a model's answers with these.
	Right    bool
	Tools    []string
	Context  []engines.Message
	Response string
}

// ChatCorpus is the pretraining corpus of the embedded chat model. Example i is a pure function of
// (Seed, i). It teaches each agent example's formats deliberately unevenly, so reinforcement
// learning has something left to learn: where calling a tool is right, the corpus sometimes
// answers directly instead (a guess); results are copied into answers faithfully. Out of 100:
//
//   - 32 calculator agent (examples/calculator_agent): the first turn calls calc (22, 4 times in 7)
//     or guesses; 10 more answer from the call's result;
//   - 22 ToolOrchestra orchestrator (examples/toolorchestra, the whole question at once): calls for
//     the parts in order — calc for a calculator part, expert (by the part's letter) for the other
//     or, now and then, an answer of its own — then one \boxed{} with every part's answer;
//   - 14 AgentFlow planner (examples/agentflow) and 6 of its verifier;
//   - 20 MemAgent (examples/memagent): 14 notes updates (half of them from the chunk that holds the
//     fact) and 6 answers from notes;
//   - 6 arithmetic word problems, half with candidate answers (the debate's second round).
//
// Two variants (options of `synthetic:chat`, neither in builtin:tiny-chat's corpus) change one kind
// each and leave the other examples as they are:
//   - VaryChunks (vary_chunks=true) gives each MemAgent notes update a chunk of 1 to ChatChunk
//     sentences, uniformly, instead of ChatChunk: a curriculum from copying a lone sentence to
//     finding one among ten;
//   - EasyCalc (easy_calc=true) sends a third of the orchestrator's easy parts to the calculator
//     (their own expression), the rest to the expert or its own answer as before: all three routes
//     an easy part can take, so that reinforcement learning can find the cheap one that is right.
type ChatCorpus struct {
	Seed       uint64
	VaryChunks bool
	EasyCalc   bool
}

// ParseChatCorpus reads "synthetic:chat[?vary_chunks=true&easy_calc=true]" (each option true or
// false); ok is false for another task source.
func ParseChatCorpus(task string, seed uint64) (c ChatCorpus, ok bool, err error) {
	name, query, _ := strings.Cut(task, "?")
	if name != "synthetic:chat" {
		return c, false, nil
	}
	c.Seed = seed
	if query == "" {
		return c, true, nil
	}
	for _, kv := range strings.Split(query, "&") {
		k, v, _ := strings.Cut(kv, "=")
		if v != "true" && v != "false" {
			return c, true, fmt.Errorf("%s: option %q: want %s=true or %s=false", task, kv, k, k)
		}
		b := v == "true"
		switch k {
		case "vary_chunks":
			c.VaryChunks = b
		case "easy_calc":
			c.EasyCalc = b
		default:
			return c, true, fmt.Errorf("%s: unknown option %q (synthetic:chat takes vary_chunks and easy_calc; give its seed with --seed)", task, k)
		}
	}
	return c, true, nil
}

// Example returns example i.
func (c ChatCorpus) Example(i int) ChatExample {
	r := rand.New(rand.NewPCG(c.Seed^0x63686174, uint64(i))) // "chat"
	switch k := r.IntN(100); {
	case k < 32:
		return c.calcExample(r, i, k < 22)
	case k < 54:
		return c.orchestraExample(r, i)
	case k < 74:
		return c.plannerExample(r, i, k < 68)
	case k < 94:
		return c.memoryExample(r, i, k < 88)
	default:
		prompt, response := Arith{Seed: c.Seed, Difficulty: 2}.Example(i)
		return ChatExample{Kind: "arith", Context: []engines.Message{{Role: "user", Content: prompt}}, Response: response, Right: true}
	}
}

func sys(s string) engines.Message  { return engines.Message{Role: "system", Content: s} }
func user(s string) engines.Message { return engines.Message{Role: "user", Content: s} }
func asst(s string) engines.Message { return engines.Message{Role: "assistant", Content: s} }
func tool(s string) engines.Message { return engines.Message{Role: "tool", Content: s} }

// guess is a wrong answer near label, or label itself with probability 1/4: what a model that
// cannot do the arithmetic writes.
func guess(r *rand.Rand, label string) string {
	v, _ := strconv.Atoi(label)
	if r.IntN(4) == 0 {
		return label
	}
	d := 1 + r.IntN(max(2, v/10))
	if r.IntN(2) == 0 && v-d >= 0 {
		return strconv.Itoa(v - d)
	}
	return strconv.Itoa(v + d)
}

// calcExample: the calculator agent's first turn (first) or its answer after the call.
func (c ChatCorpus) calcExample(r *rand.Rand, i int, first bool) ChatExample {
	p, expr := Calc{Seed: c.Seed}.Problem(i)
	e := ChatExample{Kind: "calc", Tools: []string{CalcSchema}, Context: []engines.Message{sys(CalcSystem), user(p.Prompt)}}
	call := QwenToolCall(CalcTool, [2]string{"expr", expr})
	switch {
	case first && r.IntN(7) < 4:
		e.Response, e.Right = call, true
	case first:
		e.Response = `\boxed{` + guess(r, p.Label) + `}`
	default:
		e.Context = append(e.Context, asst(call), tool(p.Label))
		e.Response, e.Right = p.Answer(), true
	}
	return e
}

// orchestraExample is one orchestrator turn of a synthetic:multipart task given whole: a call for
// the next part, or the final answer once every part has been dealt with.
func (c ChatCorpus) orchestraExample(r *rand.Rand, i int) ChatExample {
	p, parts := MultiPart{Seed: c.Seed}.Problem(i)
	e := ChatExample{Kind: "orchestra", Tools: []string{CalcSchema, ExpertSchema},
		Context: []engines.Message{sys(OrchestraSystem), user(p.Prompt)}}
	// The plan of the whole conversation: per part, a call and its result, or an own answer.
	type step struct {
		call, result string
		right        bool
	}
	var plan []step
	answers := make([]string, len(parts))
	right := true // every part answered right
	for k, pt := range parts {
		switch {
		case pt.Kind == "calc" && r.IntN(5) > 0:
			plan = append(plan, step{QwenToolCall(CalcTool, [2]string{"expr", pt.Expr}), pt.Label, true})
			answers[k] = pt.Label
		case pt.Kind == "calc": // asked the expert, who cannot do it
			answers[k] = guess(r, pt.Label)
			plan = append(plan, step{QwenToolCall("expert", [2]string{"part", partLetter(k)}), `\boxed{` + answers[k] + `}`, false})
			right = right && answers[k] == pt.Label
		case c.EasyCalc && r.IntN(3) == 0:
			plan = append(plan, step{QwenToolCall(CalcTool, [2]string{"expr", pt.arithExpr}), pt.Label, true})
			answers[k] = pt.Label
		case r.IntN(3) == 0: // an easy part answered without a call
			answers[k] = pt.Label
		default:
			plan = append(plan, step{QwenToolCall("expert", [2]string{"part", partLetter(k)}), `\boxed{` + pt.Label + `}`, true})
			answers[k] = pt.Label
		}
	}
	at := r.IntN(len(plan) + 1) // the turn this example is
	for _, s := range plan[:at] {
		e.Context = append(e.Context, asst(s.call), tool(s.result))
	}
	if at < len(plan) {
		e.Response, e.Right = plan[at].call, plan[at].right
	} else {
		e.Response, e.Right = `\boxed{`+strings.Join(answers, ", ")+`}`, right
	}
	return e
}

// partLetter is the letter of part k in a synthetic:multipart prompt: "a" for "(a) …".
func partLetter(k int) string { return string(rune('a' + k)) }

// plannerExample is an AgentFlow planner turn (planner) or a verifier's reply.
func (c ChatCorpus) plannerExample(r *rand.Rand, i int, planner bool) ChatExample {
	p, expr := Calc{Seed: c.Seed}.Problem(i)
	call := QwenToolCall(CalcTool, [2]string{"expr", expr})
	if !planner {
		// The verifier reads the question, the planner's action and its result, and answers when
		// the result is the answer. A result that is not a number gets a note instead.
		e := ChatExample{Kind: "verifier", Context: []engines.Message{user(p.Prompt), asst(call), tool(p.Label)}, Response: p.Answer(), Right: true}
		if r.IntN(4) == 0 {
			e.Context[2] = tool("error: calc needs a string \"expr\"")
			e.Response = "The action failed; call calc with the expression."
		}
		return e
	}
	e := ChatExample{Kind: "planner", Tools: []string{CalcSchema, AskSchema}, Context: []engines.Message{sys(PlannerSystem), user(p.Prompt)}}
	switch r.IntN(10) {
	case 0, 1, 2, 3, 4:
		e.Response, e.Right = call, true
	case 5, 6:
		e.Response = QwenToolCall("ask", [2]string{"question", p.Prompt})
	case 7:
		e.Response = `\boxed{` + guess(r, p.Label) + `}`
	default:
		e.Context = append(e.Context, asst(call), tool(p.Label+" Verifier: The action failed; call calc with the expression."))
		e.Response, e.Right = p.Answer(), true
	}
	return e
}

// memoryExample is a MemAgent notes update (update) or the answer from the notes. Half the updates
// read the chunk that holds the fact: finding it is the skill MemAgent needs most.
func (c ChatCorpus) memoryExample(r *rand.Rand, i int, update bool) ChatExample {
	fp, doc := Facts{Seed: c.Seed, N: ChatFacts}.Problem(i)
	fact := strings.TrimSuffix(strings.TrimPrefix(fp.Prompt, "What is "), "?") + " is " + fp.Label + "."
	sents := Sentences(doc)
	at := slices.Index(sents, fact)
	size := ChatChunk
	if c.VaryChunks && update {
		size = 1 + r.IntN(ChatChunk)
	}
	chunks := (len(sents) + size - 1) / size
	k := r.IntN(chunks)
	if update && at >= 0 && r.IntN(2) == 0 {
		k = at / size
	}
	notes := "none"
	if at >= 0 && at < k*size {
		notes = fact
	}
	e := ChatExample{Kind: "memory"}
	if !update {
		if notes == "none" && r.IntN(2) == 0 {
			notes = fact
		}
		e.Context = []engines.Message{user(MemoryNotesPrompt(fp.Prompt, notes, ""))}
		e.Response, e.Right = fp.Answer(), notes != "none"
		if notes == "none" {
			e.Response = `\boxed{` + guess(r, fp.Label) + `}`
		}
		return e
	}
	chunk := strings.Join(sents[k*size:min(len(sents), (k+1)*size)], " ")
	e.Context = []engines.Message{user(MemoryNotesPrompt(fp.Prompt, notes, chunk))}
	e.Response, e.Right = notes, true
	if at >= k*size && at < (k+1)*size {
		e.Response = fact
		if r.IntN(4) == 0 { // a sloppier note: the sentence around it too
			e.Response, e.Right = strings.Join(sents[max(at-1, k*size):at+1], " "), false
		}
	}
	return e
}

// String names the corpus for logs.
func (c ChatCorpus) String() string {
	var opts []string
	if c.VaryChunks {
		opts = append(opts, fmt.Sprintf("MemAgent chunks of 1 to %d sentences", ChatChunk))
	}
	if c.EasyCalc {
		opts = append(opts, "easy parts to the calculator too")
	}
	if len(opts) == 0 {
		return fmt.Sprintf("the synthetic chat corpus (seed %d)", c.Seed)
	}
	return fmt.Sprintf("the synthetic chat corpus (seed %d, %s)", c.Seed, strings.Join(opts, ", "))
}

// ChatEval answers examples 0..n−1 of c with e (greedy; tools rendered by the engine's chat
// template) and returns, per kind and under "all", the share of the examples marked Right whose
// response the model reproduces exactly, and a few of its responses.
func ChatEval(ctx context.Context, e engines.Engine, c ChatCorpus, n int, maxTokens int) (map[string]float64, []string, error) {
	r, ok := e.(engines.Renderer)
	if !ok {
		return nil, nil, fmt.Errorf("the engine does not render chat templates")
	}
	var exs []ChatExample
	var renders []engines.RenderRequest
	for i := 0; len(exs) < n && i < 100*n; i++ {
		if ex := c.Example(i); ex.Right {
			exs = append(exs, ex)
			renders = append(renders, engines.RenderRequest{Messages: ex.Context, Tools: ex.Tools, AddGenerationPrompt: true})
		}
	}
	prompts, err := r.Render(ctx, renders)
	if err != nil {
		return nil, nil, err
	}
	reqs := make([]engines.GenerateRequest, len(exs))
	for k := range reqs {
		reqs[k] = engines.GenerateRequest{ID: fmt.Sprint(k), PromptTokens: prompts[k], Sampling: engines.Sampling{MaxTokens: maxTokens}}
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		return nil, nil, err
	}
	right, total := map[string]float64{}, map[string]float64{}
	var sample []string
	for k, cm := range cs {
		kind := exs[k].Kind
		total[kind]++
		total["all"]++
		if strings.TrimSpace(cm.Text) == exs[k].Response {
			right[kind]++
			right["all"]++
		}
		if len(sample) < 6 && (k%7 == 0) {
			sample = append(sample, kind+": "+cm.Text)
		}
	}
	for kind := range total {
		right[kind] /= total[kind]
	}
	return right, sample, nil
}
