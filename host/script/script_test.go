package script

import (
	"slices"
	"sort"
	"testing"

	"go.starlark.net/starlark"
)

// TestPredeclared pins what a sandboxed script can name without loading it (docs/sandbox.md: no
// predeclared names beyond the documented built-ins) and the modules it may load. A new name here
// is a decision: document it in README's built-ins (or keep it out of the sandbox).
func TestPredeclared(t *testing.T) {
	var got []string
	for name := range predeclared() {
		got = append(got, name)
	}
	for name := range starlark.Universe {
		got = append(got, name)
	}
	sort.Strings(got)
	want := []string{
		// slimen's built-ins (predeclared, script.go)
		"agent", "chat", "completion", "config", "generate", "log", "parallel", "reward", "score", "state", "struct", "train",
		// Starlark's own (go.starlark.net Universe)
		"False", "None", "True", "abs", "all", "any", "bool", "bytes", "chr", "dict", "dir", "enumerate", "fail",
		"float", "getattr", "hasattr", "hash", "int", "len", "list", "max", "min", "ord", "print", "range",
		"repr", "reversed", "set", "sorted", "str", "tuple", "type", "zip",
	}
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Errorf("predeclared names changed:\n got %v\nwant %v", got, want)
	}
	var mods []string
	for pkg, files := range nativeModules() {
		for f := range files {
			mods = append(mods, "@"+pkg+"//"+f)
		}
	}
	sort.Strings(mods)
	wantMods := []string{"@slimen//answers.star", "@slimen//random.star", "@slimen//stats.star", "@slimen//text.star", "@slimen//tools.star",
		"@slimen//vote.star", "@std//json.star", "@std//math.star"}
	if !slices.Equal(mods, wantMods) {
		t.Errorf("loadable native modules changed:\n got %v\nwant %v", mods, wantMods)
	}
}
