package tiny

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"sort"
)

// The safetensors format: an 8-byte little-endian header length, a JSON header mapping tensor
// names to dtype, shape and byte offsets into the data that follows, then the data.

type tensor struct {
	name  string
	shape []int
	data  []float32
}

type stEntry struct {
	DType       string `json:"dtype"`
	Shape       []int  `json:"shape"`
	DataOffsets [2]int `json:"data_offsets"`
}

// encodeSafetensors writes tensors as float32, in name order (what the safetensors library does).
func encodeSafetensors(ts []tensor, metadata map[string]string) []byte {
	ts = append([]tensor(nil), ts...)
	sort.Slice(ts, func(i, j int) bool { return ts[i].name < ts[j].name })
	header := map[string]any{}
	if metadata != nil {
		header["__metadata__"] = metadata
	}
	off := 0
	for _, t := range ts {
		header[t.name] = stEntry{DType: "F32", Shape: t.shape, DataOffsets: [2]int{off, off + 4*len(t.data)}}
		off += 4 * len(t.data)
	}
	h, err := json.Marshal(header)
	if err != nil {
		panic(err) // maps of strings and ints always marshal
	}
	for len(h)%8 != 0 { // the data is 8-byte aligned, padded with spaces as the reference writer does
		h = append(h, ' ')
	}
	out := make([]byte, 8, 8+len(h)+off)
	binary.LittleEndian.PutUint64(out, uint64(len(h)))
	out = append(out, h...)
	for _, t := range ts {
		for _, v := range t.data {
			out = binary.LittleEndian.AppendUint32(out, math.Float32bits(v))
		}
	}
	return out
}

// decodeSafetensors reads every tensor as float32 (F32, F16 and BF16 are accepted).
func decodeSafetensors(b []byte) (map[string]tensor, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("file is %d bytes, too short for a safetensors header", len(b))
	}
	n := binary.LittleEndian.Uint64(b)
	if n > uint64(len(b)-8) {
		return nil, fmt.Errorf("header length %d exceeds the file size %d", n, len(b))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &raw); err != nil {
		return nil, fmt.Errorf("header is not valid JSON: %w", err)
	}
	data := b[8+n:]
	out := map[string]tensor{}
	for name, msg := range raw {
		if name == "__metadata__" {
			continue
		}
		var e stEntry
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, fmt.Errorf("tensor %s: bad header entry: %w", name, err)
		}
		count := 1
		for _, d := range e.Shape {
			if d < 0 {
				return nil, fmt.Errorf("tensor %s: negative dimension in shape %v", name, e.Shape)
			}
			count *= d
		}
		size := map[string]int{"F32": 4, "F16": 2, "BF16": 2}[e.DType]
		if size == 0 {
			return nil, fmt.Errorf("tensor %s: dtype %s is not supported (F32, F16, BF16)", name, e.DType)
		}
		lo, hi := e.DataOffsets[0], e.DataOffsets[1]
		if lo < 0 || hi < lo || hi > len(data) || hi-lo != count*size {
			return nil, fmt.Errorf("tensor %s: data offsets [%d, %d) do not hold %d %s values within the %d data bytes", name, lo, hi, count, e.DType, len(data))
		}
		v := make([]float32, count)
		src := data[lo:hi]
		for i := range v {
			switch e.DType {
			case "F32":
				v[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
			case "BF16":
				v[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(src[2*i:])) << 16)
			case "F16":
				v[i] = halfToFloat(binary.LittleEndian.Uint16(src[2*i:]))
			}
		}
		out[name] = tensor{name: name, shape: e.Shape, data: v}
	}
	return out, nil
}

// halfToFloat converts an IEEE 754 binary16 value.
func halfToFloat(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := int(h>>10) & 0x1f
	mant := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0xff<<23 | mant<<13)
	case exp == 0:
		v := float32(mant) / (1 << 24) // subnormal: mant · 2^-24
		if sign != 0 {
			return -v
		}
		return v
	}
	return math.Float32frombits(sign | uint32(exp-15+127)<<23 | mant<<13)
}
