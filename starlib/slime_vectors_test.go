package starlib

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"testing"

	"go.starlark.net/starlark"
)

// rewardVector is one line of testdata/slime/rewards.jsonl: an input and slime's rm_hub verdict on
// it, written by testdata/slime/make_reward_vectors.py.
type rewardVector struct {
	Mode      string          `json:"mode"`
	Response  string          `json:"response"`
	Label     json.RawMessage `json:"label"`
	Choices   []string        `json:"choices"`
	Metadata  json.RawMessage `json:"metadata"`
	StrictBox bool            `json:"strict_box"`
	Want      json.RawMessage `json:"want"`
	Crash     string          `json:"crash"`
}

// knownRewardDifferences are the vectors where slimen deliberately or unavoidably gives another
// verdict than slime, keyed by mode, response and label (joined by "\x00"), each with its reason.
// The test fails on any other difference, and on an entry here that no longer differs.
var knownRewardDifferences = map[string]string{}

// rewardVectorsFile is the committed vectors, or the file named by SLIMEN_REWARD_VECTORS (made by
// the same script from other inputs or another slime commit).
func rewardVectorsFile() string {
	if p := os.Getenv("SLIMEN_REWARD_VECTORS"); p != "" {
		return p
	}
	return "../testdata/slime/rewards.jsonl"
}

func loadRewardVectors(t testing.TB) []rewardVector {
	t.Helper()
	f, err := os.Open(rewardVectorsFile())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []rewardVector
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for line := 1; sc.Scan(); line++ {
		var v rewardVector
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			t.Fatalf("rewards.jsonl:%d: %v", line, err)
		}
		out = append(out, v)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// starlarkOf turns a JSON label, verdict or metadata into the Starlark value a script would hold.
func starlarkOf(raw json.RawMessage) (starlark.Value, error) {
	d := json.NewDecoder(strings.NewReader(string(raw)))
	d.UseNumber()
	var x any
	if err := d.Decode(&x); err != nil {
		return nil, err
	}
	return starlarkOfAny(x)
}

func starlarkOfAny(x any) (starlark.Value, error) {
	switch x := x.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return starlark.MakeInt64(i), nil
		}
		f, err := x.Float64()
		return starlark.Float(f), err
	case []any:
		var out []starlark.Value
		for _, e := range x {
			v, err := starlarkOfAny(e)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return starlark.NewList(out), nil
	case map[string]any:
		// Go maps lose JSON's key order, which a dict of choices needs: the generator writes
		// such dicts with keys in sorted order, so sorting restores it.
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		d := starlark.NewDict(len(x))
		for _, k := range keys {
			v, err := starlarkOfAny(x[k])
			if err != nil {
				return nil, err
			}
			if err := d.SetKey(starlark.String(k), v); err != nil {
				return nil, err
			}
		}
		return d, nil
	case nil:
		return starlark.None, nil
	case string:
		return starlark.String(x), nil
	case bool:
		return starlark.Bool(x), nil
	}
	return nil, fmt.Errorf("unexpected JSON %v", x)
}

// runRewardVector calls the Starlark built-in that answers the vector's mode.
func runRewardVector(thread *starlark.Thread, answers, text starlark.StringDict, v rewardVector) (starlark.Value, error) {
	label, err := starlarkOf(v.Label)
	if err != nil {
		return nil, err
	}
	resp := starlark.String(v.Response)
	switch v.Mode {
	case "latex": // slime's rendering of LaTeX for sympy, which no Starlark function exposes alone
		text, err := slimeParseLatex(v.Response)
		if err != nil {
			return starlark.None, nil // slime raises and keeps the answer as it was
		}
		return starlark.String(text), nil
	case "equal":
		return starlark.Call(thread, answers["equal"], starlark.Tuple{resp, label}, nil)
	case "boxed":
		return starlark.Call(thread, answers["boxed"], starlark.Tuple{resp}, nil)
	case "extract":
		return starlark.Call(thread, answers["extract"], starlark.Tuple{resp}, nil)
	case "f1":
		return starlark.Call(thread, text["f1"], starlark.Tuple{resp, label}, nil)
	}
	var kwargs []starlark.Tuple
	if v.Choices != nil {
		choices := make([]starlark.Value, len(v.Choices))
		for i, c := range v.Choices {
			choices[i] = starlark.String(c)
		}
		kwargs = append(kwargs, starlark.Tuple{starlark.String("choices"), starlark.NewList(choices)})
	}
	if v.Metadata != nil {
		meta, err := starlarkOf(v.Metadata)
		if err != nil {
			return nil, err
		}
		kwargs = append(kwargs, starlark.Tuple{starlark.String("metadata"), meta})
	}
	if v.StrictBox {
		kwargs = append(kwargs, starlark.Tuple{starlark.String("strict_box"), starlark.True})
	}
	return starlark.Call(thread, answers["grade"], starlark.Tuple{resp, label, starlark.String(v.Mode)}, kwargs)
}

// sameVerdict compares a Starlark result with slime's: numbers by value (slime's 1 is slimen's
// 1.0), within 1e-12 for F1's ratios.
func sameVerdict(got, want starlark.Value) bool {
	num := func(v starlark.Value) (float64, bool) {
		switch v := v.(type) {
		case starlark.Int:
			f, _ := starlark.AsFloat(v)
			return f, true
		case starlark.Float:
			return float64(v), true
		}
		return 0, false
	}
	if x, ok := num(got); ok {
		y, ok := num(want)
		return ok && math.Abs(x-y) <= 1e-12
	}
	if _, ok := num(want); ok {
		return false
	}
	eq, err := starlark.Equal(got, want)
	return err == nil && eq
}

// TestSlimeRewardVectors runs slime's verdicts through @slimen//answers.star and text.star and
// reports the match rate per mode. Run with -v to see the rates.
func TestSlimeRewardVectors(t *testing.T) {
	vectors := loadRewardVectors(t)
	answers, _ := Module("slimen", "answers.star")
	text, _ := Module("slimen", "text.star")
	thread := &starlark.Thread{Name: "vectors"}
	type tally struct{ match, total, known, crash int }
	rates := map[string]*tally{}
	stillKnown := map[string]bool{}
	for _, v := range vectors {
		r := rates[v.Mode]
		if r == nil {
			r = &tally{}
			rates[v.Mode] = r
		}
		if v.Crash != "" {
			r.crash++
			continue
		}
		r.total++
		want, err := starlarkOf(v.Want)
		if err != nil {
			t.Fatalf("%s %q: bad verdict: %v", v.Mode, v.Response, err)
		}
		got, err := runRewardVector(thread, answers, text, v)
		key := v.Mode + "\x00" + v.Response + "\x00" + string(v.Label)
		if err == nil && sameVerdict(got, want) {
			r.match++
			if _, ok := knownRewardDifferences[key]; ok {
				t.Errorf("%s(%q, %s) now agrees with slime: remove it from knownRewardDifferences", v.Mode, v.Response, v.Label)
			}
			continue
		}
		if _, ok := knownRewardDifferences[key]; ok {
			r.known++
			stillKnown[key] = true
			continue
		}
		t.Errorf("%s(%q, %s) = %v, %v; slime says %s", v.Mode, v.Response, v.Label, got, err, v.Want)
	}
	modes := make([]string, 0, len(rates))
	for m := range rates {
		modes = append(modes, m)
	}
	sort.Strings(modes)
	for _, m := range modes {
		r := rates[m]
		t.Logf("%-10s %4d/%4d match slime (%.1f%%), %d known differences, %d crash slime (skipped)",
			m, r.match, r.total, 100*float64(r.match)/float64(max(r.total, 1)), r.known, r.crash)
	}
}

// BenchmarkGrade times one grader call on typical inputs: a plain number, an expression that
// needs the symbolic comparison, a long response, and the other modes.
func BenchmarkGrade(b *testing.B) {
	long := strings.Repeat("Let me think about this step by step. ", 400) + `So the answer is \boxed{\frac{\sqrt{3}}{2}}.`
	cases := []struct {
		name, response, label, mode string
	}{
		{"math/number", `The answer is \boxed{42}.`, "42", GradeMath},
		{"math/fraction", `The answer is \boxed{\dfrac{3}{4}}.`, "0.75", GradeMath},
		{"math/symbolic", `The answer is \boxed{\frac{\sqrt{3}}{2}}.`, `\sqrt{3}/2`, GradeMath},
		{"math/polynomial", `\boxed{(x+1)^2}`, "x^2+2x+1", GradeMath},
		{"math/wrong", `\boxed{x^2+2x}`, "(x+1)^2", GradeMath},
		{"math/long", long, `\frac{\sqrt{3}}{2}`, GradeMath},
		{"deepscaler", `<think>hmm</think> so \boxed{2\sqrt{2}}`, `\sqrt{8}`, GradeDeepscaler},
		{"dapo", "work\nAnswer: 1,000", "1000", GradeDAPO},
		{"f1", "the city of Paris, France", "Paris", GradeF1},
		{"gpqa", "The answer is (B).", "B", GradeGPQA},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := Grade(c.response, TextLabel(c.label), c.mode, GradeOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRewardVectors times a pass over every committed vector: the mean cost of a call over
// inputs as varied as the test's.
func BenchmarkRewardVectors(b *testing.B) {
	vectors := loadRewardVectors(b)
	answers, _ := Module("slimen", "answers.star")
	text, _ := Module("slimen", "text.star")
	thread := &starlark.Thread{Name: "bench"}
	b.ResetTimer()
	for b.Loop() {
		for _, v := range vectors {
			if v.Crash == "" {
				runRewardVector(thread, answers, text, v)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(vectors))/1000, "µs/vector")
}
