package config

import (
	"slices"
	"testing"
)

// TestEngineKindRegistry checks the one registry of engine kinds: a kind whose settings the
// package knows (torch) is valid before its opener is registered and linked after, a new kind
// joins the names a config may take, and a second opener for a name panics.
func TestEngineKindRegistry(t *testing.T) {
	if _, ok := LookupEngineKind("torch"); ok {
		t.Fatal("torch has an opener before any was registered")
	}
	open := func() {}
	RegisterEngineKind("torch", EngineKind{Open: open, OffHost: true})
	if k, ok := LookupEngineKind("torch"); !ok || !k.OffHost {
		t.Errorf("torch after its registration: %+v, %v", k, ok)
	}
	RegisterEngineKind("kinds-test", EngineKind{Open: open})
	if names := engineKindNames(); !slices.Equal(names[:4], []string{"tiny", "torch", "remote", "openai"}) || names[len(names)-1] != "kinds-test" {
		t.Errorf("kind names %v", names)
	}
	if !slices.Contains(LinkedEngineKinds(), "kinds-test") || slices.Contains(LinkedEngineKinds(), "remote") {
		t.Errorf("linked kinds %v: want the registered ones only", LinkedEngineKinds())
	}
	for _, tc := range []struct {
		name string
		k    EngineKind
	}{{"kinds-test", EngineKind{Open: open}}, {"no-open", EngineKind{}}, {"", EngineKind{Open: open}}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("RegisterEngineKind(%q, %+v) did not panic", tc.name, tc.k)
				}
			}()
			RegisterEngineKind(tc.name, tc.k)
		}()
	}
}
