package plot

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// A step where a policy had a line but no reward is a gap in its reward curve, not a straight
// line across it (issue 35: absent is absent); a step with no line at all (a run logging every
// few steps, a resumed run's missing steps) is no gap.
func TestSeriesGaps(t *testing.T) {
	in := strings.Join([]string{
		`{"step":1,"policy":"p","reward_mean":0.5,"loss":0.1}`,
		`{"step":2,"policy":"p","samples":0}`, // no completions this step: no reward, no loss
		`{"step":3,"policy":"p","reward_mean":0.7,"loss":0.2}`,
		`{"step":4,"policy":"q","reward_mean":0.1}`, // another policy's line is no gap in p's curve
		`{"step":5,"policy":"p","reward_mean":0.9}`, // not trained: no loss
		`{"step":7,"policy":"p","reward_mean":1.0,"loss":0.3}`,
	}, "\n")
	r, err := Read(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	reward := r.Series(SeriesID{Source: "p", Key: "reward_mean"})
	want := []Point{{Step: 1, Value: 0.5}, {Step: 3, Value: 0.7, Gap: true}, {Step: 5, Value: 0.9}, {Step: 7, Value: 1.0}}
	if diff := cmp.Diff(want, reward); diff != "" {
		t.Errorf("reward (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([][]Point{want[:1], want[1:]}, segments(reward)); diff != "" {
		t.Errorf("reward's pieces (-want +got):\n%s", diff)
	}
	loss := r.Series(SeriesID{Source: "p", Key: "loss"})
	if diff := cmp.Diff([]int{1, 1, 1}, lens(segments(loss))); diff != "" {
		t.Errorf("loss's pieces' lengths (-want +got):\n%s\n%+v", diff, loss)
	}
}

func lens(segs [][]Point) []int {
	var out []int
	for _, s := range segs {
		out = append(out, len(s))
	}
	return out
}
