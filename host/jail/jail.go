// Package jail runs an untrusted program (what a sandboxed script's agent() starts) inside Linux
// isolation that the caller sets up and tears down: its own PID, mount, IPC, UTS and network
// namespaces, a root file system that holds only the folders the caller lists (read-only), a
// private /tmp, a loopback network whose one open port leads to a Unix socket of the caller's,
// an unprivileged user with no capabilities and no way to gain any, and a cgroup that bounds the
// memory, processes and CPU of the whole process tree. When the program ends, or is killed, its
// whole tree goes with it: the jail's first process is the PID namespace's init, and the kernel
// kills every process of a namespace whose init is gone.
//
// The first process is the binary that embeds this package, started again with InitEnv set
// (Init); it builds the jail from inside and then starts the program. A binary that uses Start
// must call Init first thing in main (and a test binary in TestMain) when InitEnv is set.
//
// docs/sandbox.md describes the threat model.
package jail

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
)

// InitEnv marks a process as a jail's init.
const InitEnv = "SLIMEN_JAIL_INIT"

// User is the uid and gid a jailed program runs as (nobody on most systems): it owns no file
// of the host, and holds no capability.
const User = 65534

// Port is the port of the jail's loopback that leads to Spec.Socket.
const Port = 8000

// Spec is what a jail holds and bounds.
type Spec struct {
	Argv []string // Argv[0] is a path that is visible in the jail (Resolve finds one)
	Env  []string // the program's whole environment
	Dir  string   // its working folder: one of Read, or "/tmp"
	// Read are host paths (folders or files) visible read-only at the same place. The system's
	// folders (SystemPaths) are not added here: the caller lists them.
	Read []string
	// Socket is a Unix socket of the host's that 127.0.0.1:Port inside the jail leads to; ""
	// leaves the jail without a network (its loopback is still up).
	Socket string
	// The bounds of the whole tree (the cgroup's); 0 leaves one unbounded.
	MemoryBytes int64
	Pids        int
	CPUs        float64
	// TmpBytes is the size of the private /tmp (a tmpfs, whose pages count against MemoryBytes).
	TmpBytes int64
}

// SystemPaths are the folders of the host's installed software, visible in every jail when they
// exist: programs, their libraries and the loader's cache.
var SystemPaths = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
	"/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"}

// Cmd is a program running in a jail.
type Cmd struct {
	Spec   Spec
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer

	cmd    *exec.Cmd
	cg     *cgroup
	status *bufio.Reader
	root   string // the folder the jail's root is mounted on (empty on the host)

	statusFile *os.File // the read end of the status pipe, under status
	cleanOnce  sync.Once
}

// Start sets the jail up and starts the program in it. It returns once the program runs, or
// with an error that names the step that failed (and the kernel feature it needed).
func (c *Cmd) Start() error {
	if err := Available(); err != nil {
		return err
	}
	if len(c.Spec.Argv) == 0 {
		return errors.New("jail: no program to run")
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("jail: cannot find this program's own binary to start the jail's init: %v", err)
	}
	tmp := os.TempDir()
	SweepOrphans(tmp, "slimen-jail-", func(d string) { os.Remove(d) }) // empty: a jail's mounts were its own namespace's
	root, err := os.MkdirTemp(tmp, fmt.Sprintf("slimen-jail-%d-", os.Getpid()))
	if err != nil {
		return fmt.Errorf("jail: %v", err)
	}
	c.root = root
	cg, err := newCgroup(c.Spec)
	if err != nil {
		os.Remove(root)
		return err
	}
	c.cg = cg
	specR, specW, err := os.Pipe()
	if err != nil {
		c.cleanup()
		return err
	}
	statusR, statusW, err := os.Pipe()
	if err != nil {
		specR.Close()
		specW.Close()
		c.cleanup()
		return err
	}
	cmd := exec.Command(exe)
	cmd.Env = []string{InitEnv + "=1"}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = c.Stdin, c.Stdout, c.Stderr
	cmd.ExtraFiles = []*os.File{specR, statusW}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWIPC |
			syscall.CLONE_NEWUTS | syscall.CLONE_NEWNET,
		// The init dies with the process that started it (and takes the jail with it).
		Pdeathsig: syscall.SIGKILL,
		Setsid:    true,
	}
	// Pdeathsig fires when the thread that started the process exits: keep it alive.
	runtime.LockOSThread()
	err = cmd.Start()
	runtime.UnlockOSThread()
	specR.Close()
	statusW.Close()
	if err != nil {
		specW.Close()
		statusR.Close()
		c.cleanup()
		return fmt.Errorf("jail: cannot start the jail's init (new PID, mount, IPC, UTS and network namespaces): %v", err)
	}
	c.cmd = cmd
	// The init waits for its spec: it joins the cgroup first, so that every process it starts
	// is in it.
	if err := c.cg.add(cmd.Process.Pid); err != nil {
		specW.Close()
		statusR.Close()
		c.Kill()
		cmd.Wait()
		c.cleanup()
		return err
	}
	is := initSpec{Spec: c.Spec, Root: root, UID: User}
	if !c.cg.boundsPids && c.Spec.Pids > 0 {
		// No pids controller: RLIMIT_NPROC bounds the processes of the program's user, so the
		// program gets a user of its own jail.
		is.UID, is.Nproc = jailUID(), c.Spec.Pids
	}
	is.Idle = !c.cg.boundsCPU && c.Spec.CPUs > 0 // no cpu controller: it runs only on CPU time nobody else wants
	b, _ := json.Marshal(is)
	specW.Write(b)
	specW.Close()
	c.statusFile, c.status = statusR, bufio.NewReader(statusR)
	line, err := c.status.ReadString('\n')
	if line = strings.TrimSpace(line); line != "ok" {
		c.Kill()
		cmd.Wait()
		statusR.Close()
		c.cleanup()
		if line == "" {
			return fmt.Errorf("jail: the jail's init died while setting up (%v)", err)
		}
		return fmt.Errorf("jail: %s", line)
	}
	return nil
}

// Wait waits for the program and tears the jail down. It returns the program's exit code, or
// -1 with the signal that ended it.
func (c *Cmd) Wait() (int, error) {
	werr := c.cmd.Wait()
	// The init writes the program's end last; it is gone, so this reads to its end.
	rest, _ := io.ReadAll(c.status)
	c.statusFile.Close()
	var last string // the init's last line: "exit N" or "signal N"
	for _, l := range strings.Split(strings.TrimSpace(string(rest)), "\n") {
		if l != "" {
			last = l
		}
	}
	c.Kill() // whatever the program left in the cgroup
	c.cleanup()
	what, n, _ := strings.Cut(last, " ")
	code, _ := strconv.Atoi(n)
	switch {
	case what == "exit":
		return code, nil
	case what == "signal":
		return -1, fmt.Errorf("signal: %v", syscall.Signal(code))
	case werr != nil:
		return -1, werr
	}
	return -1, errors.New("the jail's init ended without saying how the program did")
}

// Kill ends the program and everything it started.
func (c *Cmd) Kill() {
	if c.cmd != nil && c.cmd.Process != nil {
		c.cmd.Process.Signal(syscall.SIGKILL)
	}
	if c.cg != nil {
		c.cg.kill()
	}
}

func (c *Cmd) cleanup() {
	c.cleanOnce.Do(func() {
		if c.cg != nil {
			c.cg.remove()
		}
		if c.root != "" {
			os.Remove(c.root)
		}
	})
}

// initSpec is what the init reads from its spec pipe.
type initSpec struct {
	Spec
	Root  string `json:"root"`
	UID   int    `json:"uid"`   // the program's user and group
	Nproc int    `json:"nproc"` // RLIMIT_NPROC of the program (0: none; the cgroup bounds it)
	Idle  bool   `json:"idle"`  // run it in the idle scheduling class (the cgroup does not bound its CPU)
}

var uidSeq atomic.Int64

// jailUID is a user of the jail's own, for RLIMIT_NPROC to count its processes alone: one of a
// range past the usual users, if this process's user namespace maps it, else User (whose count
// concurrent jails then share: a tighter bound, never a looser one).
func jailUID() int {
	uid := 100000 + (os.Getpid()%1000)*100 + int(uidSeq.Add(1)%100)
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return User
	}
	for _, line := range strings.Split(string(b), "\n") {
		var in, out, n int
		if k, _ := fmt.Sscan(line, &in, &out, &n); k == 3 && uid >= in && uid < in+n {
			return uid
		}
	}
	return User
}

// Available says whether this host can make jails, naming what it lacks if not.
func Available() error {
	availOnce.Do(func() { availErr = available() })
	return availErr
}

var (
	availOnce sync.Once
	availErr  error
)

func available() error {
	if runtime.GOOS != "linux" {
		return fmt.Errorf("jail: the jail needs Linux (namespaces and cgroups); this is %s", runtime.GOOS)
	}
	if os.Geteuid() != 0 {
		return errors.New("jail: the jail needs root: slimen sets up its namespaces, mounts and cgroup itself and runs the " +
			"program as an unprivileged user; run the sandboxed job as root (in a container, say)")
	}
	for _, ns := range []string{"pid", "mnt", "ipc", "uts", "net"} {
		if _, err := os.Stat("/proc/self/ns/" + ns); err != nil {
			return fmt.Errorf("jail: the kernel lacks %s namespaces (/proc/self/ns/%s: %v)", ns, ns, err)
		}
	}
	_, err := findCgroups()
	return err
}

// Resolve finds the program a script names (a path, or a name on PATH) and the folders it needs
// to run in a jail: for a program at PREFIX/bin/NAME, and each link on the way to the file,
// PREFIX (its libraries and packages, a virtual environment's site-packages). It returns the
// program's path and those folders.
func Resolve(prog, dir string) (string, []string, error) {
	p := prog
	if !strings.Contains(prog, "/") {
		found, err := exec.LookPath(prog)
		if err != nil {
			return "", nil, err
		}
		p = found
	} else if !filepath.IsAbs(p) {
		p = filepath.Join(dir, p)
	}
	if strings.HasPrefix(filepath.Base(p), "python") && !isELF(p) {
		// A version manager's shim (pyenv, asdf): a shell script that needs the manager, which
		// the jail does not hold. The interpreter it leads to says where it is.
		out, err := exec.Command(p, "-c", "import sys; print(sys.executable)").Output()
		if exe := strings.TrimSpace(string(out)); err == nil && filepath.IsAbs(exe) {
			p = exe
		}
	}
	var need []string
	cur := p
	for range 16 {
		if d := filepath.Dir(cur); filepath.Base(d) == "bin" {
			need = append(need, filepath.Dir(d))
		} else {
			need = append(need, d)
		}
		target, err := os.Readlink(cur)
		if err != nil {
			break
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(filepath.Dir(cur), target)
		}
		cur = target
	}
	if _, err := os.Stat(cur); err != nil {
		return "", nil, err
	}
	return p, need, nil
}

func isELF(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	var b [4]byte
	n, _ := io.ReadFull(f, b[:])
	return n == 4 && string(b[:]) == "\x7fELF"
}
