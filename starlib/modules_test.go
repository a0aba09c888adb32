package starlib

import (
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestPackages(t *testing.T) {
	pkgs := Packages()
	files := map[string][]string{}
	for pkg, mods := range pkgs {
		for file := range mods {
			files[pkg] = append(files[pkg], file)
		}
		sort.Strings(files[pkg])
	}
	want := map[string][]string{
		"slimen": {"answers.star", "random.star", "stats.star", "text.star", "tools.star", "vote.star"},
		"std":    {"json.star", "math.star"},
	}
	if diff := cmp.Diff(want, files); diff != "" {
		t.Errorf("Packages() files (-want +got):\n%s", diff)
	}

	// Callers get their own maps: changing one does not change the next loader's.
	delete(pkgs["slimen"]["answers.star"], "boxed")
	if _, ok := Packages()["slimen"]["answers.star"]["boxed"]; !ok {
		t.Error("deleting from one Packages() result changed another")
	}
	if _, ok := Module("slimen", "nope.star"); ok {
		t.Error(`Module("slimen", "nope.star") found a module`)
	}
	if _, ok := Module("graphs", "answers.star"); ok {
		t.Error(`Module("graphs", "answers.star") found a module`)
	}
}

// A script can load every module the design names, and the std modules are go.starlark.net's.
func TestLoadAll(t *testing.T) {
	src := `
load("@slimen//answers.star", "boxed", "equal")
load("@slimen//text.star", "strip_think")
load("@slimen//vote.star", "majority")
load("@slimen//stats.star", "mean")
load("@slimen//random.star", "randint")
load("@std//json.star", "encode", "decode")
load("@std//math.star", "sqrt")

finals = ["<think>x</think> \\boxed{4}", "\\boxed{4.0}", "\\boxed{5}"]
y = majority([boxed(strip_think(f)) for f in finals], key = lambda a: "4" if equal(a, "4") else a)
got = encode({"y": y, "m": mean([1, 2]), "r": sqrt(16), "d": decode("[1]"), "k": randint(1, 6) in range(1, 7)})
`
	if got := mustExec(t, src, "got"); got != `"{\"d\":[1],\"k\":true,\"m\":1.5,\"r\":4.0,\"y\":\"4\"}"` {
		t.Errorf("got %s", got)
	}
}
