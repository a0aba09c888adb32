package main

import (
	"fmt"
	"strings"
)

// againCommand is the command that starts a run that stopped without a checkpoint again: the
// `slimen exec` command line that started it (args, the words after "exec"), with its --out
// changed to the first sibling of dir (dir-2, dir-3, …) that holds no run, since slimen exec
// does not write a new run into a folder that holds one. "" for a resumed run (it has a
// checkpoint to resume from, or nothing to start again from).
func againCommand(args []string, dir string) string {
	words := []string{"slimen", "exec"}
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--resume" || a == "-resume" || strings.HasPrefix(a, "--resume=") || strings.HasPrefix(a, "-resume="):
			return ""
		case a == "--out" || a == "-out":
			i++ // and its value
		case strings.HasPrefix(a, "--out=") || strings.HasPrefix(a, "-out="):
		default:
			words = append(words, a)
		}
	}
	next := dir
	for i := 2; holdsRun(next); i++ {
		next = fmt.Sprintf("%s-%d", dir, i)
	}
	words = append(words, "--out", next)
	for i, w := range words {
		words[i] = shellWord(w)
	}
	return strings.Join(words, " ")
}

// shellWord quotes w for a POSIX shell where it needs it.
func shellWord(w string) string {
	if w != "" && strings.Trim(w, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
		return w
	}
	return "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
}
