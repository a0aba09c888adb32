package host

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
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

type metricsWriter struct {
	f *os.File
}

func (w *metricsWriter) open(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	w.f = f
	return nil
}

// writeLines appends metrics lines (a step's: each policy, then _run, then any _eval).
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
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
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

func (e *eventLog) write(toLog bool, format string, args ...any) {
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
