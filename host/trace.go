package host

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync/atomic"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/graph"
)

// Trace runs one rollout of a script and returns the dataflow between its policies
// (`slimen graph`). Every policy is scripted to answer with a unique marker, \boxed{N}; a marker
// found in a later prompt is an edge from the completion that produced it to that call, however
// the script carried it (whole text, boxed answer, tag contents). Nodes are generate calls
// grouped by policy and round, the round being the length of the longest chain of calls that
// feeds the call; an edge's count is how many completions of its source node reached prompts of
// its target node.
func Trace(ctx context.Context, scriptPath string, cfg *config.Config, task Task) (graph.Graph, error) {
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
		return graph.Graph{}, err
	}
	defer r.Close()
	ros, err := r.runRollouts(ctx, 1, []Task{task}, rolloutFn{fn: r.script.rollout, name: "rollout"}, nil)
	if err != nil {
		return graph.Graph{}, err
	}
	if ros[0].err != nil {
		return graph.Graph{}, fmt.Errorf("the traced rollout failed:\n%s", indent(scriptErrorText(ros[0].err)))
	}
	g := traceGraph(ros[0].generated)
	g.Title = fmt.Sprintf("%s: dataflow of one rollout", scriptPath)
	return g, nil
}

const traceMarkerBase = 90000

var traceMarker = regexp.MustCompile(`\b9\d{4,}\b`)

// traceGraph builds the graph from the completions of one traced rollout.
func traceGraph(gen []*Completion) graph.Graph {
	type call struct {
		id      string
		policy  string
		prompt  string
		comps   []*Completion
		sources map[*call]map[*Completion]bool // feeding call → its completions seen in the prompt
		round   int
	}
	calls := map[string]*call{}
	var order []*call
	byMarker := map[string]*Completion{}
	callOf := map[*Completion]*call{}
	sort.SliceStable(gen, func(i, j int) bool { return lessKey(gen[i].key, gen[j].key) })
	for _, c := range gen {
		id, _, _ := strings.Cut(c.id, "#")
		k := calls[id]
		if k == nil {
			var prompt strings.Builder
			for _, m := range c.messages {
				prompt.WriteString(m.Content)
				prompt.WriteByte('\n')
			}
			k = &call{id: id, policy: c.policy, prompt: prompt.String(), sources: map[*call]map[*Completion]bool{}}
			calls[id] = k
			order = append(order, k)
		}
		k.comps = append(k.comps, c)
		callOf[c] = k
		for _, m := range traceMarker.FindAllString(c.text, -1) {
			byMarker[m] = c
		}
	}
	// Calls are in call-tree order, so every source precedes the calls it feeds.
	for _, k := range order {
		for _, m := range traceMarker.FindAllString(k.prompt, -1) {
			c := byMarker[m]
			if src := callOf[c]; src != nil && src != k {
				if k.sources[src] == nil {
					k.sources[src] = map[*Completion]bool{}
				}
				k.sources[src][c] = true
				k.round = max(k.round, src.round+1)
			}
		}
	}
	var g graph.Graph
	index := map[string]int{} // node id → position in g.Nodes
	nodeOf := func(k *call) string { return fmt.Sprintf("%s_r%d", k.policy, k.round) }
	// An edge counts the completions of its source box that reached any prompt of its target
	// box, each once however many prompts it reached.
	edges := map[[2]string]map[*Completion]bool{}
	for _, k := range order {
		id := nodeOf(k)
		i, ok := index[id]
		if !ok {
			i = len(g.Nodes)
			index[id] = i
			g.Nodes = append(g.Nodes, graph.Node{ID: id, Policy: k.policy, Round: k.round})
		}
		g.Nodes[i].Samples += len(k.comps)
		for src, comps := range k.sources {
			e := [2]string{nodeOf(src), id}
			if edges[e] == nil {
				edges[e] = map[*Completion]bool{}
			}
			for c := range comps {
				edges[e][c] = true
			}
		}
	}
	ncalls := map[string]int{}
	for _, k := range order {
		ncalls[nodeOf(k)]++
	}
	for i := range g.Nodes {
		n := &g.Nodes[i]
		n.Label = fmt.Sprintf("%d generate calls", ncalls[n.ID])
		if ncalls[n.ID] == 1 {
			n.Label = "1 generate call"
		}
	}
	for e, comps := range edges {
		g.Edges = append(g.Edges, graph.Edge{From: e[0], To: e[1], Count: len(comps)})
	}
	sort.Slice(g.Edges, func(i, j int) bool {
		if g.Edges[i].From != g.Edges[j].From {
			return g.Edges[i].From < g.Edges[j].From
		}
		return g.Edges[i].To < g.Edges[j].To
	})
	return g
}
