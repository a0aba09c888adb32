package host

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
)

// The batcher sends the batches of two adapters as one engine batch with the ids prefixed by the
// adapter and gives each caller its completions under its own ids; when the merged batch fails,
// each call is sent alone, so only the bad one fails.
func TestAdapterBatcherMergesAndIsolatesFailures(t *testing.T) {
	var mu sync.Mutex
	var sent [][]string
	gen := func(ctx context.Context, reqs []engines.GenerateRequest, adapters []string) ([]engines.Completion, error) {
		mu.Lock()
		sent = append(sent, adapters)
		mu.Unlock()
		var out []engines.Completion
		for i, r := range reqs {
			if strings.Contains(r.ID, "bad") {
				return nil, errors.New("bad request " + r.ID)
			}
			for k := range max(r.N, 1) {
				out = append(out, engines.Completion{RequestID: r.ID, Index: k, Text: adapters[i]})
			}
		}
		return out, nil
	}
	act := &activity{}
	b := newAdapterBatcher(gen, act)
	// A window no run waits out: the batches go because both adapters have one waiting, not because
	// a 20 ms timer ran out before the second goroutine got its call in (as it did under -race on a
	// loaded machine).
	b.window = time.Minute
	// Both policies' dispatchers are handing a batch over (as after a flush).
	da, db := &dispatcher{sending: true}, &dispatcher{sending: true}
	b.join("a", da)
	b.join("b", db)
	call := func(adapter string, ids ...string) ([]engines.Completion, error) {
		var reqs []engines.GenerateRequest
		for _, id := range ids {
			reqs = append(reqs, engines.GenerateRequest{ID: id, N: 2})
		}
		return b.generate(context.Background(), adapter, reqs)
	}
	run := func(aIDs, bIDs []string) (outA, outB []engines.Completion, errA, errB error) {
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); outA, errA = call("a", aIDs...) }()
		go func() { defer wg.Done(); outB, errB = call("b", bIDs...) }()
		wg.Wait()
		return
	}
	outA, outB, errA, errB := run([]string{"x"}, []string{"x", "y"})
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	if len(sent) != 1 || len(sent[0]) != 3 {
		t.Fatalf("engine batches %v; want one of 3 requests", sent)
	}
	if len(outA) != 2 || len(outB) != 4 || outA[0].RequestID != "x" || outA[0].Text != "a" || outB[2].RequestID != "y" || outB[2].Text != "b" {
		t.Errorf("completions: a %+v, b %+v", outA, outB)
	}
	sent = nil
	outA, _, errA, errB = run([]string{"z"}, []string{"bad"})
	if errA != nil || len(outA) != 2 || errB == nil || !strings.Contains(errB.Error(), "bad") {
		t.Errorf("after a failed merged batch: a %v (%d completions), b %v; want a served and b failed", errA, len(outA), errB)
	}
	if len(sent) != 3 {
		t.Errorf("engine batches %v; want the merged one, then each call alone", sent)
	}
}
