package openai

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/slimen/slimen/engines"
)

// This file defines the front's POST /v1/chat/completions: parse, act (generator), write.

// chat answers a chat-completions request: parsed and checked (parseChat), sampled (generator),
// and written as one answer or, streamed, as it grows (chatOut).
func (h *handler) chat(w http.ResponseWriter, r *http.Request) {
	c, err := h.parseChat(w, r)
	if err != nil {
		h.fail(w, err)
		return
	}
	generate, release, err := h.generator(w, r, c.gr, c.explicit, c.body.Stream, c.msgs, c.tu)
	if err != nil {
		h.fail(w, err)
		return
	}
	defer release()
	out := h.startChat(w, r, c)
	comps, err := generate(r.Context(), out.piece())
	if err != nil {
		out.fail(err)
		return
	}
	out.write(comps)
}

// chatBody is the JSON body of a chat-completions request.
type chatBody struct {
	chatRequest
	extras
}

// chatCall is a chat-completions request, parsed and checked: its body, its engine request (the
// sampling settings, ID "chatcmpl-…"), whether it gave max_tokens, its messages, and what its
// tools fields ask of the answer.
type chatCall struct {
	body     chatBody
	gr       engines.GenerateRequest
	explicit bool
	msgs     []ChatMessage
	tu       toolUse
}

// parseChat reads a chat-completions request and checks it; its errors are the client's.
func (h *handler) parseChat(w http.ResponseWriter, r *http.Request) (chatCall, error) {
	var c chatCall
	if err := h.decode(w, r, &c.body); err != nil {
		return c, err
	}
	var err error
	c.gr, c.explicit, err = h.request(c.body.sampling)
	if err == nil {
		err = c.body.extras.check()
	}
	switch {
	case err != nil:
	case len(c.body.Messages) == 0:
		err = badRequest("messages", "messages is empty")
	case c.body.TopLogprobs != nil && *c.body.TopLogprobs > 0:
		err = badRequest("top_logprobs", "top_logprobs = %d: this server returns the sampled token's log-prob only; leave top_logprobs 0", *c.body.TopLogprobs)
	}
	if err == nil {
		c.msgs, err = chatMessages(c.body.Messages)
	}
	if err == nil {
		c.tu, err = c.body.extras.toolFields()
	}
	if err != nil {
		return c, err
	}
	c.gr.ID = "chatcmpl-" + c.gr.ID
	return c, nil
}

// chatOut writes the answer to a chat call: streamed, the server-sent events of the API (each
// sample's role, its text as it grows, then its rest, tool calls and finish reason, then the
// usage if asked), or else one JSON object once the samples are done.
type chatOut struct {
	h      *handler
	w      http.ResponseWriter
	c      chatCall
	head   chatResponse
	sw     *stream       // nil: not streamed
	deltas []*textDeltas // by sample index, streamed
}

// startChat begins the answer: streamed, the events' headers and each sample's first chunk.
func (h *handler) startChat(w http.ResponseWriter, r *http.Request, c chatCall) *chatOut {
	o := &chatOut{h: h, w: w, c: c, head: chatResponse{ID: c.gr.ID, Object: "chat.completion", Created: time.Now().Unix(), Model: h.modelName(r)}}
	if !c.body.Stream {
		return o
	}
	o.head.Object = "chat.completion.chunk"
	o.sw = startStream(w)
	o.deltas = make([]*textDeltas, c.gr.N)
	for i := range c.gr.N {
		ch := o.head
		ch.Choices = []chatChoice{{Index: i, Delta: &responseMessage{Role: "assistant", Content: ptr("")}}}
		o.sw.send(ch)
		o.deltas[i] = newTextDeltas(c.gr.Stop, c.tu.read)
	}
	return o
}

// piece is what sampling hands each sample's text as it grows: streamed, it sends what is new
// (held back where it may turn out to be a stop sequence or a tool call); nil when not streamed.
func (o *chatOut) piece() func(index int, text string) {
	if o.sw == nil {
		return nil
	}
	return func(index int, text string) {
		if index < len(o.deltas) {
			if d := o.deltas[index].add(text); d != "" {
				ch := o.head
				ch.Choices = []chatChoice{{Index: index, Delta: &responseMessage{Content: &d}}}
				o.sw.send(ch)
			}
		}
	}
}

// fail answers a failed sampling: an error event once the stream has begun, else the API's error.
func (o *chatOut) fail(err error) {
	if o.sw != nil {
		o.sw.fail(o.h, err)
		return
	}
	o.h.fail(o.w, err)
}

// write answers the samples.
func (o *chatOut) write(comps []engines.Completion) {
	if o.sw != nil {
		o.writeStream(comps)
		return
	}
	resp := o.head
	for _, comp := range comps {
		ch := o.choice(comp)
		msg, finish := answerMessage(comp, o.c.tu.read)
		ch.Message, ch.FinishReason = &msg, &finish
		resp.Choices = append(resp.Choices, ch)
	}
	resp.Usage = usageOf(comps)
	if o.c.body.ReturnTokenIDs && len(comps) > 0 {
		resp.PromptTokenIDs = nonNil(comps[0].PromptTokens)
	}
	writeJSON(o.w, resp)
}

// writeStream ends the stream: each sample's text not yet sent and its tool calls (the API's
// deltas of a call: its id and name, then its arguments), its finish reason, then the usage if
// stream_options asks for it.
func (o *chatOut) writeStream(comps []engines.Completion) {
	for _, comp := range comps {
		c := o.head
		ch := o.choice(comp)
		msg, finish := answerMessage(comp, o.c.tu.read)
		fin := &finish
		content := ""
		if msg.Content != nil {
			content = *msg.Content
		}
		if comp.Index < len(o.deltas) {
			content = o.deltas[comp.Index].rest(content)
		}
		calls := msg.ToolCalls
		ch.FinishReason, ch.Delta = nil, &responseMessage{Content: &content}
		for k, tc := range calls {
			first := tc
			first.Index, first.Function.Arguments = ptr(k), json.RawMessage(`""`)
			ch.Delta.ToolCalls = append(ch.Delta.ToolCalls, first)
		}
		c.Choices = []chatChoice{ch}
		if o.c.body.ReturnTokenIDs && comp.Index == 0 {
			c.PromptTokenIDs = nonNil(comp.PromptTokens)
		}
		o.sw.send(c)
		for k, tc := range calls {
			c = o.head
			args := wireToolCall{Index: ptr(k)}
			args.Function.Arguments = tc.Function.Arguments
			c.Choices = []chatChoice{{Index: comp.Index, Delta: &responseMessage{ToolCalls: []wireToolCall{args}}}}
			o.sw.send(c)
		}
		c = o.head
		c.Choices = []chatChoice{{Index: comp.Index, Delta: &responseMessage{}, FinishReason: fin}}
		o.sw.send(c)
	}
	if so := o.c.body.StreamOptions; so != nil && so.IncludeUsage {
		c := o.head
		c.Choices, c.Usage = []chatChoice{}, usageOf(comps)
		o.sw.send(c)
	}
	o.sw.done()
}

// choice is a sample's choice of the answer, with its log-probabilities and token ids where the
// request asks for them.
func (o *chatOut) choice(c engines.Completion) chatChoice {
	ch := chatChoice{Index: c.Index, FinishReason: ptr(c.FinishReason)}
	if o.c.body.Logprobs {
		ch.Logprobs = &chatLogprobs{Content: make([]tokenLogprob, 0, len(c.Tokens))}
		for k, t := range c.Tokens {
			tok := o.h.tokenText(t, o.c.body.ReturnTokensAsTokenIDs)
			lp := tokenLogprob{Token: tok, Bytes: bytesOf(tok), TopLogprobs: []tokenLogprob{}}
			if k < len(c.Logprobs) {
				lp.Logprob = float64(c.Logprobs[k])
			}
			ch.Logprobs.Content = append(ch.Logprobs.Content, lp)
		}
	}
	if o.c.body.ReturnTokenIDs {
		ch.TokenIDs = nonNil(c.Tokens)
	}
	return ch
}
