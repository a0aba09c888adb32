package graph

import (
	"fmt"
	"strconv"
	"strings"
)

// Mermaid renders g as a Mermaid flowchart, left to right, one colour class per policy. Node IDs
// become n0, n1, … because a traced ID may hold characters (or words such as "end") that Mermaid
// would read as syntax.
func Mermaid(g Graph) string {
	var b strings.Builder
	if g.Title != "" {
		// YAML double-quoted strings take Go's escapes, so a title with ':' or '#' stays one string.
		fmt.Fprintf(&b, "---\ntitle: %s\n---\n", strconv.Quote(g.Title))
	}
	b.WriteString("flowchart LR\n")
	class := map[string]string{}
	for i, p := range g.Policies() {
		c := palette[i%len(palette)]
		class[p] = fmt.Sprintf("p%d", i)
		fmt.Fprintf(&b, "  classDef p%d fill:%s,stroke:%s,stroke-width:2px,color:#000\n", i, c.fill, c.stroke)
	}
	id := map[string]string{}
	for i, n := range g.Nodes {
		if _, dup := id[n.ID]; !dup {
			id[n.ID] = fmt.Sprintf("n%d", i)
		} else {
			continue
		}
		lines := []string{mermaidText(nodeTitle(n)), fmt.Sprintf("round %d", n.Round)}
		if n.Label != "" {
			lines = append(lines, mermaidText(n.Label))
		}
		fmt.Fprintf(&b, "  %s[\"%s\"]:::%s\n", id[n.ID], strings.Join(lines, "<br/>"), class[n.Policy])
	}
	for _, e := range g.drawnEdges() {
		if e.Count > 1 {
			fmt.Fprintf(&b, "  %s -->|%d| %s\n", id[e.From], e.Count, id[e.To])
		} else {
			fmt.Fprintf(&b, "  %s --> %s\n", id[e.From], id[e.To])
		}
	}
	return b.String()
}

// mermaidText escapes text for a quoted Mermaid label: Mermaid reads #name; as an entity and
// treats < > as HTML, so those characters are written as numeric entities.
func mermaidText(s string) string {
	r := strings.NewReplacer("#", "#35;", `"`, "#quot;", "<", "#lt;", ">", "#gt;", "\n", " ")
	return r.Replace(s)
}
