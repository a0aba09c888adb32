package remote_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
)

// BenchmarkGenerate measures what going through the protocol adds to a small generate call:
// the same fake engine in-process and behind a server on loopback. "serial" is one caller
// waiting for each answer (latency); "batch32" sends 32 requests a call, as the host's dispatcher
// does; "parallel" is many callers sharing the client's stream.
func BenchmarkGenerate(b *testing.B) {
	ctx := context.Background()
	var seq atomic.Int64
	req := func() []engines.GenerateRequest {
		return []engines.GenerateRequest{chat(fmt.Sprint("b-", seq.Add(1)), "2+2?", 1)}
	}
	local := newFake()
	c := dial(b, remote.Options{Address: serve(b, newFake(), server.Options{})})
	for _, eng := range []struct {
		name string
		e    engines.Engine
	}{{"inprocess", local}, {"remote", c}} {
		b.Run(eng.name+"/serial", func(b *testing.B) {
			for b.Loop() {
				if _, err := eng.e.Generate(ctx, req()); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(eng.name+"/batch32", func(b *testing.B) {
			// As the host sends them: the calls of many rollouts coalesced into one.
			for b.Loop() {
				reqs := make([]engines.GenerateRequest, 0, 32)
				for range 32 {
					reqs = append(reqs, req()...)
				}
				if _, err := eng.e.Generate(ctx, reqs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(32*b.N), "ns/request")
		})
		b.Run(eng.name+"/parallel", func(b *testing.B) {
			b.SetParallelism(8)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := eng.e.Generate(ctx, req()); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkTrain measures a small optimizer step through the protocol (unary call, id check).
func BenchmarkTrain(b *testing.B) {
	ctx := context.Background()
	c := dial(b, remote.Options{Address: serve(b, newFake(), server.Options{})})
	i := 0
	for b.Loop() {
		i++
		if _, err := c.Train(ctx, batch(fmt.Sprint("s", i))); err != nil {
			b.Fatal(err)
		}
	}
}
