package tasks

// Synthetic task families that make an agent's tools matter, beside synthetic:arith:
//
//   - synthetic:calc — arithmetic too large to do without a calculator (2-digit products,
//     3-digit sums and differences); task.metadata["expr"] is the expression.
//   - synthetic:facts — a long document of facts (longer than the embedded model's context) and a
//     question about one of them; task.metadata["document"] holds the document.
//   - synthetic:multipart — a question in several parts, some needing the calculator and some easy
//     enough for a small expert; task.metadata["parts"] lists them, each with its own prompt,
//     label and kind ("calc" or "arith").
//
// Like synthetic:arith, task i of a seed is a pure function of (family, seed, parameters, i).

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// Calc generates synthetic:calc problems: word problems in synthetic:arith's phrasing whose
// numbers are too large for the embedded model's arithmetic (2-digit products, 3-digit sums and
// differences). Problem i's expression (e.g. "47*29") is what a
// calculator needs.
type Calc struct{ Seed uint64 }

// Problem returns problem i and its expression.
func (c Calc) Problem(i int) (Problem, string) {
	r := rand.New(rand.NewPCG(c.Seed^0x63616c63, uint64(i)*0x9E3779B97F4A7C15+7)) // "calc"
	name, item := names[r.IntN(len(names))], items[r.IntN(len(items))]
	var prompt, expr string
	var ans int
	switch r.IntN(3) {
	case 0:
		x, y := 11+r.IntN(89), 11+r.IntN(89)
		prompt, expr, ans = fmt.Sprintf("%s has %d bags of %d %s.", name, x, y, item), fmt.Sprintf("%d*%d", x, y), x*y
	case 1:
		x, y := 100+r.IntN(900), 100+r.IntN(900)
		prompt, expr, ans = fmt.Sprintf("%s has %d %s and gets %d more.", name, x, item, y), fmt.Sprintf("%d+%d", x, y), x+y
	default:
		x, y := 100+r.IntN(900), 100+r.IntN(900)
		if y > x {
			x, y = y, x
		}
		prompt, expr, ans = fmt.Sprintf("%s has %d %s and gives away %d.", name, x, item, y), fmt.Sprintf("%d-%d", x, y), x-y
	}
	return Problem{
		ID:     fmt.Sprintf("calc-s%d-%d", c.Seed, i),
		Prompt: prompt + " How many " + item + "?",
		Label:  strconv.Itoa(ans),
	}, expr
}

// CalcTool is the name of the calculator tool in the agent corpus and the examples.
const CalcTool = "calc"

// ToolCall is the assistant turn that calls the calculator on expr, in the Hermes/Qwen format
// that @slimen//tools.star's parse_tool_calls reads.
func ToolCall(expr string) string {
	return `<tool_call>{"name": "` + CalcTool + `", "arguments": {"expr": "` + expr + `"}}</tool_call>`
}

// Facts generates synthetic:facts tasks: a document of N facts "NAME's KEY is V." among filler
// sentences, and a question about one fact. The document is longer than the embedded model's
// 512-token context at the default N, so an agent has to read it in chunks (MemAgent).
type Facts struct {
	Seed uint64
	N    int // facts in a document; 0: 40
}

var (
	factKeys = []string{"locker", "room", "code", "bus", "desk", "seat"}
	fillers  = []string{"The sun was out.", "It rained at noon.", "The bell rang twice.",
		"Lunch was late.", "A dog barked.", "The hall was quiet.", "Someone sang."}
)

// Problem returns task i: the question as the prompt, the fact's value as the label, and the
// document.
func (f Facts) Problem(i int) (Problem, string) {
	n := f.N
	if n <= 0 {
		n = 40
	}
	r := rand.New(rand.NewPCG(f.Seed^0x6661637473, uint64(i)*0x9E3779B97F4A7C15+11)) // "facts"
	type fact struct{ who, key, val string }
	var facts []fact
	seen := map[string]bool{}
	for len(facts) < n {
		who := names[r.IntN(len(names))]
		key := factKeys[r.IntN(len(factKeys))]
		if seen[who+key] {
			if len(seen) == len(names)*len(factKeys) {
				break
			}
			continue
		}
		seen[who+key] = true
		facts = append(facts, fact{who, key, strconv.Itoa(10 + r.IntN(90))})
	}
	var doc strings.Builder
	for k, ft := range facts {
		if k > 0 {
			doc.WriteByte(' ')
		}
		fmt.Fprintf(&doc, "%s's %s is %s.", ft.who, ft.key, ft.val)
		if r.IntN(2) == 0 {
			doc.WriteString(" " + fillers[r.IntN(len(fillers))])
		}
	}
	q := facts[r.IntN(len(facts))]
	return Problem{
		ID:     fmt.Sprintf("facts-n%d-s%d-%d", n, f.Seed, i),
		Prompt: fmt.Sprintf("What is %s's %s?", q.who, q.key),
		Label:  q.val,
	}, doc.String()
}

// Sentences splits a synthetic:facts document into its sentences, each ending with ".".
func Sentences(doc string) []string {
	parts := strings.Split(doc, ". ")
	for k := range parts[:len(parts)-1] {
		parts[k] += "."
	}
	return parts
}

// MemoryChunk is the number of sentences in one chunk a MemAgent reads (examples/memagent reads
// the document the same way).
const MemoryChunk = 10

// MemoryPrompt is the user message of a memory-update turn, and with chunk "" the one of the final
// answer: the question, the memory so far ("none" at first) and the next chunk.
func MemoryPrompt(question, memory, chunk string) string {
	if chunk == "" {
		return question + " Memory: " + memory
	}
	return question + " Memory: " + memory + " Text: " + chunk
}

// MultiPart generates synthetic:multipart tasks: Parts sub-questions, each a synthetic:calc
// problem (needs a calculator) or a synthetic:arith problem at difficulty 2 (a small expert can
// answer it), answered together as their answers joined by ", ".
type MultiPart struct {
	Seed  uint64
	Parts int // sub-questions per task; 0: 2
}

// Part is one sub-question of a MultiPart task.
type Part struct {
	Prompt, Label string
	Kind          string // "calc" or "arith"
	Expr          string // the calculator expression of a "calc" part
	// arithExpr is an "arith" part's expression, for the chat corpus's easy parts sent to the
	// calculator (ChatCorpus.EasyCalc); the tasks' metadata keeps Expr alone.
	arithExpr string
}

// Problem returns task i and its parts.
func (m MultiPart) Problem(i int) (Problem, []Part) {
	n := m.Parts
	if n <= 0 {
		n = 2
	}
	r := rand.New(rand.NewPCG(m.Seed^0x6d756c7469, uint64(i)*0x9E3779B97F4A7C15+13)) // "multi"
	parts := make([]Part, n)
	var prompt strings.Builder
	var labels []string
	for k := range parts {
		j := int(r.Uint32() >> 1)
		if r.IntN(2) == 0 {
			p, expr := Calc{Seed: m.Seed}.Problem(j)
			parts[k] = Part{Prompt: p.Prompt, Label: p.Label, Kind: "calc", Expr: expr}
		} else {
			p, expr := Arith{Seed: m.Seed, Difficulty: 2}.ProblemExpr(j)
			parts[k] = Part{Prompt: p.Prompt, Label: p.Label, Kind: "arith", arithExpr: expr}
		}
		fmt.Fprintf(&prompt, "(%c) %s ", 'a'+k, parts[k].Prompt)
		labels = append(labels, parts[k].Label)
	}
	return Problem{
		ID:     fmt.Sprintf("multipart-p%d-s%d-%d", n, m.Seed, i),
		Prompt: strings.TrimSpace(prompt.String()),
		Label:  strings.Join(labels, ", "),
	}, parts
}

// SyntheticNames lists the synthetic task families.
var SyntheticNames = []string{"arith", "calc", "facts", "multipart"}

// parseSynthetic opens the synthetic sources other than arith: "synthetic:calc[?seed=S]",
// "synthetic:facts[?facts=N&seed=S]", "synthetic:multipart[?parts=N&seed=S]". ok is false for
// any other path.
func parseSynthetic(path string, seed uint64) (Source, bool, error) {
	rest, found := strings.CutPrefix(path, "synthetic:")
	if !found {
		return nil, false, nil
	}
	name, query, _ := strings.Cut(rest, "?")
	params := map[string]*uint64{"seed": &seed}
	var n uint64
	switch name {
	case "calc":
	case "facts":
		params["facts"] = &n
	case "multipart":
		params["parts"] = &n
	default:
		return nil, false, nil
	}
	if query != "" {
		for _, kv := range strings.Split(query, "&") {
			k, v, _ := strings.Cut(kv, "=")
			dst, ok := params[k]
			if !ok {
				return nil, true, fmt.Errorf("%s: unknown parameter %q (known: %s)", path, k, strings.Join(slices.Sorted(maps.Keys(params)), ", "))
			}
			u, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return nil, true, fmt.Errorf("%s: %s=%q is not a non-negative integer", path, k, v)
			}
			*dst = u
		}
	}
	switch name {
	case "facts":
		if n > uint64(len(names)*len(factKeys)) {
			return nil, true, fmt.Errorf("%s: facts must be at most %d", path, len(names)*len(factKeys))
		}
		return syntheticSource{path, func(i int) Task {
			p, doc := Facts{Seed: seed, N: int(n)}.Problem(i)
			return Task{ID: p.ID, Prompt: p.Prompt, Label: p.Label, HasLabel: true, Index: i,
				Metadata: map[string]any{"document": doc}}
		}}, true, nil
	case "multipart":
		if n > 8 {
			return nil, true, fmt.Errorf("%s: parts must be at most 8", path)
		}
		return syntheticSource{path, func(i int) Task {
			p, parts := MultiPart{Seed: seed, Parts: int(n)}.Problem(i)
			ps := make([]any, len(parts))
			for k, pt := range parts {
				ps[k] = map[string]any{"prompt": pt.Prompt, "label": pt.Label, "kind": pt.Kind, "expr": pt.Expr}
			}
			return Task{ID: p.ID, Prompt: p.Prompt, Label: p.Label, HasLabel: true, Index: i,
				Metadata: map[string]any{"parts": ps}}
		}}, true, nil
	default:
		return syntheticSource{path, func(i int) Task {
			p, expr := Calc{Seed: seed}.Problem(i)
			return Task{ID: p.ID, Prompt: p.Prompt, Label: p.Label, HasLabel: true, Index: i,
				Metadata: map[string]any{"expr": expr}}
		}}, true, nil
	}
}

// CheckSynthetic returns what is wrong with a synthetic task path, or nil (nil too for a path
// that is not synthetic).
func CheckSynthetic(path string) error {
	if _, ok, err := parseSynthetic(path, 0); ok {
		return err
	}
	_, _, err := ParseSpec(path, 0)
	return err
}

// syntheticSource is an endless synthetic source whose task i is task(i).
type syntheticSource struct {
	path string
	task func(int) Task
}

func (s syntheticSource) Name() string       { return s.path }
func (s syntheticSource) Len() int           { return -1 }
func (s syntheticSource) Warnings() []string { return nil }

func (s syntheticSource) Task(i int) Task {
	if i < 0 {
		panic(fmt.Sprintf("data: task index %d < 0", i))
	}
	return s.task(i)
}
