package host

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/jail"
)

// jailAttacks are agent() programs of a contributed script, under the docs' own grant
// (programs: [python3]): each prints ESCAPED and what it reached if the jail did not hold. %[1]s
// is a host file the program must not read, %[2]s a host folder it must not write, %[3]d the
// host's pid, %[4]s a host TCP address it must not reach, %[5]s a mark for its leftover processes.
var jailAttacks = map[string]string{
	"read_passwd": `
s = open("/etc/passwd").read()
if "daemon:" in s or "bin:" in s: print("ESCAPED read the host's /etc/passwd")`,
	"read_secret": `
try:
    print("ESCAPED read", open(%[1]q).read())
except OSError as e: print("refused", e)`,
	"list_root": `
import os
for d in ["/root", "/work", "/home", "/var", "/run", "/sys/fs/cgroup"]:
    try:
        if os.listdir(d): print("ESCAPED listed", d)
    except OSError: pass`,
	"write_outside": `
import os
for d in [%[2]q, "/usr", "/", os.getcwd()]:
    try:
        open(os.path.join(d, "pwned"), "w").write("x"); print("ESCAPED wrote in", d)
    except OSError: pass`,
	"host_env": `
import os
for k, v in os.environ.items():
    if "hunter2" in v or k in ("SLIMEN_TEST_HOST_SECRET", "LD_PRELOAD", "SLIMEN_SANDBOX_CHILD"): print("ESCAPED env", k)`,
	"kill_host": `
import os, signal
for pid in [os.getppid(), %[3]d, 1]:
    try:
        os.kill(pid, signal.SIGKILL); print("ESCAPED killed", pid)
    except OSError: pass`,
	"forge_pipes": `
import os
me = str(os.getpid())
for p in os.listdir("/proc"):
    if not p.isdigit() or p == me: continue
    for fd in range(0, 8):
        try:
            f = os.open("/proc/%%s/fd/%%d" %% (p, fd), os.O_WRONLY)
            os.write(f, b'{"t":"call","id":99,"rollout":1,"method":"generate"}\n'); print("ESCAPED wrote to", p, fd)
        except OSError: pass`,
	"network": `
import socket
h, port = %[4]q.rsplit(":", 1)
try:
    socket.create_connection((h, int(port)), timeout=2); print("ESCAPED reached the host's loopback")
except OSError: print("no network")`,
	"daemon": `
import os, subprocess
subprocess.Popen(["sleep", "300%[5]s"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "301%[5]s"])
    os._exit(0)
print("left daemons")`,
	"fork_memory": `
import os
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        b = bytearray(120 << 20)
        for j in range(0, len(b), 4096): b[j] = 1
        os._exit(0)
    kids.append(pid)
ok = sum(1 for k in kids if os.waitpid(k, 0)[1] == 0)
if ok == 4: print("ESCAPED 4 x 120 MB under memory_mb 256")`,
	"fork_bomb": `
import os, time
n = 0
try:
    for i in range(500):
        if os.fork() == 0:
            time.sleep(3); os._exit(0)
        n += 1
except OSError: pass
if n >= 500: print("ESCAPED started", n, "processes")`,
}

const jailScript = `
ATTACKS = %s

def rollout(task):
    if task.label == "honest":
        r = agent(["python3", %q, "turns"], task.prompt, policy = "p", tools_prompt = "system")
        for c in r.chats:
            reward(c, 1.0)
            train(c)
        return
    r = agent(["python3", "-c", ATTACKS[task.label]], "", policy = "p", check = False, timeout = 20)
    state.update(task.id, lambda _: r.output + "|" + r.stderr[-400:], None)
`

// TestAgentJailHostile is issue 34's red team, as tests: under --sandbox with the docs' grant,
// agent() programs that read, write, signal, forge, listen, leave daemons or fork past their
// memory reach nothing outside the jail, and honest agent() rollouts beside them train.
func TestAgentJailHostile(t *testing.T) {
	needPython(t)
	if err := jail.Available(); err != nil {
		t.Skipf("no jail on this host: %v", err)
	}
	if raceEnabled {
		t.Skip("a race-detector child does not fit the docs' memory_mb 256 (its shadow memory); the jail is the same without it")
	}
	t.Setenv("SLIMEN_TEST_HOST_SECRET", "hunter2")
	secret := filepath.Join(t.TempDir(), "secret.txt")
	os.WriteFile(secret, []byte("hunter2\n"), 0o644)
	outside := t.TempDir()
	os.Chmod(outside, 0o777)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	mark := fmt.Sprintf("%d%d", os.Getpid(), time.Now().UnixNano()%100000)
	names := make([]string, 0, len(jailAttacks))
	for n := range jailAttacks {
		names = append(names, n)
	}
	sort.Strings(names)
	var dict strings.Builder
	dict.WriteString("{\n")
	tasks := listTasks{{ID: "honest1", Prompt: "q", Label: "honest", HasLabel: true}}
	for _, n := range names {
		fmt.Fprintf(&dict, "    %q: %q,\n", n, fmt.Sprintf(jailAttacks[n], secret, outside, os.Getpid(), ln.Addr().String(), mark))
		tasks = append(tasks, listTasks{{ID: n, Prompt: "q", Label: n, HasLabel: true}}...)
	}
	dict.WriteString("}")
	tasks = append(tasks, listTasks{{ID: "honest2", Prompt: "q", Label: "honest", HasLabel: true}}...)
	prog, _ := filepath.Abs("testdata/agent_client.py")
	cfg := testConfig(len(tasks), "p")
	cfg.Rollout.MaxFailedFraction, cfg.Rollout.MaxResponseLen = 1, 16
	cfg.Sandbox.Programs = []string{"python3"}
	cfg.Sandbox.Train = []string{"p"}
	cfg.Sandbox.MemoryMB, cfg.Sandbox.WallSeconds = 256, 30
	cfg.Sandbox.AgentRead = []string{filepath.Dir(prog)}
	echo := func(_ context.Context, p config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }
	r, err := Load(context.Background(), writeScript(t, fmt.Sprintf(jailScript, dict.String(), prog)),
		Options{Config: cfg, Tasks: tasks, OpenEngine: echo, Sandbox: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Failed) != 0 {
		t.Errorf("failed rollouts: %v", res.Failed)
	}
	if n := res.Policies[0].Float("samples"); n != 2 {
		t.Errorf("%v samples trained, want the 2 honest rollouts' 2", n)
	}
	for _, n := range names {
		v, ok := r.State().Get(n)
		if !ok {
			t.Errorf("%s: stored nothing", n)
			continue
		}
		if out := v.String(); strings.Contains(out, "ESCAPED") || strings.Contains(out, "Traceback") {
			t.Errorf("%s: %s", n, out)
		}
	}
	if ents, _ := os.ReadDir(outside); len(ents) > 0 {
		t.Errorf("a program wrote outside its jail: %v", ents)
	}
	time.Sleep(100 * time.Millisecond)
	if ps, _ := exec.Command("pgrep", "-f", mark).Output(); len(ps) > 0 {
		t.Errorf("an agent program's processes outlived its rollout: %s", ps)
	}
}

// TestAgentJailGrants: under --sandbox the operator's config decides the program's argv and the
// variables a script may set; a loader or interpreter variable is refused even where listed.
func TestAgentJailGrants(t *testing.T) {
	needPython(t)
	if err := jail.Available(); err != nil {
		t.Skipf("no jail on this host: %v", err)
	}
	cases := []struct {
		programs, env []string
		call, want    string
	}{
		{[]string{"python3 agent.py"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p")`, `sandbox.programs lists ["python3 agent.py"], which does not match ["python3" "-c" "print(1)"]`},
		{[]string{"python3 -c print(1)"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p")`, ""},
		{[]string{"python3"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p", env = {"LD_PRELOAD": "/tmp/x.so"})`, `env sets "LD_PRELOAD", which no sandboxed script may set`},
		{[]string{"python3"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p", env = {"BASH_FUNC_python3%": "() { id; }"})`, `env sets "BASH_FUNC_python3%", which no sandboxed script may set`},
		{[]string{"python3"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p", env = {"PYTHONWARNINGS": "x", "BROWSER": "sh"})`, `env sets "BROWSER", which no sandboxed script may set`},
		{[]string{"python3"}, nil, `agent(["python3", "-c", "print(1)"], "", policy = "p", env = {"MODE": "x"})`, `env sets "MODE", which sandbox.agent_env does not list`},
		{[]string{"python3"}, []string{"MODE"}, `agent(["python3", "-c", "import os; assert os.environ['MODE'] == 'x'"], "", policy = "p", env = {"MODE": "x"})`, ""},
	}
	for i, c := range cases {
		cfg := testConfig(1, "p")
		cfg.Rollout.MaxFailedFraction = 1
		cfg.Sandbox.Programs, cfg.Sandbox.AgentEnv, cfg.Sandbox.Train = c.programs, c.env, []string{"p"}
		echo := func(_ context.Context, p config.PolicyConfig) (engines.Engine, error) { return scripted.Echo("x"), nil }
		r, err := Load(context.Background(), writeScript(t, "def rollout(task):\n    "+c.call+"\n"),
			Options{Config: cfg, Tasks: listTasks{{ID: "a", Prompt: "q"}}, OpenEngine: echo, Sandbox: true})
		if err != nil {
			t.Fatal(err)
		}
		res, err := r.Step(context.Background())
		r.Close()
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case c.want == "" && len(res.Failed) != 0:
			t.Errorf("case %d: failed: %v", i, res.Failed)
		case c.want != "" && (len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Msg, c.want)):
			t.Errorf("case %d: want a failure with %q, got %v", i, c.want, res.Failed)
		}
	}
}

// BenchmarkAgentJail is the jail's cost: an agent() program's start (python3 -c pass, ten a
// rollout, one after the other) and one
// chat-completions call (agent_client.py's bench mode, 200 calls in conversations of 8 turns, on
// a scripted engine that answers at once), in-process against --sandbox, where the program runs
// in a jail and its calls cross the jail's loopback proxy and the sandbox child's pipe.
//
//	go test ./host -run '^$' -bench AgentJail -benchtime 10x
func BenchmarkAgentJail(b *testing.B) {
	if testing.Short() {
		b.Skip("starts Python")
	}
	needPython(b)
	if err := jail.Available(); err != nil {
		b.Skipf("no jail on this host: %v", err)
	}
	prog, _ := filepath.Abs("testdata/agent_client.py")
	// The interpreter itself, not a version manager's shim (pyenv's costs a shell and ~0.3 s a
	// start outside the jail; the jail resolves it to the interpreter).
	out, err := exec.Command("python3", "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		b.Fatal(err)
	}
	py := strings.TrimSpace(string(out))
	const calls = 200
	scripts := map[string]string{
		"start": fmt.Sprintf(`
def rollout(task):
    for i in range(10):
        agent([%q, "-c", "pass"], "", policy = "p")
`, py),
		"call": fmt.Sprintf(`
def rollout(task):
    agent([%q, %q, "bench", "%d"], task.prompt, policy = "p", max_calls = %d)
`, py, prog, calls, calls+1),
	}
	for _, what := range []string{"start", "call"} {
		for _, sandboxed := range []bool{false, true} {
			name := what + "/in-process"
			if sandboxed {
				name = what + "/sandboxed"
			}
			b.Run(name, func(b *testing.B) {
				eng := &stampEngine{Engine: scripted.New(func(scripted.Request) string { return "ok" })}
				cfg := testConfig(1, "p")
				cfg.Sandbox.Programs, cfg.Sandbox.Train = []string{py}, []string{"p"}
				cfg.Sandbox.AgentRead = []string{filepath.Dir(prog)}
				r, err := Load(context.Background(), writeScript(b, scripts[what]), Options{Config: cfg,
					Engines: map[string]engines.Engine{"p": eng}, Tasks: listTasks{{ID: "a", Prompt: "What is 3 + 4?"}}, Sandbox: sandboxed})
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				if _, err := r.Step(context.Background()); err != nil { // the sandbox child's start
					b.Fatal(err)
				}
				eng.gaps()
				var all []time.Duration
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					res, err := r.Step(context.Background())
					if err != nil || len(res.Failed) > 0 {
						b.Fatal(err, res.Failed)
					}
					all = append(all, eng.gaps()...)
				}
				if what == "start" {
					b.ReportMetric(b.Elapsed().Seconds()*1000/float64(10*b.N), "ms/program")
					return
				}
				slices.Sort(all)
				b.ReportMetric(quantile(all, 0.5), "µs/call-p50")
				b.ReportMetric(quantile(all, 0.99), "µs/call-p99")
			})
		}
	}
}
