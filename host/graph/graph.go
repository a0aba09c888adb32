// Package graph draws the dataflow between the policies of one rollout: which generate calls fed
// which prompts. The host traces a rollout into a Graph; this package renders it as a Mermaid
// flowchart (for Markdown) and as a standalone SVG (for a person to look at).
package graph

import (
	"fmt"
	"strings"
)

// Node is one generate call group: the calls of one policy at one round (0-based depth in the
// dataflow), with the number of samples they drew.
type Node struct {
	ID      string `json:"id"`
	Policy  string `json:"policy"`
	Round   int    `json:"round"`
	Label   string `json:"label,omitempty"` // an extra line under the policy, e.g. the call site
	Samples int    `json:"samples"`
}

// Edge says that completions of From had their text reach prompts of To. Count is how many
// completions of From did, each counted once however many prompts of To it reached.
type Edge struct {
	From  string `json:"from"`
	To    string `json:"to"`
	Count int    `json:"count"`
}

// Graph is the traced dataflow of one rollout.
type Graph struct {
	Title string `json:"title,omitempty"`
	Nodes []Node `json:"nodes"`
	Edges []Edge `json:"edges"`
}

// Check reports what the renderers would have to leave out or could not draw faithfully: node IDs
// that repeat, edges naming a node that is not there, negative rounds.
func (g Graph) Check() error {
	var problems []string
	seen := map[string]bool{}
	for i, n := range g.Nodes {
		if seen[n.ID] {
			problems = append(problems, fmt.Sprintf("node %d: id %q is used by an earlier node", i, n.ID))
		}
		seen[n.ID] = true
		if n.Round < 0 {
			problems = append(problems, fmt.Sprintf("node %q: round %d is negative", n.ID, n.Round))
		}
	}
	for i, e := range g.Edges {
		for _, end := range []string{e.From, e.To} {
			if !seen[end] {
				problems = append(problems, fmt.Sprintf("edge %d (%s -> %s): no node has id %q", i, e.From, e.To, end))
			}
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("graph %q: %s", g.Title, strings.Join(problems, "; "))
	}
	return nil
}

// palette holds distinct colours that stay apart for the colour-blind (Okabe–Ito, then Tableau),
// each with a light tint to fill boxes so black text stays readable on them.
var palette = []struct{ stroke, fill string }{
	{"#0072b2", "#d5e8f5"},
	{"#d55e00", "#f9dfcc"},
	{"#009e73", "#cceee5"},
	{"#cc79a7", "#f5e4ed"},
	{"#e69f00", "#faecc9"},
	{"#56b4e9", "#ddf0fb"},
	{"#7f7f7f", "#e5e5e5"},
	{"#8c564b", "#e8dddb"},
	{"#bcbd22", "#f2f2d3"},
	{"#9467bd", "#e9e1f2"},
}

// Policies lists the graph's policies in order of first appearance by round, so the first
// policies of the dataflow get the first colours on every drawing of the same topology (the
// palette's order: slimen view colours its charts by it too).
func (g Graph) Policies() []string {
	var out []string
	seen := map[string]bool{}
	maxRound := 0
	for _, n := range g.Nodes {
		maxRound = max(maxRound, n.Round)
	}
	for r := 0; r <= maxRound; r++ {
		for _, n := range g.Nodes {
			if max(n.Round, 0) == r && !seen[n.Policy] {
				seen[n.Policy] = true
				out = append(out, n.Policy)
			}
		}
	}
	return out
}

// nodeTitle is a node's first line: the policy and how many samples it drew.
func nodeTitle(n Node) string {
	return fmt.Sprintf("%s ×%d", n.Policy, n.Samples)
}

// drawnEdges are the edges whose ends both exist; Check reports the others.
func (g Graph) drawnEdges() []Edge {
	ids := map[string]bool{}
	for _, n := range g.Nodes {
		ids[n.ID] = true
	}
	var out []Edge
	for _, e := range g.Edges {
		if ids[e.From] && ids[e.To] {
			out = append(out, e)
		}
	}
	return out
}
