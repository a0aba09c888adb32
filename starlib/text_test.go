package starlib

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestTags(t *testing.T) {
	cases := []struct {
		text, name string
		want       []string
	}{
		{"<a>1</a> x <a>2</a>", "a", []string{"1", "2"}},
		{"<verdict>\napprove\n</verdict>", "verdict", []string{"\napprove\n"}},
		{`<approach_1 kind="x">go</approach_1>`, "approach_1", []string{"go"}},
		{"<a>1</a> <a>cut off", "a", []string{"1"}},
		{"<ab>no</ab>", "a", nil},
		{"<a>multi\nline</a >", "a", []string{"multi\nline"}},
		{"no tags", "a", nil},
	}
	for _, c := range cases {
		got, err := Tags(c.text, c.name)
		if err != nil {
			t.Errorf("Tags(%q, %q): %v", c.text, c.name, err)
			continue
		}
		if diff := cmp.Diff(c.want, got); diff != "" {
			t.Errorf("Tags(%q, %q) (-want +got):\n%s", c.text, c.name, diff)
		}
	}
	if _, _, err := Tag("x", "a b"); err == nil {
		t.Error(`Tag accepted the tag name "a b"`)
	}
}

func TestStripThink(t *testing.T) {
	cases := []struct{ in, want string }{
		{"<think>hmm</think> The answer is 4.", "The answer is 4."},
		{"A <think>x</think> B <think>y</think> C", "A  B  C"},
		{"prompt opened it</think>\nvisible", "visible"},
		{"visible <think>cut off while thinking", "visible"},
		{"no thinking at all", "no thinking at all"},
		{"done</think> answer <think>again</think> end", "answer  end"},
	}
	for _, c := range cases {
		if got := StripThink(c.in); got != c.want {
			t.Errorf("StripThink(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestF1(t *testing.T) {
	cases := []struct {
		a, b string
		want float64
	}{
		{"Paris", "paris", 1},
		{"The Eiffel Tower!", "eiffel tower", 1},
		{"eiffel tower paris", "eiffel tower", 0.8}, // p = 2/3, r = 1
		{"tower tower", "tower", 2.0 / 3},           // repeats count once per reference token
		{"don't", "dont", 1},
		{"london", "paris", 0},
		{"", "", 0},    // nothing shared, as in slime
		{"the", "", 0}, // articles only: no tokens on either side
		{"x", "", 0},
		{"yes", "yes", 1},
		{"yes", "yes it is", 0}, // yes/no/noanswer must match whole
		{"no answer", "noanswer", 0},
		{"naïve—café", "naïve café", 0}, // only ASCII punctuation is deleted
	}
	for _, c := range cases {
		if got := F1(c.a, c.b); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("F1(%q, %q) = %v, want %v", c.a, c.b, got, c.want)
		}
	}
}

func TestTruncate(t *testing.T) {
	cases := []struct {
		in   string
		n    int
		tail bool
		want string
	}{
		{"héllo", 2, false, "hé"},
		{"héllo", 3, true, "llo"},
		{"héllo", 9, false, "héllo"},
		{"héllo", 0, true, ""},
	}
	for _, c := range cases {
		if got := Truncate(c.in, c.n, c.tail); got != c.want {
			t.Errorf("Truncate(%q, %d, %v) = %q, want %q", c.in, c.n, c.tail, got, c.want)
		}
	}
}

func TestTextScript(t *testing.T) {
	header := `load("@slimen//text.star", "tag", "tags", "strip_think", "f1", "find", "find_all", "sub", "truncate")`
	runScriptCases(t, header, []scriptCase{
		{src: `got = tag("<verdict> approve </verdict><verdict>reject</verdict>", "verdict")`, want: `"reject"`},
		{src: `got = tag("<verdict> approve </verdict>", "verdict", strip = False)`, want: `" approve "`},
		{src: `got = tag("none", "verdict")`, want: "None"},
		{src: `got = tags("<a>1</a><a> 2 </a>", "a")`, want: `["1", "2"]`},
		{src: `got = strip_think("<think>x</think> y")`, want: `"y"`},
		{src: `got = f1("x y", "y z")`, want: "0.5"},
		{src: `got = find("Judgment:\\s*(?:IDX|Solution)?\\s*#?(\\d+)", "Judgment: Solution #3")`, want: `"3"`},
		{src: `got = find("\\d+", "ab 12 34")`, want: `"12"`},
		{src: `got = find("(\\w)=(\\d)?", "x=")`, want: `("x", None)`},
		{src: `got = find("\\d", "none")`, want: "None"},
		{src: `got = find_all("(\\w)=(\\d)", "a=1 b=2")`, want: `[("a", "1"), ("b", "2")]`},
		{src: `got = find_all("\\d", "none")`, want: "[]"},
		{src: `got = sub("(\\d+)", "<$1>", "a 1 b 22")`, want: `"a <1> b <22>"`},
		{src: `got = sub("(?i)answer", "A", "Answer answer")`, want: `"A A"`},
		{src: `got = truncate("abcdef", 3, tail = True)`, want: `"def"`},
		{src: `got = find("(", "x")`, wantErr: `text.find: bad pattern "(" (Go RE2 syntax): error parsing regexp: missing closing )`},
		{src: `got = find_all("[", "x")`, wantErr: `text.find_all: bad pattern "["`},
		{src: `got = sub("(?<=a)b", "", "ab")`, wantErr: `text.sub: bad pattern`},
		{src: `got = tag("x", "a b")`, wantErr: `text.tag: for parameter name: "a b" is not a tag name`},
		{src: `got = tag("x")`, wantErr: "text.tag: missing argument for name"},
		{src: `got = truncate("x", -1)`, wantErr: "text.truncate: for parameter n: got -1"},
		{src: `got = f1("x", 1)`, wantErr: "text.f1: for parameter reference: got int, want string"},
	})
}
