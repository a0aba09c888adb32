package starlib

import (
	"fmt"
	"math"

	"go.starlark.net/starlark"
)

// number unpacks an int or a float as float64; UnpackArgs' *float64 refuses ints.
type number float64

func (n *number) Unpack(v starlark.Value) error {
	f, ok := starlark.AsFloat(v)
	if !ok {
		return fmt.Errorf("got %s, want int or float", v.Type())
	}
	if math.IsNaN(f) {
		return fmt.Errorf("got nan, want a number")
	}
	*n = number(f)
	return nil
}

// collect reads an iterable into a fresh slice.
func collect(xs starlark.Iterable) []starlark.Value {
	var out []starlark.Value
	if n := starlark.Len(xs); n > 0 {
		out = make([]starlark.Value, 0, n)
	}
	it := xs.Iterate()
	defer it.Done()
	var x starlark.Value
	for it.Next(&x) {
		out = append(out, x)
	}
	return out
}

// floats reads an iterable of numbers for the built-in fn. NaN and infinities are refused: a
// statistic over them is meaningless, and the message points at the element that went wrong.
func floats(fn string, xs starlark.Iterable) ([]float64, error) {
	var out []float64
	for i, v := range collect(xs) {
		f, ok := starlark.AsFloat(v)
		if !ok {
			return nil, fmt.Errorf("%s: element %d is %s, want int or float", fn, i, v.Type())
		}
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return nil, fmt.Errorf("%s: element %d is %v, want a finite number", fn, i, f)
		}
		out = append(out, f)
	}
	return out, nil
}

// floatList is the Starlark list of xs.
func floatList(xs []float64) *starlark.List {
	out := make([]starlark.Value, len(xs))
	for i, x := range xs {
		out[i] = starlark.Float(x)
	}
	return starlark.NewList(out)
}
