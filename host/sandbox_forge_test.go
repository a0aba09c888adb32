package host

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/script/sandbox"
)

// The forged-child tests (issue 34, item 3): the host does not trust what comes over a child's
// channel. Each starts its children through forgeChild, which plays a child whose channel
// something else writes to: it runs the real sandbox child and passes its messages on, but once
// task t3 is among its rollouts it adds forged ones of its own. Each attack must fail t3 alone
// (the child that forged is stopped; the honest rollouts it held run again alone and are
// trained), and the host's peak memory stays under hostPeakMiB.

// forgeHostFDs are the fds of the host's channel in a child (sandbox.HostInFD, HostOutFD).
var forgeHostFDs = [2]int{sandbox.HostInFD, sandbox.HostOutFD}

// forgeScript is an honest script: each rollout samples once and trains what it sampled.
const forgeScript = `
def rollout(task):
    c = generate("p", task.prompt)
    reward(c, 1.0)
    train(c)
`

func TestSandboxForgedChild(t *testing.T) {
	for _, tc := range []struct {
		mode, want string
	}{
		// 40 generate calls of one line each, past generate_calls (32).
		{"calls", `sandbox budget generate_calls \(32\) exceeded: the rollout's call 33 \(a generate\) came to the host, .*forged`},
		// One call that reserves 100,000 tokens, past tokens (4096).
		{"tokens", `sandbox budget tokens \(4096\) exceeded: a generate call asks for up to 100000 tokens .*forged`},
		// One line asking for 200,000 samples: the host would hold them all.
		{"n", `generate call for n=200000 samples \(the child allows 1 to 4096\).*forged`},
		// A report for a rollout that trains a completion the host never generated for it, with
		// its own reward: a neighbour's report while the neighbour still runs.
		{"train", `trains completion "t3/77#0", which the host never generated for the rollout.*forged`},
		// Print notes past print_bytes (4096) that the child never charged.
		{"events", `sandbox budget print_bytes \(4096\) exceeded: .*forged`},
		// A chat turn whose tool schema (100 KB) is past prompt_bytes (64 KiB).
		{"render", `sandbox budget prompt_bytes \(65536\) exceeded: chat was given a conversation of \d+ bytes \(its messages and tool schemas\).*forged`},
		// 40 chat turns (renderings), past generate_calls (32).
		{"turns", `sandbox budget generate_calls \(32\) exceeded: the rollout's call 33 \(a chat turn\) came to the host.*forged`},
		// Calls of a rollout the child was never given.
		{"unknown", `for rollout 1000, which it was never given`},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			res, took, mib := forgedStep(t, tc.mode)
			t.Logf("step %.1fs, host peak %d MiB", took.Seconds(), mib)
			if mib > hostPeakMiB && !raceEnabled {
				t.Errorf("host peak resident memory %d MiB, want under %d", mib, hostPeakMiB)
			}
			checkForged(t, res, regexp.MustCompile(tc.want))
		})
	}
}

// TestSandboxDeadChildHeldPipes: a child that dies while a process it started holds its pipes
// (the channel, stdout and stderr) is noticed from its process: the step ends in seconds, not
// when that process lets go (30 s here) or the rollout's wall time and its grace.
func TestSandboxDeadChildHeldPipes(t *testing.T) {
	res, took, _ := forgedStep(t, "daemon")
	checkForged(t, res, regexp.MustCompile(`the script's process died`))
	t.Logf("step %.1fs", took.Seconds())
	if took > 10*time.Second {
		t.Errorf("the step took %v with a dead child's pipes held, want under 10s", took)
	}
}

// forgedStep runs one step of forgeScript over 8 tasks with children that forge in mode, and
// returns it, how long it took and the host's peak resident memory in MiB.
func forgedStep(t *testing.T, mode string) (*StepResult, time.Duration, int) {
	t.Helper()
	if _, err := os.Stat("/bin/sleep"); err != nil && mode == "daemon" {
		t.Skip("no /bin/sleep")
	}
	cfg := testConfig(8, "p")
	cfg.Sandbox = hostileSandbox()
	cfg.Sandbox.Policies, cfg.Sandbox.Train = []string{"p"}, []string{"p"}
	pids := t.TempDir()
	t.Cleanup(func() { killForgeDaemons(pids) })
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The child's environment marks it a sandbox child; forgeChild starts the real one itself.
	cmd := []string{"/bin/sh", "-c", `unset ` + sandbox.ChildEnv + `; exec "$@"`, "sh",
		exe, "-test.run=^TestForgeChildHelper$", "--", "forge", mode, strconv.Itoa(cfg.Sandbox.MemoryMB), pids}
	// The honest rollouts take a while, so that a neighbour of t3 is still running when t3 comes.
	eng := scripted.New(func(r scripted.Request) string {
		if strings.Contains(r.Prompt, "q") && !strings.Contains(r.Prompt, "q3") {
			time.Sleep(300 * time.Millisecond)
		}
		return `\boxed{1}`
	})
	peak := resetPeak(t)
	r, err := Load(context.Background(), writeScript(t, forgeScript), Options{Config: cfg, Tasks: numberedTasks(8),
		Engines: map[string]engines.Engine{"p": eng}, Sandbox: true, SandboxCommand: cmd})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Second)
	defer cancel()
	t0 := time.Now()
	res, err := r.Step(ctx)
	took := time.Since(t0)
	if err != nil {
		t.Fatalf("the run did not survive: %v", err)
	}
	return res, took, peak()
}

// checkForged: t3 alone failed, with want; the 7 honest samples were trained.
func checkForged(t *testing.T, res *StepResult, want *regexp.Regexp) {
	t.Helper()
	if len(res.Failed) != 1 || res.Failed[0].TaskID != "t3" || !want.MatchString(res.Failed[0].Msg) {
		for _, f := range res.Failed {
			t.Logf("failed: %s", f.Error())
		}
		t.Fatalf("want exactly task t3 failed with %q", want)
	}
	if n := res.Policies[0].Float("samples"); n != 7 {
		t.Errorf("trained %v samples, want the 7 honest ones", n)
	}
}

func killForgeDaemons(dir string) {
	files, _ := filepath.Glob(filepath.Join(dir, "*.pid"))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// TestForgeChildHelper is not a test: it is the forging child of the tests above, started by
// the host with its channel on forgeHostFDs.
func TestForgeChildHelper(t *testing.T) {
	args := flag.Args()
	if len(args) != 4 || args[0] != "forge" {
		t.Skip("the forging sandbox child of TestSandboxForgedChild; it runs only as their child")
	}
	os.Exit(forgeChild(args[1], args[2], args[3]))
}

// forgeChild runs the real child behind a proxy that forges messages to the host in mode.
func forgeChild(mode, mem, pidDir string) int {
	hostIn, hostOut := os.NewFile(uintptr(forgeHostFDs[0]), "host-in"), os.NewFile(uintptr(forgeHostFDs[1]), "host-out")
	// The real child gets its channel both as fds 3 and 4 and as stdin and stdout.
	toR, toW, _ := os.Pipe()
	fromR, fromW, _ := os.Pipe()
	exe, _ := os.Executable()
	child := exec.Command(exe)
	child.Env = append(os.Environ(), sandbox.ChildEnv+"="+mem)
	child.Stdin, child.Stdout, child.Stderr = toR, fromW, os.Stderr
	child.ExtraFiles = []*os.File{toR, fromW}
	if err := child.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "forge: start the child:", err)
		return 2
	}
	toR.Close()
	fromW.Close()

	var outMu sync.Mutex
	write := func(m sandbox.Msg) {
		b, _ := json.Marshal(m)
		outMu.Lock()
		hostOut.Write(append(b, '\n'))
		outMu.Unlock()
	}
	var mu sync.Mutex
	pending := map[int64]bool{} // rollouts the real child has not reported
	var t3 int64
	forged := false
	forge := func(neighbour int64) {
		id := t3
		switch mode {
		case "calls", "tokens", "n":
			n, calls, maxTokens := 1, 1, 1
			switch mode {
			case "calls":
				calls = 40
			case "tokens":
				maxTokens = 100_000
			case "n":
				n = 200_000
			}
			for i := range calls {
				g := sandbox.Generate{Policy: "p", Req: engines.GenerateRequest{ID: fmt.Sprintf("t3/9%d", i),
					Messages: []engines.Message{{Role: "user", Content: "forged"}}, N: n, Sampling: engines.Sampling{MaxTokens: maxTokens}}}
				args, _ := json.Marshal(g)
				write(sandbox.Msg{T: "call", ID: 1<<40 + int64(i), Rollout: id, Method: "generate", Args: args})
			}
		case "render", "turns":
			rq := sandbox.Render{Policy: "p", Reqs: []engines.RenderRequest{{Messages: []engines.Message{{Role: "user", Content: "hi"}}, AddGenerationPrompt: true}}}
			calls := 40
			if mode == "render" {
				rq.Reqs[0].Tools, calls = []string{strings.Repeat("x", 100_000)}, 1
			}
			args, _ := json.Marshal(rq)
			for i := range calls {
				write(sandbox.Msg{T: "call", ID: 1<<40 + int64(i), Rollout: id, Method: "render", Args: args})
			}
		case "train":
			if neighbour != 0 {
				id = neighbour
			}
			d, _ := json.Marshal(sandbox.Done{Queued: []sandbox.Queued{{ID: "t3/77#0", Group: "g"}}, Rewards: map[string]float64{"t3/77#0": 1000}})
			write(sandbox.Msg{T: "done", ID: id, Result: d})
		case "events":
			line, _ := json.Marshal(strings.Repeat("x", 1000))
			for range 40 {
				write(sandbox.Msg{T: "note", Rollout: id, Method: "event", Args: line})
			}
		case "unknown":
			args, _ := json.Marshal("k")
			write(sandbox.Msg{T: "call", ID: 1 << 40, Rollout: 1000, Method: "state_get", Args: args})
		case "daemon":
			// A process that holds the child's pipes outlives it.
			d := exec.Command("/bin/sleep", "30")
			d.Stdin, d.Stdout, d.Stderr = os.Stdin, os.Stdout, os.Stderr
			d.ExtraFiles = []*os.File{hostIn, hostOut}
			d.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			if d.Start() == nil {
				os.WriteFile(filepath.Join(pidDir, strconv.Itoa(d.Process.Pid)+".pid"), []byte(strconv.Itoa(d.Process.Pid)), 0o644)
			}
			child.Process.Kill()
			os.Exit(1)
		}
	}
	// The host's messages go to the child; t3's rollout sets off the forgery. A report forged
	// for a neighbour waits for one a little, holding t3 back meanwhile; with none, t3's own
	// report is forged before the child sees t3.
	var held []byte
	release := func(neighbour int64) { // under mu
		forged = true
		forge(neighbour)
		if held != nil {
			toW.Write(held)
			held = nil
		}
	}
	go func() {
		r := bufio.NewReaderSize(hostIn, 1<<20)
		for {
			line, err := r.ReadBytes('\n')
			var m sandbox.Msg
			if len(line) > 0 && json.Unmarshal(line, &m) == nil && m.T == "rollout" {
				var a sandbox.Rollout
				json.Unmarshal(m.Args, &a)
				mu.Lock()
				pending[m.ID] = true
				isT3 := a.Task.ID == "t3"
				if isT3 {
					t3 = m.ID
				}
				switch {
				case t3 == 0 || forged:
					toW.Write(line)
				case mode != "train":
					toW.Write(line)
					release(0)
				case !isT3: // a neighbour came after t3
					toW.Write(line)
					release(m.ID)
				default:
					var neighbour int64
					for id := range pending {
						if id != t3 {
							neighbour = id
						}
					}
					if neighbour != 0 {
						toW.Write(line)
						release(neighbour)
						break
					}
					held = line
					time.AfterFunc(200*time.Millisecond, func() {
						mu.Lock()
						defer mu.Unlock()
						if !forged {
							release(0)
						}
					})
				}
				mu.Unlock()
			} else if len(line) > 0 {
				toW.Write(line)
			}
			if err != nil {
				toW.Close()
				return
			}
		}
	}()
	// The child's messages go to the host.
	r := bufio.NewReaderSize(fromR, 1<<20)
	for {
		line, err := r.ReadBytes('\n')
		if len(line) > 0 {
			var m sandbox.Msg
			if json.Unmarshal(line, &m) == nil && m.T == "done" {
				mu.Lock()
				delete(pending, m.ID)
				mu.Unlock()
			}
			outMu.Lock()
			hostOut.Write(line)
			outMu.Unlock()
		}
		if err != nil {
			break
		}
	}
	child.Wait()
	return 0
}

// TestSandboxChildEnv: a child gets its limits and what it needs to run (PATH, HOME, …), not the
// host's environment with its tokens and keys; and its channel is on fds 3 and 4.
func TestSandboxChildEnv(t *testing.T) {
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	t.Setenv("SLIMEN_TEST_HOST_SECRET", "s3cret")
	t.Setenv("LD_PRELOAD", "")
	dir := t.TempDir()
	// Records what it got, then answers as a child whose script failed to load.
	probe := []string{"/bin/sh", "-c", `env > "$0/env"; [ -e /proc/$$/fd/3 ] && [ -e /proc/$$/fd/4 ] && echo yes > "$0/fds"; read a <&3; echo '{"t":"fatal","error":"probe"}' >&4`, dir}
	cfg := testConfig(1, "p")
	cfg.Sandbox.CPUSeconds = 7
	_, err := Load(context.Background(), writeScript(t, forgeScript), Options{Config: cfg, Tasks: numberedTasks(1),
		Engines: map[string]engines.Engine{"p": scripted.Echo("x")}, Sandbox: true, SandboxCommand: probe})
	if err == nil || !strings.Contains(err.Error(), "probe") {
		t.Fatalf("Load: %v, want the probe's error", err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "env"))
	env := string(b)
	for _, want := range []string{sandbox.ChildEnv + "=", sandbox.CPUEnv + "=7", "PATH="} {
		if !strings.Contains(env, want) {
			t.Errorf("the child's environment lacks %s:\n%s", want, env)
		}
	}
	for _, not := range []string{"SLIMEN_TEST_HOST_SECRET", "LD_PRELOAD"} {
		if strings.Contains(env, not) {
			t.Errorf("the child's environment has the host's %s:\n%s", not, env)
		}
	}
	if fds, _ := os.ReadFile(filepath.Join(dir, "fds")); strings.TrimSpace(string(fds)) != "yes" {
		t.Errorf("the child has no channel on fds 3 and 4")
	}
}

// TestSandboxReportBounds: a child's report that rewards or advantages a completion the host did
// generate with a value out of scale fails its rollout at the host, as reward() and train() fail
// in the child: one forged report cannot NaN the step's loss.
func TestSandboxReportBounds(t *testing.T) {
	r := loadRun(t, "def rollout(task):\n    pass\n", testConfig(1, "p"), map[string]engines.Engine{"p": scripted.Echo("x")}, listTasks{{ID: "t1", Prompt: "q"}})
	for _, d := range []func(id string) sandbox.Done{
		func(id string) sandbox.Done {
			return sandbox.Done{Rewards: map[string]float64{id: 1e300}, Queued: []sandbox.Queued{{ID: id, Group: "g"}}}
		},
		func(id string) sandbox.Done {
			return sandbox.Done{Rewards: map[string]float64{id: 1}, Queued: []sandbox.Queued{{ID: id, Group: "g", Advantage: []float64{1e300}, HasAdv: true}}}
		},
	} {
		ro := &script.Rollout{Task: Task{ID: "t1"}}
		req := engines.GenerateRequest{ID: "t1/0", Messages: []engines.Message{{Role: "user", Content: "q"}}, N: 1}
		cs := script.CompletionsOf("p", req, []engines.Completion{{RequestID: "t1/0", Tokens: []int32{1}, Logprobs: []float32{-1}, Text: "x"}})
		ro.Note(cs[0])
		err := r.applyReport(ro, d(cs[0].ID()))
		if err == nil || !strings.Contains(err.Error(), "at most 1e+06 in magnitude") {
			t.Errorf("report %+v: %v, want it refused", d(cs[0].ID()), err)
		}
		if len(ro.Queued()) != 0 {
			t.Errorf("a refused report queued %d samples", len(ro.Queued()))
		}
	}
}
