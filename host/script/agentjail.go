package script

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/jail"
)

// Under --sandbox an agent() program is the operator's to allow and the jail's to hold
// (docs/sandbox.md): sandbox.programs must match its whole argv, the script may set only the
// variables sandbox.agent_env lists, and it runs in a jail (host/jail) that sees the system's
// folders, the program's installation, the script's folder and sandbox.agent_read, read-only;
// writes only a private /tmp; reaches only this rollout's endpoint; and dies whole with the call.

// mayStart checks that a sandboxed rollout may start argv: an entry of sandbox.programs must
// match it. where is the script's place of the call.
func (b *Budget) mayStart(fn, where string, argv []string) error {
	if b == nil {
		return nil
	}
	for _, entry := range b.cfg.Programs {
		if ProgramMatches(entry, argv) {
			return nil
		}
	}
	listed := "lists none"
	if len(b.cfg.Programs) > 0 {
		listed = fmt.Sprintf("lists %q", b.cfg.Programs)
	}
	return fmt.Errorf("%s: %s: a sandboxed script starts only the programs the operator's config grants, "+
		"and sandbox.programs %s, which does not match %q; "+
		"add the program there (sandbox: {programs: [%q]}) if this script may run it",
		where, fn, listed, argv, argv[0])
}

// ProgramMatches says whether an entry of sandbox.programs allows argv: one word is argv[0]
// exactly, with any arguments; several words match argv word by word (path.Match), a last word
// "**" matching any further arguments.
func ProgramMatches(entry string, argv []string) bool {
	words := strings.Fields(entry)
	if len(words) == 1 {
		return argv[0] == words[0]
	}
	rest := len(words) > 0 && words[len(words)-1] == "**"
	if rest {
		words = words[:len(words)-1]
	}
	if len(argv) < len(words) || (!rest && len(argv) != len(words)) {
		return false
	}
	for i, w := range words {
		if i == 0 && argv[0] != w {
			return false
		}
		if ok, err := path.Match(w, argv[i]); err != nil || !ok {
			return false
		}
	}
	return true
}

// mayEnv checks the variables a sandboxed script passes with env=.
func (b *Budget) mayEnv(fn, where string, env map[string]string) error {
	if b == nil {
		return nil
	}
	names := make([]string, 0, len(env))
	for k := range env {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		if config.ReservedAgentEnv(k) {
			return fmt.Errorf("%s: %s: env sets %q, which no sandboxed script may set: loader, "+
				"shell and interpreter variables run code in the program, and PATH, HOME, TMPDIR, "+
				"LANG and OPENAI_*/SLIMEN_* are the jail's", where, fn, k)
		}
		if !slices.Contains(b.cfg.AgentEnv, k) {
			return fmt.Errorf("%s: %s: env sets %q, which sandbox.agent_env does not list; "+
				"a sandboxed script sets only the variables the operator's config names (sandbox: {agent_env: [%s]})", where, fn, k, k)
		}
	}
	return nil
}

// agentProc is a started agent() program: bare, or in a jail.
type agentProc interface {
	wait() (int, error)
	kill()
}

type bareProc struct{ cmd *exec.Cmd }

func (p bareProc) wait() (int, error) {
	err := p.cmd.Wait()
	p.kill() // what the program left running goes with it
	return p.cmd.ProcessState.ExitCode(), err
}

func (p bareProc) kill() {
	if p.cmd.Process != nil {
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
}

// startBare runs the program as the host's user, with the host's environment and the session's
// variables: a trusted script's agent().
func startBare(prog string, argv, env []string, dir string, stdin io.Reader, stdout, stderr io.Writer) (agentProc, error) {
	cmd := exec.Command(prog, argv[1:]...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 2 * time.Second // a child of the program holding its stdout open does not hold agent()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return bareProc{cmd}, nil
}

type jailProc struct{ c *jail.Cmd }

func (p jailProc) wait() (int, error) { return p.c.Wait() }
func (p jailProc) kill()              { p.c.Kill() }

// startJailed runs the program in a jail whose port leads to agents' socket: the environment is
// the jail's (PATH, HOME and TMPDIR in its /tmp, LANG) and the session's variables, nothing of the
// host's.
func startJailed(agents *AgentEndpoint, cfg config.SandboxConfig, prog string, argv, env []string, dir string,
	stdin io.Reader, stdout, stderr io.Writer) (agentProc, error) {
	sock, err := agents.Socket()
	if err != nil {
		return nil, err
	}
	resolved, need, err := resolveProgram(prog, dir)
	if err != nil {
		return nil, err
	}
	read := append(slices.Clone(jail.SystemPaths), need...)
	read = append(read, cfg.AgentRead...)
	path := []string{"/usr/local/bin", "/usr/bin", "/bin"}
	for _, d := range need {
		if st, err := os.Stat(filepath.Join(d, "bin")); err == nil && st.IsDir() {
			path = append([]string{filepath.Join(d, "bin")}, path...)
		}
	}
	wd := "/tmp"
	if dir != "" {
		read, wd = append(read, dir), dir
	}
	full := append([]string{"PATH=" + strings.Join(path, ":"), "HOME=/tmp", "TMPDIR=/tmp", "LANG=C.UTF-8"}, env...)
	c := &jail.Cmd{Spec: jail.Spec{Argv: append([]string{resolved}, argv[1:]...), Env: full, Dir: wd, Read: read,
		Socket: sock, MemoryBytes: int64(cfg.MemoryMB) << 20, Pids: cfg.AgentPids, CPUs: cfg.AgentCPUs,
		TmpBytes: int64(cfg.MemoryMB) << 19}, Stdin: stdin, Stdout: stdout, Stderr: stderr}
	if err := c.Start(); err != nil {
		return nil, err
	}
	return jailProc{c}, nil
}

// resolveProgram is jail.Resolve, remembered: finding a version manager's interpreter starts it.
func resolveProgram(prog, dir string) (string, []string, error) {
	key := prog + "\x00" + dir + "\x00" + os.Getenv("PATH")
	if r, ok := resolved.Load(key); ok {
		r := r.(resolvedProgram)
		return r.path, r.need, nil
	}
	p, need, err := jail.Resolve(prog, dir)
	if err != nil {
		return "", nil, fmt.Errorf("cannot find the program to run in the jail: %v", err)
	}
	resolved.Store(key, resolvedProgram{p, need})
	return p, need, nil
}

type resolvedProgram struct {
	path string
	need []string
}

var resolved sync.Map

// jailBaseURL is the endpoint as a jailed program reaches it.
var jailBaseURL = "http://127.0.0.1:" + strconv.Itoa(jail.Port)
