package main

import (
	"os"
	"path/filepath"
	"testing"
)

// againCommand drops every form of --out for a sibling that holds no run, quotes what a shell
// would split, and gives nothing for a resumed run.
func TestAgainCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	for _, d := range []string{dir, dir + "-2"} { // both hold a run
		os.MkdirAll(filepath.Join(d, "checkpoints"), 0o755)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"s.star", "--out", dir, "--steps", "3"}, "slimen exec s.star --steps 3 --out " + dir + "-3"},
		{[]string{"-out=" + dir, "my script.star", "--config=it's.yaml"}, `slimen exec 'my script.star' '--config=it'\''s.yaml' --out ` + dir + "-3"},
		{[]string{"s.star"}, "slimen exec s.star --out " + dir + "-3"},
		{[]string{"--resume", dir}, ""},
	} {
		if got := againCommand(tc.args, dir); got != tc.want {
			t.Errorf("againCommand(%q) = %s\nwant %s", tc.args, got, tc.want)
		}
	}
}
