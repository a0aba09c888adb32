package capbuf

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// TestBuffer: the head keeps the first bytes, the tail the last ones, whatever the sizes of the
// writes; nothing is dropped until more than Head+Tail bytes came.
func TestBuffer(t *testing.T) {
	for _, tc := range []struct {
		head, tail int
		writes     []string
		want       string
		dropped    bool
	}{
		{head: 4, writes: []string{"ab", "cdef", "gh"}, want: "abcd", dropped: true},
		{tail: 4, writes: []string{"ab", "cdef", "gh"}, want: "efgh", dropped: true},
		{tail: 4, writes: []string{"abcdefghij"}, want: "ghij", dropped: true},
		{tail: 4, writes: []string{"ab", "cd"}, want: "abcd"},
		{head: 3, tail: 3, writes: []string{"fatal", ": x\n", "dump", "end"}, want: "fatend", dropped: true},
		{head: 3, tail: 3, writes: []string{"ab", "cdef"}, want: "abcdef"},
		{head: 3, tail: 3, writes: []string{"abcdefg"}, want: "abcefg", dropped: true},
		{writes: []string{"x"}, want: "", dropped: true},
	} {
		b := &Buffer{Head: tc.head, Tail: tc.tail}
		for _, w := range tc.writes {
			if n, err := b.Write([]byte(w)); n != len(w) || err != nil {
				t.Fatalf("Write(%q) = %d, %v", w, n, err)
			}
		}
		if got := b.String(); got != tc.want || b.Dropped() != tc.dropped {
			t.Errorf("head %d tail %d after %q: %q (dropped %v), want %q (dropped %v)", tc.head, tc.tail, tc.writes, got, b.Dropped(), tc.want, tc.dropped)
		}
	}
}

// TestBufferConcurrentWrites: writers on several goroutines (a process's stdout and stderr into
// one buffer) keep whole lines up to the cap.
func TestBufferConcurrentWrites(t *testing.T) {
	b := &Buffer{Tail: 1000}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				fmt.Fprintf(b, "g%d line %03d\n", g, i)
			}
		}()
	}
	wg.Wait()
	out := b.String()
	if len(out) != 1000 || !b.Dropped() {
		t.Fatalf("kept %d bytes (dropped %v), want the last 1000", len(out), b.Dropped())
	}
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n")[1:] {
		if len(l) != len("g0 line 000") {
			t.Errorf("torn line %q", l)
		}
	}
}
