package wandb

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/engines/torch"
)

// This file defines the sidecar process: slimen_torch/wandb_sidecar.py (embedded in the binary
// with the torch worker) run by the project's Python, JSON lines on its stdin, replies on its
// stdout, the SDK's messages on its stderr.

// sidecarFile is the sidecar's source in engines/torch's embedded package.
const sidecarFile = "slimen_torch/wandb_sidecar.py"

// writeWait bounds how long one message may wait for the sidecar to take it: a sidecar that
// takes none for this long is stuck, and the run stops logging to it. exitWait bounds how long a
// sidecar whose input has ended may take to exit before it is killed. (Variables for the tests.)
var (
	writeWait = time.Minute
	exitWait  = 10 * time.Second
)

// sidecar is a running wandb_sidecar.py.
type sidecar struct {
	cmd     *exec.Cmd
	sendMu  sync.Mutex // one message at a time: a long line is not written atomically
	stdin   *os.File   // the write end of its stdin (a pipe, for write deadlines)
	replies chan reply
	exited  chan struct{} // closed once the process has exited
	waitErr error         // its exit status, once exited is closed
	tail    *tailLines    // its last lines of output, for error messages
	dir     string        // the folder of its script, removed once it exits
	python  string
}

// reply is one line the sidecar writes on stdout.
type reply struct {
	Type    string `json:"type"`
	Error   string `json:"error"`
	Missing string `json:"missing"`
	ID      string `json:"id"`
	Name    string `json:"name"`
	URL     string `json:"url"`
	Dir     string `json:"dir"`
	Mode    string `json:"mode"`
}

// startSidecar starts the sidecar under python; output takes the lines it writes on stderr.
func startSidecar(python string, output func(line string)) (*sidecar, error) {
	src, err := fs.ReadFile(torch.Package, sidecarFile)
	if err != nil {
		return nil, err
	}
	// The script runs alone in a folder: next to slimen_torch's modules, its types.py would stand
	// in for the standard library's.
	dir, err := os.MkdirTemp("", "slimen-wandb-")
	if err != nil {
		return nil, err
	}
	script := filepath.Join(dir, "slimen_wandb_sidecar.py")
	if err := os.WriteFile(script, src, 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	s := &sidecar{replies: make(chan reply, 4), exited: make(chan struct{}), tail: &tailLines{max: 20}, dir: dir, python: python, stdin: inW}
	s.cmd = exec.Command(python, "-u", script)
	s.cmd.Env = append(os.Environ(), "PYTHONUNBUFFERED=1")
	s.cmd.Stdin = inR
	// The SDK's own process (wandb-core) may hold the stderr pipe a moment after the sidecar exits.
	s.cmd.WaitDelay = 5 * time.Second
	stdout, err := s.cmd.StdoutPipe()
	if err != nil {
		inR.Close()
		inW.Close()
		os.RemoveAll(dir)
		return nil, err
	}
	s.cmd.Stderr = &lineWriter{emit: func(line string) {
		s.tail.add(line)
		output(line)
	}}
	if err := s.cmd.Start(); err != nil {
		inR.Close()
		inW.Close()
		os.RemoveAll(dir)
		return nil, err
	}
	inR.Close() // the child's copy is the one that counts
	go func() {
		s.readReplies(stdout) // to its end, before Wait closes it
		s.waitErr = s.cmd.Wait()
		os.RemoveAll(dir)
		close(s.exited)
	}()
	return s, nil
}

// readReplies hands each line of the sidecar's stdout to replies; a line that is not a reply
// is kept as output.
func (s *sidecar) readReplies(stdout io.Reader) {
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var r reply
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil || r.Type == "" {
			s.tail.add(sc.Text())
			continue
		}
		select {
		case s.replies <- r:
		default: // nobody waits for it (a reply after a timeout)
		}
	}
}

// send writes one message, waiting at most writeWait for the sidecar to take it.
func (s *sidecar) send(msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if err := s.stdin.SetWriteDeadline(time.Now().Add(writeWait)); err != nil {
		return err
	}
	if _, err := s.stdin.Write(b); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("the W&B sidecar took no message for %v; it is stuck", writeWait)
		}
		return s.exitError(err)
	}
	return nil
}

// await waits up to d for a reply of one of the given types; the sidecar's exit, an error reply
// or the end of ctx ends the wait with an error.
func (s *sidecar) await(ctx context.Context, d time.Duration, types ...string) (reply, error) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return reply{}, fmt.Errorf("waiting for the W&B sidecar: %w", ctx.Err())
		case r := <-s.replies:
			if done, err := answers(r, types); done {
				return r, err
			}
		case <-s.exited:
			for { // the replies it wrote before it exited are all in
				select {
				case r := <-s.replies:
					if done, err := answers(r, types); done {
						return r, err
					}
				default:
					return reply{}, s.exitError(nil)
				}
			}
		case <-timer.C:
			return reply{}, fmt.Errorf("the W&B sidecar did not answer within %v%s", d, s.lastLines())
		}
	}
}

// answers reports whether r ends a wait for one of types: it is one, or an error.
func answers(r reply, types []string) (bool, error) {
	if r.Type == "error" {
		return true, errors.New(r.Error)
	}
	return slices.Contains(types, r.Type), nil
}

// hasExited reports whether the process has exited.
func (s *sidecar) hasExited() bool {
	select {
	case <-s.exited:
		return true
	default:
		return false
	}
}

// exitError says that the sidecar is gone, with its exit status and last lines when it has
// exited; cause is the error that revealed it (a write to a closed pipe), if any.
func (s *sidecar) exitError(cause error) error {
	select {
	case <-s.exited:
		status := "exited"
		if s.waitErr != nil {
			status = "exited: " + s.waitErr.Error()
		}
		return fmt.Errorf("the W&B sidecar (%s) %s%s", s.python, status, s.lastLines())
	case <-time.After(time.Second):
		if cause == nil {
			cause = errors.New("no answer")
		}
		return fmt.Errorf("the W&B sidecar (%s): %w%s", s.python, cause, s.lastLines())
	}
}

func (s *sidecar) lastLines() string {
	if t := s.tail.String(); t != "" {
		return "; its last lines:\n" + t
	}
	return ""
}

// close ends the sidecar's input and waits up to d for it to exit, then kills it.
func (s *sidecar) close(d time.Duration) error {
	s.stdin.Close()
	select {
	case <-s.exited:
		return nil
	case <-time.After(d):
		s.cmd.Process.Kill()
		<-s.exited
		return fmt.Errorf("the W&B sidecar did not exit within %v of its last message and was killed%s", d, s.lastLines())
	}
}

// tailLines keeps the last max lines added to it.
type tailLines struct {
	mu    sync.Mutex
	lines []string
	max   int
}

func (t *tailLines) add(line string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, line)
	if len(t.lines) > t.max {
		t.lines = t.lines[len(t.lines)-t.max:]
	}
}

func (t *tailLines) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}

// lineWriter hands each complete line written to it to emit.
type lineWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	emit func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for {
		i := bytes.IndexByte(w.buf.Bytes(), '\n')
		if i < 0 {
			break
		}
		line := strings.TrimRight(string(w.buf.Next(i+1)), "\r\n")
		if line != "" {
			w.emit(line)
		}
	}
	return len(p), nil
}
