package tiny

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
)

// TestGenerateStream: GenerateStream samples what Generate samples, and hands over each sample's
// text as it grows, before it returns: the pieces of a sample add up to its text, which runs past
// a stop string that ended it (its Text is cut there).
func TestGenerateStream(t *testing.T) {
	e, err := Open("builtin:tiny-arith", Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx := context.Background()
	reqs := []engines.GenerateRequest{
		{ID: "a", Messages: []engines.Message{{Role: "user", Content: "12+30="}}, N: 2, Sampling: engines.Sampling{MaxTokens: 24, Temperature: 1, Seed: 3}},
		{ID: "b", Messages: []engines.Message{{Role: "user", Content: "Ann has 3 pens and buys 4 more. How many pens?"}}, Sampling: engines.Sampling{MaxTokens: 40, Temperature: 1, Seed: 9, Stop: []string{"}"}}},
	}
	want, err := e.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	pieces := map[[2]int][]string{}
	got, err := e.GenerateStream(ctx, reqs, func(req, index int, text string) {
		pieces[[2]int{req, index}] = append(pieces[[2]int{req, index}], text)
	})
	if err != nil {
		t.Fatal(err)
	}
	for k, c := range got {
		w := want[k]
		if c.Text != w.Text || c.FinishReason != w.FinishReason || !slices.Equal(c.Tokens, w.Tokens) {
			t.Fatalf("completion %d streamed: %q %s %v; Generate: %q %s %v", k, c.Text, c.FinishReason, c.Tokens, w.Text, w.FinishReason, w.Tokens)
		}
		req := 0
		if c.RequestID == "b" {
			req = 1
		}
		ps := pieces[[2]int{req, c.Index}]
		all := strings.Join(ps, "")
		if len(ps) < 2 || !strings.HasPrefix(all, c.Text) {
			t.Errorf("completion %d (%q): pieces %q", k, c.Text, ps)
		}
		// Request b's stop string "}" is in its pieces, not in its text.
		if all != c.Text && (req == 0 || all != c.Text+"}") {
			t.Errorf("completion %d: text %q (%s), pieces %q", k, c.Text, c.FinishReason, ps)
		}
	}
}
