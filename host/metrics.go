package host

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Metrics is one line of metrics.jsonl: step, policy and named numbers (docs/architecture.md, "The run directory"). Keys are
// written sorted, step and policy first, so equal runs give byte-equal files apart from timings.
type Metrics map[string]any

func newMetrics(step int, policy string) Metrics { return Metrics{"step": step, "policy": policy} }

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

func (w *metricsWriter) close() error {
	if w.f == nil {
		return nil
	}
	return w.f.Close()
}

// eventLog is events.log: start-up facts, rollout failures with backtraces, script prints,
// skipped optimizer steps, reloads. Lines also go to the run's Log writer.
type eventLog struct {
	mu sync.Mutex
	f  *os.File
	w  io.Writer
}

func (e *eventLog) open(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("events log: %w", err)
	}
	e.f = f
	return nil
}

func (e *eventLog) printf(format string, args ...any) { e.write(true, format, args...) }

// filef writes to events.log only (the run's Log writer is spared a flood of similar lines).
func (e *eventLog) filef(format string, args ...any) { e.write(false, format, args...) }

// split writes one thing said two ways: toLog to the run's Log writer, toFile to events.log (a
// line that points the terminal's reader to events.log makes no sense inside it). Without an
// events.log the terminal's line is not about it either.
func (e *eventLog) split(toLog, toFile string) {
	if e == nil {
		return
	}
	e.mu.Lock()
	hasFile := e.f != nil
	e.mu.Unlock()
	if !hasFile {
		toLog = strings.Replace(toLog, " (all in events.log)", "", 1)
	}
	e.write(false, "%s", toFile)
	if e.w != nil {
		e.mu.Lock()
		fmt.Fprintln(e.w, toLog)
		e.mu.Unlock()
	}
}

func (e *eventLog) write(toLog bool, format string, args ...any) {
	if e == nil {
		return
	}
	msg := fmt.Sprintf(format, args...)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.f != nil {
		fmt.Fprintf(e.f, "%s %s\n", time.Now().UTC().Format(time.RFC3339), msg)
	}
	if e.w != nil && toLog {
		fmt.Fprintln(e.w, msg)
	}
}

func (e *eventLog) close() error {
	if e.f == nil {
		return nil
	}
	return e.f.Close()
}
