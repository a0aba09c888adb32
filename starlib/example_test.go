package starlib_test

import (
	"fmt"

	"github.com/slimen/slimen/starlib"
	"go.starlark.net/starlark"
)

func ExampleEqual() {
	fmt.Println(starlib.Equal(`\dfrac{1}{2}`, "0.5"), starlib.Equal(`\left( 1, 2 \right).`, "(1,2)"), starlib.Equal("-3", "3"))
	// Output: true true false
}

func ExampleGrade() {
	response := `<think>2 + 2 is \boxed{5}?</think> No: \boxed{4}`
	for _, mode := range []string{starlib.GradeMath, starlib.GradeDeepscaler, starlib.GradeDAPO} {
		score, _ := starlib.Grade(response, starlib.TextLabel("4"), mode, starlib.GradeOptions{})
		fmt.Println(mode, score)
	}
	// Output:
	// math 1
	// deepscaler 1
	// dapo -1
}

// A host gives each rollout thread a generator seeded from the run seed, the step and the task.
func ExampleSetRandom() {
	thread := &starlark.Thread{
		Load: func(_ *starlark.Thread, module string) (starlark.StringDict, error) {
			m, _ := starlib.Module("slimen", "random.star")
			return m, nil
		},
	}
	starlib.SetRandom(thread, starlib.TaskSeed(1, 0, "task-0"))
	g, err := starlark.ExecFile(thread, "x.star", `
load("@slimen//random.star", "randint")
roll = randint(1, 6)
`, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	roll, _ := starlark.AsInt32(g["roll"])
	fmt.Println(roll >= 1 && roll <= 6)
	// Output: true
}
