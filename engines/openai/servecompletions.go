package openai

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/slimen/slimen/engines"
)

// This file defines the front's POST /v1/completions: parse, act, write.

// completions answers a completions request: parsed and checked (parseCompletions), its prompts
// made engine requests within the context and the budget in flight (completionRequests,
// reserve), sampled, and written as one answer or, streamed, as it grows (completionOut).
func (h *handler) completions(w http.ResponseWriter, r *http.Request) {
	c, err := h.parseCompletions(w, r)
	if err != nil {
		h.fail(w, err)
		return
	}
	reqs, cost, err := h.completionRequests(r.Context(), c)
	if err != nil {
		h.fail(w, err)
		return
	}
	release, err := h.reserve(w, cost, int64(len(reqs)*c.gr.N))
	if err != nil {
		h.fail(w, err)
		return
	}
	defer release()
	out := h.startCompletions(w, r, c)
	comps, err := h.generateStreaming(r.Context(), reqs, out.piece())
	if err != nil {
		out.fail(err)
		return
	}
	out.write(reqs, comps)
}

// completionBody is the JSON body of a completions request.
type completionBody struct {
	completionRequest
	extras
}

// completionCall is a completions request, parsed and checked: its body, the engine request of
// its sampling settings (ID "cmpl-…", which each prompt's request extends) and whether it gave
// max_tokens.
type completionCall struct {
	body     completionBody
	gr       engines.GenerateRequest
	explicit bool
}

// parseCompletions reads a completions request and checks it; its errors are the client's.
func (h *handler) parseCompletions(w http.ResponseWriter, r *http.Request) (completionCall, error) {
	var c completionCall
	if err := h.decode(w, r, &c.body); err != nil {
		return c, err
	}
	var err error
	c.gr, c.explicit, err = h.request(c.body.sampling)
	if err == nil {
		err = c.body.extras.check()
	}
	req := &c.body
	switch {
	case err != nil:
	case len(req.Prompt) == 0:
		err = badRequest("prompt", "prompt is missing")
	case req.Logprobs != nil && *req.Logprobs > 0:
		err = badRequest("logprobs", "logprobs = %d asks for %d alternatives per token; this server returns the sampled "+
			"token's log-prob only: send logprobs 0", *req.Logprobs, *req.Logprobs)
	case req.Echo:
		err = badRequest("echo", "echo is not supported by this server")
	}
	if err != nil {
		return c, err
	}
	c.gr.ID = "cmpl-" + c.gr.ID
	return c, nil
}

// completionRequests makes each prompt of a call an engine request (ID "cmpl-…-i"), its tokens
// checked against the vocabulary and the context, and returns them with the tokens they may make
// the engine hold. Text prompts are tokenized together, as raw text: special-token text in them
// is the special tokens, as a prompt is read by vLLM.
func (h *handler) completionRequests(ctx context.Context, c completionCall) ([]engines.GenerateRequest, int64, error) {
	ps := c.body.Prompt
	var texts []string
	for _, p := range ps {
		if p.isText {
			texts = append(texts, p.text)
		}
	}
	var tokenized [][]int32
	if len(texts) > 0 {
		var err error
		if tokenized, err = h.eng.Tokenize(ctx, texts); err != nil {
			return nil, 0, err
		}
	}
	reqs := make([]engines.GenerateRequest, len(ps))
	var cost int64
	for i, p := range ps {
		reqs[i] = c.gr
		reqs[i].ID = fmt.Sprintf("%s-%d", c.gr.ID, i)
		ids := p.ids
		if p.isText {
			ids, tokenized = tokenized[0], tokenized[1:]
		}
		if err := h.checkPrompt(i, len(ps), ids); err != nil {
			return nil, 0, err
		}
		reqs[i].PromptTokens = ids
		if err := h.fit(&reqs[i], len(ids), c.explicit, "prompt"); err != nil {
			return nil, 0, err
		}
		cost += int64(len(ids)) + int64(c.gr.N)*int64(reqs[i].MaxTokens)
	}
	return reqs, cost, nil
}

// completionOut writes the answer to a completions call: streamed, the server-sent events of the
// API (each choice's text as it grows, then its rest and its finish reason, then the usage if
// asked), or else one JSON object once the samples are done. Choice p*n+i is prompt p's sample i.
type completionOut struct {
	h      *handler
	w      http.ResponseWriter
	c      completionCall
	head   completionResponse
	sw     *stream             // nil: not streamed
	deltas map[int]*textDeltas // by choice index, streamed
}

// startCompletions begins the answer: streamed, the events' headers.
func (h *handler) startCompletions(w http.ResponseWriter, r *http.Request, c completionCall) *completionOut {
	o := &completionOut{h: h, w: w, c: c, deltas: map[int]*textDeltas{},
		head: completionResponse{ID: c.gr.ID, Object: "text_completion", Created: time.Now().Unix(), Model: h.modelName(r)}}
	if c.body.Stream {
		o.sw = startStream(w)
	}
	return o
}

// piece is what sampling hands each sample's text as it grows: streamed, it sends what is new
// (held back where it may turn out to be a stop sequence); nil when not streamed.
func (o *completionOut) piece() func(req, index int, text string) {
	if o.sw == nil {
		return nil
	}
	return func(p, i int, text string) {
		k := p*o.c.gr.N + i
		if o.deltas[k] == nil {
			o.deltas[k] = newTextDeltas(o.c.gr.Stop, false)
		}
		if t := o.deltas[k].add(text); t != "" {
			c := o.head
			c.Choices = []completionChoice{{Index: k, Text: t}}
			o.sw.send(c)
		}
	}
}

// fail answers a failed sampling: an error event once the stream has begun, else the API's error.
func (o *completionOut) fail(err error) {
	if o.sw != nil {
		o.sw.fail(o.h, err)
		return
	}
	o.h.fail(o.w, err)
}

// write answers the samples of the requests reqs.
func (o *completionOut) write(reqs []engines.GenerateRequest, comps []engines.Completion) {
	index := map[string]int{}
	for i, q := range reqs {
		index[q.ID] = i
	}
	resp := o.head
	for _, c := range comps {
		resp.Choices = append(resp.Choices, o.choice(index[c.RequestID], c))
	}
	if o.sw == nil {
		resp.Usage = usageOf(comps)
		writeJSON(o.w, resp)
		return
	}
	for _, ch := range resp.Choices {
		c := o.head
		fin := ch.FinishReason
		ch.FinishReason = nil
		if d := o.deltas[ch.Index]; d != nil {
			ch.Text = d.rest(ch.Text)
		}
		c.Choices = []completionChoice{ch}
		o.sw.send(c)
		c.Choices = []completionChoice{{Index: ch.Index, FinishReason: fin}}
		o.sw.send(c)
	}
	if so := o.c.body.StreamOptions; so != nil && so.IncludeUsage {
		c := o.head
		c.Choices, c.Usage = []completionChoice{}, usageOf(comps)
		o.sw.send(c)
	}
	o.sw.done()
}

// choice is sample c of prompt p as a choice of the answer, with its log-probabilities and token
// ids where the request asks for them.
func (o *completionOut) choice(p int, c engines.Completion) completionChoice {
	req := o.c.body
	ch := completionChoice{Index: p*o.c.gr.N + c.Index, Text: c.Text, FinishReason: ptr(c.FinishReason)}
	if req.Logprobs != nil {
		lp := &completionLogprobs{Tokens: []string{}, TokenLogprobs: []*float64{}, TextOffset: []int{}}
		off := 0
		for k, t := range c.Tokens {
			tok := o.h.tokenText(t, req.ReturnTokensAsTokenIDs)
			var v float64
			if k < len(c.Logprobs) {
				v = float64(c.Logprobs[k])
			}
			lp.Tokens, lp.TokenLogprobs, lp.TextOffset = append(lp.Tokens, tok), append(lp.TokenLogprobs, ptr(v)), append(lp.TextOffset, off)
			off += len(tok)
		}
		ch.Logprobs = lp
	}
	if req.ReturnTokenIDs {
		ch.TokenIDs, ch.PromptTokenIDs = nonNil(c.Tokens), nonNil(c.PromptTokens)
	}
	return ch
}
