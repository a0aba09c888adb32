package jail

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestMain lets the test binary serve as a jail's init, as the slimen binary does.
func TestMain(m *testing.M) {
	if os.Getenv(InitEnv) != "" {
		os.Exit(Init())
	}
	if mark := os.Getenv("JAIL_TEST_MAKER"); mark != "" {
		// TestJailDiesWithItsMaker's maker: starts a jail, says so, and waits to be killed.
		c := &Cmd{Spec: Spec{Argv: []string{"/bin/sh", "-c", "setsid sleep 304" + mark + " & sleep 305" + mark},
			Dir: "/tmp", Read: SystemPaths, MemoryBytes: 64 << 20, Pids: 16}}
		if err := c.Start(); err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		fmt.Println("started")
		c.Wait()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func needJail(t *testing.T) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("no jail on this host: %v", err)
	}
}

// run runs a shell command in a jail and returns its exit code and output.
func run(t *testing.T, spec Spec, script string) (int, string, error) {
	t.Helper()
	spec.Argv = []string{"/bin/sh", "-c", script}
	if spec.Dir == "" {
		spec.Dir = "/tmp"
	}
	if spec.Env == nil {
		spec.Env = []string{"PATH=/usr/bin:/bin", "HOME=/tmp"}
	}
	spec.Read = append(spec.Read, SystemPaths...)
	if spec.MemoryBytes == 0 {
		spec.MemoryBytes = 256 << 20
	}
	if spec.Pids == 0 {
		spec.Pids = 64
	}
	var out bytes.Buffer
	c := &Cmd{Spec: spec, Stdout: &out, Stderr: &out}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	code, err := c.Wait()
	return code, out.String(), err
}

// TestJailSeesOnlyItsGrant: the program runs as nobody, sees the listed folders read-only and
// nothing else of the host's files or processes, and writes only its private /tmp.
func TestJailSeesOnlyItsGrant(t *testing.T) {
	needJail(t)
	grant := t.TempDir()
	os.WriteFile(filepath.Join(grant, "agent.txt"), []byte("granted\n"), 0o644)
	secret := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secret, []byte("host secret\n"), 0o644)
	code, out, err := run(t, Spec{Read: []string{grant}, Dir: grant}, fmt.Sprintf(`
		id -u; id -g
		cat agent.txt
		cat %s 2>/dev/null || echo no-secret
		ls /root 2>/dev/null || echo no-root
		test -e /work || echo no-work
		echo x > %s/new 2>/dev/null || echo no-write-grant
		echo x > /usr/new 2>/dev/null || echo no-write-usr
		echo scratch > /tmp/s && cat /tmp/s
		test -e /proc/1 && echo sees-init
		echo procs=$(ls /proc | grep -c '^[0-9]')
		hostname
		kill -9 %d 2>/dev/null || echo no-kill
	`, secret, grant, os.Getpid()))
	if err != nil || code != 0 {
		t.Fatalf("code %d, %v: %s", code, err, out)
	}
	// The program's user: nobody, or a user of its own jail where RLIMIT_NPROC stands in for
	// the pids controller; never root, and its group is its own.
	if ids := strings.SplitN(out, "\n", 3); len(ids) < 3 || ids[0] == "0" || ids[0] != ids[1] {
		t.Errorf("the program runs as uid/gid %q", ids[:2])
	}
	want := []string{"granted", "no-secret", "no-root", "no-write-grant", "no-write-usr", "scratch", "slimen-jail", "no-kill"}
	for _, w := range want {
		if !strings.Contains(out, w+"\n") {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
	if _, err := os.Stat(filepath.Join(grant, "new")); err == nil {
		t.Error("the program wrote into its read-only grant")
	}
	if strings.Contains(out, "sees-init") || !(strings.Contains(out, "procs=3\n") || strings.Contains(out, "procs=4\n")) {
		t.Errorf("the program sees other processes than its own (sh, its subshell, ls, grep; not the jail's init, which is root's): %s", out)
	}
}

// TestJailNetwork: the program reaches the host's socket through 127.0.0.1:Port and nothing
// else: not the host's loopback.
func TestJailNetwork(t *testing.T) {
	needJail(t)
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 is not installed")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "endpoint.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "endpoint got %s %s", r.URL.Path, body)
	}))
	host, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	go http.Serve(host, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "host reached") }))
	py, need, err := Resolve("python3", "")
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	c := &Cmd{Spec: Spec{Argv: []string{py, "-c", fmt.Sprintf(`
import urllib.request
print(urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:%d/v1/x", data=b"hi")).read().decode())
try:
    urllib.request.urlopen("http://%s/", timeout=2).read()
    print("host loopback reached")
except Exception as e:
    print("no host loopback")
`, Port, host.Addr())}, Env: []string{"PATH=/usr/bin:/bin", "HOME=/tmp"}, Dir: "/tmp",
		Read: append(need, SystemPaths...), Socket: sock, MemoryBytes: 256 << 20, Pids: 64}, Stdout: &out, Stderr: &out}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	code, err := c.Wait()
	if code != 0 || !strings.Contains(out.String(), "endpoint got /v1/x hi") || !strings.Contains(out.String(), "no host loopback") {
		t.Fatalf("code %d, %v: %s", code, err, out.String())
	}
}

// TestJailTreeEnds: what the program leaves behind (a daemon in a session of its own, a double
// fork) is gone when it ends, and when it is killed.
func TestJailTreeEnds(t *testing.T) {
	needJail(t)
	mark := fmt.Sprintf("%d.%d", os.Getpid(), time.Now().UnixNano()%1000000)
	_, out, err := run(t, Spec{}, fmt.Sprintf(`(setsid sleep 300%s &) ; (sleep 301%s &) ; echo left`, mark, mark))
	if err != nil || !strings.Contains(out, "left") {
		t.Fatalf("%v: %s", err, out)
	}
	time.Sleep(100 * time.Millisecond)
	if ps, _ := exec.Command("pgrep", "-f", mark).Output(); len(ps) > 0 {
		t.Errorf("processes outlived the jail: %s", ps)
	}
	// Killed while running.
	var b bytes.Buffer
	c := &Cmd{Spec: Spec{Argv: []string{"/bin/sh", "-c", "setsid sleep 302" + mark + " & sleep 303" + mark}, Dir: "/tmp",
		Read: SystemPaths, MemoryBytes: 64 << 20, Pids: 16}, Stdout: &b, Stderr: &b}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	c.Kill()
	if code, err := c.Wait(); code != -1 || err == nil {
		t.Errorf("killed: code %d, %v", code, err)
	}
	time.Sleep(100 * time.Millisecond)
	if ps, _ := exec.Command("pgrep", "-f", mark).Output(); len(ps) > 0 {
		t.Errorf("processes outlived the killed jail: %s", ps)
	}
}

// TestJailBounds: memory and processes are bounded for the whole tree, not per process.
func TestJailBounds(t *testing.T) {
	needJail(t)
	// Four processes of 40 MB each under a 64 MB bound: tail keeps a line without newline whole.
	code, out, _ := run(t, Spec{MemoryBytes: 64 << 20}, `
		for i in 1 2 3 4; do (head -c 40000000 /dev/zero | tail -c 40000000 > /dev/null; echo done $?) & done; wait; echo end`)
	if strings.Count(out, "done 0") == 4 {
		t.Errorf("four 40 MB processes ran under a 64 MB bound (code %d): %s", code, out)
	}
	code, out, _ = run(t, Spec{Pids: 8}, `n=0; for i in $(seq 30); do sleep 2 & n=$((n+1)); done 2>/dev/null; echo started; jobs -p | wc -l`)
	if strings.Contains(out, "\n30\n") {
		t.Errorf("30 processes started under pids 8 (code %d): %s", code, out)
	}
}

// TestJailEnvironment: the program gets the environment it is given, nothing of the host's.
func TestJailEnvironment(t *testing.T) {
	needJail(t)
	t.Setenv("SLIMEN_TEST_HOST_SECRET", "hunter2")
	_, out, err := run(t, Spec{Env: []string{"PATH=/usr/bin:/bin", "ONLY=this"}}, `env`)
	if err != nil || strings.Contains(out, "hunter2") || !strings.Contains(out, "ONLY=this") {
		t.Fatalf("%v: %s", err, out)
	}
}

// BenchmarkJailStart is what a jail adds to a program's start: /bin/true run bare (fork and
// exec) and in a jail (the init's exec, namespaces, mounts, cgroup, and its teardown).
//
//	go test ./host/jail -run '^$' -bench JailStart
func BenchmarkJailStart(b *testing.B) {
	b.Run("bare", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := exec.Command("/bin/true").Run(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("jail", func(b *testing.B) {
		if err := Available(); err != nil {
			b.Skipf("no jail on this host: %v", err)
		}
		for i := 0; i < b.N; i++ {
			c := &Cmd{Spec: Spec{Argv: []string{"/bin/true"}, Dir: "/tmp", Read: SystemPaths, MemoryBytes: 64 << 20, Pids: 16, CPUs: 1}}
			if err := c.Start(); err != nil {
				b.Fatal(err)
			}
			if code, err := c.Wait(); code != 0 {
				b.Fatal(code, err)
			}
		}
	})
}

// TestJailLeavesNothing: a jail's root folder and cgroup are gone after it, and those of a
// maker that died are swept by the next jail.
func TestJailLeavesNothing(t *testing.T) {
	needJail(t)
	if !Orphaned("slimen-jail-2147483646-7", "slimen-jail-") || Orphaned(fmt.Sprintf("slimen-jail-%d-1", os.Getppid()), "slimen-jail-") ||
		Orphaned(fmt.Sprintf("slimen-jail-%d-1", os.Getpid()), "slimen-jail-") {
		t.Error("Orphaned: a dead maker's name is not told from a live one's")
	}
	stale := filepath.Join(os.TempDir(), "slimen-jail-2147483646-x")
	os.Mkdir(stale, 0o700)
	run(t, Spec{}, "true")
	if _, err := os.Stat(stale); err == nil {
		t.Error("a dead maker's root folder was not swept")
	}
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), fmt.Sprintf("slimen-jail-%d-*", os.Getpid())))
	l, _ := findCgroups()
	for _, h := range l.hs {
		g, _ := filepath.Glob(filepath.Join(h.dir, fmt.Sprintf("slimen-jail-%d-*", os.Getpid())))
		left = append(left, g...)
	}
	if len(left) > 0 {
		t.Errorf("jails left %v", left)
	}
}

// BenchmarkJailNeighbour is what a hostile program costs its neighbours: one core's work (a
// SHA-256 of 32 MiB) alone, beside a jail whose program spins 16 processes under the default
// bound (agent_cpus: 1), beside the same without a CPU bound, and in the idle scheduling class
// (the fallback where the host gives sub-groups no cpu controller).
//
//	go test ./host/jail -run '^$' -bench JailNeighbour -benchtime 20x
func BenchmarkJailNeighbour(b *testing.B) {
	buf := make([]byte, 32<<20)
	work := func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			sha256.Sum256(buf)
		}
	}
	b.Run("alone", work)
	for _, v := range []struct {
		name string
		cpus float64
		idle bool
	}{{"cpus=1", 1, false}, {"unbounded", 0, false}, {"idle-class", 1, true}} {
		b.Run("beside-spinner-"+v.name, func(b *testing.B) {
			if err := Available(); err != nil {
				b.Skipf("no jail on this host: %v", err)
			}
			if v.idle { // the fallback where the host gives no cpu controller
				absentControllers = []string{"cpu"}
				defer func() { absentControllers = nil }()
			}
			cpus := v.cpus
			c := &Cmd{Spec: Spec{Argv: []string{"/bin/sh", "-c", `i=0; while [ $i -lt 16 ]; do (while :; do :; done) & i=$((i+1)); done; wait`},
				Dir: "/tmp", Read: SystemPaths, MemoryBytes: 64 << 20, Pids: 64, CPUs: cpus}}
			if err := c.Start(); err != nil {
				b.Fatal(err)
			}
			defer c.Wait()
			defer c.Kill()
			time.Sleep(200 * time.Millisecond)
			b.ResetTimer()
			work(b)
		})
	}
}

// TestJailDiesWithItsMaker: a process that made a jail and is SIGKILLed (a sandbox child killed
// by the host) takes the jail's whole tree with it.
func TestJailDiesWithItsMaker(t *testing.T) {
	needJail(t)
	mark := fmt.Sprintf("%d%d", os.Getpid(), time.Now().UnixNano()%100000)
	maker := exec.Command(os.Args[0], "-test.run=^$")
	maker.Env = append(os.Environ(), "JAIL_TEST_MAKER="+mark)
	out, _ := maker.StdoutPipe()
	if err := maker.Start(); err != nil {
		t.Fatal(err)
	}
	line := make([]byte, 8)
	io.ReadFull(out, line)
	if string(line) != "started\n" {
		t.Fatalf("the maker said %q", line)
	}
	time.Sleep(100 * time.Millisecond)
	if ps, _ := exec.Command("pgrep", "-f", mark).Output(); len(ps) == 0 {
		t.Fatal("the jail's program is not running")
	}
	maker.Process.Kill()
	maker.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ps, _ := exec.Command("pgrep", "-f", mark).Output()
		if len(ps) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the jail outlived its maker: %s", ps)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestJailFallbacks: where sub-groups get no pids or cpu controller (a container with only
// memory delegated), the program runs as a user of its own jail under RLIMIT_NPROC, in the idle
// scheduling class it cannot leave.
func TestJailFallbacks(t *testing.T) {
	needJail(t)
	if _, err := exec.LookPath("chrt"); err != nil {
		t.Skip("chrt is not installed")
	}
	absentControllers = []string{"pids", "cpu"}
	defer func() { absentControllers = nil }()
	code, out, _ := run(t, Spec{Pids: 8, CPUs: 1}, `
		id -u
		chrt -p $$
		chrt -o -p 0 $$ 2>/dev/null && echo ESCAPED the idle class
		for i in $(seq 30); do sleep 2 & done 2>/dev/null; echo jobs=$(jobs -p | wc -l)`)
	// The shell itself may fail to fork past the bound (exit 2): what it printed says enough.
	if strings.Contains(out, "65534\n") || !strings.Contains(out, "SCHED_IDLE") || strings.Contains(out, "ESCAPED") || strings.Contains(out, "jobs=30") {
		t.Errorf("fallbacks do not hold (exit %d):\n%s", code, out)
	}
}
