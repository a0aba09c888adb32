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
	Mode     string          `json:"mode"`
	Response string          `json:"response"`
	Label    json.RawMessage `json:"label"`
	Choices  []string        `json:"choices"`
	Want     json.RawMessage `json:"want"`
	Crash    string          `json:"crash"`
}

// knownRewardDifferences are the vectors where slimen deliberately or unavoidably gives another
// verdict than slime, keyed by mode, response and label (joined by "\x00"), each with its reason.
// The test fails on any other difference, and on an entry here that no longer differs.
var knownRewardDifferences = map[string]string{}

func loadRewardVectors(t testing.TB) []rewardVector {
	t.Helper()
	f, err := os.Open("../testdata/slime/rewards.jsonl")
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

// starlarkOf turns a JSON label or verdict into the Starlark value a script would hold.
func starlarkOf(raw json.RawMessage) (starlark.Value, error) {
	var x any
	if err := json.Unmarshal(raw, &x); err != nil {
		return nil, err
	}
	switch x := x.(type) {
	case nil:
		return starlark.None, nil
	case string:
		return starlark.String(x), nil
	case bool:
		return starlark.Bool(x), nil
	case float64:
		if x == math.Trunc(x) && !strings.ContainsAny(string(raw), ".eE") {
			return starlark.MakeInt64(int64(x)), nil
		}
		return starlark.Float(x), nil
	}
	return nil, fmt.Errorf("unexpected JSON %s", raw)
}

// runRewardVector calls the Starlark built-in that answers the vector's mode.
func runRewardVector(thread *starlark.Thread, answers, text starlark.StringDict, v rewardVector) (starlark.Value, error) {
	label, err := starlarkOf(v.Label)
	if err != nil {
		return nil, err
	}
	resp := starlark.String(v.Response)
	switch v.Mode {
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
