package view

import (
	"bytes"
	"encoding/json"
	"math"
	"net/http"
	"slices"

	"github.com/slimen/slimen/host/plot"
)

// curvesChunk is how many bytes of metrics.jsonl one /api/curves answer covers at most; the page
// asks again while more is true.
const curvesChunk = 4 << 20

// curveSeries is one curve of a chunk of metrics.jsonl: a numeric key of one source's lines.
type curveSeries struct {
	Source  string       `json:"source"`
	Dataset string       `json:"dataset,omitempty"`
	Key     string       `json:"key"`
	Points  [][2]float64 `json:"points"` // [step, value]
}

// sourceSteps lists the steps at which a source (and eval dataset) has a line: a step with a line
// but not a key is a gap in that key's curve, as host/plot draws it.
type sourceSteps struct {
	Source  string `json:"source"`
	Dataset string `json:"dataset,omitempty"`
	Steps   []int  `json:"steps"`
}

// curvesReply is the answer of /api/curves: the curves of metrics.jsonl's complete lines from
// the offset asked for to Offset. The page merges chunks, a later value of a step replacing an
// earlier one (a resumed run logs again the steps after its checkpoint).
type curvesReply struct {
	Gen     int           `json:"gen"`
	Offset  int64         `json:"offset"`
	Size    int64         `json:"size"`
	More    bool          `json:"more"`
	Reset   bool          `json:"reset,omitempty"`
	Exists  bool          `json:"exists"`
	Series  []curveSeries `json:"series"`
	Lines   []sourceSteps `json:"lines"`
	Skipped int           `json:"skipped"`
}

func (s *Server) handleCurves(w http.ResponseWriter, r *http.Request) {
	from, gen, ok := offsetParams(w, r)
	if !ok {
		return
	}
	from = max(from, 0)
	size, cur, exists, err := s.files.stat("metrics.jsonl")
	if err != nil {
		s.fail(w, err)
		return
	}
	rep := curvesReply{Gen: cur, Size: size, Exists: exists, Series: []curveSeries{}, Lines: []sourceSteps{}}
	if gen != cur || from > size {
		rep.Reset, from = from != 0 || gen != 0, 0
	}
	rep.Offset = from
	if !exists {
		writeJSON(w, rep)
		return
	}
	data, end, err := s.files.lines("metrics.jsonl", from, curvesChunk)
	if err != nil {
		s.fail(w, err)
		return
	}
	rep.Offset, rep.More = end, end < size && len(data) > 0
	if len(data) == 0 {
		writeJSON(w, rep)
		return
	}
	run, err := plot.Read(bytes.NewReader(data))
	if err != nil {
		s.fail(w, err)
		return
	}
	rep.Skipped = len(run.Skipped)
	for _, id := range run.IDs() {
		pts := run.Series(id)
		c := curveSeries{Source: id.Source, Dataset: id.Dataset, Key: id.Key, Points: make([][2]float64, 0, len(pts))}
		for _, p := range pts {
			if math.IsInf(p.Value, 0) || math.IsNaN(p.Value) {
				continue
			}
			c.Points = append(c.Points, [2]float64{float64(p.Step), p.Value})
		}
		rep.Series = append(rep.Series, c)
	}
	rep.Lines = lineSteps(data)
	writeJSON(w, rep)
}

// lineSteps lists, per source and dataset, the steps of the metrics lines in data; lines that
// plot.Read skips (no integer step or no policy) are skipped here too.
func lineSteps(data []byte) []sourceSteps {
	type key struct{ source, dataset string }
	steps := map[key][]int{}
	var order []key
	eachLine(data, 0, func(line []byte, _ int64) {
		var l struct {
			Step    *float64 `json:"step"`
			Policy  string   `json:"policy"`
			Dataset string   `json:"dataset"`
		}
		if json.Unmarshal(line, &l) != nil || l.Step == nil || l.Policy == "" || *l.Step != math.Trunc(*l.Step) || math.Abs(*l.Step) > 1<<53 {
			return
		}
		k := key{l.Policy, l.Dataset}
		if _, ok := steps[k]; !ok {
			order = append(order, k)
		}
		steps[k] = append(steps[k], int(*l.Step))
	})
	out := make([]sourceSteps, 0, len(order))
	for _, k := range order {
		st := steps[k]
		slices.Sort(st)
		out = append(out, sourceSteps{Source: k.source, Dataset: k.dataset, Steps: slices.Compact(st)})
	}
	return out
}
