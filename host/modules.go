package host

import (
	"io/fs"
	"sort"

	"go.starlark.net/lib/json"
	"go.starlark.net/lib/math"
	"go.starlark.net/starlark"
)

// nativeModules are the Go-implemented packages scripts can load.
func nativeModules() map[string]map[string]starlark.StringDict {
	return map[string]map[string]starlark.StringDict{
		"std": {
			"json.star": json.Module.Members,
			"math.star": math.Module.Members,
		},
	}
}

// starlarkPackages are the packages of Starlark source embedded in the binary.
func starlarkPackages() map[string]fs.FS {
	return map[string]fs.FS{}
}

func sortStrings(s []string) { sort.Strings(s) }

// setThreadRandom seeds the thread's RNG used by @slimen//random.star and vote tie-breaks.
func setThreadRandom(th *starlark.Thread, seed uint64) {}
