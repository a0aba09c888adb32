package starlib

import (
	"fmt"
	"strings"
	"testing"

	"go.starlark.net/starlark"
)

// exec runs a Starlark program whose load statements resolve through Module, the way a host's
// loader does. seed < 0 leaves the thread without a random generator.
func exec(t *testing.T, src string, seed int64) (starlark.StringDict, error) {
	t.Helper()
	thread := &starlark.Thread{
		Name: t.Name(),
		Load: func(_ *starlark.Thread, module string) (starlark.StringDict, error) {
			pkg, file, _ := strings.Cut(strings.TrimPrefix(module, "@"), "//")
			if m, ok := Module(pkg, file); ok {
				return m, nil
			}
			return nil, fmt.Errorf("no module %s", module)
		},
	}
	if seed >= 0 {
		SetRandom(thread, uint64(seed))
	}
	return starlark.ExecFile(thread, "test.star", src, nil)
}

// mustExec runs src and returns the global named want, formatted as Starlark prints it.
func mustExec(t *testing.T, src, want string) string {
	t.Helper()
	g, err := exec(t, src, 1)
	if err != nil {
		t.Fatalf("%s\n%v", src, err)
	}
	v, ok := g[want]
	if !ok {
		t.Fatalf("program defines no %s", want)
	}
	return v.String()
}

// scriptCase is a program and what its global `got` prints as, or the error it fails with.
type scriptCase struct {
	src     string
	want    string // the printed value of `got`
	wantErr string // a substring of the error
}

func runScriptCases(t *testing.T, header string, cases []scriptCase) {
	t.Helper()
	for _, c := range cases {
		src := header + "\n" + c.src
		g, err := exec(t, src, 1)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%s\nerror = %v, want one containing %q", c.src, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s\n%v", c.src, err)
			continue
		}
		if got := g["got"].String(); got != c.want {
			t.Errorf("%s\ngot = %s, want %s", c.src, got, c.want)
		}
	}
}
