package tasks

import (
	"strconv"
	"strings"
	"testing"
)

// calc problems: the expression evaluates to the label and appears in the prompt's numbers.
func TestCalcProblems(t *testing.T) {
	c := Calc{Seed: 5}
	for i := range 200 {
		p, expr := c.Problem(i)
		var x, y int
		var op byte
		for k := 0; k < len(expr); k++ {
			if expr[k] < '0' || expr[k] > '9' {
				x, _ = strconv.Atoi(expr[:k])
				y, _ = strconv.Atoi(expr[k+1:])
				op = expr[k]
				break
			}
		}
		want := map[byte]int{'+': x + y, '-': x - y, '*': x * y}[op]
		if strconv.Itoa(want) != p.Label || !strings.Contains(p.Prompt, strconv.Itoa(x)) || !strings.Contains(p.Prompt, strconv.Itoa(y)) {
			t.Fatalf("%q %s: label %s", p.Prompt, expr, p.Label)
		}
		if q, e2 := c.Problem(i); q != p || e2 != expr {
			t.Fatal("not a pure function of i")
		}
	}
}

// A facts document states the fact asked for exactly once, as one of its sentences.
func TestFactsProblems(t *testing.T) {
	for i := range 100 {
		p, doc := Facts{Seed: 2}.Problem(i)
		fact := strings.TrimSuffix(strings.TrimPrefix(p.Prompt, "What is "), "?") + " is " + p.Label + "."
		n := 0
		for _, s := range Sentences(doc) {
			if s == fact {
				n++
			}
		}
		if n != 1 || strings.Count(doc, strings.TrimSuffix(fact, " is "+p.Label+".")+" is") != 1 {
			t.Fatalf("%q: the fact %q appears %d times in %q", p.Prompt, fact, n, doc)
		}
		if len(doc) < 512 {
			t.Fatalf("a document of %d characters fits the embedded model's context", len(doc))
		}
	}
}

// A multipart task's label joins its parts' labels, and its prompt holds each part.
func TestMultiPartProblems(t *testing.T) {
	kinds := map[string]int{}
	for i := range 50 {
		p, parts := MultiPart{Seed: 1, Parts: 3}.Problem(i)
		var labels []string
		for _, pt := range parts {
			if !strings.Contains(p.Prompt, pt.Prompt) {
				t.Fatalf("%q lacks part %q", p.Prompt, pt.Prompt)
			}
			labels = append(labels, pt.Label)
			kinds[pt.Kind]++
		}
		if p.Label != strings.Join(labels, ", ") {
			t.Fatalf("label %q, parts %v", p.Label, labels)
		}
	}
	if kinds["calc"] == 0 || kinds["arith"] == 0 {
		t.Fatalf("kinds %v", kinds)
	}
}

func TestOpenAgenticSources(t *testing.T) {
	for path, key := range map[string]string{"synthetic:calc?seed=3": "expr", "synthetic:facts?facts=10": "document", "synthetic:multipart?parts=3": "parts"} {
		src, err := Open(path, Options{Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		task := src.Task(4)
		if task.Metadata[key] == nil || !task.HasLabel || src.Len() != -1 || task.Index != 4 {
			t.Fatalf("%s: %+v", path, task)
		}
	}
	for _, bad := range []string{"synthetic:calc?difficulty=2", "synthetic:facts?facts=x", "synthetic:facts?facts=999", "synthetic:multipart?parts=9", "synthetic:nope"} {
		if _, err := Open(bad, Options{}); err == nil {
			t.Errorf("%s: no error", bad)
		}
		if err := CheckSynthetic(bad); err == nil {
			t.Errorf("CheckSynthetic(%s): no error", bad)
		}
	}
}

// The agent corpus mixes its kinds in about the documented shares, and a memory update keeps the
// fact asked for once the chunk holding it has been read.
func TestAgentExample(t *testing.T) {
	c := Calc{Seed: 1}
	n := map[string]int{}
	for i := range 2000 {
		ctx, resp := c.AgentExample(i)
		last := ctx[len(ctx)-1].Content
		switch {
		case strings.HasPrefix(resp, "<tool_call>"):
			n["call"]++
		case ctx[len(ctx)-1].Role == "tool":
			n["after tool"]++
			if resp != `\boxed{`+last+`}` {
				t.Fatalf("%q after tool %q", resp, last)
			}
		case strings.Contains(last, " Memory: ") && strings.Contains(last, " Text: "):
			n["memory"]++
			if !strings.Contains(last, resp) && resp != "none" {
				t.Fatalf("memory %q is neither the old memory nor in the chunk: %q", resp, last)
			}
		case strings.Contains(last, " Memory: "):
			n["memory answer"]++
		default:
			n["direct"]++
		}
		if i < 8 {
			t.Logf("%q → %q", ctx, resp)
		}
	}
	for k, want := range map[string]int{"call": 500, "after tool": 500, "memory": 200, "memory answer": 200, "direct": 600} {
		if n[k] < want*8/10 || n[k] > want*12/10 {
			t.Errorf("%s: %d of 2000, want about %d", k, n[k], want)
		}
	}
}
