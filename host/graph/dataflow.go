package graph

import (
	"fmt"
	"regexp"
	"sort"
)

// Call is one generate call of a traced rollout: its policy, the text of its prompt and what its
// completions answered. The tracer (host.Trace) has every policy answer with a unique marker (a
// number of five or more digits starting with 9, e.g. \boxed{90001}); a marker found in a later
// prompt is an edge from the completion that produced it to that call, however the script
// carried it (whole text, boxed answer, tag contents).
type Call struct {
	Policy  string
	Prompt  string
	Outputs []string
}

var marker = regexp.MustCompile(`\b9\d{4,}\b`)

// Dataflow builds the graph of one traced rollout from its calls in call-tree order (every call
// after the calls that feed it). Nodes are calls grouped by policy and round, the round being the
// length of the longest chain of calls that feeds the call; an edge's count is how many
// completions of its source node reached prompts of its target node.
func Dataflow(title string, calls []Call) Graph {
	type output struct{ call, index int }
	byMarker := map[string]output{}
	for k, c := range calls {
		for i, text := range c.Outputs {
			for _, m := range marker.FindAllString(text, -1) {
				byMarker[m] = output{k, i}
			}
		}
	}
	rounds := make([]int, len(calls))
	sources := make([]map[output]bool, len(calls)) // the completions of earlier calls seen in a prompt
	for k, c := range calls {
		sources[k] = map[output]bool{}
		for _, m := range marker.FindAllString(c.Prompt, -1) {
			if o, ok := byMarker[m]; ok && o.call != k {
				sources[k][o] = true
				rounds[k] = max(rounds[k], rounds[o.call]+1)
			}
		}
	}
	g := Graph{Title: title}
	index := map[string]int{} // node id → position in g.Nodes
	nodeOf := func(k int) string { return fmt.Sprintf("%s_r%d", calls[k].Policy, rounds[k]) }
	// An edge counts the completions of its source box that reached any prompt of its target
	// box, each once however many prompts it reached.
	edges := map[[2]string]map[output]bool{}
	ncalls := map[string]int{}
	for k, c := range calls {
		id := nodeOf(k)
		i, ok := index[id]
		if !ok {
			i = len(g.Nodes)
			index[id] = i
			g.Nodes = append(g.Nodes, Node{ID: id, Policy: c.Policy, Round: rounds[k]})
		}
		g.Nodes[i].Samples += len(c.Outputs)
		ncalls[id]++
		for o := range sources[k] {
			e := [2]string{nodeOf(o.call), id}
			if edges[e] == nil {
				edges[e] = map[output]bool{}
			}
			edges[e][o] = true
		}
	}
	for i := range g.Nodes {
		n := &g.Nodes[i]
		n.Label = fmt.Sprintf("%d generate calls", ncalls[n.ID])
		if ncalls[n.ID] == 1 {
			n.Label = "1 generate call"
		}
	}
	for e, outs := range edges {
		g.Edges = append(g.Edges, Edge{From: e[0], To: e[1], Count: len(outs)})
	}
	sort.Slice(g.Edges, func(i, j int) bool {
		if g.Edges[i].From != g.Edges[j].From {
			return g.Edges[i].From < g.Edges[j].From
		}
		return g.Edges[i].To < g.Edges[j].To
	})
	return g
}
