// Package capbuf is an output buffer of bounded size for a child process's stdout or stderr:
// it keeps the start and the end of what was written, where the errors are, and drops the
// middle.
package capbuf

import "sync"

// Buffer keeps the first Head and the last Tail bytes written to it; what lies between is
// dropped. Writes never fail and may come from several goroutines. The zero value keeps nothing.
type Buffer struct {
	Head, Tail int

	mu         sync.Mutex
	head, tail []byte
	dropped    bool
}

// Write keeps what fits in the head and the tail.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := len(p)
	if room := b.Head - len(b.head); room > 0 {
		k := min(room, len(p))
		b.head = append(b.head, p[:k]...)
		p = p[k:]
	}
	if len(p) == 0 {
		return n, nil
	}
	if len(p) >= b.Tail {
		b.dropped = b.dropped || len(p) > b.Tail || len(b.tail) > 0
		b.tail = append(b.tail[:0], p[len(p)-b.Tail:]...)
		return n, nil
	}
	if over := len(b.tail) + len(p) - b.Tail; over > 0 {
		b.dropped = true
		b.tail = append(b.tail[:0], b.tail[over:]...)
	}
	b.tail = append(b.tail, p...)
	return n, nil
}

// String is the head and then the tail, joined where the dropped middle was.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.head) + string(b.tail)
}

// Dropped reports whether more was written than the buffer keeps.
func (b *Buffer) Dropped() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.dropped
}
