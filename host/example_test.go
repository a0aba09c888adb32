package host_test

import (
	"context"
	"fmt"
	"strings"
	"testing/fstest"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
)

// answers is a scripted engine: policy "solver" answers every prompt with \boxed{5}. Leave
// Options.Engines out and the policies run on the embedded tiny engine instead.
func answers() map[string]engines.Engine {
	return map[string]engines.Engine{"solver": scripted.Echo(`\boxed{5}`)}
}

// tasks is a task source made in Go: task i asks for i+2 plus 3.
type tasks struct{}

func (tasks) Task(i int) host.Task {
	return host.Task{ID: fmt.Sprintf("t%d", i), Prompt: fmt.Sprintf("%d + 3?", i+2), Label: fmt.Sprint(i + 5), HasLabel: true}
}

// A script and the file it loads come from an fs.FS (here built in memory); two steps run and
// their metrics are read from what Step returns.
func ExampleLoad() {
	files := fstest.MapFS{
		"solve/solve.star": {Data: []byte(`
load("reward.star", "exact")

def rollout(task):
    cs = generate("solver", task.prompt, n = 2)
    for c in cs:
        reward(c, exact(c.text, task.label))
    train(cs)
`)},
		"solve/reward.star": {Data: []byte(`
load("@slimen//answers.star", "boxed")

def exact(text, label):
    return 1.0 if boxed(text) == label else 0.0
`)},
	}
	cfg := config.Default(nil)
	cfg.Rollout.BatchSize = 2
	r, err := host.Load(context.Background(), "solve/solve.star", host.Options{Config: cfg, FS: files, Engines: answers(), Tasks: tasks{}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	for range 2 {
		res, err := r.Step(context.Background())
		if err != nil {
			fmt.Println(err)
			return
		}
		for _, m := range res.Policies {
			fmt.Printf("step %d: %s reward_mean %.2f over %v samples\n", res.Step, m.Policy(), m.Float("reward_mean"), m.Float("samples"))
		}
	}
	// Output:
	// step 1: solver reward_mean 0.50 over 4 samples
	// step 2: solver reward_mean 0.00 over 4 samples
}

// A Go function becomes a built-in the script calls like generate or reward.
func ExampleOptions_builtins() {
	shout := starlark.NewBuiltin("shout", func(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
		var s string
		if err := starlark.UnpackArgs(b.Name(), args, kwargs, "s", &s); err != nil {
			return nil, err
		}
		return starlark.String(strings.ToUpper(s) + "!"), nil
	})
	files := fstest.MapFS{"shout.star": {Data: []byte(`
def rollout(task):
    c = generate("solver", shout(task.prompt))
    reward(c, 1.0)
    train(c)
    return c.text
`)}}
	cfg := config.Default(nil)
	cfg.Rollout.BatchSize = 1
	eng := scripted.Echo("ok")
	r, err := host.Load(context.Background(), "shout.star", host.Options{Config: cfg, FS: files, Tasks: tasks{},
		Engines: map[string]engines.Engine{"solver": eng}, Builtins: starlark.StringDict{"shout": shout}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	if _, err := r.Step(context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(eng.Calls()[0][0].Messages[0].Content)
	// Output: 2 + 3?!
}

// Tasks come from Go: any type with Task(i int) host.Task. Train runs every step up to run.steps.
func ExampleOptions_tasks() {
	files := fstest.MapFS{"add.star": {Data: []byte(`
load("@slimen//answers.star", "boxed")

def rollout(task):
    c = generate("solver", task.prompt)
    reward(c, 1.0 if boxed(c.text) == task.label else 0.0)
    train(c)
    log(task_number = int(task.id[1:]))
`)}}
	cfg := config.Default(nil)
	cfg.Rollout.BatchSize, cfg.Run.Steps = 3, 2
	r, err := host.Load(context.Background(), "add.star", host.Options{Config: cfg, FS: files, Engines: answers(), Tasks: tasks{},
		AfterStep: func(_ *host.Run, res *host.StepResult) {
			fmt.Printf("step %d: accuracy %.2f, mean task number %.0f\n", res.Step, res.Policies[0].Float("reward_mean"), res.Run.Float("task_number"))
		}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	if err := r.Train(context.Background()); err != nil {
		fmt.Println(err)
	}
	// Output:
	// step 1: accuracy 0.33, mean task number 1
	// step 2: accuracy 0.00, mean task number 4
}
