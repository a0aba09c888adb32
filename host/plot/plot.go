// Package plot draws the curves of a run — reward, accuracy and loss by step — from its
// metrics.jsonl into <run>/plots/, each as SVG (for a browser) and PNG (for anything else).
package plot

import (
	"bytes"
	"errors"
	"fmt"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Size of every picture. The PNG is PNGWidth × PNGHeight pixels.
const (
	width     = 10 * vg.Inch
	height    = 5.5 * vg.Inch
	dpi       = 120
	PNGWidth  = 1200 // 10 in at 120 dpi
	PNGHeight = 660  // 5.5 in at 120 dpi
)

// ErrNothingToPlot is returned by Write when the metrics hold no reward, accuracy or loss yet.
var ErrNothingToPlot = errors.New("plot: no reward_mean, loss, accuracy or eval numbers to plot yet")

// Write reads <runDir>/metrics.jsonl and draws its curves into <runDir>/plots/. It returns the
// files written: reward.svg/.png, accuracy.svg/.png and loss.svg/.png, each only when the run has
// numbers for it. Malformed lines are left out; Load reports them.
func Write(runDir string) ([]string, error) {
	r, err := Load(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		return nil, fmt.Errorf("plot: %w", err)
	}
	return r.Write(filepath.Join(runDir, "plots"))
}

// Write draws the run's charts into dir, creating it.
func (r *Run) Write(dir string) ([]string, error) {
	charts := r.charts()
	if len(charts) == 0 {
		return nil, ErrNothingToPlot
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("plot: %w", err)
	}
	var files []string
	for _, c := range charts {
		svg, png, err := c.render()
		if err != nil {
			return files, fmt.Errorf("plot %s: %w", c.name, err)
		}
		for _, f := range []struct {
			ext  string
			data []byte
		}{{".svg", svg}, {".png", png}} {
			path := filepath.Join(dir, c.name+f.ext)
			if err := writeAtomic(path, f.data); err != nil {
				return files, fmt.Errorf("plot: %w", err)
			}
			files = append(files, path)
		}
	}
	return files, nil
}

// charts picks the curves of each picture. Colours follow the sorted policy names, so a policy
// has the same colour on the reward and the loss chart.
func (r *Run) charts() []chart {
	reward := chart{name: "reward", title: "Reward per policy", yLabel: "reward_mean", band: "± reward_std"}
	loss := chart{name: "loss", title: "Training loss per policy", yLabel: "loss"}
	for i, p := range r.Policies() {
		col := palette[i%len(palette)]
		if pts := r.Series(SeriesID{Source: p, Key: "reward_mean"}); pts != nil {
			std := r.Series(SeriesID{Source: p, Key: "reward_std"})
			reward.curves = append(reward.curves, curve{name: p, colour: col, pts: pts, std: std})
		}
		if pts := r.Series(SeriesID{Source: p, Key: "loss"}); pts != nil {
			loss.curves = append(loss.curves, curve{name: p, colour: col, pts: pts})
		}
	}
	acc := chart{name: "accuracy", title: "Accuracy", yLabel: "accuracy"}
	// Training curves first, evals after: the legend then reads in the order of the run.
	ids := r.IDs()
	slices.SortStableFunc(ids, func(a, b SeriesID) int {
		_, ea := accuracyName(a)
		_, eb := accuracyName(b)
		return cmpBool(ea, eb)
	})
	for _, id := range ids {
		name, eval := accuracyName(id)
		if name == "" {
			continue
		}
		acc.curves = append(acc.curves, curve{
			name:    name,
			colour:  palette[len(acc.curves)%len(palette)],
			pts:     r.Series(id),
			markers: eval, // evals are few points apart: show where each one is
			dashes:  dashesFor(len(acc.curves)),
		})
	}
	var out []chart
	for _, c := range []chart{reward, acc, loss} {
		if len(c.curves) > 0 {
			out = append(out, c)
		}
	}
	return out
}

// accuracyName says whether a curve belongs on the accuracy chart and under which name: run-wide
// numbers named like accuracies or pass@k, and every eval number but the eval's bookkeeping.
func accuracyName(id SeriesID) (name string, eval bool) {
	switch {
	case strings.HasPrefix(id.Key, "eval/"):
		if id.Source == "_run" || id.Source == "_eval" {
			return id.Key, true
		}
		return id.Source + " " + id.Key, true
	case id.Source == "_eval":
		if id.Key == "tasks" || id.Key == "failed" {
			return "", false
		}
		if id.Dataset == "" {
			return "eval: " + id.Key, true
		}
		return "eval " + id.Dataset + ": " + id.Key, true
	case id.Source == "_run" && (strings.Contains(id.Key, "accuracy") || strings.Contains(id.Key, "pass@")):
		return id.Key, false
	}
	return "", false
}

func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// dashesFor gives the curves past the palette's length a dash pattern, so that two curves of the
// same colour still differ.
func dashesFor(i int) []vg.Length {
	switch i / len(palette) % 3 {
	case 1:
		return []vg.Length{vg.Points(6), vg.Points(3)}
	case 2:
		return []vg.Length{vg.Points(2), vg.Points(2)}
	}
	return nil
}

// palette is Okabe–Ito's colours, distinct also for the colour-blind, then a few Tableau ones.
var palette = []color.Color{
	rgb(0x0072b2), rgb(0xd55e00), rgb(0x009e73), rgb(0xcc79a7), rgb(0xe69f00),
	rgb(0x56b4e9), rgb(0x7f7f7f), rgb(0x8c564b), rgb(0xbcbd22), rgb(0x9467bd),
}

func rgb(x uint32) color.NRGBA {
	return color.NRGBA{R: uint8(x >> 16), G: uint8(x >> 8), B: uint8(x), A: 0xff}
}

// render draws the chart twice: gonum's canvases cannot be replayed from one to the other.
func (c chart) render() (svgData, pngData []byte, err error) {
	sc := vgsvg.New(width, height)
	c.draw(draw.New(sc))
	var b bytes.Buffer
	if _, err := sc.WriteTo(&b); err != nil {
		return nil, nil, err
	}
	// The layout was measured with Liberation Sans; Arial has the same metrics, so a viewer
	// without Liberation keeps labels where they were placed instead of falling back to serif.
	svgData = bytes.ReplaceAll(b.Bytes(), []byte("font-family:Liberation Sans;"),
		[]byte("font-family:'Liberation Sans',Arial,Helvetica,sans-serif;"))

	ic := vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(dpi))
	c.draw(draw.New(ic))
	b.Reset()
	if err := png.Encode(&b, ic.Image()); err != nil {
		return nil, nil, err
	}
	return svgData, b.Bytes(), nil
}

// writeAtomic replaces path with data through a rename, so that a viewer reloading the picture
// while a run redraws it never reads half a file.
func writeAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(f.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
