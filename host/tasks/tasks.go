// Package tasks holds a run's tasks: the Task type, the sources that yield them (JSONL files and
// the built-in synthetic tasks, synthetic:arith) and the pretraining corpus of builtin:tiny-arith
// drawn from the synthetic ones. A source is an indexed, deterministic stream of tasks; the host
// turns each Task into the Starlark `task` a rollout receives.
package tasks

import (
	"fmt"
	"strings"
)

// Task is one unit of work for rollout(task).
type Task struct {
	// ID is stable across runs and epochs: a file's "id" key, else "<file name>-<line>"; for
	// synthetic tasks, the problem's id.
	ID string
	// Prompt is a string (one user turn) or a []engines.Message (a chat).
	Prompt any
	// Label is the reference answer; HasLabel is false when the task has none (None in Starlark).
	Label    string
	HasLabel bool
	// Metadata holds a JSONL line's other keys. Values are nil, bool, int64, float64, string,
	// []any or map[string]any. Each Task call returns its own top-level map; nested values are
	// shared, so treat them as read-only.
	Metadata map[string]any
	// Index is the task's position in the source's stream: the i of Source.Task(i).
	Index int
}

// Source is an indexed stream of tasks. Task(i) is a pure function of the source and i, safe to
// call from many goroutines.
type Source interface {
	// Name is the path the source was opened from.
	Name() string
	// Len is the number of distinct tasks (one epoch), or -1 for an endless source.
	Len() int
	// Task returns task i ≥ 0. A file wraps around: task Len()+k is an epoch later than task k.
	Task(i int) Task
	// Warnings lists the lines that were skipped and why, "file:line: what is wrong".
	Warnings() []string
}

// Options say how to read a source.
type Options struct {
	InputKey string // the JSONL key of the prompt; "" means "prompt"
	LabelKey string // the JSONL key of the label; "" means "label"
	// Keys is the config setting that holds InputKey and LabelKey, for messages; "" means "data"
	// (an eval dataset's is "eval.datasets[I]").
	Keys string
	// Seed seeds the synthetic generator (unless the path gives seed=) and the shuffle.
	Seed uint64
	// Shuffle visits a file's tasks in a new order every epoch, a pure function of Seed and the
	// epoch. Synthetic tasks are random already and ignore it.
	Shuffle bool
}

// EvalSeedOffset separates eval problems from training ones: an eval dataset on a synthetic
// source is opened with EvalSeed(seed), so its problems are not those the run trains on.
const EvalSeedOffset = 1_000_003

// EvalSeed is the seed to open eval datasets with in a run seeded with seed.
func EvalSeed(seed uint64) uint64 { return seed + EvalSeedOffset }

// Open opens a task source: "synthetic:arith[?difficulty=N&seed=S]" or a JSONL file (one JSON
// object per line). Malformed lines of a file are skipped and reported by Warnings; a missing
// file, or one without a single usable line, is an error.
func Open(path string, o Options) (Source, error) {
	s, err := openSource(path, o)
	if err != nil {
		return nil, &SourceError{err}
	}
	return s, nil
}

// SourceError is a task source that cannot be opened: bad input (exit status 2 in the CLI), not
// a failed run.
type SourceError struct{ Err error }

func (e *SourceError) Error() string { return e.Err.Error() }
func (e *SourceError) Unwrap() error { return e.Err }

func openSource(path string, o Options) (Source, error) {
	if o.InputKey == "" {
		o.InputKey = "prompt"
	}
	if o.LabelKey == "" {
		o.LabelKey = "label"
	}
	if o.Keys == "" {
		o.Keys = "data"
	}
	if s, ok, err := parseSynthetic(path, o.Seed); ok {
		if err != nil {
			return nil, fmt.Errorf("data: %w", err)
		}
		return s, nil
	}
	a, ok, err := ParseSpec(path, o.Seed)
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	if ok {
		return syntheticSource{path, func(i int) Task {
			p := a.Problem(i)
			return Task{ID: p.ID, Prompt: p.Prompt, Label: p.Label, HasLabel: true, Index: i,
				Metadata: map[string]any{"difficulty": int64(a.Difficulty)}}
		}}, nil
	}
	if strings.HasSuffix(path, ".parquet") {
		return nil, fmt.Errorf("data: %s: parquet is not read by slimen; convert it to JSONL (one JSON object per line)", path)
	}
	return openJSONL(path, o)
}

// Batch returns the tasks of a step: batchSize tasks from index step·batchSize on (steps count
// from 0). The same source, step and size give the same tasks.
func Batch(src Source, step, batchSize int) []Task {
	out := make([]Task, batchSize)
	for k := range out {
		out[k] = src.Task(step*batchSize + k)
	}
	return out
}

// EvalTasks returns the tasks of an eval pass: the first limit tasks, or the whole file when
// limit is 0, each once and in order.
func EvalTasks(src Source, limit int) ([]Task, error) {
	n := src.Len()
	switch {
	case n < 0 && limit <= 0:
		return nil, fmt.Errorf("data: %s never ends: give the eval dataset a limit", src.Name())
	case limit > 0 && (n < 0 || limit < n):
		n = limit
	}
	out := make([]Task, n)
	for i := range out {
		out[i] = src.Task(i)
	}
	return out, nil
}
