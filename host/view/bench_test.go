package view

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// longRun writes the rollouts.jsonl of a run of steps steps at the default 8 rollouts a step, each
// line about the size of the debate example's (9 calls), and returns its folder.
func longRun(b *testing.B, steps int) string {
	b.Helper()
	dir := b.TempDir()
	f, err := os.Create(filepath.Join(dir, "rollouts.jsonl"))
	if err != nil {
		b.Fatal(err)
	}
	w := bufio.NewWriter(f)
	for s := 1; s <= steps; s++ {
		for i := range 8 {
			rw := map[string]float64{}
			for c := range 9 {
				rw[fmt.Sprintf("agent%d", c%3)] = float64((s + i + c) % 2)
			}
			w.WriteString(rolloutLine(s, i, false, (s+i)%50 == 0, rw))
		}
	}
	if err := w.Flush(); err != nil {
		b.Fatal(err)
	}
	f.Close()
	write(b, dir, "events.log", "")
	return dir
}

// BenchmarkRollouts measures the rollout browser on a 2,000-step run (16,000 rollouts): the first
// page, which indexes the whole file; a filtered page once it is indexed; and a page after a new
// step was appended, which reads only that step.
//
//	go test ./host/view -run '^$' -bench Rollouts -benchtime 20x
func BenchmarkRollouts(b *testing.B) {
	dir := longRun(b, 2000)
	fi, _ := os.Stat(filepath.Join(dir, "rollouts.jsonl"))
	b.Logf("rollouts.jsonl: %.1f MB, 16000 rollouts", float64(fi.Size())/1e6)
	b.Run("first-page", func(b *testing.B) {
		for b.Loop() {
			s, err := New(dir, Options{})
			if err != nil {
				b.Fatal(err)
			}
			getJSON[rolloutsAnswer](b, s, "/api/rollouts")
			s.Close()
		}
	})
	s, err := New(dir, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	getJSON[rolloutsAnswer](b, s, "/api/rollouts")
	b.Run("filtered-page", func(b *testing.B) {
		for b.Loop() {
			r := getJSON[rolloutsAnswer](b, s, "/api/rollouts?policy=agent1&min_reward=1&min_step=500&max_step=1500&page=3")
			if len(r.Items) != 20 {
				b.Fatalf("%d items", len(r.Items))
			}
		}
	})
	step := 2001
	b.Run("after-a-step", func(b *testing.B) {
		for b.Loop() {
			for i := range 8 {
				appendTo(b, dir, "rollouts.jsonl", rolloutLine(step, i, false, false, map[string]float64{"agent0": 1}))
			}
			step++
			getJSON[rolloutsAnswer](b, s, "/api/rollouts")
		}
	})
}
