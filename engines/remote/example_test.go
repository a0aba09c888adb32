package remote_test

import (
	"context"
	"fmt"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
)

// A host uses a remote engine like any other engines.Engine. Here the engine is served on
// loopback in the same process, as `slimen serve` would serve it from another one.
func Example() {
	l, err := server.Listen("127.0.0.1:0", server.Options{})
	if err != nil {
		panic(err)
	}
	srv := server.New(newFake(), server.Options{})
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	ctx := context.Background()
	eng, err := remote.Dial(ctx, remote.Options{Address: l.Addr().String()})
	if err != nil {
		panic(err)
	}
	defer eng.Close()
	comps, err := eng.Generate(ctx, []engines.GenerateRequest{{
		ID:       "run-1/step-1/task-7/0", // stable across resends: answered once
		Messages: []engines.Message{{Role: "user", Content: "2+2?"}},
		N:        2,
		Sampling: engines.Sampling{MaxTokens: 16, Temperature: 1, Seed: 1},
	}})
	if err != nil {
		panic(err)
	}
	for _, c := range comps {
		fmt.Println(c.Index, c.Text, c.FinishReason)
	}
	// Output:
	// 0 2+2?→0 stop
	// 1 2+2?→1 stop
}
