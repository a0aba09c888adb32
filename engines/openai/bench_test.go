package openai

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// BenchmarkGenerateOverhead measures what the OpenAI front and client add to one generate call
// (one chat request, n = 1, 8 tokens at most): the same engine called directly, and through the
// client, JSON over loopback HTTP and the front. "tiny" is the embedded engine on
// builtin:tiny-arith (one thread), "echo" a scripted engine that does no work, so that its
// "front" line is the overhead alone. It reports the median and 99th percentile of a call.
//
//	go test ./engines/openai -run '^$' -bench GenerateOverhead -benchtime 2000x
func BenchmarkGenerateOverhead(b *testing.B) {
	ctx := context.Background()
	req := []engines.GenerateRequest{{ID: "b", Messages: []engines.Message{{Role: "user", Content: "12+30="}},
		Sampling: engines.Sampling{MaxTokens: 8, Temperature: 1, Seed: 1}}}
	for _, eng := range []struct {
		name string
		e    engines.Engine
	}{{"tiny", openTiny(b)}, {"echo", scripted.Echo("42")}} {
		c, err := Open(ctx, Options{BaseURL: front(b, eng.e, HandlerOptions{}), Model: modelName(b, eng.e)})
		if err != nil {
			b.Fatal(err)
		}
		for _, via := range []struct {
			name string
			e    engines.Engine
		}{{"direct", eng.e}, {"front", c}} {
			b.Run(eng.name+"/"+via.name, func(b *testing.B) {
				var took []time.Duration
				for b.Loop() {
					t0 := time.Now()
					if _, err := via.e.Generate(ctx, req); err != nil {
						b.Fatal(err)
					}
					took = append(took, time.Since(t0))
				}
				slices.Sort(took)
				b.ReportMetric(float64(took[len(took)/2].Nanoseconds())/1e3, "p50-µs")
				b.ReportMetric(float64(took[len(took)*99/100].Nanoseconds())/1e3, "p99-µs")
			})
		}
		c.Close()
	}
}

func modelName(b *testing.B, e engines.Engine) string {
	info, err := e.Info(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return info.Model
}
