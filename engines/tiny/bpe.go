package tiny

import (
	"cmp"
	"container/heap"
	"fmt"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The byte-level BPE vocabulary of chat models, in the form of Qwen2/Qwen3's tokenizers: text is
// split into pre-tokens by splitQwen2 (the split pattern below, written out by hand because Go's
// regexp has no lookahead), each pre-token's UTF-8 bytes are written as GPT-2's printable
// byte characters (byteChars), and merges learnt by TrainBPE join them into tokens. The
// tokenizers library reads the same description from tokenizer.json and tokenizes exactly as
// the Go code does (engines/torch/tests/test_tiny_compat.py checks it).

// qwen2SplitPattern is the pre-tokenizer's pattern in tokenizer.json: contractions, a run of
// letters with an optional leading non-letter, single digits, runs of punctuation with the
// newlines after them, newlines with the whitespace before them, whitespace not followed by a
// non-space (so the last space before a word joins the word), other whitespace.
const qwen2SplitPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

// byteChars maps a byte to the printable character GPT-2's byte-level BPE writes it as: the
// printable Latin-1 bytes stand for themselves, the others (controls, space, 0x7f–0xa0, 0xad)
// take the characters from U+0100 on, in byte order.
var byteChars, charBytes = func() ([256]rune, map[rune]byte) {
	var to [256]rune
	from := map[rune]byte{}
	n := 0
	for b := range 256 {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xa1 && b <= 0xac || b >= 0xae) {
			r = rune(256 + n)
			n++
		}
		to[b], from[r] = r, byte(b)
	}
	return to, from
}()

// byteLevel writes s's bytes as byte characters.
func byteLevel(s string) string {
	var b strings.Builder
	b.Grow(2 * len(s))
	for i := 0; i < len(s); i++ {
		b.WriteRune(byteChars[s[i]])
	}
	return b.String()
}

// unByteLevel turns byte characters back into the bytes they stand for; ok is false if p holds
// another character.
func unByteLevel(p string) (s string, ok bool) {
	out := make([]byte, 0, len(p))
	for _, r := range p {
		c, ok := charBytes[r]
		if !ok {
			return "", false
		}
		out = append(out, c)
	}
	return string(out), true
}

func isCRLF(r rune) bool { return r == '\r' || r == '\n' }

// isPunct is [^\s\p{L}\p{N}].
func isPunct(r rune) bool { return !unicode.IsSpace(r) && !unicode.IsLetter(r) && !unicode.IsNumber(r) }

// splitQwen2 calls emit with each pre-token of s, in order, as the tokenizers library's Split
// pre-tokenizer with qwen2SplitPattern and behaviour Isolated cuts it: at each position the first
// alternative of the pattern that matches, with the greedy quantifiers backtracking as a
// backtracking regex engine does. Every character is matched by some alternative, so the
// pre-tokens cover s.
func splitQwen2(s string, emit func(string)) {
	for i := 0; i < len(s); {
		n := qwen2Match(s, i)
		emit(s[i : i+n])
		i += n
	}
}

// qwen2Match returns the length of the pattern's match at s[i:] (at least one character).
func qwen2Match(s string, i int) int {
	r0, w0 := utf8.DecodeRuneInString(s[i:])
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if r0 == '\'' {
		if n := contraction(s[i+1:]); n > 0 {
			return 1 + n
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if unicode.IsLetter(r0) {
		return w0 + letters(s[i+w0:])
	}
	if !isCRLF(r0) && !unicode.IsNumber(r0) && i+w0 < len(s) {
		if r1, w1 := utf8.DecodeRuneInString(s[i+w0:]); unicode.IsLetter(r1) {
			return w0 + w1 + letters(s[i+w0+w1:])
		}
	}
	// \p{N}
	if unicode.IsNumber(r0) {
		return w0
	}
	// ?[^\s\p{L}\p{N}]+[\r\n]*
	j := i
	if r0 == ' ' {
		j++
	}
	if r, w := utf8.DecodeRuneInString(s[j:]); j < len(s) && isPunct(r) {
		for j += w; j < len(s); j += w {
			if r, w = utf8.DecodeRuneInString(s[j:]); !isPunct(r) {
				break
			}
		}
		for j < len(s) && isCRLF(rune(s[j])) {
			j++
		}
		return j - i
	}
	// Whitespace (r0 is a space: every other character matched above). \s*[\r\n]+ takes the run
	// up to its last newline; \s+(?!\S) the run but its last character when a non-space follows;
	// \s+ the run.
	end, afterNL, last := i, -1, i
	for end < len(s) {
		r, w := utf8.DecodeRuneInString(s[end:])
		if !unicode.IsSpace(r) {
			break
		}
		last = end
		end += w
		if isCRLF(r) {
			afterNL = end
		}
	}
	switch {
	case afterNL > 0:
		return afterNL - i
	case end < len(s) && last > i:
		return last - i
	}
	return end - i
}

// contraction returns the length of s's prefix that is one of s, t, re, ve, m, ll, d in any case
// (ſ, U+017F, folds to s), or 0.
func contraction(s string) int {
	for _, c := range []string{"s", "t", "re", "ve", "m", "ll", "d"} {
		if len(s) >= len(c) && strings.EqualFold(s[:len(c)], c) {
			return len(c)
		}
		if c == "s" && strings.HasPrefix(s, "ſ") {
			return len("ſ")
		}
	}
	return 0
}

// letters returns the length of s's prefix of letters.
func letters(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsLetter(r) {
			break
		}
		n += w
	}
	return n
}

// bpeModel is a byte-level BPE vocabulary: ids 0..255 are the bytes, the merges follow in the
// order they were learnt, and the added tokens come last.
type bpeModel struct {
	vocab  []string          // id → byte characters (the key of model.vocab); "" for added tokens
	merges [][2]int32        // rank → the pair it joins
	rank   map[uint64]bpeRes // pair → its rank and the token it makes
	byteID [256]int32        // the token of each byte
}

type bpeRes struct{ rank, id int32 }

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// longWord is the length from which encodeWord keeps its candidate pairs in a heap: below it a
// scan of the pairs per merge is faster, above it the scans would cost the square of the length
// (a long run of letters or punctuation in a document).
const longWord = 48

// encodeWord appends the tokens of one pre-token: its bytes, then repeatedly the pair of lowest
// rank joined (the leftmost among equals), as the tokenizers library's BPE model does.
func (m *bpeModel) encodeWord(dst []int32, word string) []int32 {
	if len(word) >= longWord {
		return m.encodeLongWord(dst, word)
	}
	start := len(dst)
	for i := 0; i < len(word); i++ {
		dst = append(dst, m.byteID[word[i]])
	}
	syms := dst[start:]
	for len(syms) > 1 {
		best, at := bpeRes{rank: -1}, -1
		for k := 0; k+1 < len(syms); k++ {
			if r, ok := m.rank[pairKey(syms[k], syms[k+1])]; ok && (at < 0 || r.rank < best.rank) {
				best, at = r, k
			}
		}
		if at < 0 {
			break
		}
		syms[at] = best.id
		syms = append(syms[:at+1], syms[at+2:]...)
	}
	return dst[:start+len(syms)]
}

// TrainBPE learns a byte-level BPE tokenizer of vocabSize tokens (the 256 bytes, the merges, and
// specials, the added tokens, last) from texts, split into pre-tokens as Qwen2's tokenizer does.
// Occurrences of the specials in texts are cut out before counting. Each step merges the most
// frequent adjacent pair; ties go to the pair whose left token, then right token, has the lower
// id (tokens made earlier first), so the same texts give the same tokenizer. A pair must occur
// at least twice to be merged, so a small corpus may give fewer tokens than asked.
//
// specials must start with the end-of-sequence token; the first is also the padding token if
// there is only one. The chat tokenizer of TrainChatBPE passes ChatSpecials.
func TrainBPE(texts []string, vocabSize int, specials []string) (*Tokenizer, error) {
	if len(specials) == 0 {
		return nil, fmt.Errorf("tiny: TrainBPE: specials must name at least the end-of-sequence token")
	}
	if vocabSize < 256+len(specials) {
		return nil, fmt.Errorf("tiny: TrainBPE: vocab size %d is below the 256 bytes and %d special tokens", vocabSize, len(specials))
	}
	for i, s := range specials {
		if s == "" || slices.Index(specials, s) != i {
			return nil, fmt.Errorf("tiny: TrainBPE: special token %d %q is empty or repeated", i, s)
		}
	}
	// Count the pre-tokens.
	counts := map[string]int64{}
	for _, text := range texts {
		for _, part := range splitOn(text, specials) {
			splitQwen2(part, func(w string) { counts[w]++ })
		}
	}
	words := make([]bpeWord, 0, len(counts))
	for _, w := range slices.Sorted(mapsKeys(counts)) {
		syms := make([]int32, len(w))
		for i := 0; i < len(w); i++ {
			syms[i] = int32(w[i])
		}
		words = append(words, bpeWord{syms: syms, n: counts[w]})
	}
	tr := newBPETrainer(words)
	vocab := make([]string, 256, vocabSize)
	ids := map[string]int32{}
	for b := range 256 {
		vocab[b] = string(byteChars[b])
		ids[vocab[b]] = int32(b)
	}
	var merges [][2]int32
	for len(vocab)+len(specials) < vocabSize {
		a, b, ok := tr.best()
		if !ok {
			break
		}
		piece := vocab[a] + vocab[b]
		id, seen := ids[piece]
		if !seen {
			id = int32(len(vocab))
			vocab = append(vocab, piece)
			ids[piece] = id
		}
		merges = append(merges, [2]int32{a, b})
		tr.merge(a, b, id)
	}
	return newBPETokenizer(vocab, merges, specials)
}

// splitOn cuts the occurrences of specials out of text.
func splitOn(text string, specials []string) []string {
	parts := []string{text}
	for _, sp := range specials {
		var next []string
		for _, p := range parts {
			next = append(next, strings.Split(p, sp)...)
		}
		parts = next
	}
	return parts
}

func mapsKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// bpeWord is one distinct pre-token of the training texts: its current tokens and its count.
type bpeWord struct {
	syms []int32
	n    int64
}

// bpeTrainer keeps the count of every adjacent pair over the words, the words each pair may
// occur in, and a heap of (count, pair) entries that may be stale: best checks an entry against
// the current count before it trusts it.
type bpeTrainer struct {
	words []bpeWord
	count map[uint64]int64
	where map[uint64][]int32
	seen  []int32 // per word: the last merge that visited it (to skip repeats in where)
	stamp int32
	h     pairHeap
}

func newBPETrainer(words []bpeWord) *bpeTrainer {
	t := &bpeTrainer{words: words, count: map[uint64]int64{}, where: map[uint64][]int32{}, seen: make([]int32, len(words))}
	for wi, w := range words {
		for k := 0; k+1 < len(w.syms); k++ {
			p := pairKey(w.syms[k], w.syms[k+1])
			t.count[p] += w.n
			if l := t.where[p]; len(l) == 0 || l[len(l)-1] != int32(wi) {
				t.where[p] = append(l, int32(wi))
			}
		}
	}
	for p, c := range t.count {
		t.h = append(t.h, pairEntry{c, p})
	}
	heap.Init(&t.h)
	return t
}

// best returns the pair to merge next: the largest count of at least 2, ties to the lower ids.
func (t *bpeTrainer) best() (a, b int32, ok bool) {
	for t.h.Len() > 0 {
		top := heap.Pop(&t.h).(pairEntry)
		c := t.count[top.pair]
		switch {
		case c == top.n && c >= 2:
			return int32(top.pair >> 32), int32(uint32(top.pair)), true
		case c < top.n && c >= 2:
			heap.Push(&t.h, pairEntry{c, top.pair}) // the count fell since: queue it as it is now
		}
		// c > top.n: a newer entry with the larger count is queued; c < 2: not worth a token.
	}
	return 0, 0, false
}

// merge joins every occurrence of (a, b) into id, left to right, updating the pair counts.
func (t *bpeTrainer) merge(a, b, id int32) {
	t.stamp++
	key := pairKey(a, b)
	delta := map[uint64]int64{}
	for _, wi := range t.where[key] {
		if t.seen[wi] == t.stamp {
			continue
		}
		t.seen[wi] = t.stamp
		w := &t.words[wi]
		out := w.syms[:0]
		syms := w.syms
		for k := 0; k < len(syms); k++ {
			if k+1 < len(syms) && syms[k] == a && syms[k+1] == b {
				if len(out) > 0 {
					prev := out[len(out)-1]
					delta[pairKey(prev, a)] -= w.n
					delta[pairKey(prev, id)] += w.n
				}
				delta[key] -= w.n
				// As if merged in place: a following occurrence of the pair sees id as its left
				// neighbour and takes back the (id, a) counted here.
				if k+2 < len(syms) {
					next := syms[k+2]
					delta[pairKey(b, next)] -= w.n
					delta[pairKey(id, next)] += w.n
				}
				out = append(out, id)
				k++
				continue
			}
			out = append(out, syms[k])
		}
		w.syms = out
		for k := 0; k+1 < len(out); k++ {
			if out[k] == id || out[k+1] == id {
				p := pairKey(out[k], out[k+1])
				if l := t.where[p]; len(l) == 0 || l[len(l)-1] != wi {
					t.where[p] = append(l, wi)
				}
			}
		}
	}
	delete(t.where, key)
	for _, p := range slices.Sorted(func(yield func(uint64) bool) {
		for p := range delta {
			if !yield(p) {
				return
			}
		}
	}) {
		d := delta[p]
		if d == 0 {
			continue
		}
		c := t.count[p] + d
		if c <= 0 {
			delete(t.count, p)
			continue
		}
		t.count[p] = c
		if d > 0 {
			heap.Push(&t.h, pairEntry{c, p})
		}
	}
}

type pairEntry struct {
	n    int64
	pair uint64
}

// pairHeap pops the largest count first, then the lower left id, then the lower right id.
type pairHeap []pairEntry

func (h pairHeap) Len() int { return len(h) }
func (h pairHeap) Less(i, j int) bool {
	if h[i].n != h[j].n {
		return h[i].n > h[j].n
	}
	return cmp.Less(h[i].pair, h[j].pair)
}
func (h pairHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *pairHeap) Push(x any)   { *h = append(*h, x.(pairEntry)) }
func (h *pairHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// encodeLongWord is encodeWord with the symbols in a linked list and the candidate merges in a
// heap ordered by (rank, position), as the tokenizers library does it: each merge costs a log
// of the length instead of a scan. An entry is stale when its left symbol was merged away or now
// forms another pair; popping checks that.
func (m *bpeModel) encodeLongWord(dst []int32, word string) []int32 {
	n := len(word)
	sym := make([]int32, n)
	next, prev := make([]int, n), make([]int, n)
	for i := range n {
		sym[i], next[i], prev[i] = m.byteID[word[i]], i+1, i-1
	}
	next[n-1] = -1
	var h mergeHeap
	push := func(i int) {
		if j := next[i]; j >= 0 {
			if r, ok := m.rank[pairKey(sym[i], sym[j])]; ok {
				heap.Push(&h, mergeEntry{rank: r.rank, pos: i, pair: pairKey(sym[i], sym[j])})
			}
		}
	}
	for i := range n - 1 {
		push(i)
	}
	for h.Len() > 0 {
		top := heap.Pop(&h).(mergeEntry)
		i := top.pos
		j := next[i]
		if sym[i] < 0 || j < 0 || pairKey(sym[i], sym[j]) != top.pair {
			continue
		}
		sym[i] = m.rank[top.pair].id
		sym[j] = -1
		next[i] = next[j]
		if next[j] >= 0 {
			prev[next[j]] = i
		}
		if p := prev[i]; p >= 0 {
			push(p)
		}
		push(i)
	}
	for i := 0; i >= 0; i = next[i] {
		dst = append(dst, sym[i])
	}
	return dst
}

type mergeEntry struct {
	rank int32
	pos  int
	pair uint64
}

// mergeHeap pops the lowest rank first, then the leftmost position.
type mergeHeap []mergeEntry

func (h mergeHeap) Len() int { return len(h) }
func (h mergeHeap) Less(i, j int) bool {
	if h[i].rank != h[j].rank {
		return h[i].rank < h[j].rank
	}
	return h[i].pos < h[j].pos
}
func (h mergeHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *mergeHeap) Push(x any)   { *h = append(*h, x.(mergeEntry)) }
func (h *mergeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
