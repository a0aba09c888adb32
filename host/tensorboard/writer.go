package tensorboard

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"
)

// Writer writes one event file. Its methods add events to a buffer; Flush writes them out in one
// write, so a live TensorBoard sees whole steps.
type Writer struct {
	mu   sync.Mutex
	f    *os.File
	buf  []byte
	now  func() time.Time
	path string
}

// Create makes dir if needed and starts a new event file in it,
// events.out.tfevents.<unix seconds>.<hostname>, with its file_version event written. A name
// already taken (two writers in the same second) gets a suffix.
func Create(dir string) (*Writer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("tensorboard: %w", err)
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	w := &Writer{now: time.Now}
	base := filepath.Join(dir, "events.out.tfevents."+strconv.FormatInt(w.now().Unix(), 10)+"."+host)
	for i := 0; ; i++ {
		path := base
		if i > 0 {
			path += "." + strconv.Itoa(i)
		}
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if errors.Is(err, fs.ErrExist) && i < 100 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("tensorboard: %w", err)
		}
		w.f, w.path = f, path
		break
	}
	w.add(0, fileVersion())
	if err := w.Flush(); err != nil {
		w.f.Close()
		return nil, err
	}
	return w, nil
}

// Path is the event file's path.
func (w *Writer) Path() string { return w.path }

func (w *Writer) add(step int64, field []byte) {
	t := w.now()
	wall := float64(t.UnixNano()) / 1e9
	w.mu.Lock()
	w.buf = appendRecord(w.buf, event(wall, step, field))
	w.mu.Unlock()
}

// Scalar adds a scalar (TensorBoard's Scalars tab) at step.
func (w *Writer) Scalar(step int64, tag string, v float64) {
	w.add(step, summary(scalarValue(tag, float32(v))))
}

// Histogram adds a histogram of values at step (nothing for no values).
func (w *Writer) Histogram(step int64, tag string, values []float64) {
	if h, ok := HistogramOf(values); ok {
		w.add(step, summary(histoValue(tag, h)))
	}
}

// Text adds markdown text (TensorBoard's Text tab) at step.
func (w *Writer) Text(step int64, tag, markdown string) {
	w.add(step, summary(textValue(tag, markdown)))
}

// SessionStart marks a restart at step: TensorBoard drops what earlier files of the folder hold
// for this step and later ones (a resumed run's first attempt).
func (w *Writer) SessionStart(step int64) {
	w.add(step, sessionLogStart())
}

// Flush writes the events added since the last Flush.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.buf) == 0 {
		return nil
	}
	_, err := w.f.Write(w.buf)
	w.buf = w.buf[:0]
	if err != nil {
		return fmt.Errorf("tensorboard: %w", err)
	}
	return nil
}

// Close flushes and closes the file.
func (w *Writer) Close() error {
	err := w.Flush()
	if cerr := w.f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("tensorboard: %w", cerr)
	}
	return err
}

// histogramBuckets is how many equal buckets HistogramOf spreads values over.
const histogramBuckets = 30

// HistogramOf summarises values (those that are finite) in equal buckets from their minimum to
// their maximum; ok is false when there are none.
func HistogramOf(values []float64) (h Histogram, ok bool) {
	h.Min, h.Max = math.Inf(1), math.Inf(-1)
	var vs []float64
	for _, v := range values {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		vs = append(vs, v)
		h.Min, h.Max = min(h.Min, v), max(h.Max, v)
		h.Sum += v
		h.SumSquares += v * v
	}
	if len(vs) == 0 {
		return Histogram{}, false
	}
	h.Num = float64(len(vs))
	if h.Min == h.Max {
		h.Limits, h.Counts = []float64{h.Max}, []float64{h.Num}
		return h, true
	}
	width := (h.Max - h.Min) / histogramBuckets
	h.Limits = make([]float64, histogramBuckets)
	h.Counts = make([]float64, histogramBuckets)
	for i := range h.Limits {
		h.Limits[i] = h.Min + width*float64(i+1)
	}
	h.Limits[histogramBuckets-1] = h.Max
	for _, v := range vs {
		i := min(int((v-h.Min)/width), histogramBuckets-1)
		h.Counts[i]++
	}
	return h, true
}
