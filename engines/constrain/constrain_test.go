package constrain

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
)

type fixtureCase struct {
	Name   string          `json:"name"`
	Spec   json.RawMessage `json:"spec"`
	Accept []string        `json:"accept"`
	Reject []string        `json:"reject"`
	Dead   []string        `json:"dead"`
	Error  string          `json:"error"`
}

func loadCases(t testing.TB) []fixtureCase {
	b, err := os.ReadFile("../../testdata/constrain/cases.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Cases []fixtureCase `json:"cases"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	return f.Cases
}

func compileText(text string) (*Grammar, error) {
	s, err := Parse(text)
	if err != nil {
		return nil, err
	}
	return Compile(s)
}

// TestFixture runs the cases testdata/constrain/cases.json shares with the Python port.
func TestFixture(t *testing.T) {
	for _, c := range loadCases(t) {
		t.Run(c.Name, func(t *testing.T) {
			g, err := compileText(string(c.Spec))
			if c.Error != "" {
				if err == nil || !strings.Contains(err.Error(), c.Error) {
					t.Fatalf("error %v; want one saying %q", err, c.Error)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range c.Accept {
				if !g.Match(s) {
					t.Errorf("%q not accepted", s)
				}
			}
			for _, s := range append(c.Reject, c.Dead...) {
				if g.Match(s) {
					t.Errorf("%q accepted", s)
				}
			}
			for _, s := range c.Dead {
				if !g.Start().Feed(s).Dead() {
					t.Errorf("%q is still the beginning of a response; want a dead end", s)
				}
			}
			for _, s := range c.Accept {
				for i := range len(s) {
					if g.Start().Feed(s[:i]).Dead() {
						t.Errorf("%q: its beginning %q is a dead end", s, s[:i])
					}
				}
			}
		})
	}
}

// TestNoDeadEnds walks every fixture grammar at random, one allowed byte at a time: from every
// state reached some byte (or the end) goes on, so a sampler that picks only allowed tokens is
// never stuck.
func TestNoDeadEnds(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range loadCases(t) {
		if c.Error != "" {
			continue
		}
		g, err := compileText(string(c.Spec))
		if err != nil {
			t.Fatal(err)
		}
		for walk := range 40 {
			s := g.Start()
			var text []byte
			for step := range 200 {
				var next []int
				for b := range 256 {
					if !s.feed(b).Dead() {
						next = append(next, b)
					}
				}
				if len(next) == 0 {
					if !s.Accepts() {
						t.Fatalf("%s: walk %d: dead end after %q", c.Name, walk, text)
					}
					break
				}
				if s.Accepts() && rng.IntN(8) == 0 || step == 199 {
					break
				}
				b := next[rng.IntN(len(next))]
				s, text = s.feed(b), append(text, byte(b))
			}
		}
	}
}

func charVocab() ([]string, []bool) {
	texts := []string{"<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|unk|>", "\n"}
	special := make([]bool, len(texts))
	for i := range 6 {
		special[i] = true
	}
	for c := ' '; c <= '~'; c++ {
		texts, special = append(texts, string(c)), append(special, false)
	}
	return texts, special
}

// subwordVocab is a vocabulary of size pieces like a BPE tokenizer's: the characters, then
// pieces of JSON and words of several characters, some ending in quotes or braces.
func subwordVocab(size int) ([]string, []bool) {
	texts, special := charVocab()
	seen := map[string]bool{}
	for _, t := range texts {
		seen[t] = true
	}
	rng := rand.New(rand.NewPCG(7, 7))
	frag := []string{"\"", "\": ", "\", \"", "{\"", "\"}", "}", "{", "[", "]", ", ", ": ", "\n", "  ", "true", "null", "false", "name", "age", "_", "<tool_call>", "</tool_call>", "arguments"}
	letters := "abcdefghijklmnopqrstuvwxyz0123456789 "
	for len(texts) < size {
		var b strings.Builder
		for range 1 + rng.IntN(3) {
			if rng.IntN(3) == 0 {
				b.WriteString(frag[rng.IntN(len(frag))])
			} else {
				for range 1 + rng.IntN(5) {
					b.WriteByte(letters[rng.IntN(len(letters))])
				}
			}
		}
		if s := b.String(); !seen[s] {
			seen[s] = true
			texts, special = append(texts, s), append(special, false)
		}
	}
	return texts, special
}

// TestMatcherTokens: a token is allowed when its whole text walks the automaton, whatever its
// length; special tokens only as EOS where the grammar accepts.
func TestMatcherTokens(t *testing.T) {
	g, err := compileText(`{"json_schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false}}`)
	if err != nil {
		t.Fatal(err)
	}
	texts := []string{"<|end|>", "{", "{\"", "{\"name", "{\"nome", "\": \"", "\"", "}", "\"}", "x", "<|user|>", "{\"name\": \"Bo\"}"}
	special := []bool{true, false, false, false, false, false, false, false, false, false, true, false}
	m := NewMatcher(g, NewVocab(texts, special), []int32{0})
	allowed := func(s State) []string {
		var out []string
		for id, ok := range m.Allowed(s) {
			if ok {
				out = append(out, texts[id])
			}
		}
		return out
	}
	check := func(s State, want ...string) {
		t.Helper()
		if got := allowed(s); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("allowed %q; want %q", got, want)
		}
	}
	s := g.Start()
	check(s, "{", "{\"", "{\"name", "{\"name\": \"Bo\"}")
	s = s.Feed("{\"name\": \"Bo")
	check(s, "{", "{\"", "\"", "}", "\"}", "x") // inside the string any text; a quote ends it
	s = s.Feed("\"")
	check(s, "}")
	s = s.Feed("}")
	check(s, "<|end|>")
}

// TestMatcherCached: the mask of a state asked again is the same (cached) answer, and states that
// differ in what may follow get different ones.
func TestMatcherCached(t *testing.T) {
	g, err := compileText(`{"json_schema": {"type": "object"}}`)
	if err != nil {
		t.Fatal(err)
	}
	texts, special := charVocab()
	m := NewMatcher(g, NewVocab(texts, special), []int32{1})
	a := m.Allowed(g.Start().Feed(`{"a": "xy`))
	b := m.Allowed(g.Start().Feed(`{"a": "xyz`))
	if &a[0] != &b[0] {
		t.Error("two positions inside one string did not share their mask")
	}
	c := m.Allowed(g.Start().Feed(`{"a": 1`))
	if &a[0] == &c[0] {
		t.Error("inside a string and after a number share a mask")
	}
}

// BenchmarkMask is the matcher's cost per sampled token along a response of a strict schema:
// cold (each state computed) and warm (as along a generation, states cached), on the tiny
// engine's 102-token character vocabulary and on a 4,096-piece subword vocabulary.
func BenchmarkMask(b *testing.B) {
	spec := `{"json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"], "additionalProperties": false}}`
	response := `{"name": "Ann Lee", "age": 31, "tags": ["a", "bc", "def"]}`
	for _, v := range []struct {
		name string
		size int
	}{{"chars102", 0}, {"subword4096", 4096}} {
		texts, special := charVocab()
		if v.size > 0 {
			texts, special = subwordVocab(v.size)
		}
		vocab := NewVocab(texts, special)
		g, err := compileText(spec)
		if err != nil {
			b.Fatal(err)
		}
		for _, warm := range []bool{false, true} {
			name := v.name + "/cold"
			if warm {
				name = v.name + "/warm"
			}
			b.Run(name, func(b *testing.B) {
				m := NewMatcher(g, vocab, []int32{1})
				steps := 0
				for range b.N {
					if !warm {
						m = NewMatcher(g, vocab, []int32{1})
					}
					s := g.Start()
					for i := range len(response) {
						m.Allowed(s)
						s = s.Feed(response[i : i+1])
						steps++
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(steps)/1e3, "µs/token")
			})
		}
	}
}
