package tasks

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines"
)

// Example is example i of the pretraining corpus of builtin:tiny-arith, drawn from problem i of
// a: the CLI's `slimen pretrain` hands these to the tiny engine's Pretrain. Half the prompts are
// the bare problem; the other half append candidate answers, as the multi-agent topologies do
// when they show one agent the others' answers:
//
//	Ann has 12 pens and gets 7 more. How many pens? Answers: 19, 17.
//
// Each candidate is right with probability 1/2. The response is always the correct \boxed{N}, so
// the model learns to use agreeing context without trusting it blindly. Formats are terse: every
// character is a token.
func (a Arith) Example(i int) (prompt, response string) {
	p := a.Problem(i)
	r := rand.New(rand.NewPCG(a.Seed^0x636f_7270_7573, uint64(i))) // "corpus"
	prompt = p.Prompt
	if r.IntN(2) == 1 {
		prompt += " Answers: " + strings.Join(candidates(r, p.Label, 1+r.IntN(3)), ", ") + "."
	}
	return prompt, p.Answer()
}

// candidates returns n answers to show with a problem, each the label with probability 1/2 and
// otherwise a nearby wrong non-negative number.
func candidates(r *rand.Rand, label string, n int) []string {
	want, _ := strconv.Atoi(label)
	out := make([]string, n)
	for k := range out {
		v := want
		if r.IntN(2) == 0 {
			for v == want || v < 0 {
				v = want + r.IntN(21) - 10
			}
		}
		out[k] = strconv.Itoa(v)
	}
	return out
}

// ArithAccuracy generates one answer to each of problems 0..n−1 of a at the given temperature and
// returns the fraction whose last \boxed{…} equals the label exactly.
func ArithAccuracy(ctx context.Context, e engines.Engine, a Arith, n int, temperature float64, seed uint64) (float64, error) {
	reqs := make([]engines.GenerateRequest, n)
	for i := range reqs {
		p := a.Problem(i)
		reqs[i] = engines.GenerateRequest{ID: p.ID, Messages: []engines.Message{{Role: "user", Content: p.Prompt}},
			Sampling: engines.Sampling{MaxTokens: 16, Temperature: temperature, Seed: seed}}
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		return 0, err
	}
	right := 0
	for i, c := range cs {
		if a.Correct(i, c.Text) {
			right++
		}
	}
	return float64(right) / float64(n), nil
}

// Correct says whether text answers problem i: its last \boxed{…} holds the label exactly.
func (a Arith) Correct(i int, text string) bool {
	got, ok := lastBoxed(text)
	return ok && got == a.Problem(i).Label
}

// lastBoxed returns the content of the last \boxed{…} in s (no nesting: the answers are integers).
func lastBoxed(s string) (string, bool) {
	i := strings.LastIndex(s, `\boxed{`)
	if i < 0 {
		return "", false
	}
	rest := s[i+len(`\boxed{`):]
	j := strings.IndexByte(rest, '}')
	if j < 0 {
		return "", false
	}
	return strings.TrimSpace(rest[:j]), true
}

// String names the source of a for logs, as a data path would.
func (a Arith) String() string {
	return fmt.Sprintf("synthetic:arith?difficulty=%d&seed=%d", a.Difficulty, a.Seed)
}

// AgentExample is example i of the pretraining corpus of builtin:tiny-agent: the conversation
// before an assistant turn and the turn itself. It teaches the formats of the agent examples,
// deliberately unevenly, so that reinforcement learning has something left to learn. Out of 20:
//
//   - 5: the first turn of a synthetic:calc problem (problem i of c) is a calculator call,
//     <tool_call>{"name": "calc", "arguments": {"expr": "47*29"}}</tool_call>;
//   - 5: after that call and its result (a tool message), the answer \boxed{N} copies the result;
//   - 4: the first turn answers a calc problem directly, which the model cannot compute;
//   - 2: a synthetic:arith problem at difficulty 2 answered directly, as builtin:tiny-arith does;
//   - 2: a MemAgent memory update on a synthetic:facts document (examples/memagent): the question,
//     the memory and a chunk of the document in, the new memory out (the fact asked for if the
//     chunk holds it, else the memory as it was);
//   - 2: a MemAgent answer from the memory.
//
// A model trained briefly on it calls the tool on about half the calc problems, answers the rest
// directly (mostly wrongly), and copies the numbers of its calls only sometimes right.
func (c Calc) AgentExample(i int) (context []engines.Message, response string) {
	r := rand.New(rand.NewPCG(c.Seed^0x6167656e74, uint64(i))) // "agent"
	p, expr := c.Problem(i)
	turn := func(s string) []engines.Message { return []engines.Message{user(s)} } // a conversation of one user message
	switch k := r.IntN(20); {
	case k < 5:
		return turn(p.Prompt), ToolCall(expr)
	case k < 10:
		return append(turn(p.Prompt), asst(ToolCall(expr)), tool(p.Label)), p.Answer()
	case k < 14:
		return turn(p.Prompt), p.Answer()
	case k < 16:
		prompt, resp := Arith{Seed: c.Seed, Difficulty: 2}.Example(i)
		return turn(prompt), resp
	default:
		fp, doc := Facts{Seed: c.Seed}.Problem(i)
		fact := fp.Prompt[len("What is "):len(fp.Prompt)-1] + " is " + fp.Label + "."
		sents := Sentences(doc)
		at := slices.Index(sents, fact)
		chunk := r.IntN((len(sents) + MemoryChunk - 1) / MemoryChunk)
		memory := "none"
		if at >= 0 && at < chunk*MemoryChunk {
			memory = fact
		}
		if k >= 18 {
			if memory == "none" && r.IntN(2) == 0 {
				memory = fact
			}
			return turn(MemoryPrompt(fp.Prompt, memory, "")), fp.Answer()
		}
		text := strings.Join(sents[chunk*MemoryChunk:min(len(sents), (chunk+1)*MemoryChunk)], " ")
		if at >= chunk*MemoryChunk && at < (chunk+1)*MemoryChunk {
			return turn(MemoryPrompt(fp.Prompt, memory, text)), fact
		}
		return turn(MemoryPrompt(fp.Prompt, memory, text)), memory
	}
}

// CalcFirstTurns samples the first turn of problems 0..n−1 of c at the given temperature and
// returns the fraction that are exactly the right tool call and the fraction that answer
// directly (a \boxed{…} and no <tool_call>).
func CalcFirstTurns(ctx context.Context, e engines.Engine, c Calc, n int, temperature float64, seed uint64) (call, direct float64, sample []string, err error) {
	reqs := make([]engines.GenerateRequest, n)
	want := make([]string, n)
	for i := range reqs {
		p, expr := c.Problem(i)
		want[i] = ToolCall(expr)
		reqs[i] = engines.GenerateRequest{ID: p.ID, Messages: []engines.Message{{Role: "user", Content: p.Prompt}},
			Sampling: engines.Sampling{MaxTokens: 96, Temperature: temperature, Seed: seed}}
	}
	cs, err := e.Generate(ctx, reqs)
	if err != nil {
		return 0, 0, nil, err
	}
	for i, cm := range cs {
		if i < 3 {
			sample = append(sample, cm.Text)
		}
		switch {
		case cm.Text == want[i]:
			call++
		case !strings.Contains(cm.Text, "<tool_call>") && strings.Contains(cm.Text, `\boxed{`):
			direct++
		}
	}
	return call / float64(n), direct / float64(n), sample, nil
}
