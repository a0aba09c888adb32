package host

import (
	"context"
	"fmt"
	"runtime"
	"syscall"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
)

// BenchmarkDebateStep measures the host's own cost of one step of one debate a task (3 agents, 2
// critic rounds: 32 tasks, 9 generate calls each; the example plays six a task) on scripted
// engines that answer at once: script execution, dispatch, advantages and bookkeeping, in-process
// and sandboxed (rollouts in child processes).
//
//	go test ./host -run '^$' -bench DebateStep -benchtime 20x
func BenchmarkDebateStep(b *testing.B) {
	const oneDebate = `load("@graphs//debate.star", "debate")

def rollout(task):
    debate(task, generator = "generator", critic = "critic", agents = 3, rounds = 2)
`
	for _, sandbox := range []bool{false, true} {
		b.Run(fmt.Sprintf("sandbox=%v", sandbox), func(b *testing.B) {
			answer := func(r scripted.Request) string { return fmt.Sprintf(`\boxed{%d}`, r.Seed%3) }
			cfg := testConfig(32, "generator", "critic")
			cfg.Sandbox.Train = []string{"generator", "critic"}
			r, err := Load(context.Background(), writeScript(b, oneDebate), Options{Config: cfg, Tasks: numberedTasks(32),
				Engines: map[string]engines.Engine{"generator": scripted.New(answer), "critic": scripted.New(answer)}, Sandbox: sandbox})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				res, err := r.Step(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				if len(res.Failed) > 0 {
					b.Fatal(res.Failed[0])
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/32, "µs/rollout")
		})
	}
}

// BenchmarkExamSwarmEight measures one step of the exam swarm with eight agents
// (examples/exam_swarm/exam_swarm8.star) on the embedded engine: as LoRA adapters on one base
// with the agents' generate batches sent as one engine batch (lora8-cross) or policy by policy
// (lora8-per-policy), and as eight full copies (full8). heap-MB is the Go heap in use after the
// steps; engine-batches/step counts the generate batches that reached an engine; cpu-ms/step is
// the process's CPU time (steadier than the wall time on a shared machine).
//
//	go test ./host -run '^$' -bench ExamSwarmEight -benchtime 4x -count 3
func BenchmarkExamSwarmEight(b *testing.B) {
	for _, c := range []struct {
		name, cfg string
		cross     bool
	}{{"lora8-cross", "config_lora8.yaml", true}, {"lora8-per-policy", "config_lora8.yaml", false}, {"full8", "config_full8.yaml", false}} {
		b.Run(c.name, func(b *testing.B) {
			cfg, err := config.Load("../examples/exam_swarm/" + c.cfg)
			if err != nil {
				b.Fatal(err)
			}
			r, err := Load(context.Background(), "../examples/exam_swarm/exam_swarm8.star", Options{Config: cfg, Out: b.TempDir(), perPolicyBatches: !c.cross})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			step := func() {
				res, err := r.Step(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				if len(res.Failed) > 0 {
					b.Fatal(res.Failed[0])
				}
			}
			step() // warm-up: the first step allocates the engines' buffers
			batches := func() int {
				if c.cross {
					n := 0
					for _, bt := range r.pols.adapterBatchers {
						bt.mu.Lock()
						n += bt.batches
						bt.mu.Unlock()
					}
					return n
				}
				n := 0
				for _, p := range r.pols.byName {
					k, _ := p.disp.stats()
					n += k
				}
				return n
			}
			before := batches()
			cpu := func() float64 {
				var ru syscall.Rusage
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
				return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e6
			}
			cpu0 := cpu()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				step()
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/step")
			b.ReportMetric((cpu()-cpu0)/float64(b.N), "cpu-ms/step")
			b.ReportMetric(float64(batches()-before)/float64(b.N), "engine-batches/step")
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			b.ReportMetric(float64(ms.HeapInuse)/(1<<20), "heap-MB")
		})
	}
}
