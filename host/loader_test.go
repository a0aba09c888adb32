package host

import (
	"strings"
	"testing"

	"github.com/slimen/slimen/host/script"
)

func TestLoads(t *testing.T) {
	s, err := script.Load("../testdata/loads/main.star", script.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Globals["X"].String() != "42" {
		t.Errorf("X = %s", s.Globals["X"])
	}
	// The script and every file it loaded, for --watch and the version hash.
	if len(s.Files) != 3 {
		t.Errorf("files: %v", s.Files)
	}
	for _, tc := range []struct{ file, want string }{
		{"cycle_a.star", "load cycle: ../testdata/loads/cycle_a.star → ../testdata/loads/cycle_b.star → ../testdata/loads/cycle_a.star"},
		{"escape.star", `it escapes the script's folder`},
		// A failure inside a loaded file keeps that file's line and the load's line.
		{"broken_lib_user.star", "broken_lib_user.star:1:1"},
		{"broken_lib_user.star", "broken_lib.star:4:7: in <toplevel>"},
	} {
		_, err := script.Load("../testdata/loads/"+tc.file, script.Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.file, err, tc.want)
		}
	}
	_, err = script.LoadSource("x.star", []byte(`load("@nope//a.star", "a")`), script.Options{})
	if err == nil || !strings.Contains(err.Error(), "unknown package @nope") {
		t.Errorf("unknown package: %v", err)
	}
	_, err = script.LoadSource("x.star", []byte(`load("/etc/passwd", "a")`), script.Options{})
	if err == nil || !strings.Contains(err.Error(), "absolute paths are not loadable") {
		t.Errorf("absolute path: %v", err)
	}
	_, err = script.LoadSource("x.star", []byte("load(\"helper.star\", \"a\")\ndef rollout(t):\n  pass\n"), script.Options{Sandbox: true})
	if err == nil || !strings.Contains(err.Error(), "sandbox only loads") {
		t.Errorf("sandbox: %v", err)
	}
}

func TestRolloutSignature(t *testing.T) {
	_, err := script.LoadSource("x.star", []byte("def rollout(a, b):\n  pass\n"), script.Options{})
	if err == nil || !strings.Contains(err.Error(), "exactly one parameter") {
		t.Errorf("two parameters: %v", err)
	}
	_, err = script.LoadSource("x.star", []byte("rollout = 3\n"), script.Options{})
	if err == nil || !strings.Contains(err.Error(), "not a function") {
		t.Errorf("not a function: %v", err)
	}
}
