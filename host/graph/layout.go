package graph

import (
	"slices"
	"unicode/utf8"
)

// Sizes of the drawing, in SVG user units (pixels at 100%).
const (
	margin      = 24.0
	titleSize   = 18.0
	nameSize    = 14.0 // a node's first line
	textSize    = 12.0 // other lines, round headers, counts, legend
	lineGap     = 4.0
	boxPadX     = 14.0
	boxPadY     = 10.0
	minBoxWidth = 120.0
	columnGap   = 120.0 // room for the curves and their count labels
	rowGap      = 26.0
	headerGap   = 28.0 // from the round headers' baseline to the tallest column
)

// textWidth estimates how wide text is in a sans-serif face; the SVG carries no font metrics and
// a viewer picks its own face, so boxes get a little slack instead.
func textWidth(s string, size float64, bold bool) float64 {
	em := 0.58
	if bold {
		em = 0.63
	}
	return float64(utf8.RuneCountInString(s)) * size * em
}

// box is a node placed on the drawing: (x, y) is its top-left corner.
type box struct {
	Node
	col        int
	x, y, w, h float64
	lines      []string // under the title: the label, if any
}

func (b *box) cy() float64 { return b.y + b.h/2 }

// layout is a layered drawing: one column per round, boxes ordered in each column so that edges
// cross little, columns centred on the tallest.
type layout struct {
	boxes  []*box
	byID   map[string]*box
	cols   [][]*box
	colX   []float64
	colW   []float64
	top    float64 // y of the round headers' baseline
	bottom float64 // y under the lowest box
	right  float64 // x right of the last column
}

func newLayout(g Graph, top float64) *layout {
	l := &layout{byID: map[string]*box{}}
	ncol := 0
	for _, n := range g.Nodes {
		if _, dup := l.byID[n.ID]; dup {
			continue
		}
		b := &box{Node: n, col: max(n.Round, 0)}
		if n.Label != "" {
			b.lines = []string{n.Label}
		}
		b.w = textWidth(nodeTitle(n), nameSize, true)
		for _, s := range b.lines {
			b.w = max(b.w, textWidth(s, textSize, false))
		}
		b.w = max(minBoxWidth, b.w+2*boxPadX)
		b.h = 2*boxPadY + nameSize + float64(len(b.lines))*(textSize+lineGap)
		l.boxes = append(l.boxes, b)
		l.byID[n.ID] = b
		ncol = max(ncol, b.col+1)
	}
	l.cols = make([][]*box, ncol)
	for _, b := range l.boxes {
		l.cols[b.col] = append(l.cols[b.col], b)
	}
	l.order(g.drawnEdges())

	l.top = top
	l.colX = make([]float64, ncol)
	l.colW = make([]float64, ncol)
	heights := make([]float64, ncol)
	tallest := 0.0
	x := margin
	for c, col := range l.cols {
		w := minBoxWidth
		for i, b := range col {
			w = max(w, b.w)
			heights[c] += b.h
			if i > 0 {
				heights[c] += rowGap
			}
		}
		l.colX[c], l.colW[c] = x, w
		x += w + columnGap
		tallest = max(tallest, heights[c])
	}
	l.right = x - columnGap
	for c, col := range l.cols {
		y := top + headerGap + (tallest-heights[c])/2
		for _, b := range col {
			// Boxes of a column share its width so the column reads as one round.
			b.x, b.w, b.y = l.colX[c], l.colW[c], y
			y += b.h + rowGap
		}
	}
	l.bottom = top + headerGap + tallest
	return l
}

// order sorts each column by the barycentre of its neighbours in the other columns, sweeping
// forward and back a few times: the usual heuristic that removes most crossings of a layered
// drawing without searching every permutation.
func (l *layout) order(edges []Edge) {
	pos := func(b *box) float64 {
		col := l.cols[b.col]
		return (float64(slices.Index(col, b)) + 0.5) / float64(len(col))
	}
	sweep := func(c int, forward bool) {
		col := l.cols[c]
		key := map[*box]float64{}
		for _, b := range col {
			sum, w := 0.0, 0.0
			for _, e := range edges {
				from, to := l.byID[e.From], l.byID[e.To]
				var other *box
				switch {
				case forward && to == b && from.col < c:
					other = from
				case !forward && from == b && to.col > c:
					other = to
				default:
					continue
				}
				weight := float64(max(e.Count, 1))
				sum += weight * pos(other)
				w += weight
			}
			if w == 0 {
				key[b] = pos(b) // nothing to follow: keep its place
			} else {
				key[b] = sum / w
			}
		}
		slices.SortStableFunc(col, func(a, b *box) int {
			switch {
			case key[a] < key[b]:
				return -1
			case key[a] > key[b]:
				return 1
			}
			return 0
		})
	}
	for range 3 {
		for c := 1; c < len(l.cols); c++ {
			sweep(c, true)
		}
		for c := len(l.cols) - 2; c >= 0; c-- {
			sweep(c, false)
		}
	}
	for c := 1; c < len(l.cols); c++ {
		sweep(c, true)
	}
}
