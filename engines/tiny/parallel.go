package tiny

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// parallelFor calls fn(lo, hi) over consecutive pieces of [0, n), of at most grain indices each,
// on up to threads goroutines. Callers compute every index independently of the others, so
// results never depend on how the range was split or scheduled; that is what makes the engine
// deterministic for any number of threads.
func parallelFor(threads, n, grain int, fn func(lo, hi int)) {
	if n <= 0 {
		return
	}
	grain = max(grain, 1)
	pieces := (n + grain - 1) / grain
	if threads <= 1 || pieces == 1 {
		fn(0, n)
		return
	}
	workers := min(threads, pieces)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				p := int(next.Add(1)) - 1
				if p >= pieces {
					return
				}
				fn(p*grain, min((p+1)*grain, n))
			}
		})
	}
	wg.Wait()
}

// defaultThreads is the number of goroutines the engine uses when Options.Threads is 0.
func defaultThreads() int { return runtime.GOMAXPROCS(0) }
