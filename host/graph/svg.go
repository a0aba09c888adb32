package graph

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"slices"
	"strconv"
)

// note tells a reader who has not seen the tracer what the boxes and arrows mean.
var note = []string{
	"policy ×n: the generate calls of a policy in one round, n samples in all",
	"arrow: completions whose text reached the next prompts; number: how many, when more than one",
}

const noteSize = 11.0

const fontFamily = `system-ui, -apple-system, 'Segoe UI', 'Helvetica Neue', Arial, 'DejaVu Sans', sans-serif`

// SVG renders g as a standalone SVG document: one column per round, a rounded box per node
// coloured by policy, a curve with an arrowhead per edge (labelled with its count when more than
// one completion passed), and a legend of the policies. Every node is a <g class="node"> and
// every edge a <path class="edge">, so the drawing can also be styled or inspected.
func SVG(g Graph) []byte {
	policies := g.Policies()
	colour := map[string]int{}
	for i, p := range policies {
		colour[p] = i % len(palette)
	}
	top := margin
	if g.Title != "" {
		top += titleSize + 14
	}
	top += textSize // the round headers' baseline
	l := newLayout(g, top)
	edges := g.drawnEdges()

	// The legend sits under the drawing and wraps to the drawing's width.
	legendTop := l.bottom + 30
	width := max(l.right+margin, 2*margin+textWidth(g.Title, titleSize, true))
	for _, s := range note {
		width = max(width, 2*margin+textWidth(s, noteSize, false))
	}
	type legendItem struct {
		x, y float64
		p    string
	}
	var legend []legendItem
	lx, ly := margin, legendTop
	for _, p := range policies {
		w := 18 + textWidth(p, textSize, false) + 22
		if lx > margin && lx+w > width-margin {
			lx, ly = margin, ly+22
		}
		legend = append(legend, legendItem{lx, ly, p})
		lx += w
	}
	noteY := ly + 28
	height := noteY + float64(len(note)-1)*(noteSize+lineGap) + margin/2

	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%s" height="%s" viewBox="0 0 %s %s" font-family="%s">`+"\n",
		num(width), num(height), num(width), num(height), fontFamily)
	if g.Title != "" {
		fmt.Fprintf(&b, "<title>%s</title>\n", esc(g.Title))
	}
	b.WriteString("<defs>\n")
	for _, p := range policies {
		// One arrowhead per colour: SVG 1.1 markers cannot take the colour of the path using them.
		fmt.Fprintf(&b, `<marker id="arrow%d" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" markerHeight="9" `+
			`markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="%s"/></marker><!-- %s -->`+"\n",
			colour[p], palette[colour[p]].stroke, esc(p))
	}
	b.WriteString("</defs>\n")
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="#ffffff"/>`+"\n")
	if g.Title != "" {
		fmt.Fprintf(&b, `<text x="%s" y="%s" font-size="%s" font-weight="bold" fill="#222">%s</text>`+"\n",
			num(margin), num(margin+titleSize), num(titleSize), esc(g.Title))
	}
	for c := range l.cols {
		fmt.Fprintf(&b, `<text x="%s" y="%s" font-size="%s" fill="#666" text-anchor="middle">round %d</text>`+"\n",
			num(l.colX[c]+l.colW[c]/2), num(l.top), num(textSize), c)
	}

	// Edges first so that boxes cover their ends.
	out, in := ports(l, edges)
	b.WriteString(`<g class="edges" fill="none">` + "\n")
	var labels bytes.Buffer
	for i, e := range edges {
		from, to := l.byID[e.From], l.byID[e.To]
		c := colour[from.Policy]
		width := 1.5 + math.Min(3, math.Log2(float64(max(e.Count, 1))))*0.6
		var d string
		var mx, my float64
		if to.col > from.col {
			x1, y1 := from.x+from.w, out[i]
			x2, y2 := to.x-1, in[i]
			dx := (x2 - x1) / 2
			d = fmt.Sprintf("M%s,%s C%s,%s %s,%s %s,%s", num(x1), num(y1), num(x1+dx), num(y1), num(x2-dx), num(y2), num(x2), num(y2))
			mx, my = (x1+x2)/2, (y1+y2)/2
		} else {
			// An edge into the same or an earlier round loops over the boxes.
			x1, y1 := from.x+from.w/2, from.y
			x2, y2 := to.x+to.w/2+8, to.y-1
			lift := 40 + 0.15*math.Abs(x2-x1)
			d = fmt.Sprintf("M%s,%s C%s,%s %s,%s %s,%s", num(x1), num(y1), num(x1), num(y1-lift), num(x2), num(y2-lift), num(x2), num(y2))
			mx, my = (x1+x2)/2, (y1+y2)/2-0.75*lift
		}
		fmt.Fprintf(&b, `<path class="edge" data-from="%s" data-to="%s" data-count="%d" d="%s" stroke="%s" `+
			`stroke-opacity="0.8" stroke-width="%s" marker-end="url(#arrow%d)"/>`+"\n",
			esc(e.From), esc(e.To), e.Count, d, palette[c].stroke, num(width), c)
		if e.Count > 1 {
			s := strconv.Itoa(e.Count)
			w := textWidth(s, textSize, true) + 8
			fmt.Fprintf(&labels, `<g class="count"><rect x="%s" y="%s" width="%s" height="16" rx="8" fill="#fff" stroke="%s" `+
				`stroke-width="1"/><text x="%s" y="%s" font-size="%s" font-weight="bold" `+
				`text-anchor="middle" fill="#333">%s</text></g>`+"\n",
				num(mx-w/2), num(my-8), num(w), palette[c].stroke, num(mx), num(my+4), num(textSize), s)
		}
	}
	b.WriteString("</g>\n")

	for _, bx := range l.boxes {
		c := palette[colour[bx.Policy]]
		fmt.Fprintf(&b, `<g class="node" data-id="%s" data-policy="%s" data-round="%d" data-samples="%d">`,
			esc(bx.ID), esc(bx.Policy), bx.Round, bx.Samples)
		fmt.Fprintf(&b, `<rect x="%s" y="%s" width="%s" height="%s" rx="10" fill="%s" stroke="%s" stroke-width="2"/>`,
			num(bx.x), num(bx.y), num(bx.w), num(bx.h), c.fill, c.stroke)
		y := bx.y + boxPadY + nameSize - 2
		fmt.Fprintf(&b, `<text x="%s" y="%s" font-size="%s" font-weight="bold" text-anchor="middle" fill="#111">%s</text>`,
			num(bx.x+bx.w/2), num(y), num(nameSize), esc(nodeTitle(bx.Node)))
		for _, s := range bx.lines {
			y += textSize + lineGap
			fmt.Fprintf(&b, `<text x="%s" y="%s" font-size="%s" text-anchor="middle" fill="#444">%s</text>`,
				num(bx.x+bx.w/2), num(y), num(textSize), esc(s))
		}
		b.WriteString("</g>\n")
	}
	// Count labels go over the boxes' edges but under nothing, so none is hidden.
	b.Write(labels.Bytes())

	for _, it := range legend {
		c := palette[colour[it.p]]
		fmt.Fprintf(&b, `<g class="legend"><rect x="%s" y="%s" width="14" height="14" rx="3" fill="%s" stroke="%s" `+
			`stroke-width="2"/><text x="%s" y="%s" font-size="%s" fill="#222">%s</text></g>`+"\n",
			num(it.x), num(it.y-11), c.fill, c.stroke, num(it.x+20), num(it.y), num(textSize), esc(it.p))
	}
	for i, s := range note {
		fmt.Fprintf(&b, `<text x="%s" y="%s" font-size="%s" fill="#777">%s</text>`+"\n",
			num(margin), num(noteY+float64(i)*(noteSize+lineGap)), num(noteSize), esc(s))
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// ports spreads the ends of the edges meeting at one side of a box over the middle of that side,
// in the order of the boxes at their other ends, so arrows do not pile onto one point and do not
// cross just before the box. It returns the y of each forward edge's start and end.
func ports(l *layout, edges []Edge) (out, in []float64) {
	out, in = make([]float64, len(edges)), make([]float64, len(edges))
	outs, ins := map[*box][]int{}, map[*box][]int{}
	for i, e := range edges {
		from, to := l.byID[e.From], l.byID[e.To]
		if to.col > from.col {
			outs[from] = append(outs[from], i)
			ins[to] = append(ins[to], i)
		}
	}
	spread := func(b *box, idx []int, other func(int) *box, ys []float64) {
		slices.SortStableFunc(idx, func(i, j int) int {
			oi, oj := other(i), other(j)
			if d := oi.cy() - oj.cy(); d != 0 {
				return int(math.Copysign(1, d))
			}
			return oi.col - oj.col
		})
		step := math.Min(10, (b.h-16)/float64(max(len(idx)-1, 1)))
		for k, i := range idx {
			ys[i] = b.cy() + (float64(k)-float64(len(idx)-1)/2)*step
		}
	}
	for b, idx := range outs {
		spread(b, idx, func(i int) *box { return l.byID[edges[i].To] }, out)
	}
	for b, idx := range ins {
		spread(b, idx, func(i int) *box { return l.byID[edges[i].From] }, in)
	}
	return out, in
}

// num writes a coordinate with at most one decimal: enough at screen scale, and short output.
func num(f float64) string { return strconv.FormatFloat(math.Round(f*10)/10, 'f', -1, 64) }

func esc(s string) string {
	var b bytes.Buffer
	xml.EscapeText(&b, []byte(s)) // also escapes quotes, so safe in attributes
	return b.String()
}
