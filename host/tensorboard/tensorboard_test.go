package tensorboard

import (
	"encoding/binary"
	"encoding/hex"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// The CRCs and the framed record are what TensorBoard's own writer computes
// (tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c, RecordWriter).
func TestMaskedCRC(t *testing.T) {
	var five [8]byte
	binary.LittleEndian.PutUint64(five[:], 5)
	for _, c := range []struct {
		data []byte
		want uint32
	}{
		{nil, 0xa282ead8},
		{[]byte("123456789"), 0xc78ab0e5},
		{[]byte("hello"), 0x191c1fbb},
		{five[:], 0x3e04b2ea},
	} {
		if got := maskedCRC(c.data); got != c.want {
			t.Errorf("maskedCRC(%q) = %#x, want %#x", c.data, got, c.want)
		}
	}
	if got, want := hex.EncodeToString(appendRecord(nil, []byte("hello"))), "0500000000000000eab2043e68656c6c6fbb1f1c19"; got != want {
		t.Errorf("record of hello = %s, want %s", got, want)
	}
}

// fields decodes a message into its fields by number (the last of each, and every bytes value in
// order under repeated).
type fields struct {
	varint   map[protowire.Number]uint64
	fixed64  map[protowire.Number]uint64
	fixed32  map[protowire.Number]uint32
	bytes    map[protowire.Number][]byte
	repeated map[protowire.Number][][]byte
}

func decode(t *testing.T, b []byte) fields {
	t.Helper()
	f := fields{map[protowire.Number]uint64{}, map[protowire.Number]uint64{}, map[protowire.Number]uint32{}, map[protowire.Number][]byte{}, map[protowire.Number][][]byte{}}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		switch typ {
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			f.varint[num], b = v, b[n:]
		case protowire.Fixed64Type:
			v, n := protowire.ConsumeFixed64(b)
			f.fixed64[num], b = v, b[n:]
		case protowire.Fixed32Type:
			v, n := protowire.ConsumeFixed32(b)
			f.fixed32[num], b = v, b[n:]
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				t.Fatalf("bad bytes: %v", protowire.ParseError(n))
			}
			f.bytes[num], b = v, b[n:]
			f.repeated[num] = append(f.repeated[num], v)
		default:
			t.Fatalf("unexpected wire type %v", typ)
		}
	}
	return f
}

// readRecords reads an event file's records, checking their framing.
func readRecords(t *testing.T, path string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	for len(b) > 0 {
		n := binary.LittleEndian.Uint64(b)
		if binary.LittleEndian.Uint32(b[8:]) != maskedCRC(b[:8]) {
			t.Fatal("bad length CRC")
		}
		data := b[12 : 12+n]
		if binary.LittleEndian.Uint32(b[12+n:]) != maskedCRC(data) {
			t.Fatal("bad data CRC")
		}
		out = append(out, data)
		b = b[16+n:]
	}
	return out
}

func TestWriterEvents(t *testing.T) {
	dir := t.TempDir()
	w, err := Create(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(filepath.Base(w.Path()), "events.out.tfevents.") {
		t.Errorf("file name %s", w.Path())
	}
	w.Scalar(3, "p/reward_mean", 0.25)
	w.Histogram(3, "p/reward", []float64{0, 1, 1, math.NaN()})
	w.Text(3, "rollouts/0", "**hi**")
	w.SessionStart(4)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs := readRecords(t, w.Path())
	if len(recs) != 5 {
		t.Fatalf("%d records, want file_version and 4 events", len(recs))
	}
	if ev := decode(t, recs[0]); string(ev.bytes[eventFileVersion]) != "brain.Event:2" {
		t.Errorf("first event: %+v", ev)
	}
	value := func(rec []byte) (fields, fields) {
		ev := decode(t, rec)
		if ev.varint[eventStep] != 3 || ev.fixed64[eventWallTime] == 0 {
			t.Errorf("event step %d wall time %d", ev.varint[eventStep], ev.fixed64[eventWallTime])
		}
		s := decode(t, ev.bytes[eventSummary])
		return ev, decode(t, s.bytes[1])
	}
	_, v := value(recs[1])
	if string(v.bytes[valueTag]) != "p/reward_mean" || math.Float32frombits(v.fixed32[valueSimple]) != 0.25 {
		t.Errorf("scalar: %+v", v)
	}
	_, v = value(recs[2])
	h := decode(t, v.bytes[valueHisto])
	if string(v.bytes[valueTag]) != "p/reward" || math.Float64frombits(h.fixed64[3]) != 3 || math.Float64frombits(h.fixed64[4]) != 2 || math.Float64frombits(h.fixed64[2]) != 1 {
		t.Errorf("histogram: num %v sum %v max %v", math.Float64frombits(h.fixed64[3]), math.Float64frombits(h.fixed64[4]), math.Float64frombits(h.fixed64[2]))
	}
	_, v = value(recs[3])
	tensor, meta := decode(t, v.bytes[valueTensor]), decode(t, v.bytes[valueMetadata])
	if tensor.varint[1] != dtString || string(tensor.bytes[8]) != "**hi**" || string(decode(t, meta.bytes[1]).bytes[1]) != "text" {
		t.Errorf("text: tensor %+v metadata %+v", tensor, meta)
	}
	ev := decode(t, recs[4])
	if ev.varint[eventStep] != 4 || decode(t, ev.bytes[eventSessionLog]).varint[1] != sessionStart {
		t.Errorf("session start: %+v", ev)
	}
}

func TestHistogramOf(t *testing.T) {
	h, ok := HistogramOf([]float64{-1, 0, 0.5, 2, math.Inf(1)})
	if !ok || h.Num != 4 || h.Min != -1 || h.Max != 2 || h.Sum != 1.5 || h.SumSquares != 5.25 {
		t.Fatalf("%+v", h)
	}
	var total float64
	for _, c := range h.Counts {
		total += c
	}
	if total != 4 || h.Counts[0] != 1 || h.Counts[len(h.Counts)-1] != 1 || h.Limits[len(h.Limits)-1] != 2 || !slices.IsSorted(h.Limits) {
		t.Errorf("buckets %v limits %v", h.Counts, h.Limits)
	}
	if h, _ := HistogramOf([]float64{3, 3}); !slices.Equal(h.Limits, []float64{3}) || !slices.Equal(h.Counts, []float64{2}) {
		t.Errorf("equal values: %+v", h)
	}
	if _, ok := HistogramOf([]float64{math.NaN()}); ok {
		t.Error("a histogram of nothing finite")
	}
}

// Two writers started in the same second in one folder write two files.
func TestCreateTwice(t *testing.T) {
	dir := t.TempDir()
	a, err := Create(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Create(dir)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	b.Close()
	if a.Path() == b.Path() {
		t.Errorf("both wrote %s", a.Path())
	}
}
