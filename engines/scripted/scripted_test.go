package scripted

import (
	"context"
	"slices"
	"testing"

	"github.com/slimen/slimen/engines"
)

// TestLastMessage: a chat turn's prompt (tokens rendered with RenderChat) gives back the content of
// its last message, whatever came before it and with newlines inside.
func TestLastMessage(t *testing.T) {
	cases := []struct {
		msgs []engines.Message
		want string
	}{
		{[]engines.Message{{Role: "user", Content: "hi"}}, "hi"},
		{[]engines.Message{{Role: "system", Content: "s"}, {Role: "user", Content: "q"}, {Role: "assistant", Content: "a"}, {Role: "tool", Content: "408"}}, "408"},
		{[]engines.Message{{Role: "user", Content: "two\nlines"}}, "two\nlines"},
	}
	for _, c := range cases {
		if got := LastMessage(RenderChat(c.msgs, true)); got != c.want {
			t.Errorf("LastMessage(%q) = %q, want %q", RenderChat(c.msgs, true), got, c.want)
		}
	}
}

// TestGenerateKeepsPromptTokens: a request of tokens is answered for exactly those tokens, EOS
// included (a conversation's sampled turns end with it).
func TestGenerateKeepsPromptTokens(t *testing.T) {
	prompt := append(Encode("user: hi\nassistant: a"), EOS)
	out, err := Echo("b").Generate(context.Background(), []engines.GenerateRequest{{ID: "r", PromptTokens: prompt, Sampling: engines.Sampling{MaxTokens: 4}}})
	if err != nil || !slices.Equal(out[0].PromptTokens, prompt) {
		t.Errorf("prompt tokens %v, %v; want %v", out[0].PromptTokens, err, prompt)
	}
}
