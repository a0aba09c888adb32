package host

import (
	"context"
	"fmt"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// BenchmarkDebateStep measures the host's own cost of one step of the debate example (32 tasks,
// 9 generate calls each) on scripted engines that answer at once: script execution, dispatch,
// advantages and bookkeeping, in-process and sandboxed (rollouts in child processes).
//
//	go test ./host -run '^$' -bench DebateStep -benchtime 20x
func BenchmarkDebateStep(b *testing.B) {
	for _, sandbox := range []bool{false, true} {
		b.Run(fmt.Sprintf("sandbox=%v", sandbox), func(b *testing.B) {
			answer := func(r scripted.Request) string { return fmt.Sprintf(`\boxed{%d}`, r.Seed%3) }
			cfg := testConfig(32, "generator", "critic")
			cfg.Sandbox.Train = []string{"generator", "critic"}
			r, err := Load(context.Background(), "../examples/debate/debate.star", Options{Config: cfg, Tasks: numberedTasks(32),
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
