package jail

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Init is the jail's first process: PID 1 of new PID, mount, IPC, UTS and network namespaces,
// started by Cmd.Start with its spec on fd 3 and a status pipe on fd 4. It builds the root file
// system, brings the loopback up with the port that leads to the host's socket, starts the
// program as User with no privileges, reaps every process of the namespace, and exits when the
// program does (the kernel then kills whatever the program left). It returns the exit code.
func Init() int {
	syscall.CloseOnExec(3)
	syscall.CloseOnExec(4)
	status := os.NewFile(4, "status")
	fail := func(step string, err error) int {
		fmt.Fprintf(status, "%s: %v\n", step, err)
		return 125
	}
	var s initSpec
	raw, err := io.ReadAll(os.NewFile(3, "spec"))
	if err != nil {
		return fail("reading the jail's spec", err)
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return fail("reading the jail's spec", err)
	}
	sockDir, err := buildRoot(s)
	if err != nil {
		return fail("building the jail's file system", err)
	}
	unix.Sethostname([]byte("slimen-jail"))
	if err := loopbackUp(); err != nil {
		return fail("bringing up the jail's loopback (network namespace)", err)
	}
	if s.Socket != "" {
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(Port))
		if err != nil {
			return fail("listening on the jail's loopback", err)
		}
		go proxy(ln, sockDir, filepath.Base(s.Socket))
	}
	pid, err := startProgram(s)
	if err != nil {
		return fail("starting "+s.Argv[0]+" in the jail", err)
	}
	fmt.Fprintln(status, "ok")
	for {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(-1, &ws, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			fmt.Fprintf(status, "wait: %v\n", err)
			return 125
		}
		if got != pid {
			continue // an orphan of the program, reaped
		}
		if ws.Signaled() {
			fmt.Fprintf(status, "signal %d\n", int(ws.Signal()))
		} else {
			fmt.Fprintf(status, "exit %d\n", ws.ExitStatus())
		}
		return 0
	}
}

// startProgram starts the program as User, in a session of its own, unable to gain privileges
// (no_new_privs: set-user-ID files and file capabilities do nothing).
func startProgram(s initSpec) (int, error) {
	runtime.LockOSThread() // no_new_privs and the scheduling class are a thread's; the program is forked from this one
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return 0, fmt.Errorf("no_new_privs: %v", err)
	}
	syscall.Setrlimit(syscall.RLIMIT_CORE, &syscall.Rlimit{})
	if s.Nproc > 0 {
		if err := syscall.Setrlimit(unix.RLIMIT_NPROC, &syscall.Rlimit{Cur: uint64(s.Nproc), Max: uint64(s.Nproc)}); err != nil {
			return 0, fmt.Errorf("RLIMIT_NPROC: %v", err)
		}
	}
	if s.Idle {
		// RLIMIT_NICE 0 keeps an unprivileged program from leaving the idle class.
		syscall.Setrlimit(unix.RLIMIT_NICE, &syscall.Rlimit{})
		if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
			return 0, fmt.Errorf("the idle scheduling class: %v", err)
		}
	}
	uid := uint32(s.UID)
	return syscall.ForkExec(s.Argv[0], s.Argv, &syscall.ProcAttr{
		Dir:   s.Dir,
		Env:   s.Env,
		Files: []uintptr{0, 1, 2},
		Sys: &syscall.SysProcAttr{
			Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}},
			Setsid:     true,
		},
	})
}

// buildRoot makes the jail's root file system on s.Root and moves into it: a read-only tmpfs
// that holds the listed paths (bound read-only), /proc of the new PID namespace (other users'
// processes hidden), a few /dev nodes, a private /tmp, and an /etc of a few lines. It returns
// the folder of the host's socket, open, for the proxy (the program cannot reach it).
func buildRoot(s initSpec) (*os.File, error) {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return nil, fmt.Errorf("making mounts private (mount namespace): %v", err)
	}
	root := s.Root
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=4m,mode=755"); err != nil {
		return nil, fmt.Errorf("tmpfs root: %v", err)
	}
	if err := os.MkdirAll(root+"/proc", 0o555); err != nil {
		return nil, err
	}
	if err := unix.Mount("proc", root+"/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "hidepid=2"); err != nil {
		return nil, fmt.Errorf("/proc (PID namespace): %v", err)
	}
	if err := makeDev(root + "/dev"); err != nil {
		return nil, fmt.Errorf("/dev: %v", err)
	}
	tmp := "size=" + strconv.FormatInt(max(s.TmpBytes, 1<<20), 10) + ",mode=1777"
	if err := os.MkdirAll(root+"/tmp", 0o1777); err != nil {
		return nil, err
	}
	if err := unix.Mount("tmpfs", root+"/tmp", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmp); err != nil {
		return nil, fmt.Errorf("/tmp: %v", err)
	}
	var mounted []string
	paths := slices.Clone(s.Read)
	slices.SortFunc(paths, func(a, b string) int { return len(a) - len(b) })
	for _, p := range paths {
		p = filepath.Clean(p)
		if !filepath.IsAbs(p) || p == "/" || p == "/tmp" || within(p, "/proc") || within(p, "/dev") ||
			slices.ContainsFunc(mounted, func(m string) bool { return within(p, m) }) {
			continue
		}
		ok, err := bindReadOnly(p, root+p)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", p, err)
		}
		if ok {
			mounted = append(mounted, p)
		}
	}
	if err := writeEtc(root+"/etc", s.UID); err != nil && !slices.Contains(mounted, "/etc") {
		return nil, fmt.Errorf("/etc: %v", err)
	}
	var sockDir *os.File
	if s.Socket != "" {
		fd, err := unix.Open(filepath.Dir(s.Socket), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("the endpoint's socket: %v", err)
		}
		sockDir = os.NewFile(uintptr(fd), "socket-dir")
	}
	old := root + "/.old"
	if err := os.Mkdir(old, 0o700); err != nil {
		return nil, err
	}
	if err := unix.PivotRoot(root, old); err != nil {
		return nil, fmt.Errorf("pivot_root: %v", err)
	}
	if err := os.Chdir("/"); err != nil {
		return nil, err
	}
	if err := unix.Unmount("/.old", unix.MNT_DETACH); err != nil {
		return nil, fmt.Errorf("detaching the host's file system: %v", err)
	}
	os.Remove("/.old")
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return nil, fmt.Errorf("read-only root: %v", err)
	}
	return sockDir, nil
}

// within says whether path p is m or under it.
func within(p, m string) bool {
	return p == m || strings.HasPrefix(p, strings.TrimSuffix(m, "/")+"/")
}

// bindReadOnly makes host path p visible read-only at dst; a link is made again as a link (a
// merged /usr's /bin -> usr/bin). A path that does not exist is skipped (false).
func bindReadOnly(p, dst string) (bool, error) {
	st, err := os.Lstat(p)
	if err != nil {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return false, err
	}
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(p)
		if err != nil {
			return false, err
		}
		return false, os.Symlink(target, dst) // not a mount: paths under it are still added
	case st.IsDir():
		err = os.Mkdir(dst, 0o755)
	default:
		var f *os.File
		if f, err = os.Create(dst); err == nil {
			f.Close()
		}
	}
	if err != nil && !os.IsExist(err) {
		return false, err
	}
	if err := unix.Mount(p, dst, "", unix.MS_BIND, ""); err != nil {
		return false, fmt.Errorf("bind mount: %v", err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV)
	if err := unix.Mount("", dst, "", flags, ""); err != nil {
		return false, fmt.Errorf("read-only remount: %v", err)
	}
	return true, nil
}

// makeDev makes a /dev of the harmless nodes, bound from the host's.
func makeDev(dev string) error {
	if err := os.MkdirAll(dev, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "size=64k,mode=755"); err != nil {
		return err
	}
	for _, n := range []string{"null", "zero", "full", "random", "urandom"} {
		f, err := os.Create(filepath.Join(dev, n))
		if err != nil {
			return err
		}
		f.Close()
		if err := unix.Mount("/dev/"+n, filepath.Join(dev, n), "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("%s: %v", n, err)
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2", "shm": "/tmp"} {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil {
			return err
		}
	}
	return unix.Mount("", dev, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, "")
}

// writeEtc writes the few lines of /etc a program asks for: who it is, and localhost.
func writeEtc(etc string, uid int) error {
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return err
	}
	files := map[string]string{
		"passwd":   fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\nagent:x:%d:%d:agent:/tmp:/bin/sh\n", uid, uid),
		"group":    fmt.Sprintf("root:x:0:\nagent:x:%d:\n", uid),
		"hosts":    "127.0.0.1 localhost\n::1 localhost\n",
		"hostname": "slimen-jail\n",
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(etc, name), []byte(text), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// loopbackUp brings the namespace's lo up.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// proxy forwards each connection to the jail's port to the host's socket, named in the folder
// dir (open since before the host's file system was detached).
func proxy(ln net.Listener, dir *os.File, name string) {
	socket := fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), name)
	defer runtime.KeepAlive(dir)
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			u, err := net.Dial("unix", socket)
			if err != nil {
				return
			}
			defer u.Close()
			done := make(chan struct{}, 2)
			pipe := func(dst, src net.Conn) {
				io.Copy(dst, src)
				if cw, ok := dst.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
				done <- struct{}{}
			}
			go pipe(u, c)
			go pipe(c, u)
			<-done
			<-done
		}()
	}
}
