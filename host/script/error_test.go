package script

import (
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadErrorKeepsCause checks that the Error of a script that cannot be read keeps the
// file system's error: errors.Is sees fs.ErrNotExist through it, and the message is unchanged.
func TestLoadErrorKeepsCause(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "missing.star"), Options{})
	var se *Error
	if !errors.As(err, &se) {
		t.Fatalf("Load of a missing file: %v (%T), want an *Error", err, err)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("errors.Is(%q, fs.ErrNotExist) is false: the cause is lost", err)
	}
	if !strings.HasPrefix(err.Error(), "cannot read script: open ") {
		t.Errorf("message %q changed", err)
	}
}

// TestErrorf checks that Errorf keeps the message fmt.Errorf gives and the errors %w wraps.
func TestErrorf(t *testing.T) {
	cause := errors.New("no such policy")
	for _, tc := range []struct {
		format string
		want   string
	}{
		{"%w", "no such policy"},
		{"resume: %w", "resume: no such policy"},
	} {
		err := error(Errorf(tc.format, cause))
		if err.Error() != tc.want {
			t.Errorf("Errorf(%q): message %q, want %q", tc.format, err, tc.want)
		}
		if !errors.Is(err, cause) {
			t.Errorf("Errorf(%q): errors.Is does not reach the cause", tc.format)
		}
		if ErrorText(err) != tc.want {
			t.Errorf("ErrorText(Errorf(%q)) = %q, want its message", tc.format, ErrorText(err))
		}
	}
}
