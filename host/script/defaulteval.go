package script

import (
	"fmt"

	"go.starlark.net/starlark"
)

// defaultEvalSource is the eval of a script without eval_rollout(task). It grades every policy on
// the task: its greedy answer, and with n samples per prompt (n > 1) the mean accuracy at the
// dataset's temperature and pass@n.
const defaultEvalSource = `
load("@slimen//answers.star", "grade")

def default_eval(task):
    out = {}
    if task.label == None:
        return out
    for p in POLICIES:
        greedy = generate(p, task.prompt, temperature = 0)
        out[p + "/greedy_accuracy"] = grade(greedy.text, task.label, "math")
        if N > 1:
            scores = [grade(c.text, task.label, "math") for c in generate(p, task.prompt, n = N)]
            total = 0.0
            for s in scores:
                total += s
            out[p + "/accuracy"] = total / N
            out[p + "/pass@%d" % N] = max(scores)
    return out
`

// DefaultEval compiles the default eval function for the given policies and samples per task.
func DefaultEval(policies []string, n int) (starlark.Callable, error) {
	pre := predeclared()
	names := make([]starlark.Value, len(policies))
	for i, p := range policies {
		names[i] = starlark.String(p)
	}
	pre["POLICIES"] = starlark.Tuple(names) // shared by every eval rollout at once: immutable
	pre["N"] = starlark.MakeInt(n)
	l := newLoader("/", pre, false)
	g, err := l.execFile("<default eval>", []byte(defaultEvalSource))
	if err != nil {
		return nil, fmt.Errorf("default eval: %w", err)
	}
	g.Freeze()
	return g["default_eval"].(starlark.Callable), nil
}
