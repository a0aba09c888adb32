package tiny

import (
	"embed"
	"fmt"
	"io/fs"
	"strings"
)

// builtinFiles holds the checkpoints compiled into the binary, one folder per name.
//
//go:embed builtin
var builtinFiles embed.FS

// Builtins lists the names of the embedded checkpoints (open them as "builtin:NAME").
func Builtins() []string {
	entries, _ := builtinFiles.ReadDir("builtin")
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names
}

func builtinFS(name string) (fs.FS, error) {
	if _, err := fs.Stat(builtinFiles, "builtin/"+name+"/"+fileConfig); name == "" || strings.Contains(name, "/") || err != nil {
		return nil, fmt.Errorf("tiny: unknown model builtin:%s (embedded: %s)", name, strings.Join(Builtins(), ", "))
	}
	return fs.Sub(builtinFiles, "builtin/"+name)
}
