package starlib

import (
	"fmt"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// Vote is @slimen//vote.star: majority voting over answers, as consensus topologies need.
var Vote = &starlarkstruct.Module{
	Name: "vote",
	Members: starlark.StringDict{
		"majority": starlark.NewBuiltin("vote.majority", voteMajority),
		"counts":   starlark.NewBuiltin("vote.counts", voteCounts),
	},
}

// ballot is one distinct answer: its key, the first value that had it, and its votes.
type ballot struct {
	key, first starlark.Value
	votes      int
}

// tally groups values by key (the value itself when key is nil) in order of first appearance.
// None values, and values whose key is None, abstain: no answer is not an answer.
func tally(thread *starlark.Thread, fn string, values starlark.Iterable, key starlark.Callable) ([]ballot, error) {
	index := starlark.NewDict(0)
	var ballots []ballot
	for i, v := range collect(values) {
		if v == starlark.None {
			continue
		}
		k := v
		if key != nil {
			var err error
			if k, err = starlark.Call(thread, key, starlark.Tuple{v}, nil); err != nil {
				return nil, fmt.Errorf("%s: key of element %d: %w", fn, i, err)
			}
			if k == starlark.None {
				continue
			}
		}
		at, found, err := index.Get(k)
		if err != nil {
			return nil, fmt.Errorf("%s: element %d: %v (vote on strings or numbers)", fn, i, err)
		}
		if found {
			n, _ := starlark.AsInt32(at)
			ballots[n].votes++
			continue
		}
		if err := index.SetKey(k, starlark.MakeInt(len(ballots))); err != nil {
			return nil, fmt.Errorf("%s: element %d: %v", fn, i, err)
		}
		ballots = append(ballots, ballot{key: k, first: v, votes: 1})
	}
	return ballots, nil
}

// winner returns the index of the ballot with most votes; pick(n) chooses among n tied ballots
// (in order of first appearance) and is only called when there is a tie.
func winner(ballots []ballot, pick func(n int) (int, error)) (int, error) {
	best := 0
	var tied []int
	for i, b := range ballots {
		switch {
		case b.votes > best:
			best, tied = b.votes, []int{i}
		case b.votes == best:
			tied = append(tied, i)
		}
	}
	if len(tied) == 1 {
		return tied[0], nil
	}
	i, err := pick(len(tied))
	if err != nil {
		return 0, err
	}
	return tied[i], nil
}

// voteMajority returns the most frequent answer, None when there is none. A tie draws from the
// rollout's seeded generator, so it is random across tasks yet identical on a rerun; only ties
// need the generator. With key (e.g. answers.normalize) answers vote by key and the first answer
// of the winning key is returned.
func voteMajority(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		values starlark.Iterable
		key    starlark.Callable
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "values", &values, "key??", &key); err != nil {
		return nil, err
	}
	ballots, err := tally(thread, b.Name(), values, key)
	if err != nil || len(ballots) == 0 {
		return starlark.None, err
	}
	i, err := winner(ballots, func(n int) (int, error) {
		r, ok := randomOf(thread)
		if !ok {
			return 0, fmt.Errorf("%s: %d answers tie and this thread has no random generator to break the tie; "+
				"call it from rollout(task), where the host seeds one", b.Name(), n)
		}
		return int(r.intN(uint64(n))), nil
	})
	if err != nil {
		return nil, err
	}
	return ballots[i].first, nil
}

// voteCounts returns {answer: votes} in order of first appearance, None abstaining as in majority.
func voteCounts(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		values starlark.Iterable
		key    starlark.Callable
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "values", &values, "key??", &key); err != nil {
		return nil, err
	}
	ballots, err := tally(thread, b.Name(), values, key)
	if err != nil {
		return nil, err
	}
	out := starlark.NewDict(len(ballots))
	for _, bl := range ballots {
		if err := out.SetKey(bl.key, starlark.MakeInt(bl.votes)); err != nil {
			return nil, err
		}
	}
	return out, nil
}
