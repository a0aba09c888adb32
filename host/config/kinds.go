package config

// This file defines the registry of engine kinds: the names engine.kind may take, and what a run
// needs of each. It is the one list of kinds: config validation reads its names, the host opens
// engines with its openers (host.RegisterEngineKind adds to it).

import (
	"fmt"
	"slices"
	"sort"
	"sync"
)

// EngineKind is what the registry holds of one engine kind.
type EngineKind struct {
	// Open is the host's opener of the kind's engines, of host.EngineKind.Open's type (this
	// package cannot name the host's types); nil for a kind whose settings this package knows
	// but that the program does not link (torch, until host/torch is imported).
	Open any
	// OffHost and PassThrough are host.EngineKind's.
	OffHost     bool
	PassThrough bool
}

// engineKinds are the engine kinds a config may name, in the order validation lists them: those
// whose settings this package knows (tiny, torch, remote, openai), then those a program
// registered.
var engineKinds = struct {
	sync.RWMutex
	names []string
	m     map[string]EngineKind
}{
	names: []string{"tiny", "torch", "remote", "openai"},
	m:     map[string]EngineKind{"tiny": {}, "torch": {}, "remote": {}, "openai": {}},
}

// RegisterEngineKind registers the opener of an engine kind, which a config may then name. It
// panics on a name that is empty or has an opener already, and on a kind without Open: both are
// programming errors, found at start-up.
func RegisterEngineKind(name string, k EngineKind) {
	engineKinds.Lock()
	defer engineKinds.Unlock()
	if name == "" || k.Open == nil || engineKinds.m[name].Open != nil {
		panic(fmt.Sprintf("host.RegisterEngineKind(%q): registered twice, or without Open", name))
	}
	if _, known := engineKinds.m[name]; !known {
		engineKinds.names = append(engineKinds.names, name)
	}
	engineKinds.m[name] = k
}

// LookupEngineKind returns the registered kind name; ok is false when no program registered an
// opener for it.
func LookupEngineKind(name string) (k EngineKind, ok bool) {
	engineKinds.RLock()
	defer engineKinds.RUnlock()
	k = engineKinds.m[name]
	return k, k.Open != nil
}

// LinkedEngineKinds lists, sorted, the kinds whose engines this program can open.
func LinkedEngineKinds() []string {
	engineKinds.RLock()
	defer engineKinds.RUnlock()
	var out []string
	for n, k := range engineKinds.m {
		if k.Open != nil {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// engineKindNames lists the engine kinds a config may name.
func engineKindNames() []string {
	engineKinds.RLock()
	defer engineKinds.RUnlock()
	return slices.Clone(engineKinds.names)
}
