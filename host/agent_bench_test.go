package host

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// stampEngine records when each Generate call reaches the engine.
type stampEngine struct {
	*scripted.Engine
	mu    sync.Mutex
	times []time.Time
}

func (e *stampEngine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	e.mu.Lock()
	e.times = append(e.times, time.Now())
	e.mu.Unlock()
	return e.Engine.Generate(ctx, reqs)
}

// cpuTime is the user and system CPU time of who (syscall.RUSAGE_SELF or RUSAGE_CHILDREN).
func cpuTime(who int) time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(who, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// gaps are the times between consecutive engine calls of one sequential caller, sorted.
func (e *stampEngine) gaps() []time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []time.Duration
	for i := 1; i < len(e.times); i++ {
		out = append(out, e.times[i].Sub(e.times[i-1]))
	}
	slices.Sort(out)
	e.times = nil
	return out
}

func quantile(d []time.Duration, q float64) float64 {
	return float64(d[int(q*float64(len(d)-1))].Microseconds())
}

// BenchmarkAgentCallOverhead compares one rollout's sequential calls made two ways, on a scripted
// engine that answers at once: chat().generate in the script (direct), and chat-completions calls
// of an agent() program (Python's standard-library client, host/testdata/agent_client.py), both
// in conversations of 8 turns that continue their tokens. A call's cost is the time between two
// consecutive calls reaching the engine; the overhead of the proxy is the difference.
//
//	go test ./host -run '^$' -bench AgentCallOverhead -benchtime 3x
func BenchmarkAgentCallOverhead(b *testing.B) {
	if testing.Short() {
		b.Skip("starts Python")
	}
	needPython(b)
	prog, _ := filepath.Abs("testdata/agent_client.py")
	const calls = 200
	scripts := map[string]string{
		"direct": fmt.Sprintf(`
def rollout(task):
    for i in range(%d):
        if i %% 8 == 0:
            c = chat("p")
            c.user(task.prompt)
        c.generate(max_tokens = 4)
        c.user("more")
`, calls),
		"agent": fmt.Sprintf(`
def rollout(task):
    agent(["python3", %q, "bench", "%d"], task.prompt, policy = "p", max_calls = %d)
`, prog, calls, calls+1),
	}
	for _, name := range []string{"direct", "agent"} {
		b.Run(name, func(b *testing.B) {
			eng := &stampEngine{Engine: scripted.New(func(scripted.Request) string { return "ok" })}
			cfg := testConfig(1, "p")
			r := loadRun(b, scripts[name], cfg, map[string]engines.Engine{"p": eng}, listTasks{{ID: "a", Prompt: "What is 3 + 4?"}})
			var all []time.Duration
			for i := 0; i < b.N; i++ {
				res, err := r.Step(context.Background())
				if err != nil || len(res.Failed) > 0 {
					b.Fatal(err, res.Failed)
				}
				all = append(all, eng.gaps()...)
			}
			slices.Sort(all)
			b.ReportMetric(quantile(all, 0.5), "µs/call-p50")
			b.ReportMetric(quantile(all, 0.99), "µs/call-p99")
		})
	}
}

// BenchmarkAgentProcesses runs one step of N rollouts at once, each an agent() program (Python's
// standard-library client) making 8 calls with 0.5 s of its own work between them, on a scripted
// engine: how many external agent processes the host keeps going at once, and at what rate.
//
//	go test ./host -run '^$' -bench AgentProcesses -benchtime 1x
func BenchmarkAgentProcesses(b *testing.B) {
	if testing.Short() {
		b.Skip("starts Python")
	}
	needPython(b)
	prog, _ := filepath.Abs("testdata/agent_client.py")
	src := fmt.Sprintf(`
def rollout(task):
    agent(["python3", %q, "bench", "8", "0.5"], task.prompt, policy = "p", timeout = 600)
`, prog)
	for _, n := range []int{1, 16, 64, 128} {
		b.Run(fmt.Sprintf("procs=%d", n), func(b *testing.B) {
			eng := scripted.New(func(scripted.Request) string { return "ok" })
			cfg := testConfig(n, "p")
			r := loadRun(b, src, cfg, map[string]engines.Engine{"p": eng}, numberedTasks(n))
			self0, kids0 := cpuTime(syscall.RUSAGE_SELF), cpuTime(syscall.RUSAGE_CHILDREN)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				res, err := r.Step(context.Background())
				if err != nil || len(res.Failed) > 0 {
					b.Fatal(err, res.Failed)
				}
			}
			sec := b.Elapsed().Seconds() / float64(b.N)
			self, kids := cpuTime(syscall.RUSAGE_SELF)-self0, cpuTime(syscall.RUSAGE_CHILDREN)-kids0
			b.ReportMetric(sec, "s/step")
			b.ReportMetric(float64(8*n)/sec, "calls/s")
			// CPU, which the machine's other load does not inflate as it does wall time.
			b.ReportMetric(kids.Seconds()*1000/float64(n*b.N), "program-cpu-ms/process")
			b.ReportMetric(self.Seconds()*1e6/float64(8*n*b.N), "host-cpu-µs/call")
		})
	}
}
