package script

import (
	"io/fs"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/graphs"
	"github.com/slimen/slimen/starlib"
)

// nativeModules are the Go-implemented packages scripts can load: @slimen// and @std//.
func nativeModules() map[string]map[string]starlark.StringDict { return starlib.Packages() }

// bundledPackages are the packages of Starlark source embedded in the binary (a fresh map: a
// loader adds Options.Modules to its own).
func bundledPackages() map[string]fs.FS {
	return map[string]fs.FS{"graphs": graphs.FS}
}

// setThreadRandom seeds the thread's generator for @slimen//random.star and vote tie-breaks. The
// seed comes from the thread's position in the rollout's call tree, so parallel children draw
// the same numbers however they are scheduled.
func setThreadRandom(th *starlark.Thread, seed uint64) { starlib.SetRandom(th, seed) }
