package host

// This file defines events.log, the run's human-readable record.

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// eventLog is events.log: start-up facts, rollout failures with backtraces, script prints,
// skipped optimizer steps, reloads. Lines also go to the run's Log writer.
type eventLog struct {
	mu sync.Mutex
	f  *os.File
	w  io.Writer
}

// open opens events.log for appending.
func (e *eventLog) open(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("events log: %w", err)
	}
	e.f = f
	return nil
}

// printf writes a line to events.log and to the run's Log writer.
func (e *eventLog) printf(format string, args ...any) { e.write(true, format, args...) }

// filef writes to events.log only (the run's Log writer is spared a flood of similar lines).
func (e *eventLog) filef(format string, args ...any) { e.write(false, format, args...) }

// split writes one thing said two ways: toLog to the run's Log writer, toFile to events.log (a
// line that points the terminal's reader to events.log makes no sense inside it). Without an
// events.log the terminal's line is not about it either.
func (e *eventLog) split(toLog, toFile string) {
	if e == nil {
		return
	}
	e.mu.Lock()
	hasFile := e.f != nil
	e.mu.Unlock()
	if !hasFile {
		toLog = strings.Replace(toLog, " (all in events.log)", "", 1)
	}
	e.write(false, "%s", toFile)
	if e.w != nil {
		e.mu.Lock()
		fmt.Fprintln(e.w, toLog)
		e.mu.Unlock()
	}
}

// write writes a timestamped line to the file and, with toLog, the line to the Log writer.
func (e *eventLog) write(toLog bool, format string, args ...any) {
	if e == nil {
		return
	}
	msg := fmt.Sprintf(format, args...)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.f != nil {
		fmt.Fprintf(e.f, "%s %s\n", time.Now().UTC().Format(time.RFC3339), msg)
	}
	if e.w != nil && toLog {
		fmt.Fprintln(e.w, msg)
	}
}

// close closes the file; a log never opened has nothing to close.
func (e *eventLog) close() error {
	if e.f == nil {
		return nil
	}
	return e.f.Close()
}
