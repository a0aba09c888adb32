package main

import (
	"context"
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
)

// TestOpenAIDocPromptIsAnswered: docs/openai.md's client example asks the model it serves
// (builtin:tiny-arith) a question with the settings it shows, and its comment says the answer. The
// model answers it so, as `slimen serve --openai` samples it (TestServeOpenAI: the same tokens as
// in-process): the example's earlier prompt, "12+30=", got garbage from this model.
func TestOpenAIDocPromptIsAnswered(t *testing.T) {
	doc, err := os.ReadFile("../../docs/openai.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)model="(builtin:[a-z-]+)",\s*messages=\[\{"role": "user", "content": "([^"]+)"\}\],\s*max_tokens=(\d+), temperature=0,.*?message\.content\)  # (\S+)\n`).FindSubmatch(doc)
	if m == nil {
		t.Fatal(`docs/openai.md: no chat.completions.create(model="builtin:…", messages=[{"role": "user", "content": …}], max_tokens=N, temperature=0, …) followed by print(r.choices[0].message.content)  # ANSWER`)
	}
	model, prompt, want := string(m[1]), string(m[2]), string(m[4])
	maxTokens, _ := strconv.Atoi(string(m[3]))
	e, err := tiny.Open(model, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	out, err := e.Generate(context.Background(), []engines.GenerateRequest{{ID: "doc",
		Messages: []engines.Message{{Role: "user", Content: prompt}}, Sampling: engines.Sampling{MaxTokens: maxTokens}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := out[0].Text; got != want || out[0].FinishReason != "stop" {
		t.Errorf("docs/openai.md asks %s %q (max_tokens=%d, temperature=0) and says %s; it answers %q (finish_reason %s)",
			model, prompt, maxTokens, want, got, out[0].FinishReason)
	}
}
