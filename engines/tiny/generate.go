package tiny

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/constrain"
)

// genSeq is one sample being generated.
type genSeq struct {
	req, index int
	prompt     []int32
	s          engines.Sampling
	cache      *kvCache[float32]
	length     int // positions in the cache
	rng        *rand.Rand
	tokens     []int32
	logprobs   []float32
	text       strings.Builder
	streamed   int    // bytes of text handed to GenerateStream's piece
	result     string // final text
	finish     string // "" while running
	// The constraint of the request (nil: none) and where the response is in it.
	cm  *constrain.Matcher
	cst constrain.State
	err error // the constraint left no token to sample
}

// Generate samples the completions of every request as one batch: prompts are prefilled together,
// then all unfinished samples advance one token per step through the KV caches. A sample's tokens
// and log-probabilities depend only on its model, prompt, sampling settings and index: its random
// stream is its own (see sampleRNG) and every row is computed alone (see matMulT and attendRow),
// so neither the other requests of the batch nor the number of threads change it.
func (e *Engine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	return e.GenerateAdapters(ctx, reqs, nil)
}

// GenerateAdapters is Generate where request i uses the LoRA adapter named adapters[i] ("" or a
// nil adapters: the base model), all in the same forward passes: the base products are shared,
// the low-rank products are computed per run of rows with the same adapter. A row's numbers do not
// depend on the other rows, so each request gets what it would get alone.
func (e *Engine) GenerateAdapters(ctx context.Context, reqs []engines.GenerateRequest, adapters []string) ([]engines.Completion, error) {
	return e.generate(ctx, reqs, adapters, nil)
}

// GenerateStream is Generate that also hands piece each sample's text as it grows, before the
// call returns and on the caller's goroutine: piece(req, index, text) with the text the sample's
// latest token added (an end-of-sequence token adds none). The pieces of a sample add up to the
// text it sampled, which runs past a stop string where one ended it (its Completion's Text is
// cut there). What is sampled is exactly what Generate samples.
func (e *Engine) GenerateStream(ctx context.Context, reqs []engines.GenerateRequest, piece func(req, index int, text string)) ([]engines.Completion, error) {
	return e.generate(ctx, reqs, nil, piece)
}

// generate is GenerateAdapters, handing piece (when not nil) each sample's new text.
func (e *Engine) generate(ctx context.Context, reqs []engines.GenerateRequest, adapters []string,
	piece func(req, index int, text string)) ([]engines.Completion, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	ads, err := e.adapterList(adapters, len(reqs))
	if err != nil {
		return nil, err
	}
	cfg := e.m.w.cfg
	m := e.m.packed(e.threads) // the weights do not change while the read lock is held
	prompts := make([][]int32, len(reqs))
	matchers := make([]*constrain.Matcher, len(reqs))
	for i, r := range reqs {
		p, err := e.promptTokens(r.Messages, r.PromptTokens)
		if err == nil && len(p) >= cfg.MaxSeqLen {
			err = fmt.Errorf("the prompt has %d tokens; the model takes at most %d tokens of prompt and response together", len(p), cfg.MaxSeqLen)
		}
		if err == nil {
			err = r.Check()
		}
		if err == nil && r.Constraint != "" {
			matchers[i], err = e.matcher(r.Constraint)
		}
		if err != nil {
			return nil, fmt.Errorf("tiny: generate request %d (%q): %w", i, r.ID, err)
		}
		prompts[i] = p
	}
	capacity := func(i int) int {
		// min first: a max_tokens near the int range must not overflow the sum.
		return min(cfg.MaxSeqLen, len(prompts[i])+min(engines.NormalizeSampling(reqs[i].Sampling).MaxTokens, cfg.MaxSeqLen))
	}

	// Prefill, chunk by chunk.
	caches := make([]*kvCache[float32], len(reqs))
	last := make([][]float32, len(reqs))
	for lo := 0; lo < len(reqs); {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		hi, rows := lo, 0
		for hi < len(reqs) && (hi == lo || rows+len(prompts[hi]) <= chunkTokens) {
			rows += len(prompts[hi])
			hi++
		}
		var tokens []int32
		var views []seqView[float32]
		var outRows []int
		for i := lo; i < hi; i++ {
			caches[i] = newKVCache[float32](cfg, capacity(i))
			views = append(views, seqView[float32]{start: len(tokens), n: len(prompts[i]), cache: caches[i], ad: ads[i]})
			tokens = append(tokens, prompts[i]...)
			outRows = append(outRows, len(tokens)-1)
		}
		logits, _ := m.forward(e.threads, tokens, views, outRows, false)
		for i := lo; i < hi; i++ {
			last[i] = logits[(i-lo)*cfg.VocabSize : (i-lo+1)*cfg.VocabSize]
		}
		lo = hi
	}

	stream := func(s *genSeq) {
		if piece != nil && s.text.Len() > s.streamed {
			piece(s.req, s.index, s.text.String()[s.streamed:])
			s.streamed = s.text.Len()
		}
	}

	// Samples: each gets a copy of its request's prompt cache (the last one takes the original).
	var seqs []*genSeq
	for i, r := range reqs {
		if err := ctx.Err(); err != nil { // a large batch's copies take a while: stop when asked
			return nil, err
		}
		n := max(r.N, 1)
		for j := range n {
			c := caches[i]
			if j < n-1 {
				c = newKVCache[float32](cfg, capacity(i))
				c.copyPrefix(caches[i], len(prompts[i]), cfg.kvDim())
			}
			s := &genSeq{req: i, index: j, prompt: prompts[i], s: engines.NormalizeSampling(r.Sampling), cache: c,
				length: len(prompts[i]), rng: sampleRNG(r.Seed, prompts[i], j)}
			if cm := matchers[i]; cm != nil {
				s.cm, s.cst = cm, cm.Grammar().Start()
			}
			e.advance(s, last[i])
			stream(s)
			seqs = append(seqs, s)
		}
	}

	// Decode: one token per unfinished sample per step.
	active := slices.DeleteFunc(slices.Clone(seqs), func(s *genSeq) bool { return s.finish != "" })
	for len(active) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		tokens := make([]int32, len(active))
		views := make([]seqView[float32], len(active))
		outRows := make([]int, len(active))
		for k, s := range active {
			tokens[k] = s.tokens[len(s.tokens)-1]
			views[k] = seqView[float32]{start: k, n: 1, pos0: s.length, cache: s.cache, ad: ads[s.req]}
			outRows[k] = k
		}
		logits, _ := m.forward(e.threads, tokens, views, outRows, false)
		for k, s := range active {
			s.length++
			e.advance(s, logits[k*cfg.VocabSize:(k+1)*cfg.VocabSize])
			stream(s)
		}
		active = slices.DeleteFunc(active, func(s *genSeq) bool { return s.finish != "" })
	}

	out := make([]engines.Completion, len(seqs))
	for k, s := range seqs {
		if s.err != nil {
			return nil, fmt.Errorf("tiny: generate request %d (%q): %w", s.req, reqs[s.req].ID, s.err)
		}
		out[k] = engines.Completion{
			RequestID:    reqs[s.req].ID,
			Index:        s.index,
			PromptTokens: slices.Clone(s.prompt),
			Tokens:       s.tokens,
			Logprobs:     s.logprobs,
			Text:         s.result,
			FinishReason: s.finish,
		}
	}
	return out, nil
}

// advance samples the next token of s from logits and decides whether s is finished: on an EOS
// token or a stop string ("stop"), or at max tokens or the model's length limit ("length").
func (e *Engine) advance(s *genSeq, logits []float32) {
	var allowed []bool
	if s.cm != nil {
		allowed = s.cm.Allowed(s.cst)
	}
	tok, lp := sampleAllowed(logits, s.s.Temperature, s.s.TopP, s.rng, allowed)
	if tok < 0 {
		s.finish, s.result = "stop", s.text.String()
		s.err = fmt.Errorf("the constraint leaves no token of the vocabulary after %q", s.result)
		return
	}
	s.tokens = append(s.tokens, tok)
	s.logprobs = append(s.logprobs, lp)
	if slices.Contains(e.eos, tok) {
		s.finish, s.result = "stop", s.text.String()
		return
	}
	prev := s.text.Len()
	s.text.WriteString(e.tok.piece(tok))
	if s.cm != nil {
		s.cst = s.cst.Feed(e.tok.piece(tok))
	}
	text := s.text.String()
	cut := -1
	for _, stop := range s.s.Stop {
		if stop == "" {
			continue
		}
		// Only a match that ends in the new piece is new: earlier text was checked before.
		from := max(0, prev-len(stop)+1)
		if i := strings.Index(text[from:], stop); i >= 0 && (cut < 0 || from+i < cut) {
			cut = from + i
		}
	}
	switch {
	case cut >= 0:
		s.finish, s.result = "stop", text[:cut]
	case len(s.tokens) >= s.s.MaxTokens || len(s.prompt)+len(s.tokens) >= e.m.w.cfg.MaxSeqLen:
		s.finish, s.result = "length", text
	}
}

// sampleRNG returns the random stream of sample index of a prompt: a PCG generator keyed by the
// request's seed and a hash of (prompt, index). Retrying a request reproduces its samples; two
// samples of one request never share a stream.
func sampleRNG(seed uint64, prompt []int32, index int) *rand.Rand {
	h := fnv.New64a()
	var buf [4]byte
	for _, t := range prompt {
		binary.LittleEndian.PutUint32(buf[:], uint32(t))
		h.Write(buf[:])
	}
	return rand.New(rand.NewPCG(seed, mix64(h.Sum64()^mix64(uint64(index)+1))))
}

// mix64 is the splitmix64 finalizer: it spreads nearby inputs over the whole 64-bit range.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// sampleToken is sampleAllowed without a constraint.
func sampleToken(logits []float32, temperature, topP float64, rng *rand.Rand) (int32, float32) {
	return sampleAllowed(logits, temperature, topP, rng, nil)
}

// sampleAllowed draws a token from logits at the given temperature (0: the most likely token, the
// lowest id on ties) within the top-p nucleus, and returns it with its log-probability under the
// untempered model (temperature 1, no nucleus): the number Train and Score compute for the same
// token, so that the ratio to the rollout policy is 1 before any update. allowed, when not nil,
// is a constraint's mask: only tokens it allows are drawn, from the distribution renormalised over
// them (the nucleus too is taken among them), and the log-probability is still the untempered
// model's over the whole vocabulary. With no token allowed it returns -1.
func sampleAllowed(logits []float32, temperature, topP float64, rng *rand.Rand, allowed []bool) (int32, float32) {
	lse := logSumExp(logits)
	pick := -1
	if allowed != nil {
		if !slices.Contains(allowed, true) {
			return -1, 0
		}
	}
	if temperature == 0 {
		for i, v := range logits {
			if (allowed == nil || allowed[i]) && (pick < 0 || v > logits[pick]) {
				pick = i
			}
		}
	} else {
		mx := math.Inf(-1) // the largest allowed logit, so that an allowed token's weight is never 0 by underflow
		for i, v := range logits {
			if allowed == nil || allowed[i] {
				mx = max(mx, float64(v))
			}
		}
		q := make([]float64, len(logits))
		order := make([]int, len(logits))
		sum := 0.0
		for i, v := range logits {
			q[i] = (float64(v) - mx) / temperature
		}
		expSlice(q, q)
		for i := range q {
			if allowed != nil && !allowed[i] {
				q[i] = 0
			}
			sum += q[i]
			order[i] = i
		}
		kept := order
		if topP < 1 {
			// The nucleus: the most likely tokens (lowest id first on ties) until their mass
			// reaches top_p.
			slices.SortStableFunc(order, func(a, b int) int {
				switch {
				case q[a] > q[b]:
					return -1
				case q[a] < q[b]:
					return 1
				}
				return 0
			})
			mass := 0.0
			for k, i := range order {
				mass += q[i]
				if mass >= topP*sum {
					kept = order[:k+1]
					break
				}
			}
			sum = 0
			for _, i := range kept {
				sum += q[i]
			}
		}
		u := rng.Float64() * sum
		for k := len(kept) - 1; k >= 0 && pick < 0; k-- {
			if q[kept[k]] > 0 { // rounding's fallback: the last token of the nucleus with weight
				pick = kept[k]
			}
		}
		acc := 0.0
		for _, i := range kept {
			acc += q[i]
			if u < acc {
				pick = i
				break
			}
		}
	}
	return int32(pick), float32(float64(logits[pick]) - lse)
}

// Score returns the log-probability of each request's tokens after its prompt, computed by the
// same code as Generate's: the numbers agree to the bit with what Generate reported for the same
// tokens. Requests with Reference set are scored by the frozen KL reference copy instead.
func (e *Engine) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return e.score(ctx, reqs, nil)
}

// score is Score with the adapter ad (nil: none) on the current model; the reference is the base
// without it.
func (e *Engine) score(ctx context.Context, reqs []engines.ScoreRequest, ad *adapterState) ([]engines.Scores, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	vocab := e.m.w.cfg.VocabSize
	out := make([]engines.Scores, len(reqs))
	for _, ref := range []bool{false, true} {
		m := e.m
		switch {
		case ref && ad != nil:
			// The reference of an adapter is the base without it.
		case ref:
			m = e.ref
		case ad != nil:
			mc := *e.m
			mc.ad = ad.w
			m = &mc
		}
		var idx []int
		var part []engines.ScoreRequest
		for i, r := range reqs {
			if r.Reference == ref {
				idx, part = append(idx, i), append(part, r)
			}
		}
		if len(part) == 0 {
			continue
		}
		m = m.packed(e.threads) // the weights do not change while the read lock is held
		lps, err := e.perToken(ctx, "score", part, func(p packed[float32]) []float64 {
			logits, _ := m.forward(e.threads, p.tokens, p.views, p.outRows, false)
			lp, _ := tokenLogprobs(e.threads, logits, p.targets, vocab)
			return lp
		})
		if err != nil {
			return nil, err
		}
		for k, lp := range lps {
			out[idx[k]].Logprobs = lp
		}
	}
	return out, nil
}

// Values returns a PPO critic's value of each request's tokens: the value head on the final
// hidden state at the position whose logits predict the token (the state before it). The head is
// created, all zeros, on first use unless the checkpoint had one (score.weight), as in the
// PyTorch engine.
func (e *Engine) Values(ctx context.Context, reqs []engines.ScoreRequest) ([][]float32, error) {
	if err := e.rlockWithValueHead(); err != nil {
		return nil, err
	}
	defer e.mu.RUnlock()
	m := e.m.packed(e.threads)
	return e.perToken(ctx, "values", reqs, func(p packed[float32]) []float64 {
		v, _ := m.values(e.threads, p.tokens, p.views, p.outRows, false)
		return f64(v)
	})
}

// rlockWithValueHead takes the read lock of an open engine whose model has a value head, creating
// the head under the write lock first if needed.
func (e *Engine) rlockWithValueHead() error {
	for {
		e.mu.RLock()
		if e.closed {
			e.mu.RUnlock()
			return ErrClosed
		}
		if e.m.w.score != nil {
			return nil
		}
		e.mu.RUnlock()
		e.mu.Lock()
		if !e.closed {
			e.ensureValueHead()
		}
		e.mu.Unlock()
	}
}

// perToken resolves each request's prompt and returns one number per token of the request: what
// at makes of the forward pass over a chunk of requests (one number per predicted token, in row
// order). what names the method in errors.
func (e *Engine) perToken(ctx context.Context, what string, reqs []engines.ScoreRequest, at func(p packed[float32]) []float64) ([][]float32, error) {
	cfg := e.m.w.cfg
	out := make([][]float32, len(reqs))
	var seqs []trainSeq
	var req []int // the request of each sequence
	for i, r := range reqs {
		p, err := e.promptTokens(r.Messages, r.PromptTokens)
		if err == nil {
			err = e.checkTokens(r.Tokens)
		}
		if err == nil && len(p)+len(r.Tokens) > cfg.MaxSeqLen {
			err = fmt.Errorf("prompt and tokens are %d tokens; the model takes at most %d", len(p)+len(r.Tokens), cfg.MaxSeqLen)
		}
		if err != nil {
			return nil, fmt.Errorf("tiny: %s request %d: %w", what, i, err)
		}
		out[i] = []float32{}
		if len(r.Tokens) > 0 {
			seqs = append(seqs, trainSeq{prompt: p, response: r.Tokens})
			req = append(req, i)
		}
	}
	err := eachChunk(ctx, seqs, chunkTokens, func(lo, hi int, p packed[float32]) {
		v := at(p)
		for k := lo; k < hi; k++ {
			n := len(seqs[k].response)
			out[req[k]], v = fromF64[float32](v[:n]), v[n:]
		}
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// The constraints' matchers, by tokenizer and constraint: a tokenizer's vocabulary is indexed
// once, a constraint compiled once and its masks kept across requests (engines/constrain).
var (
	matchersMu sync.Mutex
	vocabs     = map[*Tokenizer]*constrain.Vocab{}
	matchers   = map[matcherKey]*constrain.Matcher{}
)

type matcherKey struct {
	tok        *Tokenizer
	constraint string
}

// maxMatchers bounds the matchers kept (the oldest are not told apart: all go when it is reached).
const maxMatchers = 256

// matcher is the matcher of a request's constraint on the engine's vocabulary: each token's text
// its piece, the special tokens allowed only as EOS.
func (e *Engine) matcher(constraint string) (*constrain.Matcher, error) {
	matchersMu.Lock()
	defer matchersMu.Unlock()
	key := matcherKey{e.tok, constraint}
	if m, ok := matchers[key]; ok {
		return m, nil
	}
	spec, err := constrain.Parse(constraint)
	if err != nil {
		return nil, err
	}
	g, err := constrain.Compile(spec)
	if err != nil {
		return nil, fmt.Errorf("constraint: %w", err)
	}
	v, ok := vocabs[e.tok]
	if !ok {
		texts := make([]string, e.tok.VocabSize())
		special := make([]bool, len(texts))
		for id := range texts {
			texts[id] = e.tok.piece(int32(id))
		}
		for _, id := range e.tok.special {
			special[id] = true
		}
		v = constrain.NewVocab(texts, special)
		vocabs[e.tok] = v
	}
	if len(matchers) >= maxMatchers {
		clear(matchers)
	}
	m := constrain.NewMatcher(g, v, e.eos)
	matchers[key] = m
	return m, nil
}
