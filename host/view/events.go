package view

import (
	"bytes"
	"net/http"
	"strings"
)

// eventsChunk bounds one /api/events answer, and the tail a page first loads: a long run's
// events.log (failed rollouts' backtraces, worker output) can be large, and its end is what a
// person watching wants.
const eventsChunk = 256 << 10

// eventsReply is the answer of /api/events: events.log's complete lines from the offset asked
// for (or its last eventsChunk bytes when the offset is -1) to Offset.
type eventsReply struct {
	Gen    int      `json:"gen"`
	Offset int64    `json:"offset"`
	Size   int64    `json:"size"`
	More   bool     `json:"more"`
	Reset  bool     `json:"reset,omitempty"`
	Exists bool     `json:"exists"`
	Cut    bool     `json:"cut,omitempty"` // the answer starts past the file's beginning (offset -1)
	Lines  []string `json:"lines"`
}

func (s *Server) handleEvents(w http.ResponseWriter, r *http.Request) {
	from, gen, ok := offsetParams(w, r)
	if !ok {
		return
	}
	size, cur, exists, err := s.files.stat("events.log")
	if err != nil {
		s.fail(w, err)
		return
	}
	rep := eventsReply{Gen: cur, Size: size, Exists: exists, Lines: []string{}}
	if from >= 0 && (gen != cur || from > size) {
		rep.Reset, from = from != 0 || gen != 0, -1
	}
	if !exists {
		writeJSON(w, rep)
		return
	}
	if from < 0 {
		from = max(0, size-eventsChunk)
		if from > 0 {
			rep.Cut = true
			// Start at a line's beginning: skip what is left of the line the cut falls in.
			head, _, err := s.files.lines("events.log", from-1, 64<<10)
			if err != nil {
				s.fail(w, err)
				return
			}
			if i := bytes.IndexByte(head, '\n'); i >= 0 {
				from += int64(i)
			} else {
				from = size // one line longer than the chunk is being written; wait for its end
			}
		}
	}
	data, end, err := s.files.lines("events.log", from, eventsChunk)
	if err != nil {
		s.fail(w, err)
		return
	}
	rep.Offset, rep.More = end, end < size && len(data) > 0
	if len(data) > 0 {
		rep.Lines = strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	}
	writeJSON(w, rep)
}
