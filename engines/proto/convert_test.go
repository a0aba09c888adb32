package enginepb

import (
	"fmt"
	"math"
	"reflect"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/slimen/slimen/engines"
	"google.golang.org/protobuf/proto"
)

// fill sets every field reachable from v to a distinct non-zero value, so that a field added to
// engines/engine.go but forgotten in the conversions makes the round trips below fail.
func fill(v reflect.Value, seed *int) {
	*seed++
	switch v.Kind() {
	case reflect.String:
		v.SetString(fmt.Sprintf("s%d", *seed))
	case reflect.Int, reflect.Int32, reflect.Int64:
		v.SetInt(int64(*seed))
	case reflect.Uint64:
		v.SetUint(uint64(*seed))
	case reflect.Float32, reflect.Float64:
		v.SetFloat(float64(*seed) + 0.5)
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Slice:
		s := reflect.MakeSlice(v.Type(), 2, 2)
		for i := range 2 {
			fill(s.Index(i), seed)
		}
		v.Set(s)
	case reflect.Struct:
		for i := range v.NumField() {
			fill(v.Field(i), seed)
		}
	default:
		panic("fill: unhandled kind " + v.Kind().String())
	}
}

func filled[T any]() T {
	var x T
	seed := 0
	fill(reflect.ValueOf(&x).Elem(), &seed)
	return x
}

// wire marshals and unmarshals m, as a trip over the network does.
func wire[M proto.Message](t *testing.T, m M) M {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	out := m.ProtoReflect().New().Interface().(M)
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestRoundTripsKeepEveryField(t *testing.T) {
	info := filled[engines.Info]()
	if d := cmp.Diff(info, DecodeInfo(wire(t, EncodeInfo(info)))); d != "" {
		t.Errorf("Info (-want +got):\n%s", d)
	}
	gr := filled[engines.GenerateRequest]()
	if d := cmp.Diff(gr, DecodeGenerateRequest(wire(t, EncodeGenerateRequest(gr)))); d != "" {
		t.Errorf("GenerateRequest (-want +got):\n%s", d)
	}
	c := filled[engines.Completion]()
	// Versions is the host's record of a generation continued under a newer weights version
	// (rollout.partial); engines leave it nil, so it never crosses the wire.
	c.Versions = nil
	if d := cmp.Diff(c, DecodeCompletion(wire(t, EncodeCompletion(c)))); d != "" {
		t.Errorf("Completion (-want +got):\n%s", d)
	}
	sr := filled[engines.ScoreRequest]()
	if d := cmp.Diff(sr, DecodeScoreRequest(wire(t, EncodeScoreRequest(sr)))); d != "" {
		t.Errorf("ScoreRequest (-want +got):\n%s", d)
	}
	b := filled[engines.Batch]()
	if d := cmp.Diff(b, DecodeBatch(wire(t, EncodeBatch(b)))); d != "" {
		t.Errorf("Batch (-want +got):\n%s", d)
	}
	ts := filled[engines.TrainStats]()
	if d := cmp.Diff(ts, DecodeTrainStats(wire(t, EncodeTrainStats(ts)))); d != "" {
		t.Errorf("TrainStats (-want +got):\n%s", d)
	}
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:7777": true,
		"127.3.2.1:1":    true,
		"[::1]:7777":     true,
		"localhost:80":   true,
		":7777":          false, // every interface
		"0.0.0.0:7777":   false,
		"10.0.0.5:7777":  false,
		"gpu-node:7777":  false,
		"127.0.0.1":      false, // no port: not an address
	} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

// A max_tokens past the wire's int32 saturates rather than wraps: 4294967299 was sent as 3.
func TestMaxTokensSaturates(t *testing.T) {
	for _, n := range []int{4294967299, math.MaxInt} {
		got := EncodeGenerateRequest(engines.GenerateRequest{Sampling: engines.Sampling{MaxTokens: n}}).GetSampling().GetMaxTokens()
		if got != math.MaxInt32 {
			t.Errorf("max_tokens %d went on the wire as %d, want %d", n, got, math.MaxInt32)
		}
	}
}
