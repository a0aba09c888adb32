package host

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// LockFile is the file in a run folder whose flock(2) says that a process writes the run: a run
// (new or resumed) takes it before it writes anything there and holds it until Close. It records
// the holder (pid, host, start time, command line) for the message that refuses a second writer;
// the kernel releases a dead holder's lock, so a crashed run's folder is taken over (and the
// takeover said in events.log). A run that ends cleanly empties the file before it unlocks it.
const LockFile = "run.lock"

// lockHolder is what a lock file records of the process that holds it.
type lockHolder struct {
	PID     int    `json:"pid"`
	Host    string `json:"host"`
	Since   string `json:"since"`
	Command string `json:"command,omitempty"`
}

func (h lockHolder) String() string {
	s := fmt.Sprintf("pid %d on host %s, since %s", h.PID, h.Host, h.Since)
	if h.Command != "" {
		s += fmt.Sprintf(" (%s)", h.Command)
	}
	return s
}

// runLock is a held lock of a run folder.
type runLock struct {
	f    *os.File
	path string
	// stale is what the file recorded of a holder that ended without releasing it (a crash, a
	// kill); nil when the file was empty or new.
	stale *lockHolder
}

// lockRunDir takes the lock of run folder dir (which exists), or returns a *RunLockedError
// naming the process that holds it.
func lockRunDir(dir string) (*runLock, error) {
	path := filepath.Join(dir, LockFile)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("run folder %s: cannot open its lock file: %w", dir, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		h, _ := readHolder(f)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, &RunLockedError{Dir: dir, Holder: h}
		}
		return nil, fmt.Errorf("run folder %s: cannot lock %s: %w", dir, path, err)
	}
	l := &runLock{f: f, path: path}
	if h, err := readHolder(f); err == nil && h.PID != 0 {
		l.stale = &h
	}
	host, _ := os.Hostname()
	me := lockHolder{PID: os.Getpid(), Host: host, Since: time.Now().UTC().Format(time.RFC3339), Command: strings.Join(os.Args, " ")}
	b, _ := json.Marshal(me)
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt(append(b, '\n'), 0)
	}
	if err != nil {
		l.release()
		return nil, fmt.Errorf("run folder %s: cannot write its lock file %s: %w", dir, path, err)
	}
	return l, nil
}

// readHolder reads the holder a lock file records.
func readHolder(f *os.File) (lockHolder, error) {
	var h lockHolder
	b := make([]byte, 4096)
	n, err := f.ReadAt(b, 0)
	if n == 0 {
		return h, err
	}
	err = json.Unmarshal(bytes.TrimSpace(b[:n]), &h)
	return h, err
}

// release empties the lock file (a clean end) and unlocks it.
func (l *runLock) release() error {
	if l == nil || l.f == nil {
		return nil
	}
	l.f.Truncate(0)
	err := l.f.Close() // closing the last descriptor releases the flock
	l.f = nil
	return err
}

// gone says why the lock file this run holds is no longer its folder's: the folder was
// deleted, moved or replaced (the run would write into files nobody can see). "" while it is.
func (l *runLock) gone() string {
	if l == nil || l.f == nil {
		return ""
	}
	var held syscall.Stat_t
	if err := syscall.Fstat(int(l.f.Fd()), &held); err != nil {
		return fmt.Sprintf("its lock file cannot be read: %v", err)
	}
	if held.Nlink == 0 {
		return "it was deleted"
	}
	var now syscall.Stat_t
	if err := syscall.Stat(l.path, &now); err != nil {
		return "it was deleted or moved (" + l.path + " is gone)"
	}
	if now.Dev != held.Dev || now.Ino != held.Ino {
		return "it was replaced (" + l.path + " is another file than the one this run locked)"
	}
	return ""
}

// RunFolderHolder reports the process that holds run folder dir's lock, if one does: the CLI
// picks another default folder rather than one a live run is writing.
func RunFolderHolder(dir string) (string, bool) {
	f, err := os.Open(filepath.Join(dir, LockFile))
	if err != nil {
		return "", false
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB); err == nil {
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		return "", false
	}
	h, _ := readHolder(f)
	if h.PID == 0 {
		return "another process", true
	}
	return h.String(), true
}
