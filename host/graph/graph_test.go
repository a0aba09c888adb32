package graph

import (
	"encoding/xml"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/graph")

// debate: a generator answers three times, critics read all three answers, then critics read the
// first critics' reviews.
func debate() Graph {
	return Graph{
		Title: "debate",
		Nodes: []Node{
			{ID: "g0", Policy: "generator", Round: 0, Samples: 3},
			{ID: "c1", Policy: "critic", Round: 1, Samples: 3},
			{ID: "c2", Policy: "critic", Round: 2, Samples: 3},
		},
		Edges: []Edge{{From: "g0", To: "c1", Count: 3}, {From: "c1", To: "c2", Count: 3}},
	}
}

// debateCalls is the debate with one node per generate call: each critic of round 1 reads all
// generator samples, each critic of round 2 reads every critic of round 1.
func debateCalls() Graph {
	g := Graph{Title: "debate, one node per call", Nodes: []Node{{ID: "gen", Policy: "generator", Samples: 3, Label: "debate.star:12"}}}
	for r := 1; r <= 2; r++ {
		for i := range 3 {
			id := fmt.Sprintf("critic-%d-%d", r, i)
			g.Nodes = append(g.Nodes, Node{ID: id, Policy: "critic", Round: r, Samples: 1, Label: fmt.Sprintf("critic #%d", i+1)})
			if r == 1 {
				g.Edges = append(g.Edges, Edge{From: "gen", To: id, Count: 3})
				continue
			}
			for j := range 3 {
				g.Edges = append(g.Edges, Edge{From: fmt.Sprintf("critic-1-%d", j), To: id, Count: 1})
			}
		}
	}
	g.Nodes = append(g.Nodes, Node{ID: "judge", Policy: "judge", Round: 3, Samples: 1})
	for i := range 3 {
		g.Edges = append(g.Edges, Edge{From: fmt.Sprintf("critic-2-%d", i), To: "judge", Count: 1})
	}
	return g
}

func solverSummarizer() Graph {
	return Graph{
		Title: `solvers → "summarizer": #1`,
		Nodes: []Node{
			{ID: "s", Policy: "solver", Round: 0, Samples: 4},
			{ID: "end", Policy: "summarizer", Round: 1, Samples: 1, Label: "<final answer>"},
		},
		Edges: []Edge{{From: "s", To: "end", Count: 4}},
	}
}

var examples = map[string]func() Graph{
	"debate":            debate,
	"debate_calls":      debateCalls,
	"solver_summarizer": solverSummarizer,
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("..", "..", "testdata", "graph", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./host/graph -update to write it)", err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("%s differs from the golden file (-want +got); if the change is meant, rerun with -update:\n%s", name, diff)
	}
}

func TestMermaidGolden(t *testing.T) {
	for name, g := range examples {
		t.Run(name, func(t *testing.T) { golden(t, name+".mmd", []byte(Mermaid(g()))) })
	}
}

func TestSVGGolden(t *testing.T) {
	for name, g := range examples {
		t.Run(name, func(t *testing.T) { golden(t, name+".svg", SVG(g())) })
	}
}

func TestMermaidEscapesAndCounts(t *testing.T) {
	m := Mermaid(solverSummarizer())
	for _, want := range []string{
		"flowchart LR",
		`title: "solvers → \"summarizer\": #1"`,
		`n1["summarizer ×1<br/>round 1<br/>#lt;final answer#gt;"]:::p1`, // the ID "end" is not used: Mermaid reserves it
		"n0 -->|4| n1",
	} {
		if !strings.Contains(m, want) {
			t.Errorf("Mermaid output lacks %q:\n%s", want, m)
		}
	}
	// A single completion is not labelled: the arrow says it.
	one := Mermaid(Graph{Nodes: []Node{{ID: "a", Policy: "p"}, {ID: "b", Policy: "q", Round: 1}}, Edges: []Edge{{From: "a", To: "b", Count: 1}}})
	if !strings.Contains(one, "n0 --> n1\n") || strings.Contains(one, "title:") {
		t.Errorf("unlabelled edge or untitled graph drawn wrong:\n%s", one)
	}
}

// svgDoc is the part of the SVG the tests look at.
type svgDoc struct {
	Groups []svgGroup `xml:"g"`
	Texts  []string   `xml:"text"`
}

type svgGroup struct {
	Class  string     `xml:"class,attr"`
	ID     string     `xml:"data-id,attr"`
	Policy string     `xml:"data-policy,attr"`
	Rects  []svgRect  `xml:"rect"`
	Texts  []string   `xml:"text"`
	Paths  []svgPath  `xml:"path"`
	Groups []svgGroup `xml:"g"`
}

type svgRect struct {
	X      float64 `xml:"x,attr"`
	Y      float64 `xml:"y,attr"`
	Width  float64 `xml:"width,attr"`
	Height float64 `xml:"height,attr"`
	Fill   string  `xml:"fill,attr"`
}

type svgPath struct {
	Class  string `xml:"class,attr"`
	From   string `xml:"data-from,attr"`
	To     string `xml:"data-to,attr"`
	Marker string `xml:"marker-end,attr"`
	D      string `xml:"d,attr"`
}

func parseSVG(t *testing.T, b []byte) svgDoc {
	t.Helper()
	var doc svgDoc
	if err := xml.Unmarshal(b, &doc); err != nil {
		t.Fatalf("SVG does not parse as XML: %v\n%s", err, b)
	}
	return doc
}

func TestSVGStructure(t *testing.T) {
	for name, mk := range examples {
		t.Run(name, func(t *testing.T) {
			g := mk()
			doc := parseSVG(t, SVG(g))
			nodes := map[string]svgGroup{}
			var edges []svgPath
			legend := map[string]bool{}
			for _, grp := range doc.Groups {
				switch grp.Class {
				case "node":
					if len(grp.Rects) != 1 {
						t.Errorf("node %s has %d rects, want 1", grp.ID, len(grp.Rects))
					}
					nodes[grp.ID] = grp
				case "edges":
					edges = append(edges, grp.Paths...)
				case "legend":
					legend[strings.Join(grp.Texts, "")] = true
				}
			}
			if len(nodes) != len(g.Nodes) {
				t.Errorf("%d node groups, want %d", len(nodes), len(g.Nodes))
			}
			if len(edges) != len(g.Edges) {
				t.Errorf("%d edge paths, want %d", len(edges), len(g.Edges))
			}
			for _, e := range edges {
				if e.Class != "edge" || !strings.HasPrefix(e.Marker, "url(#arrow") || !strings.Contains(e.D, "C") {
					t.Errorf("edge %s->%s is not a curve with an arrowhead: %+v", e.From, e.To, e)
				}
			}
			for _, n := range g.Nodes {
				grp, ok := nodes[n.ID]
				if !ok {
					t.Errorf("node %s not drawn", n.ID)
					continue
				}
				if !strings.HasPrefix(grp.Texts[0], n.Policy+" ×") {
					t.Errorf("node %s reads %q, want the policy %s first", n.ID, grp.Texts[0], n.Policy)
				}
				if !legend[n.Policy] {
					t.Errorf("policy %s missing from the legend %v", n.Policy, legend)
				}
			}
			if !contains(doc.Texts, "round 0") {
				t.Errorf("no round header in %v", doc.Texts)
			}
		})
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// TestSVGLayout checks what makes the drawing readable: each round is a column left of the next,
// boxes of a column do not overlap, and boxes of one policy share a fill while other policies'
// differ.
func TestSVGLayout(t *testing.T) {
	g := debateCalls()
	doc := parseSVG(t, SVG(g))
	round := map[string]int{}
	for _, n := range g.Nodes {
		round[n.ID] = n.Round
	}
	var rects []svgRect
	var ids []string
	fill := map[string]string{}
	for _, grp := range doc.Groups {
		if grp.Class != "node" {
			continue
		}
		r := grp.Rects[0]
		rects, ids = append(rects, r), append(ids, grp.ID)
		if f, ok := fill[grp.Policy]; ok && f != r.Fill {
			t.Errorf("policy %s drawn in %s and %s", grp.Policy, f, r.Fill)
		}
		fill[grp.Policy] = r.Fill
	}
	if fill["critic"] == fill["generator"] || fill["critic"] == fill["judge"] {
		t.Errorf("policies share a colour: %v", fill)
	}
	for i, a := range rects {
		for j, b := range rects {
			ri, rj := round[ids[i]], round[ids[j]]
			switch {
			case ri < rj && a.X+a.Width >= b.X:
				t.Errorf("%s (round %d) is not left of %s (round %d)", ids[i], ri, ids[j], rj)
			case ri == rj && i < j && a.Y < b.Y+b.Height && b.Y < a.Y+a.Height:
				t.Errorf("%s and %s overlap", ids[i], ids[j])
			}
		}
	}
}

func TestCheck(t *testing.T) {
	if err := debateCalls().Check(); err != nil {
		t.Errorf("a good graph fails Check: %v", err)
	}
	bad := Graph{
		Title: "bad",
		Nodes: []Node{{ID: "a", Policy: "p"}, {ID: "a", Policy: "p", Round: -1}},
		Edges: []Edge{{From: "a", To: "ghost", Count: 2}},
	}
	err := bad.Check()
	if err == nil {
		t.Fatal("Check passes a graph with a repeated id, a negative round and a dangling edge")
	}
	for _, want := range []string{`id "a" is used by an earlier node`, "round -1 is negative", `no node has id "ghost"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Check error lacks %q: %v", want, err)
		}
	}
	// The renderers leave the dangling edge out instead of failing.
	if doc := parseSVG(t, SVG(bad)); len(doc.Groups) == 0 {
		t.Error("no drawing for a graph with a dangling edge")
	}
	if strings.Contains(Mermaid(bad), "ghost") {
		t.Error("Mermaid draws an edge to a node that does not exist")
	}
}
