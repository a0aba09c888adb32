package host

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// TracedCall is one generate call of a traced rollout: its policy, its prompt's text (the
// contents of its messages, one a line) and its completions' texts.
type TracedCall struct {
	Policy  string
	Prompt  string
	Outputs []string
}

// Trace runs one rollout of a script and returns its generate calls in call-tree order (a call
// after the calls it was made after), for `slimen graph` to draw the dataflow between them
// (host/graph's Dataflow). Every policy is scripted to answer with a unique marker, \boxed{N}
// with N from 90001 on, so a marker found in a later prompt shows which completion reached it.
func Trace(ctx context.Context, scriptPath string, cfg *config.Config, task Task) ([]TracedCall, error) {
	var next atomic.Int64
	next.Store(traceMarkerBase)
	marker := func(scripted.Request) string { return fmt.Sprintf(`\boxed{%d}`, next.Add(1)) }
	opts := Options{Config: cfg, Tasks: listSource{task},
		OpenEngine: func(context.Context, config.PolicyConfig) (engines.Engine, error) { return scripted.New(marker), nil }}
	if cfg != nil {
		c := *cfg
		c.Rollout.BatchSize = 1
		opts.Config = &c
	}
	r, err := Load(ctx, scriptPath, opts)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	ros, err := r.runRollouts(ctx, 1, []Task{task}, 1, rolloutFn{fn: r.script.Rollout(), name: "rollout"}, nil, -1)
	if err != nil {
		return nil, err
	}
	if ros[0].Err != nil {
		return nil, fmt.Errorf("the traced rollout failed:\n%s", indent(script.ErrorText(ros[0].Err)))
	}
	return tracedCalls(ros[0].Generated()), nil
}

const traceMarkerBase = 90000

// tracedCalls groups the completions of one traced rollout by their call, in call-tree order.
func tracedCalls(gen []*script.Completion) []TracedCall {
	sort.SliceStable(gen, func(i, j int) bool { return gen[i].Before(gen[j]) })
	var calls []TracedCall
	index := map[string]int{}
	for _, c := range gen {
		id, _, _ := strings.Cut(c.ID(), "#")
		k, ok := index[id]
		if !ok {
			var prompt strings.Builder
			for _, m := range c.Messages() {
				prompt.WriteString(m.Content)
				prompt.WriteByte('\n')
			}
			k = len(calls)
			index[id] = k
			calls = append(calls, TracedCall{Policy: c.Policy(), Prompt: prompt.String()})
		}
		calls[k].Outputs = append(calls[k].Outputs, c.Text())
	}
	return calls
}
