package config

import (
	"fmt"
	"sort"
	"strings"
)

// Error is one problem in a config file, at a YAML line.
type Error struct {
	File string // as given to Load
	Line int    // 1-based; 0 when the problem has no single line
	Path string // the key's path as the user wrote it: policies[1].megatron.lr
	Msg  string
}

// Error reads FILE:LINE: PATH: MSG, leaving out the line and the path where there is none.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Path != "" {
		b.WriteString(e.Path + ": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// errorList is every problem of one file, reported together so a user fixes them in one pass.
type errorList []*Error

// ErrorList is what Load returns when the file has problems: each one on its own line, in line
// order. errors.As(err, &list) gets at them.
type ErrorList []*Error

// Error puts each problem on a line of its own.
func (l ErrorList) Error() string {
	lines := make([]string, len(l))
	for i, e := range l {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

// err returns nil or the problems as an ErrorList, sorted by line, duplicates dropped.
func (l errorList) err() error {
	if len(l) == 0 {
		return nil
	}
	out := ErrorList(append([]*Error(nil), l...))
	sort.SliceStable(out, func(i, j int) bool { return out[i].Line < out[j].Line })
	uniq := out[:0]
	for i, e := range out {
		if i > 0 && e.Error() == out[i-1].Error() {
			continue
		}
		uniq = append(uniq, e)
	}
	return uniq
}
