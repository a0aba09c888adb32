package view

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
)

// maxLine bounds one line of a run file; a longer one is an error naming the file and offset
// rather than a read that grows without end.
const maxLine = 64 << 20

// files tracks the run files the page tails. A file's generation changes when it is no longer
// the file a reader's offsets point into: replaced by a rename (a resumed run rewrites
// metrics.jsonl without the steps after its checkpoint) or truncated. A client that sends an old
// generation starts again from offset 0.
type files struct {
	root *os.Root
	mu   sync.Mutex
	seen map[string]seenFile
}

type seenFile struct {
	info os.FileInfo
	gen  int
}

// stat returns a run file's size and generation; ok is false when the file does not exist (yet).
func (f *files) stat(name string) (size int64, gen int, ok bool, err error) {
	fi, err := f.root.Stat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, err
	}
	if !fi.Mode().IsRegular() {
		return 0, 0, false, fmt.Errorf("%s is not a regular file", name)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, had := f.seen[name]
	if !had {
		s.gen = 1
	} else if !os.SameFile(s.info, fi) || fi.Size() < s.info.Size() {
		s.gen++
	}
	s.info = fi
	f.seen[name] = s
	return fi.Size(), s.gen, true, nil
}

// lines reads the complete lines of a run file from byte offset from, at most about limit bytes
// of them (more when a single line is longer), and returns them with the offset just past the
// last newline read. A last line without its newline yet is left for a later read: the writer
// may be in the middle of it.
func (f *files) lines(name string, from, limit int64) ([]byte, int64, error) {
	fh, err := f.root.Open(name)
	if err != nil {
		return nil, from, err
	}
	defer fh.Close()
	for n := limit; ; n *= 2 {
		buf := make([]byte, n)
		k, err := fh.ReadAt(buf, from)
		if err != nil && err != io.EOF {
			return nil, from, fmt.Errorf("%s: %w", name, err)
		}
		buf = buf[:k]
		if i := bytes.LastIndexByte(buf, '\n'); i >= 0 {
			return buf[:i+1], from + int64(i) + 1, nil
		}
		if int64(k) < n { // the end of the file, inside a line not finished yet
			return nil, from, nil
		}
		if n >= maxLine {
			return nil, from, fmt.Errorf("%s: the line at byte %d is longer than %d MiB", name, from, maxLine>>20)
		}
	}
}

// eachLine calls fn for every non-empty line of data with its offset in the file, data having
// been read from offset base.
func eachLine(data []byte, base int64, fn func(line []byte, off int64)) {
	for len(data) > 0 {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			i = len(data)
		}
		if line := bytes.TrimSpace(data[:i]); len(line) > 0 {
			fn(data[:i], base)
		}
		base += int64(i) + 1
		data = data[min(i+1, len(data)):]
	}
}
