package tiny

import (
	"math"
	"slices"
	"testing"

	"github.com/slimen/slimen/engines"
)

// A model with the BPE vocabulary and 4,096 positions pretrains on a conversation with tool
// schemas longer than 512 tokens, renders it with tools, and generates past position 512 with
// the log-probs that scoring the same tokens (no KV cache) gives.
func TestBPELongContext(t *testing.T) {
	tok := trainedBPE(t, 480)
	cfg := ModelConfig{Hidden: 16, Intermediate: 24, Layers: 2, Heads: 2, KVHeads: 1, MaxSeqLen: 4096, RopeTheta: 1e6, TieEmbeddings: true}
	e, err := NewWithTokenizer(cfg, tok, 5, Options{Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	conv := chatConversation()
	prompt, err := tok.EncodeChatTools(conv[:len(conv)-2], chatToolSchemas, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(prompt) <= 600 {
		t.Fatalf("the prompt is %d tokens; the test wants more than 600", len(prompt))
	}
	rendered, err := e.Render(ctx, []engines.RenderRequest{{Messages: conv[:len(conv)-2], Tools: chatToolSchemas, AddGenerationPrompt: true}})
	if err != nil || !slices.Equal(rendered[0], prompt) {
		t.Fatalf("Render with tools: %v (%d tokens, want %d)", err, len(rendered[0]), len(prompt))
	}
	info, _ := e.Info(ctx)
	if info.ChatTemplate != QwenChatTemplate || info.MaxSeqLen != 4096 {
		t.Fatalf("Info: template %.40q…, %d positions", info.ChatTemplate, info.MaxSeqLen)
	}

	var losses []float64
	ex := Example{Context: conv[:len(conv)-2], Tools: chatToolSchemas, Response: conv[len(conv)-2].Content}
	err = Pretrain(ctx, e, func(int) Example { return ex }, PretrainOptions{Steps: 8, BatchSize: 1, LR: 3e-2,
		OnStep: func(_ int, loss float64) error { losses = append(losses, loss); return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if !(losses[len(losses)-1] < losses[0]-0.3) || math.IsNaN(losses[0]) {
		t.Fatalf("loss %v did not fall", losses)
	}

	cs, err := e.Generate(ctx, []engines.GenerateRequest{{ID: "long", PromptTokens: prompt, Sampling: engines.Sampling{MaxTokens: 12, Temperature: 1, Seed: 3}}})
	if err != nil {
		t.Fatal(err)
	}
	c := cs[0]
	if len(c.Tokens) == 0 || len(prompt)+len(c.Tokens) <= 600 {
		t.Fatalf("generated %d tokens", len(c.Tokens))
	}
	sc, err := e.Score(ctx, []engines.ScoreRequest{{PromptTokens: prompt, Tokens: c.Tokens}})
	if err != nil {
		t.Fatal(err)
	}
	for i, lp := range sc[0].Logprobs {
		if math.Abs(float64(lp-c.Logprobs[i])) > 1e-4 {
			t.Fatalf("token %d (position %d): generated with log-prob %v, scored %v", i, len(prompt)+i, c.Logprobs[i], lp)
		}
	}
	if c.Text != tok.Decode(c.Tokens[:len(c.Tokens)-boolInt(c.FinishReason == "stop")]) {
		t.Fatalf("completion text %q is not the decoded tokens", c.Text)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestQwenChatText(t *testing.T) {
	conv := chatConversation()
	text, err := QwenChatText(conv, chatToolSchemas, true)
	if err != nil {
		t.Fatal(err)
	}
	tok := trainedBPE(t, 480)
	ids, _ := tok.EncodeChatTools(conv, chatToolSchemas, true)
	if got := tok.Decode(ids); got != text {
		t.Fatalf("QwenChatText differs from the decoded rendering:\n%q\n%q", text, got)
	}
}
