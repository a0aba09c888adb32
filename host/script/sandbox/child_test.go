package sandbox

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

const channelHelperEnv = "SLIMEN_TEST_CHANNEL_HELPER"

// TestChannelClosedOnExec: a program the child starts (agent()) holds neither end of the host's
// channel, and the child is not dumpable (a program of the same non-root user cannot open
// /proc/<child>/fd/4). The control: the same child without openChannel passes fds 3 and 4 on,
// as any inherited fd is.
func TestChannelClosedOnExec(t *testing.T) {
	if mode := os.Getenv(channelHelperEnv); mode != "" {
		channelHelper(mode)
		return
	}
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	run := func(mode string) string {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		defer w.Close()
		cmd := exec.Command(os.Args[0], "-test.run=^TestChannelClosedOnExec$")
		cmd.Env = append(os.Environ(), channelHelperEnv+"="+mode)
		cmd.ExtraFiles = []*os.File{r, w} // fds 3 and 4
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v: %s", mode, err, out)
		}
		return string(out)
	}
	if got := run("bare"); !strings.Contains(got, "fd 3 open") || !strings.Contains(got, "fd 4 open") {
		t.Fatalf("without openChannel the program should see fds 3 and 4 (the test cannot see them otherwise): %q", got)
	}
	got := run("channel")
	if strings.Contains(got, "open") {
		t.Errorf("a program the child started holds the host's channel: %q", got)
	}
	if !strings.Contains(got, "dumpable 0") {
		t.Errorf("the child is dumpable: %q", got)
	}
}

func channelHelper(mode string) {
	if mode == "channel" {
		if _, _, err := openChannel(); err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
	}
	d, _, _ := syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_GET_DUMPABLE, 0, 0)
	fmt.Printf("dumpable %d\n", d)
	cmd := exec.Command("/bin/sh", "-c", `for fd in 3 4; do [ -e /proc/$$/fd/$fd ] && echo "fd $fd open"; done; true`)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	os.Exit(0)
}
