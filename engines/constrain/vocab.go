package constrain

import (
	"encoding/binary"
	"sort"
	"sync"
)

// Vocab is a tokenizer's vocabulary as the matcher walks it: the tokens' texts in a trie, so that
// tokens sharing a beginning share its walk and a dead beginning prunes every token under it.
// Special tokens (and tokens with no text) are left out: they are allowed only as end-of-sequence
// tokens where the grammar accepts.
type Vocab struct {
	size  int
	nodes []vnode
}

type vnode struct {
	edges []vedge // by byte
	toks  []int32 // the tokens whose text ends here
}

type vedge struct {
	b  byte
	to int32
}

// NewVocab indexes a vocabulary: texts[id] is token id's text (the tokenizer's decoding of that
// token alone), special[id] whether it is a special (control) token. special may be nil.
func NewVocab(texts []string, special []bool) *Vocab {
	v := &Vocab{size: len(texts), nodes: []vnode{{}}}
	children := []map[byte]int32{{}}
	for id, t := range texts {
		if t == "" || (special != nil && special[id]) {
			continue
		}
		at := int32(0)
		for i := 0; i < len(t); i++ {
			nx, ok := children[at][t[i]]
			if !ok {
				nx = int32(len(v.nodes))
				v.nodes = append(v.nodes, vnode{})
				children = append(children, map[byte]int32{})
				children[at][t[i]] = nx
			}
			at = nx
		}
		v.nodes[at].toks = append(v.nodes[at].toks, int32(id))
	}
	for i, ch := range children {
		for b, to := range ch {
			v.nodes[i].edges = append(v.nodes[i].edges, vedge{b, to})
		}
		sort.Slice(v.nodes[i].edges, func(a, c int) bool { return v.nodes[i].edges[a].b < v.nodes[i].edges[c].b })
	}
	return v
}

// Size is the number of tokens.
func (v *Vocab) Size() int { return v.size }

// Matcher is a grammar on a vocabulary: it says which tokens may come next in a state. It keeps
// the answers by state (a response revisits the same states: every token inside one string is
// read in the same state), up to maxCached of them. Safe for concurrent use.
type Matcher struct {
	g     *Grammar
	v     *Vocab
	eos   []int32
	mu    sync.Mutex
	cache map[string][]bool
}

// maxCached bounds the states a Matcher keeps the mask of.
const maxCached = 4096

// NewMatcher pairs a grammar with a vocabulary whose end-of-sequence tokens are eos.
func NewMatcher(g *Grammar, v *Vocab, eos []int32) *Matcher {
	return &Matcher{g: g, v: v, eos: eos, cache: map[string][]bool{}}
}

// Grammar is the matcher's grammar.
func (m *Matcher) Grammar() *Grammar { return m.g }

// Allowed returns, for each token, whether it may come next in state s: its text walks the
// automaton without a dead end, or it is an end-of-sequence token and s accepts. The slice is
// shared: read it, do not change it.
func (m *Matcher) Allowed(s State) []bool {
	key := s.key()
	m.mu.Lock()
	mask, ok := m.cache[key]
	m.mu.Unlock()
	if ok {
		return mask
	}
	mask = m.compute(s)
	m.mu.Lock()
	if len(m.cache) >= maxCached {
		clear(m.cache)
	}
	m.cache[key] = mask
	m.mu.Unlock()
	return mask
}

func (m *Matcher) compute(s State) []bool {
	mask := make([]bool, m.v.size)
	if s.Dead() {
		return mask
	}
	m.walk(0, s, mask)
	if s.Accepts() {
		for _, t := range m.eos {
			if t >= 0 && int(t) < len(mask) {
				mask[t] = true
			}
		}
	}
	return mask
}

// walk marks the tokens under trie node at, whose text so far leaves the automaton in s (alive).
func (m *Matcher) walk(at int32, s State, mask []bool) {
	nd := &m.v.nodes[at]
	for _, t := range nd.toks {
		mask[t] = true
	}
	for _, e := range nd.edges {
		if ns := s.feed(int(e.b)); !ns.Dead() {
			m.walk(e.to, ns, mask)
		}
	}
}

// Advance is the state after token tok (its text; a special token leaves the state as it is).
func (m *Matcher) Advance(s State, text string) State { return s.Feed(text) }

// key is the state as a string: equal for states the automaton cannot tell apart.
func (s State) key() string {
	var b []byte
	for _, a := range s.alts {
		for st := a; st != nil; st = st.up {
			f := &st.f
			b = append(b, byte(f.kind), f.st, f.ws)
			id := 0
			if f.n != nil {
				id = f.n.id
			}
			b = binary.AppendVarint(b, int64(id))
			if f.lit != nil {
				b = binary.AppendVarint(b, int64(f.lit.id))
			}
			b = binary.AppendVarint(b, int64(f.i))
			b = binary.AppendVarint(b, int64(f.cur))
			b = binary.AppendUvarint(b, f.seen)
		}
		b = append(b, 0xff)
	}
	return string(b)
}
