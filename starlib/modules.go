package starlib

import (
	"maps"

	"go.starlark.net/lib/json"
	"go.starlark.net/lib/math"
	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// slimenModules and stdModules are the files of @slimen// and @std//.
var (
	slimenModules = map[string]*starlarkstruct.Module{
		"answers.star": Answers,
		"text.star":    Text,
		"vote.star":    Vote,
		"stats.star":   Stats,
		"random.star":  Random,
		"tools.star":   Tools,
	}
	stdModules = map[string]*starlarkstruct.Module{
		"json.star": json.Module,
		"math.star": math.Module,
	}
)

// Packages returns every Go-native package for a loader: package name ("slimen", "std") → file
// ("answers.star") → the globals that file defines. The maps are fresh on every call, so a caller
// may keep or change them; the values are frozen and shared.
func Packages() map[string]map[string]starlark.StringDict {
	out := map[string]map[string]starlark.StringDict{"slimen": {}, "std": {}}
	for file := range slimenModules {
		out["slimen"][file], _ = Module("slimen", file)
	}
	for file := range stdModules {
		out["std"][file], _ = Module("std", file)
	}
	return out
}

// Module returns the globals of @pkg//file: the module's members, so that
// load("@slimen//answers.star", "boxed") binds answers' boxed.
func Module(pkg, file string) (starlark.StringDict, bool) {
	var m *starlarkstruct.Module
	switch pkg {
	case "slimen":
		m = slimenModules[file]
	case "std":
		m = stdModules[file]
	}
	if m == nil {
		return nil, false
	}
	globals := maps.Clone(m.Members)
	globals.Freeze()
	return globals, true
}
