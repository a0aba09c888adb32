package plot

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
)

// Run is the numbers of a run's metrics.jsonl, as one curve per (line source, key).
type Run struct {
	// Skipped holds the 1-based numbers of the lines that were not a metrics object with an
	// integer "step" and a string "policy" (a line cut short by a crash, a stray print).
	Skipped []int

	values map[SeriesID]map[int]float64
	// lines holds the steps that have a line, per source and dataset: a step with a line but
	// without a key is a gap in that key's curve (no reward in that step), not a straight line
	// across it.
	lines map[[2]string]map[int]bool
}

// SeriesID names one curve: a numeric key of the lines of one source. Source is the line's
// "policy": a policy name, "_run" or "_eval"; Dataset is the "dataset" of eval lines.
type SeriesID struct {
	Source, Dataset, Key string
}

// Point is one value of a curve.
type Point struct {
	Step  int
	Value float64
	// Gap: the curve breaks before this point; its source has a line between the point before
	// and this one that lacks the key (a policy with no reward, or not trained, in that step).
	Gap bool
}

// Load reads a metrics.jsonl file.
func Load(path string) (*Run, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := Read(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}

// Read parses metrics lines. Every numeric key becomes a curve, so numbers that the host or a
// script starts logging later are plotted without a change here. When a step appears twice (a
// resumed run re-logs the steps after its checkpoint) the later line wins.
func Read(rd io.Reader) (*Run, error) {
	r := &Run{values: map[SeriesID]map[int]float64{}, lines: map[[2]string]map[int]bool{}}
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var obj map[string]any
		if err := json.Unmarshal(line, &obj); err != nil {
			r.Skipped = append(r.Skipped, n)
			continue
		}
		step, okStep := obj["step"].(float64)
		source, okSource := obj["policy"].(string)
		if !okStep || !okSource || source == "" || step != math.Trunc(step) || math.Abs(step) > 1<<53 {
			r.Skipped = append(r.Skipped, n)
			continue
		}
		dataset, _ := obj["dataset"].(string)
		src := [2]string{source, dataset}
		if r.lines[src] == nil {
			r.lines[src] = map[int]bool{}
		}
		r.lines[src][int(step)] = true
		for k, v := range obj {
			x, ok := v.(float64) // null (a NaN when written), strings and bools are not plotted
			if !ok || k == "step" {
				continue
			}
			id := SeriesID{source, dataset, k}
			if r.values[id] == nil {
				r.values[id] = map[int]float64{}
			}
			r.values[id][int(step)] = x
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return r, nil
}

// Series returns a curve's points in step order; nil if the run has none.
func (r *Run) Series(id SeriesID) []Point {
	m := r.values[id]
	pts := make([]Point, 0, len(m))
	for s, v := range m {
		pts = append(pts, Point{Step: s, Value: v})
	}
	slices.SortFunc(pts, func(a, b Point) int { return a.Step - b.Step })
	if len(pts) == 0 {
		return nil
	}
	var lines []int
	for s := range r.lines[[2]string{id.Source, id.Dataset}] {
		lines = append(lines, s)
	}
	slices.Sort(lines)
	k := 0
	for i := 1; i < len(pts); i++ {
		for k < len(lines) && lines[k] <= pts[i-1].Step {
			k++
		}
		pts[i].Gap = k < len(lines) && lines[k] < pts[i].Step
	}
	return pts
}

// segments cuts a curve at its gaps.
func segments(pts []Point) [][]Point {
	var out [][]Point
	from := 0
	for i := 1; i <= len(pts); i++ {
		if i == len(pts) || pts[i].Gap {
			out = append(out, pts[from:i])
			from = i
		}
	}
	return out
}

// IDs returns every curve of the run, sorted.
func (r *Run) IDs() []SeriesID {
	ids := make([]SeriesID, 0, len(r.values))
	for id := range r.values {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b SeriesID) int {
		return strings.Compare(a.Source+"\x00"+a.Dataset+"\x00"+a.Key, b.Source+"\x00"+b.Dataset+"\x00"+b.Key)
	})
	return ids
}

// Policies returns the policies that have per-policy lines, sorted; "_run", "_eval" and any other
// source starting with "_" are run-wide.
func (r *Run) Policies() []string {
	seen := map[string]bool{}
	var out []string
	for id := range r.values {
		if !strings.HasPrefix(id.Source, "_") && !seen[id.Source] {
			seen[id.Source] = true
			out = append(out, id.Source)
		}
	}
	slices.Sort(out)
	return out
}
