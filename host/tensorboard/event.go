package tensorboard

import (
	"math"

	"google.golang.org/protobuf/encoding/protowire"
)

// This file encodes the messages of tensorboard/compat/proto that the writer needs: Event,
// Summary, Summary.Value, HistogramProto, SummaryMetadata, TensorProto and SessionLog, field
// numbers as in those .proto files.

// Event fields.
const (
	eventWallTime    = 1 // double
	eventStep        = 2 // int64
	eventFileVersion = 3 // string
	eventSummary     = 5 // Summary
	eventSessionLog  = 7 // SessionLog
)

// Summary.Value fields (Summary holds them as field 1, repeated).
const (
	valueTag      = 1 // string
	valueSimple   = 2 // float
	valueHisto    = 5 // HistogramProto
	valueTensor   = 8 // TensorProto
	valueMetadata = 9 // SummaryMetadata
)

// dtString is TensorFlow's DataType DT_STRING.
const dtString = 7

// sessionStart is SessionLog.SessionStatus START.
const sessionStart = 1

func appendDouble(b []byte, num protowire.Number, v float64) []byte {
	b = protowire.AppendTag(b, num, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, math.Float64bits(v))
}

func appendBytes(b []byte, num protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, v)
}

// event encodes an Event of wall time and step with one more field already encoded (rest).
func event(wallTime float64, step int64, rest []byte) []byte {
	b := appendDouble(nil, eventWallTime, wallTime)
	b = appendVarint(b, eventStep, uint64(step))
	return append(b, rest...)
}

// fileVersion is the Event field of the first record of every event file.
func fileVersion() []byte { return appendBytes(nil, eventFileVersion, []byte("brain.Event:2")) }

// summary is the Event field holding a Summary of the given encoded values.
func summary(values ...[]byte) []byte {
	var s []byte
	for _, v := range values {
		s = appendBytes(s, 1, v)
	}
	return appendBytes(nil, eventSummary, s)
}

// scalarValue is a Summary.Value with a simple_value.
func scalarValue(tag string, v float32) []byte {
	b := appendBytes(nil, valueTag, []byte(tag))
	b = protowire.AppendTag(b, valueSimple, protowire.Fixed32Type)
	return protowire.AppendFixed32(b, math.Float32bits(v))
}

// Histogram is a HistogramProto: the values' count, sum, sum of squares, range, and the counts
// of buckets whose right edges are Limits.
type Histogram struct {
	Min, Max, Num, Sum, SumSquares float64
	Limits, Counts                 []float64
}

func appendPacked(b []byte, num protowire.Number, vs []float64) []byte {
	var p []byte
	for _, v := range vs {
		p = protowire.AppendFixed64(p, math.Float64bits(v))
	}
	return appendBytes(b, num, p)
}

// histoValue is a Summary.Value with a histo.
func histoValue(tag string, h Histogram) []byte {
	var p []byte
	p = appendDouble(p, 1, h.Min)
	p = appendDouble(p, 2, h.Max)
	p = appendDouble(p, 3, h.Num)
	p = appendDouble(p, 4, h.Sum)
	p = appendDouble(p, 5, h.SumSquares)
	p = appendPacked(p, 6, h.Limits)
	p = appendPacked(p, 7, h.Counts)
	b := appendBytes(nil, valueTag, []byte(tag))
	return appendBytes(b, valueHisto, p)
}

// textValue is a Summary.Value of the text plugin: a scalar DT_STRING tensor of markdown.
func textValue(tag, text string) []byte {
	plugin := appendBytes(nil, 1, []byte("text")) // PluginData.plugin_name
	meta := appendBytes(nil, 1, plugin)           // SummaryMetadata.plugin_data
	tensor := appendVarint(nil, 1, dtString)      // TensorProto.dtype
	tensor = appendBytes(tensor, 2, nil)          // tensor_shape: a scalar
	tensor = appendBytes(tensor, 8, []byte(text)) // string_val
	b := appendBytes(nil, valueTag, []byte(tag))
	b = appendBytes(b, valueTensor, tensor)
	return appendBytes(b, valueMetadata, meta)
}

// sessionLogStart is the Event field of a SessionLog START: TensorBoard then drops the events of
// earlier files at this step and after (a resumed run replaces what its first attempt wrote
// past the checkpoint).
func sessionLogStart() []byte {
	return appendBytes(nil, eventSessionLog, appendVarint(nil, 1, sessionStart))
}
