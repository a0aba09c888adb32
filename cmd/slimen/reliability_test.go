package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/slimen/slimen/host"
)

// Issue 39 at the command line: one writer per run folder, a crashed run's lock taken over.

// TestTwoWritersOneFolder: while `slimen exec` runs, a second exec into its --out and a
// --resume of it are refused with the holder's pid; the first run goes on alone and its
// metrics hold each step once.
func TestTwoWritersOneFolder(t *testing.T) {
	cfg := smallRun(t, "400", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	first := exec.Command(slimenBin, "exec", debate, "--config", cfg, "--out", out)
	first.Dir = "../.."
	stderr, err := first.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	defer first.Process.Kill()
	// The first run holds the folder once it says where it writes; it has a checkpoint to
	// resume from once it says it saved one.
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	for sc.Scan() && !strings.Contains(sc.Text(), "checkpoint: step 1 saved") {
		log.WriteString(sc.Text() + "\n")
	}
	go io.Copy(io.Discard, stderr)
	if _, _, err := host.FindCheckpoint(out); err != nil {
		t.Fatalf("the first run wrote no checkpoint: %v\n%s", err, log.String())
	}
	holder := fmt.Sprintf("in use by pid %d", first.Process.Pid)
	for _, args := range [][]string{
		{"exec", debate, "--config", cfg, "--out", out},
		{"exec", "--resume", out},
	} {
		got, err := slimen(t, nil, args...)
		if err == nil || !strings.Contains(got, holder) {
			t.Errorf("slimen %s while another run writes its folder: %v\n%s\nwant a refusal naming %q", strings.Join(args, " "), err, got, holder)
		}
	}
	if err := first.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := first.Wait(); err != nil {
		t.Fatalf("the first run: %v", err)
	}
	seen := map[int]int{}
	for _, line := range strings.Split(strings.TrimSpace(readText(t, filepath.Join(out, "metrics.jsonl"))), "\n") {
		var m struct {
			Step   int    `json:"step"`
			Policy string `json:"policy"`
		}
		if json.Unmarshal([]byte(line), &m) == nil && m.Policy == "_run" {
			seen[m.Step]++
		}
	}
	for s, n := range seen {
		if n != 1 {
			t.Errorf("step %d has %d _run lines in metrics.jsonl, want 1", s, n)
		}
	}
}

// TestCrashedRunsLockTakenOver: a run SIGKILLed mid-checkpoint leaves its lock file naming it; the
// kernel released the lock, so --resume takes the folder over and says whose lock it was.
func TestCrashedRunsLockTakenOver(t *testing.T) {
	cfg := smallRun(t, "3", ", save_interval: 1")
	out := filepath.Join(t.TempDir(), "run")
	cmd := exec.Command(slimenBin, "exec", debate, "--config", cfg, "--out", out)
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "SLIMEN_TEST_SIGKILL_IN_CHECKPOINT=2")
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the run was not killed: %v", err)
	}
	if log, err := slimen(t, nil, "exec", "--resume", out); err != nil {
		t.Fatalf("resume after the crash: %v\n%s", err, log)
	}
	want := fmt.Sprintf("was left locked by pid %d on host", cmd.Process.Pid)
	if e := readText(t, filepath.Join(out, "events.log")); !strings.Contains(e, want) || !strings.Contains(e, "ended without releasing it") {
		t.Errorf("events.log does not say %q:\n%s", want, e)
	}
	if _, held := host.RunFolderHolder(out); held {
		t.Error("the folder is still locked after the resumed run ended")
	}
}

// TestDefaultRunDirSkipsAHeldFolder: the default folder runs/NAME is in use by a live run that
// has written nothing yet: a new run takes runs/NAME-2 instead of being refused or mixing in; an
// explicit --out of it is refused naming the holder.
func TestDefaultRunDirSkipsAHeldFolder(t *testing.T) {
	t.Chdir(t.TempDir())
	os.MkdirAll(filepath.Join("runs", "x"), 0o755)
	f, err := os.Create(filepath.Join("runs", "x", host.LockFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(f, `{"pid": 4242, "host": "h", "since": "2026-01-02T03:04:05Z"}`)
	if dir, err := runDir("x.star", "", ""); err != nil || dir != filepath.Join("runs", "x-2") {
		t.Errorf("runDir = %q, %v; want runs/x-2 beside the held runs/x", dir, err)
	}
	if _, err := runDir("x.star", "", filepath.Join("runs", "x")); err == nil || !strings.Contains(err.Error(), "in use by pid 4242 on host h") {
		t.Errorf("an explicit --out of a held folder: %v; want a refusal naming pid 4242", err)
	}
}

func readText(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestResumeConfigMovesEnginesOnly: `--resume --config NEW` is no longer ignored: a config that
// changes what the run computes (here the learning rate) is refused naming the setting, one
// that changes nothing is said to change nothing, and the run resumes.
func TestResumeConfigMovesEnginesOnly(t *testing.T) {
	cfg := smallRun(t, "1", "")
	out := filepath.Join(t.TempDir(), "run")
	if log, err := slimen(t, nil, "exec", debate, "--config", cfg, "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, log)
	}
	changed := filepath.Join(t.TempDir(), "changed.yaml")
	os.WriteFile(changed, []byte(strings.Replace(readText(t, cfg), "lr: 1.0e-3", "lr: 2.0e-3", 1)), 0o644)
	log, err := slimen(t, nil, "exec", "--resume", out, "--config", changed, "--steps", "2")
	if err == nil || !strings.Contains(log, `policy "generator": train.lr differs from the checkpoint's config`) {
		t.Fatalf("--resume with a config that changes the learning rate: %v\n%s", err, log)
	}
	log, err = slimen(t, nil, "exec", "--resume", out, "--config", cfg, "--steps", "2")
	if err != nil || !strings.Contains(log, "the engines live where the checkpoint's config says; nothing changed") {
		t.Fatalf("--resume with the run's own config: %v\n%s", err, log)
	}
}
