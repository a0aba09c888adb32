package script

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
)

// qwenTok is a tokenizer for the test template: its special tokens are one id each, every other
// character is its own id.
var qwenSpecials = []string{"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_response>", "</tool_response>"}

func qwenEncode(s string) []int32 {
	var out []int32
	for len(s) > 0 {
		matched := false
		for i, sp := range qwenSpecials {
			if strings.HasPrefix(s, sp) {
				out, s, matched = append(out, int32(1000+i)), s[len(sp):], true
				break
			}
		}
		if !matched {
			out, s = append(out, int32(s[0])), s[1:]
		}
	}
	return out
}

const qwenEOS = 1001 // <|im_end|>

// qwen3Render renders as Qwen3's chat template does: the reasoning of assistant turns before the
// last user query is dropped, the last assistant turn gets a (possibly empty) think block, tool
// results go into user blocks. Re-rendering a conversation after a new user query therefore
// changes the earlier turns: the case the chat's token bookkeeping must survive.
func qwen3Render(msgs []engines.Message, gen bool) string {
	last := -1
	for i, m := range msgs {
		if m.Role == "user" {
			last = i
		}
	}
	var b strings.Builder
	for i, m := range msgs {
		switch m.Role {
		case "assistant":
			content, reasoning := m.Content, ""
			if k := strings.Index(content, "</think>"); k >= 0 {
				reasoning = strings.TrimLeft(strings.Split(content[:k], "<think>")[len(strings.Split(content[:k], "<think>"))-1], "\n")
				reasoning = strings.TrimRight(reasoning, "\n")
				content = strings.TrimLeft(content[k+len("</think>"):], "\n")
			}
			if i > last && (i == len(msgs)-1 || reasoning != "") {
				b.WriteString("<|im_start|>assistant\n<think>\n" + strings.Trim(reasoning, "\n") + "\n</think>\n\n" + strings.TrimLeft(content, "\n"))
			} else {
				b.WriteString("<|im_start|>assistant\n" + content)
			}
			b.WriteString("<|im_end|>\n")
		case "tool":
			if i == 0 || msgs[i-1].Role != "tool" {
				b.WriteString("<|im_start|>user")
			}
			b.WriteString("\n<tool_response>\n" + m.Content + "\n</tool_response>")
			if i == len(msgs)-1 || msgs[i+1].Role != "tool" {
				b.WriteString("<|im_end|>\n")
			}
		default:
			b.WriteString("<|im_start|>" + m.Role + "\n" + m.Content + "<|im_end|>\n")
		}
	}
	if gen {
		b.WriteString("<|im_start|>assistant\n")
	}
	return b.String()
}

// chatHost answers a rollout's chat turns: Render with qwen3Render, Generate with the next of its
// replies (a reply ending in <|im_end|> was ended by EOS, one without it ran out of max_tokens).
type chatHost struct {
	Host    // the methods a chat does not use are not implemented
	replies []string
	prompts [][]int32
}

func (h *chatHost) CheckPolicy(string) (bool, string, error) { return true, "", nil }
func (h *chatHost) Sampling() engines.Sampling {
	return engines.Sampling{MaxTokens: 16, Temperature: 1, TopP: 1}
}
func (h *chatHost) Generated(int) {}
func (h *chatHost) Event(string)  {}
func (h *chatHost) Render(_ context.Context, _ string, reqs []engines.RenderRequest) (Rendered, error) {
	out := Rendered{EOS: []int32{qwenEOS}, MaxSeqLen: 4096}
	for _, r := range reqs {
		out.Tokens = append(out.Tokens, qwenEncode(qwen3Render(r.Messages, r.AddGenerationPrompt)))
	}
	return out, nil
}
func (h *chatHost) Generate(_ context.Context, _ string, req engines.GenerateRequest) ([]engines.Completion, error) {
	text := h.replies[0]
	h.replies = h.replies[1:]
	h.prompts = append(h.prompts, req.PromptTokens)
	toks := qwenEncode(text)
	finish := "length"
	if strings.HasSuffix(text, "<|im_end|>") {
		finish = "stop"
		text = strings.TrimSuffix(text, "<|im_end|>")
	}
	return []engines.Completion{{RequestID: req.ID, PromptTokens: req.PromptTokens, Tokens: toks, Logprobs: make([]float32, len(toks)),
		Text: text, FinishReason: finish}}, nil
}

// TestChatThinkStrippingTemplate: with a template that re-renders earlier turns differently once
// a new user query follows (Qwen3 drops their <think> blocks), the conversation keeps every
// sampled id, including the reasoning, and what it adds between turns is what an append-only
// rendering places there: the rest of the end of the turn ("\n" after a sampled <|im_end|>, all of
// "<|im_end|>\n" after a turn cut by max_tokens) and the new messages with the generation prompt.
func TestChatThinkStrippingTemplate(t *testing.T) {
	h := &chatHost{replies: []string{
		"<think>\nadd them\n</think>\n\n7<|im_end|>", // EOS sampled
		"<think>\ncall the tool\n</think>\n\n<tool_call>x</tool_call><|im_end|>",
		"I think the answer is 4", // cut by max_tokens: no EOS
		"<think>\nsure\n</think>\n\n4<|im_end|>",
	}}
	ro := &Rollout{Host: h, Ctx: context.Background(), Task: Task{ID: "t"}}
	th := ro.NewThread(nil)
	src := `
c = chat("p", system = "S")
c.user("3 + 4?")
c.generate()
c.user("and now?")
c.generate()
c.tool("42")
c.generate()
c.user("sure?")
c.generate()
`
	g, err := starlark.ExecFile(th, "t.star", src, predeclared())
	if err != nil {
		t.Fatal(err)
	}
	c := g["c"].(*Chat)
	want := qwenEncode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n3 + 4?<|im_end|>\n<|im_start|>assistant\n" +
		"<think>\nadd them\n</think>\n\n7<|im_end|>" +
		"\n<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n" +
		"<think>\ncall the tool\n</think>\n\n<tool_call>x</tool_call><|im_end|>" +
		"\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" +
		"I think the answer is 4" +
		"<|im_end|>\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n" +
		"<think>\nsure\n</think>\n\n4<|im_end|>")
	if d := cmp.Diff(want, c.tokens); d != "" {
		t.Errorf("conversation tokens (-append-only rendering +chat):\n%s", d)
	}
	// Every prompt the engine saw is the conversation so far; the mask is 1 at the replies.
	for k, p := range h.prompts {
		if !slices.Equal(p, c.tokens[:len(p)]) {
			t.Errorf("turn %d was sampled from a prompt that is not a prefix of the conversation", k)
		}
	}
	n := 0
	for _, m := range c.mask {
		n += int(m)
	}
	wantN := 0
	for _, tr := range c.turns {
		wantN += len(tr.tokens)
	}
	if n != wantN || len(c.mask) != len(c.tokens) {
		t.Errorf("mask has %d ones over %d entries; want %d over %d", n, len(c.mask), wantN, len(c.tokens))
	}
	// A fresh rendering strips the first turns' reasoning: the chat did not re-render them.
	if fresh := qwenEncode(qwen3Render(c.msgs, false)); slices.Equal(fresh, c.tokens) {
		t.Error("the template does not strip history here; the test checks nothing")
	}
}

// TestRenderedAfter: the new messages' tokens, for an append-only rendering and one whose
// earlier part changed.
func TestRenderedAfter(t *testing.T) {
	got, err := renderedAfter([]int32{1, 2, 3}, []int32{1, 2, 3, 4, 5})
	if err != nil || !slices.Equal(got, []int32{4, 5}) {
		t.Errorf("append-only: %v %v", got, err)
	}
	// 7 8 9 (reasoning) dropped, 3 9 closes the turn, 4 5 is new.
	got, err = renderedAfter([]int32{1, 7, 8, 2, 3, 9}, []int32{1, 2, 3, 9, 4, 5})
	if err != nil || !slices.Equal(got, []int32{4, 5}) {
		t.Errorf("stripped: %v %v", got, err)
	}
	if _, err := renderedAfter([]int32{1, 2}, []int32{3, 4}); err == nil {
		t.Error("unrelated renderings: no error")
	}
}
