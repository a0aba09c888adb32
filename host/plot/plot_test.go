package plot

import (
	"bytes"
	"encoding/xml"
	"errors"
	"fmt"
	"image/color"
	"image/png"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// fixtureRun copies testdata/plot/metrics.jsonl into a fresh run directory: two policies over 30
// steps, run-wide accuracy, evals every 10 steps and one line cut short.
func fixtureRun(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "plot", "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "metrics.jsonl"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestWriteFixture(t *testing.T) {
	dir := fixtureRun(t)
	files, err := Write(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range files {
		rel, _ := filepath.Rel(dir, f)
		names = append(names, rel)
	}
	want := []string{
		"plots/reward.svg", "plots/reward.png",
		"plots/accuracy.svg", "plots/accuracy.png",
		"plots/loss.svg", "plots/loss.png",
	}
	if diff := cmp.Diff(want, names); diff != "" {
		t.Fatalf("files written (-want +got):\n%s", diff)
	}
	texts := map[string][]string{
		"reward":   {"Reward per policy", "step", "reward_mean", "critic", "generator", "± reward_std"},
		"accuracy": {"Accuracy", "step", "accuracy", "generator_accuracy", "eval arith: generator/pass@4", "eval arith: critic/greedy_accuracy"},
		"loss":     {"Training loss per policy", "step", "loss", "critic", "generator"},
	}
	for name, want := range texts {
		got := svgTexts(t, filepath.Join(dir, "plots", name+".svg"))
		for _, w := range want {
			if !slices.Contains(got, w) {
				t.Errorf("%s.svg has no text %q; it has %q", name, w, got)
			}
		}
		f, err := os.Open(filepath.Join(dir, "plots", name+".png"))
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(f)
		f.Close()
		if err != nil {
			t.Fatalf("%s.png: %v", name, err)
		}
		if b := img.Bounds(); b.Dx() != PNGWidth || b.Dy() != PNGHeight {
			t.Errorf("%s.png is %dx%d, want %dx%d", name, b.Dx(), b.Dy(), PNGWidth, PNGHeight)
		}
	}
	// Text is laid out with Liberation Sans; without it a viewer must fall back to a sans face of
	// the same metrics, not to its default serif.
	if b, _ := os.ReadFile(filepath.Join(dir, "plots", "reward.svg")); !bytes.Contains(b, []byte("Arial,Helvetica,sans-serif")) {
		t.Error("reward.svg names no fallback font")
	}
	// Eval bookkeeping and non-accuracy run numbers stay off the accuracy chart.
	acc := strings.Join(svgTexts(t, filepath.Join(dir, "plots", "accuracy.svg")), "\n")
	for _, no := range []string{"tasks", "failed", "rollouts", "step_s"} {
		if strings.Contains(acc, no) {
			t.Errorf("accuracy.svg plots %q", no)
		}
	}
}

// svgTexts parses an SVG as XML and returns the content of its text elements.
func svgTexts(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var texts []string
	d := xml.NewDecoder(bytes.NewReader(b))
	inText := false
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("%s does not parse as XML: %v", path, err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			inText = tok.Name.Local == "text"
		case xml.CharData:
			if inText {
				texts = append(texts, strings.TrimSpace(string(tok)))
			}
		case xml.EndElement:
			inText = false
		}
	}
	return texts
}

func TestReadFixture(t *testing.T) {
	r, err := Load(filepath.Join("..", "..", "testdata", "plot", "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{54}, r.Skipped); diff != "" {
		t.Errorf("skipped lines (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"critic", "generator"}, r.Policies()); diff != "" {
		t.Errorf("policies (-want +got):\n%s", diff)
	}
	if n := len(r.Series(SeriesID{Source: "generator", Key: "reward_mean"})); n != 30 {
		t.Errorf("generator has %d reward points, want 30 (the cut line must not add one)", n)
	}
	eval := r.Series(SeriesID{Source: "_eval", Dataset: "arith", Key: "generator/pass@4"})
	if diff := cmp.Diff([]Point{{Step: 0, Value: 0.25}, {Step: 10, Value: 0.5}, {Step: 20, Value: 0.7}, {Step: 30, Value: 0.9}}, eval); diff != "" {
		t.Errorf("eval pass@4 (-want +got):\n%s", diff)
	}
	if r.Series(SeriesID{Source: "_run", Key: "note"}) != nil {
		t.Error("a string value became a curve")
	}
}

func TestReadEdgeCases(t *testing.T) {
	in := strings.Join([]string{
		`{"step":1,"policy":"p","reward_mean":0.1,"kl":null}`,
		``, // a blank line is not a malformed one
		`{"step":2,"policy":"p","reward_mean":0.2}`,
		`{"step":2.5,"policy":"p","reward_mean":9}`, // steps are whole
		`{"policy":"p","reward_mean":9}`,
		`{"step":3,"reward_mean":9}`,
		`[1,2]`,
		`step 3 done`,
		// A resumed run logs step 2 again: the later line is the run's.
		`{"step":2,"policy":"p","reward_mean":0.25}`,
	}, "\n")
	r, err := Read(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{4, 5, 6, 7, 8}, r.Skipped); diff != "" {
		t.Errorf("skipped lines (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]Point{{Step: 1, Value: 0.1}, {Step: 2, Value: 0.25}}, r.Series(SeriesID{Source: "p", Key: "reward_mean"})); diff != "" {
		t.Errorf("reward (-want +got):\n%s", diff)
	}
	if r.Series(SeriesID{Source: "p", Key: "kl"}) != nil {
		t.Error("a null became a point")
	}
}

func TestWriteNothingToPlot(t *testing.T) {
	dir := t.TempDir()
	if _, err := Write(dir); err == nil || !strings.Contains(err.Error(), "metrics.jsonl") {
		t.Errorf("a run without metrics.jsonl: err = %v, want one naming the file", err)
	}
	writeMetrics(t, dir, `{"step":1,"policy":"_run","rollouts":4}`+"\n")
	if files, err := Write(dir); !errors.Is(err, ErrNothingToPlot) || len(files) > 0 {
		t.Errorf("a run with nothing to plot: files %v, err %v; want an error", files, err)
	}
}

// An eval before the first step is a single point: the chart still has a width and shows it.
func TestWriteSinglePointAndEvalKeys(t *testing.T) {
	dir := t.TempDir()
	lines := `{"step":0,"policy":"_eval","dataset":"gsm8k","solver/accuracy":0.4,"tasks":20}` + "\n" +
		`{"step":0,"policy":"_run","eval/mean_len":0.7}` + "\n"
	writeMetrics(t, dir, lines)
	files, err := Write(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || filepath.Base(files[0]) != "accuracy.svg" {
		t.Fatalf("files %v, want accuracy.svg and accuracy.png only", files)
	}
	texts := svgTexts(t, files[0])
	for _, w := range []string{"eval gsm8k: solver/accuracy", "eval/mean_len"} {
		if !slices.Contains(texts, w) {
			t.Errorf("accuracy.svg lacks %q: %q", w, texts)
		}
	}
}

// A zig-zagging curve gets a moving average and the legend says so; a steady one does not.
func TestSmoothingOnlyWhenNoisy(t *testing.T) {
	var noisyRun, steadyRun strings.Builder
	for s := 1; s <= 30; s++ {
		zig := 0.3
		if s%2 == 0 {
			zig = 0.6
		}
		fmt.Fprintf(&noisyRun, `{"step":%d,"policy":"p","reward_mean":%g}`+"\n", s, zig+0.01*float64(s))
		fmt.Fprintf(&steadyRun, `{"step":%d,"policy":"p","reward_mean":%g}`+"\n", s, 0.02*float64(s))
	}
	for _, tc := range []struct {
		name, lines string
		smoothed    bool
	}{{"noisy", noisyRun.String(), true}, {"steady", steadyRun.String(), false}} {
		dir := t.TempDir()
		writeMetrics(t, dir, tc.lines)
		if _, err := Write(dir); err != nil {
			t.Fatal(err)
		}
		texts := svgTexts(t, filepath.Join(dir, "plots", "reward.svg"))
		if got := slices.Contains(texts, "mean of 3 steps"); got != tc.smoothed {
			t.Errorf("%s curve: moving average in the legend = %v, want %v (%q)", tc.name, got, tc.smoothed, texts)
		}
		if slices.Contains(texts, "± reward_std") {
			t.Errorf("%s curve has no reward_std but the legend shows a band", tc.name)
		}
	}
}

func TestNiceTicks(t *testing.T) {
	labels := func(ts niceTicks, lo, hi float64) string {
		var out []string
		for _, tk := range ts.Ticks(lo, hi) {
			out = append(out, tk.Label)
		}
		return strings.Join(out, " ")
	}
	for _, tc := range []struct {
		integer bool
		lo, hi  float64
		want    string
	}{
		{true, 1, 30, "5 10 15 20 25 30"},
		{true, 0, 3, "0 1 2 3"},
		{true, 0, 1000, "0 200 400 600 800 1000"},
		{true, 0, 150, "0 25 50 75 100 125 150"},
		{false, -0.02, 1.02, "0 0.2 0.4 0.6 0.8 1.0"},
		{false, -0.13, 0.41, "-0.1 0 0.1 0.2 0.3 0.4"},
		{false, 0, 1.3, "0 0.25 0.50 0.75 1.00 1.25"},
		{false, 5, 5, "5"},
	} {
		if got := labels(niceTicks{tc.integer}, tc.lo, tc.hi); got != tc.want {
			t.Errorf("ticks(%v, %g, %g) = %q, want %q", tc.integer, tc.lo, tc.hi, got, tc.want)
		}
	}
}

func writeMetrics(t *testing.T, dir, lines string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "metrics.jsonl"), []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestSmoothingEndsAndBandRange: the moving average keeps its width at the ends (its last point is
// the mean of the last window steps, not the raw last value), and a band of a 0..1 reward stops
// at 0 and 1.
func TestSmoothingEndsAndBandRange(t *testing.T) {
	var pts []Point
	for i := 1; i <= 20; i++ {
		pts = append(pts, Point{Step: i, Value: float64(i % 2)}) // 0, 1, 0, 1, …: the raw last value is 0
	}
	avg := movingAverage(pts, 4)
	if first, last := avg[0].Value, avg[len(avg)-1].Value; first != 0.5 || last != 0.5 {
		t.Errorf("moving average of 0/1 zig-zag starts at %v and ends at %v, want 0.5 and 0.5", first, last)
	}
	cv := curve{pts: []Point{{Step: 1, Value: 0.1}, {Step: 2, Value: 0.5}, {Step: 3, Value: 0.9}}, std: []Point{{Step: 1, Value: 0.3}, {Step: 2, Value: 0.5}, {Step: 3, Value: 0.3}}, colour: color.Black}
	lo, hi := bandRange([]curve{cv})
	band := bandOf(cv, lo, hi)
	if band == nil || lo != 0 || hi != 1 {
		t.Fatalf("band %v in [%v, %v], want one in [0, 1]", band, lo, hi)
	}
	for _, xy := range band.XYs[0] {
		if xy.Y < 0 || xy.Y > 1 {
			t.Errorf("band point %v lies outside the reward range [0, 1]", xy)
		}
	}
	if lo, hi := bandRange([]curve{{pts: []Point{{Step: 1, Value: 3}, {Step: 2, Value: -2}}}}); !math.IsInf(lo, -1) || !math.IsInf(hi, 1) {
		t.Errorf("rewards in [-2, 3]: band range [%v, %v], want unbounded", lo, hi)
	}
}
