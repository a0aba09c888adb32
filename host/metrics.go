package host

// This file defines metrics.jsonl: its lines, their writer, and the numbers a step records
// (rewards, the run-wide line, the busy meter of engines).

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/host/script"
)

// Metrics is one line of metrics.jsonl: step, policy and named numbers (docs/architecture.md, "The run directory"). Keys are
// written sorted, step and policy first, so equal runs give byte-equal files apart from timings.
type Metrics map[string]any

// newMetrics starts the metrics line of a policy (or "_run", "_eval") at a step.
func newMetrics(step int, policy string) Metrics { return Metrics{"step": step, "policy": policy} }

// set sets a field of the line.
func (m Metrics) set(k string, v any) { m[k] = v }

// Policy is the line's policy ("_run" for run-wide numbers).
func (m Metrics) Policy() string { s, _ := m["policy"].(string); return s }

// Float returns a numeric field.
func (m Metrics) Float(k string) float64 {
	switch v := m[k].(type) {
	case float64:
		return v
	case int:
		return float64(v)
	}
	return math.NaN()
}

// int returns an integer field; 0 when it is absent.
func (m Metrics) int(k string) int { v, _ := m[k].(int); return v }

// TimingFields are the metrics that measure wall time or the machine (a policy's GPU memory and
// utilisation, DeviceMetrics) and so differ between equal runs.
var TimingFields = []string{"rollout_s", "train_s", "step_s", "tokens_per_s", "gpu_mem_gib", "gpu_used_gib", "gpu_util", "engine_busy", "rollout_wall_s"}

// DeviceMetrics is implemented by an engine that can say what its devices hold and do now (a torch
// worker on GPUs, read through NVML): its numbers join its policy's line of every step's metrics.
// It returns nothing where it cannot tell (no NVML, a worker on the CPU): the keys are then absent,
// never zero.
type DeviceMetrics interface {
	DeviceMetrics() map[string]float64
}

// addDeviceMetrics adds the engine's device numbers, if it has any, to its policy's line.
func addDeviceMetrics(m Metrics, eng any) {
	d, ok := eng.(DeviceMetrics)
	if !ok {
		return
	}
	for k, v := range d.DeviceMetrics() {
		m.set(k, v)
	}
}

// WithoutTimings returns metrics.jsonl text with the TimingFields removed from every line: what
// two equal runs must agree on byte for byte.
func WithoutTimings(jsonl string) string {
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(jsonl), "\n") {
		for _, k := range TimingFields {
			if i := strings.Index(line, `"`+k+`":`); i >= 0 {
				j := strings.IndexAny(line[i:], ",}")
				if line[i+j] == ',' {
					j++ // drop the separator with the field
				}
				line = line[:i] + line[i+j:]
			}
		}
		out = append(out, strings.TrimSuffix(strings.Replace(line, ",}", "}", 1), ","))
	}
	return strings.Join(out, "\n")
}

// MarshalJSON writes step and policy first, then the other keys sorted.
func (m Metrics) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	fmt.Fprintf(&b, `{"step":%d,"policy":%s`, m.int("step"), strconv.Quote(m.Policy()))
	keys := make([]string, 0, len(m))
	for k := range m {
		if k != "step" && k != "policy" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := m[k]
		if f, ok := v.(float64); ok && (math.IsNaN(f) || math.IsInf(f, 0)) {
			v = nil
		}
		enc, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(&b, ",%s:%s", strconv.Quote(k), enc)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// metricsWriter appends to metrics.jsonl. The file is only ever appended to: a step's lines go
// out in one write, and a write cut short (a full disk) is cut back to the last whole line, so
// what earlier steps wrote is never touched. Where a resume must drop lines, or a torn last line
// left by a crash must go, the new file is written beside it and renamed over it (rewrite), so a
// crash at any moment leaves the old file or the new one, whole.
type metricsWriter struct {
	f    *os.File
	size int64 // the bytes of whole lines in the file
}

// open opens metrics.jsonl for appending. A last line without its newline (a write cut short by
// a crash or a full disk) is completed when it is a whole JSON object, else dropped; either is
// said in events.
func (w *metricsWriter) open(path string, events *eventLog) error {
	if err := repairTail(path, events); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("metrics: %w", err)
	}
	w.f, w.size = f, fi.Size()
	return nil
}

// repairTail completes or drops a torn last line of the metrics file at path.
func repairTail(path string, events *eventLog) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if len(b) == 0 || b[len(b)-1] == '\n' {
		return nil
	}
	cut := bytes.LastIndexByte(b, '\n') + 1
	torn := b[cut:]
	var obj map[string]any
	if json.Unmarshal(torn, &obj) == nil {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			return err
		}
		_, err = f.Write([]byte{'\n'})
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		events.printf("metrics: %s ended without a newline after a whole line (a write cut short); the newline was added", path)
		return nil
	}
	if err := rewriteFile(path, b[:cut]); err != nil {
		return err
	}
	show := torn
	if len(show) > 80 {
		show = show[:80]
	}
	events.printf("metrics: dropped the torn last line of %s (%d bytes, a write cut short by a crash or a full disk): %q", path, len(torn), show)
	return nil
}

// rewriteFile replaces the file at path by b: written beside it, synced, renamed over it.
func rewriteFile(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after a successful rename there is nothing left to remove
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	syncDir(filepath.Dir(path))
	return nil
}

// writeLines appends metrics lines (a step's: each policy, then _run, then any _eval) in one
// write. A write that fails part-way is cut back, so the file keeps only whole lines.
func (w *metricsWriter) writeLines(ms []Metrics) error {
	if w.f == nil {
		return nil
	}
	var b bytes.Buffer
	for _, m := range ms {
		line, err := json.Marshal(m)
		if err != nil {
			return err
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	if _, err := w.f.Write(b.Bytes()); err != nil {
		if terr := w.f.Truncate(w.size); terr != nil {
			return fmt.Errorf("metrics: %s: %w; the partial lines could not be cut back (%v): the next resume drops them", w.f.Name(), err, terr)
		}
		return fmt.Errorf("metrics: %s: %w", w.f.Name(), err)
	}
	w.size += int64(b.Len())
	return nil
}

// metricsStep reads the step of a metrics line; ok is false for a line that is not one.
func metricsStep(line []byte) (step int, policy string, ok bool) {
	var head struct {
		Step   *int   `json:"step"`
		Policy string `json:"policy"`
	}
	if json.Unmarshal(line, &head) != nil || head.Step == nil {
		return 0, "", false
	}
	return *head.Step, head.Policy, true
}

// scanLines calls fn with each line of b (without its newline).
func scanLines(b []byte, fn func(line []byte)) {
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			fn(b)
			return
		}
		fn(b[:i])
		b = b[i+1:]
	}
}

// truncateAfter drops the metrics lines of steps after step (a resume goes on from step). The
// file is rewritten (beside it, then renamed) only when it holds such lines.
func (w *metricsWriter) truncateAfter(step int) error {
	if w.f == nil {
		return nil
	}
	path := w.f.Name()
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	var keep bytes.Buffer
	dropped := false
	scanLines(b, func(line []byte) {
		if s, _, ok := metricsStep(line); ok && s > step {
			dropped = true
			return
		}
		keep.Write(line)
		keep.WriteByte('\n')
	})
	if !dropped {
		return nil
	}
	if err := w.f.Close(); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	w.f = nil
	if err := rewriteFile(path, keep.Bytes()); err != nil {
		return fmt.Errorf("metrics: dropping the lines of steps after %d from %s: %w (the file is as it was)", step, path, err)
	}
	return w.open(path, nil)
}

// missingSteps lists the steps 1…step that have no _run line in the metrics file: lines lost (a
// file cut by hand, a crash of an older version) that no resume can bring back.
func (w *metricsWriter) missingSteps(step int) ([]int, error) {
	if w.f == nil || step <= 0 {
		return nil, nil
	}
	b, err := os.ReadFile(w.f.Name())
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	have := map[int]bool{}
	scanLines(b, func(line []byte) {
		if s, p, ok := metricsStep(line); ok && p == "_run" {
			have[s] = true
		}
	})
	var missing []int
	for s := 1; s <= step; s++ {
		if !have[s] {
			missing = append(missing, s)
		}
	}
	return missing, nil
}

// stepRanges writes steps (ascending) as ranges: "2, 5-9, 12".
func stepRanges(steps []int) string {
	var parts []string
	for i := 0; i < len(steps); {
		j := i
		for j+1 < len(steps) && steps[j+1] == steps[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(steps[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", steps[i], steps[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}

// close closes the file; a writer never opened has nothing to close.
func (w *metricsWriter) close() error {
	if w.f == nil {
		return nil
	}
	return w.f.Close()
}

// fillRewardMetrics sets a policy's reward and generation numbers of a step (reward_mean,
// samples, tokens, truncated, response_len, …) from its completions and its trained samples.
func fillRewardMetrics(m Metrics, gens []*script.Completion, ss []trainSample) {
	var rs []float64
	tokens, truncated := 0, 0
	for _, c := range gens {
		if rw, ok := c.Reward(); ok {
			rs = append(rs, rw)
		}
		tokens += len(c.Tokens())
		if c.FinishReason() == "length" {
			truncated++
		}
	}
	for _, s := range ss {
		if s.C.Conversation() {
			rs = append(rs, s.reward) // a chat's reward is its conversation's, not a turn's
		}
	}
	if len(rs) > 0 {
		// No reward is no number: a policy that generated nothing this step, or whose
		// completions nobody rewarded (a frozen judge), has no reward_mean, not a mean of 0.
		mean, std := meanStd(rs)
		m.set("reward_mean", mean)
		m.set("reward_std", std)
	}
	m.set("samples", len(ss))
	m.set("completions", len(gens))
	m.set("tokens", tokens)
	rl := 0.0
	if len(gens) > 0 {
		rl = float64(tokens) / float64(len(gens))
		m.set("truncated", float64(truncated)/float64(len(gens)))
	} else {
		m.set("truncated", 0.0)
	}
	m.set("response_len", rl)
}

// meanStd returns the mean and the population standard deviation (0, 0 for no values).
func meanStd(xs []float64) (float64, float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	mean := s / float64(len(xs))
	var v float64
	for _, x := range xs {
		v += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(v / float64(len(xs)))
}

// runMetrics is a step's run-wide line ("_run"): rollouts, failures, tokens, timings and the
// means of the script's log() values, whose sums (logNameSet.sums) are logs. Its tokens_per_s is
// the tokens generated over genS, the time an engine was generating them (an agent() run's
// rollouts also start programs and run tools, which rolloutS counts).
func runMetrics(step int, ros []*script.Rollout, res *StepResult, rolloutS, genS, trainS, stepS float64, logs map[string][2]float64) Metrics {
	m := newMetrics(step, "_run")
	m.set("rollouts", len(ros))
	m.set("failed", len(res.Failed))
	tokens := 0
	for _, p := range res.Policies {
		tokens += p.int("tokens")
	}
	m.set("tokens", tokens)
	m.set("rollout_s", rolloutS)
	m.set("train_s", trainS)
	m.set("step_s", stepS)
	switch {
	case genS > 0:
		m.set("tokens_per_s", float64(tokens)/genS)
	case rolloutS > 0: // nothing generated
		m.set("tokens_per_s", 0.0)
	}
	for k, v := range logs {
		m.set(k, v[0]/v[1])
	}
	return m
}

// logNameSet is the log() names a run has written to its _run lines, at most
// script.MaxLogNamesPerRun; the run owns it (Run.logNames).
type logNameSet map[string]bool

// sums adds up the log() values of the step's successful rollouts. It applies log()'s rules
// again, since a sandboxed rollout's values come from its child: a rollout that reports a name
// the host writes itself (script.RunFields), a name too long or not finite, or more than
// script.MaxLogNamesPerRollout names, counts with none of its values. Names new to the run past
// script.MaxLogNamesPerRun are dropped; events says both.
func (names *logNameSet) sums(step int, ros []*script.Rollout, events *eventLog) map[string][2]float64 {
	sums := map[string][2]float64{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		logs := ro.Logs()
		if err := checkLogs(logs); err != nil {
			events.printf("step %d task %s: its log() values are left out of the metrics: %v", step, ro.Task.ID, err)
			continue
		}
		for k, v := range logs {
			a := sums[k]
			sums[k] = [2]float64{a[0] + v[0], a[1] + v[1]}
		}
	}
	var dropped []string
	for k := range sums {
		if !(*names)[k] && len(*names) >= script.MaxLogNamesPerRun {
			dropped = append(dropped, k)
			continue
		}
		if *names == nil {
			*names = logNameSet{}
		}
		(*names)[k] = true
	}
	if len(dropped) > 0 {
		sort.Strings(dropped)
		for _, k := range dropped {
			delete(sums, k)
		}
		list := strings.Join(dropped[:min(len(dropped), 5)], ", ")
		if len(dropped) > 5 {
			list += ", …"
		}
		events.printf("step %d: log(): the run has written %d metric names, the most a run writes; %d new names are left out of its metrics: %s",
			step, len(*names), len(dropped), list)
	}
	return sums
}

// checkLogs applies log()'s rules to a rollout's logged values.
func checkLogs(logs map[string][2]float64) error {
	if len(logs) > script.MaxLogNamesPerRollout {
		return fmt.Errorf("%d metric names, more than the %d a rollout logs", len(logs), script.MaxLogNamesPerRollout)
	}
	for k, v := range logs {
		if err := script.CheckLogName("log", k); err != nil {
			return err
		}
		if math.IsNaN(v[0]) || math.IsInf(v[0], 0) || !(v[1] >= 1) {
			return fmt.Errorf("log: %s is not a finite number", k)
		}
	}
	return nil
}

// busyMeter measures the time an engine has at least one call running.
type busyMeter struct {
	mu      sync.Mutex
	running int
	since   time.Time
	total   time.Duration
	tokens  int64 // what the calls produced (count), for a rate over the same calls' time
}

// count adds the tokens a call produced; a nil meter counts nothing.
func (b *busyMeter) count(tokens int) {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.tokens += int64(tokens)
	b.mu.Unlock()
}

// read returns the busy time and the tokens counted so far, taken together.
func (b *busyMeter) read() (time.Duration, int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	t := b.total
	if b.running > 0 {
		t += time.Since(b.since)
	}
	return t, b.tokens
}

// begin and end bracket one engine call; a nil meter measures nothing.
func (b *busyMeter) begin() {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.running == 0 {
		b.since = time.Now()
	}
	b.running++
}

// end ends the call begin began.
func (b *busyMeter) end() {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.running--
	if b.running == 0 {
		b.total += time.Since(b.since)
	}
}

// busy returns the busy time so far, the call running now included.
func (b *busyMeter) busy() time.Duration {
	t, _ := b.read()
	return t
}
