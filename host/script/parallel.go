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
	ts, err := blockingOf(thread, b.Name())
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
	if depth := (len(base) + 1) / 2; depth > maxParallelDepth { // a path grows by 2 a nesting: the call, the item
		return nil, fmt.Errorf("%s: parallel calls nested more than %d deep", b.Name(), maxParallelDepth)
	}
	ro := ts.ro
	results := make([]starlark.Value, len(xs))
	errs := make([]error, len(xs))
	run := func(i int) {
		child := ro.NewThread(append(append([]int(nil), base...), i))
		results[i], errs[i] = ro.Call(child, fn, starlark.Tuple{xs[i]})
	}
	// Each item runs on a thread of its own while the rollout has a thread slot free; an item
	// that finds none runs on the calling thread, so a rollout never has more threads running
	// than its slots allow (a fan-out nested a thousand wide stays a handful of threads), nested
	// calls cannot deadlock waiting for slots, and every item still runs on a Starlark thread of
	// its own call-tree position, so what it computes does not depend on where it ran.
	slots := ro.threadSlots()
	var wg sync.WaitGroup
	for i := range xs {
		select {
		case slots <- struct{}{}:
			ro.Host.Running(1) // counts as running before its parent stops running
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				defer func() { <-slots }()
				defer ro.Host.Running(-1)
				run(i)
			}(i)
		default:
			run(i)
		}
	}
	ro.Host.Running(-1)
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
	// maxRolloutThreads bounds the threads of one rollout running at once outside a sandbox
	// (inside one, sandbox.threads does).
	maxRolloutThreads = 4096
	// maxParallelDepth bounds how deep parallel calls nest: a thread's Starlark stack starts
	// empty, so recursion through parallel escapes Starlark's own recursion check.
	maxParallelDepth = 64
)
