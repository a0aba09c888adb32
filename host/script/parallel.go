package script

import (
	"fmt"
	"sync"

	"go.starlark.net/starlark"
)

// builtinParallel runs fn(item) for every item, each on its own thread, and returns the results in
// order. The first failing item (in item order) fails the call with its own backtrace. fn (with
// the values it captures) and the items are frozen first.
func builtinParallel(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := stateOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	var fn starlark.Callable
	var items starlark.Iterable
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "fn", &fn, "items", &items); err != nil {
		return nil, err
	}
	// Threads share fn's captured values and the items: freezing them makes the sharing safe
	// (a frozen value cannot change under another thread).
	fn.Freeze()
	var xs []starlark.Value
	iter := items.Iterate()
	var x starlark.Value
	for iter.Next(&x) {
		if err := ts.ro.Budget.parallel(b.Name(), len(xs)+1); err != nil {
			iter.Done()
			return nil, err
		}
		if len(xs) >= maxParallelItems {
			iter.Done()
			return nil, fmt.Errorf("%s: more than %d items; split the work", b.Name(), maxParallelItems)
		}
		x.Freeze()
		xs = append(xs, x)
	}
	iter.Done()
	base := ts.next()
	ro := ts.ro
	results := make([]starlark.Value, len(xs))
	errs := make([]error, len(xs))
	sem := make(chan struct{}, parallelWidth)
	var wg sync.WaitGroup
	ro.Host.Running(len(xs) - 1) // children count as running before the parent stops running
	for i := range xs {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			defer ro.Host.Running(-1)
			child := ro.NewThread(append(append([]int(nil), base...), i))
			results[i], errs[i] = ro.Call(child, fn, starlark.Tuple{xs[i]})
		}(i)
	}
	wg.Wait()
	ro.Host.Running(1)
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("%s: item %d: %s", b.Name(), i, ErrorText(err))
		}
	}
	return starlark.NewList(results), nil
}

const (
	maxParallelItems = 100_000
	parallelWidth    = 4096 // items running at once; more wait their turn
)
