package host

import (
	"fmt"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/synthetic"
)

type arithTasks struct{ a synthetic.Arith }

func (s arithTasks) Task(i int) (Task, error) {
	p := s.a.Problem(i)
	return Task{ID: p.ID, Prompt: p.Prompt, Label: p.Label, HasLabel: true}, nil
}

func openTasks(c *config.Config) (TaskSource, error) {
	a, ok, err := synthetic.ParseSpec(c.Data.Path, c.Run.Seed)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("data: %s: JSONL sources arrive with host/data", c.Data.Path)
	}
	return arithTasks{a}, nil
}
