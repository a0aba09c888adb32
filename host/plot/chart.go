package plot

import (
	"image/color"
	"math"
	"strconv"

	xfont "golang.org/x/image/font"
	gplot "gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// chart is one picture: curves against the step.
type chart struct {
	name, title, yLabel string
	band                string // the legend's name for the bands, e.g. "± reward_std"
	curves              []curve
}

// curve is one line of a chart, with an optional band of ± std around it.
type curve struct {
	name    string
	colour  color.Color
	dashes  []vg.Length
	pts     []Point
	std     []Point
	markers bool
}

var (
	sans = font.Font{Typeface: "Liberation", Variant: "Sans"}
	bold = font.Font{Typeface: "Liberation", Variant: "Sans", Weight: xfont.WeightBold}
)

const (
	lineWidth   = 1.8 // points
	maxLegend   = 18  // curves named in the legend: with the style key, what fits beside the plot at 10 pt
	legendChars = 38  // longer names are shortened so the legend leaves the plot most of the width
)

func (c chart) draw(dc draw.Canvas) {
	p := gplot.New()
	p.Title.Text = c.title
	p.Title.TextStyle.Font = font.From(bold, 15)
	p.Title.Padding = vg.Points(10)
	p.X.Label.Text = "step"
	p.Y.Label.Text = c.yLabel
	for _, ax := range []*gplot.Axis{&p.X, &p.Y} {
		ax.Label.TextStyle.Font = font.From(sans, 12)
		ax.Tick.Label.Font = font.From(sans, 10)
		ax.Padding = 0
	}
	p.X.Tick.Marker = niceTicks{integer: true}
	p.Y.Tick.Marker = niceTicks{}
	grid := plotter.NewGrid()
	grid.Vertical.Color = color.Gray{0xe4}
	grid.Horizontal.Color = color.Gray{0xe4}
	grid.Vertical.Width, grid.Horizontal.Width = vg.Points(0.6), vg.Points(0.6)
	p.Add(grid)

	legend := gplot.NewLegend()
	legend.TextStyle.Font = font.From(sans, 10)
	legend.Left, legend.Top = true, true
	legend.Padding = vg.Points(3)
	legend.ThumbnailWidth = vg.Points(22)

	window := smoothingWindow(c.curves)
	lo, hi := bandRange(c.curves)
	var bands, raws, smooths, marks []gplot.Plotter
	anyBand, anySmooth, listed := false, false, 0
	for _, cv := range c.curves {
		if band := bandOf(cv, lo, hi); band != nil {
			bands = append(bands, band)
			anyBand = true
		}
		// A curve is drawn in pieces between its gaps (steps where its policy had a line but not
		// this number): a step without a reward is not a straight line from the one before.
		line := newLine(nil, cv.colour, lineWidth, cv.dashes)
		thumb := line
		if window > 1 && noisy(cv.pts) {
			anySmooth = true
			line.Color = fade(cv.colour, 0x55)
			line.Width = vg.Points(1)
			thumb = newLine(nil, cv.colour, 2.6, cv.dashes)
			for _, seg := range segments(movingAverage(cv.pts, window)) {
				smooths = append(smooths, withPoints(thumb, seg))
			}
		}
		var alone []Point // points with no neighbour to draw a line to: marked
		for _, seg := range segments(cv.pts) {
			raws = append(raws, withPoints(line, seg))
			if len(seg) == 1 {
				alone = append(alone, seg[0])
			}
		}
		var thumbs []gplot.Thumbnailer
		thumbs = append(thumbs, thumb)
		if cv.markers || len(cv.pts) == 1 {
			s := newMarkers(cv.pts, cv.colour)
			marks = append(marks, s)
			thumbs = append(thumbs, s)
		} else if len(alone) > 0 {
			marks = append(marks, newMarkers(alone, cv.colour))
		}
		if listed < maxLegend {
			legend.Add(shorten(cv.name), thumbs...)
			listed++
		}
	}
	if n := len(c.curves) - maxLegend; n > 0 {
		legend.Add(strconv.Itoa(n) + " more not listed")
	}
	// The key to the line styles comes after the names, in grey lines, set off by a blank entry.
	grey := color.Gray{0x70}
	if anySmooth || anyBand {
		legend.Add("")
	}
	if anySmooth {
		legend.Add("each step", newLine(nil, fade(grey, 0x77), 1, nil))
		legend.Add("mean of "+strconv.Itoa(window)+" steps", newLine(nil, grey, 2.6, nil))
	}
	if anyBand {
		legend.Add(c.band, &plotter.Polygon{Color: fade(grey, 0x40)})
	}
	p.Add(bands...)
	p.Add(raws...)
	p.Add(smooths...)
	p.Add(marks...)
	c.setRanges(p)

	// The legend gets a column right of the plot, so it never hides a curve.
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	lw := legend.Rectangle(dc).Size().X + vg.Points(30)
	dc = draw.Crop(dc, 0, 0, 0, -vg.Points(8)) // air above the title
	p.Draw(draw.Crop(dc, 0, -lw, 0, 0))
	top := p.Title.TextStyle.Height(p.Title.Text) + p.Title.Padding + vg.Points(4)
	legend.Draw(draw.Crop(dc, dc.Size().X-lw+vg.Points(12), 0, 0, -top))
}

// setRanges fits the axes to the data with a margin, so no curve runs along the frame, and shows
// fractions (every value in [0, 1]) on the whole 0–1 scale so that a small gain does not look big.
func (c chart) setRanges(p *gplot.Plot) {
	xmin, xmax := math.Inf(1), math.Inf(-1)
	ymin, ymax := math.Inf(1), math.Inf(-1)
	unit := true
	for _, cv := range c.curves {
		stds := map[int]float64{}
		for _, s := range cv.std {
			stds[s.Step] = s.Value
		}
		for _, pt := range cv.pts {
			xmin, xmax = math.Min(xmin, float64(pt.Step)), math.Max(xmax, float64(pt.Step))
			ymin, ymax = math.Min(ymin, pt.Value-stds[pt.Step]), math.Max(ymax, pt.Value+stds[pt.Step])
			unit = unit && pt.Value >= 0 && pt.Value <= 1
		}
	}
	if xmin == xmax {
		xmin, xmax = xmin-1, xmax+1
	}
	p.X.Min, p.X.Max = xmin, xmax
	switch {
	case unit && c.name == "accuracy":
		p.Y.Min, p.Y.Max = -0.02, 1.02
	case ymin == ymax:
		pad := math.Max(math.Abs(ymin)*0.1, 0.5)
		p.Y.Min, p.Y.Max = ymin-pad, ymax+pad
	default:
		pad := (ymax - ymin) * 0.05
		p.Y.Min, p.Y.Max = ymin-pad, ymax+pad
	}
}

func newLine(pts []Point, c color.Color, width float64, dashes []vg.Length) *plotter.Line {
	xys := make(plotter.XYs, len(pts))
	for i, pt := range pts {
		xys[i] = plotter.XY{X: float64(pt.Step), Y: pt.Value}
	}
	l := &plotter.Line{XYs: xys}
	l.Color = c
	l.Width = vg.Points(width)
	l.Dashes = dashes
	return l
}

// withPoints is a copy of the line's style through the points.
func withPoints(style *plotter.Line, pts []Point) *plotter.Line {
	l := *style
	l.XYs = newLine(pts, nil, 0, nil).XYs
	return &l
}

func newMarkers(pts []Point, c color.Color) *plotter.Scatter {
	xys := make(plotter.XYs, len(pts))
	for i, pt := range pts {
		xys[i] = plotter.XY{X: float64(pt.Step), Y: pt.Value}
	}
	s := &plotter.Scatter{XYs: xys}
	s.GlyphStyle = draw.GlyphStyle{Color: c, Radius: vg.Points(3), Shape: draw.CircleGlyph{}}
	return s
}

// bandRange is where a band may reach: [0, 1] when every value of the chart lies there (a reward
// that is a score or a pass rate), [-1, 1] likewise, else anywhere. mean ± std of a 0/1 reward
// with mean 0.9 is [0.6, 1.2]: no reward reaches 1.2.
func bandRange(cs []curve) (lo, hi float64) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, c := range cs {
		for _, pt := range c.pts {
			lo, hi = min(lo, pt.Value), max(hi, pt.Value)
		}
	}
	switch {
	case lo >= 0 && hi <= 1:
		return 0, 1
	case lo >= -1 && hi <= 1:
		return -1, 1
	}
	return math.Inf(-1), math.Inf(1)
}

// bandOf is the light area between mean - std and mean + std at the steps that have both, cut to
// [lo, hi].
func bandOf(cv curve, lo, hi float64) *plotter.Polygon {
	if len(cv.std) == 0 {
		return nil
	}
	std := map[int]float64{}
	for _, s := range cv.std {
		std[s.Step] = s.Value
	}
	var rings []plotter.XYer // one a piece of the curve between its gaps
	for _, seg := range segments(cv.pts) {
		var upper, lower plotter.XYs
		for _, pt := range seg {
			if s, ok := std[pt.Step]; ok {
				upper = append(upper, plotter.XY{X: float64(pt.Step), Y: min(pt.Value+s, hi)})
				lower = append(lower, plotter.XY{X: float64(pt.Step), Y: max(pt.Value-s, lo)})
			}
		}
		if len(upper) < 2 {
			continue
		}
		ring := upper
		for i := len(lower) - 1; i >= 0; i-- {
			ring = append(ring, lower[i])
		}
		rings = append(rings, ring)
	}
	if len(rings) == 0 {
		return nil
	}
	poly, err := plotter.NewPolygon(rings...)
	if err != nil {
		return nil // a NaN cannot reach here: Read keeps only JSON numbers
	}
	poly.Color = fade(cv.colour, 0x33)
	poly.LineStyle.Width = 0
	return poly
}

func fade(c color.Color, alpha uint8) color.NRGBA {
	n := color.NRGBAModel.Convert(c).(color.NRGBA)
	n.A = alpha
	return n
}

// smoothingWindow is about a tenth of the longest curve, so the moving average follows the trend
// of a short run and still irons out a long one; 1 means no smoothing.
func smoothingWindow(cs []curve) int {
	n := 0
	for _, c := range cs {
		n = max(n, len(c.pts))
	}
	if n < 12 {
		return 1
	}
	return min(max(3, n/10), 100)
}

// noisy says that a curve zig-zags: at least a third of its steps turn back from the step
// before, where a trend, even a wobbly one, mostly goes on in one direction.
func noisy(pts []Point) bool {
	if len(pts) < 12 {
		return false
	}
	turns := 0
	for i := 2; i < len(pts); i++ {
		a, b := pts[i-1].Value-pts[i-2].Value, pts[i].Value-pts[i-1].Value
		if a*b < 0 {
			turns++
		}
	}
	return 3*turns >= len(pts)-2
}

// movingAverage is the mean over window points, centred where it can be; near the ends the window
// slides inward and keeps its width, so the last point of the smoothed line is the mean of the
// last window steps, not the last step's raw value.
func movingAverage(pts []Point, window int) []Point {
	out := make([]Point, len(pts))
	window = min(window, len(pts))
	for i := range pts {
		from := min(max(i-window/2, 0), len(pts)-window)
		sum := 0.0
		for _, pt := range pts[from : from+window] {
			sum += pt.Value
		}
		out[i] = Point{Step: pts[i].Step, Value: sum / float64(window), Gap: pts[i].Gap}
	}
	return out
}

// shorten cuts a long legend name in its middle, where eval names repeat the least.
func shorten(s string) string {
	r := []rune(s)
	if len(r) <= legendChars {
		return s
	}
	keep := legendChars - 1
	return string(r[:keep/2]) + "…" + string(r[len(r)-(keep-keep/2):])
}
