package script

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"strconv"

	"go.starlark.net/starlark"
)

// EncodeState writes the state store as JSON that keeps Starlark's types: ints stay ints (any
// size), tuples stay tuples, dict keys keep their types.
func EncodeState(s *State) ([]byte, error) {
	out := map[string]any{}
	for _, k := range s.Keys() {
		v, _ := s.Get(k)
		e, err := EncodeValue(v)
		if err != nil {
			return nil, fmt.Errorf("state %q: %w", k, err)
		}
		out[k] = e
	}
	return json.MarshalIndent(out, "", " ")
}

// EncodeValue turns a Starlark value into JSON that keeps its types (the state store's values,
// sandbox messages).
func EncodeValue(v starlark.Value) (any, error) {
	switch v := v.(type) {
	case starlark.NoneType:
		return nil, nil
	case starlark.Bool:
		return bool(v), nil
	case starlark.String:
		return string(v), nil
	case starlark.Int:
		return map[string]any{"int": v.String()}, nil
	case starlark.Float:
		f := float64(v)
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return map[string]any{"float": strconv.FormatFloat(f, 'g', -1, 64)}, nil
		}
		return map[string]any{"float": f}, nil
	case *starlark.List, starlark.Tuple:
		var items []any
		it := starlark.Iterate(v)
		defer it.Done()
		var x starlark.Value
		for it.Next(&x) {
			e, err := EncodeValue(x)
			if err != nil {
				return nil, err
			}
			items = append(items, e)
		}
		if items == nil {
			items = []any{}
		}
		if _, ok := v.(starlark.Tuple); ok {
			return map[string]any{"tuple": items}, nil
		}
		return map[string]any{"list": items}, nil
	case *starlark.Dict:
		pairs := [][2]any{}
		for _, kv := range v.Items() {
			k, err := EncodeValue(kv[0])
			if err != nil {
				return nil, err
			}
			x, err := EncodeValue(kv[1])
			if err != nil {
				return nil, err
			}
			pairs = append(pairs, [2]any{k, x})
		}
		return map[string]any{"dict": pairs}, nil
	}
	return nil, fmt.Errorf("a %s cannot be saved", v.Type())
}

// DecodeState reads what EncodeState wrote into s.
func DecodeState(b []byte, s *State) error {
	var in map[string]json.RawMessage
	if err := json.Unmarshal(b, &in); err != nil {
		return err
	}
	for k, raw := range in {
		v, err := DecodeValue(raw)
		if err != nil {
			return fmt.Errorf("%q: %w", k, err)
		}
		if err := s.Set(k, v); err != nil {
			return err
		}
	}
	return nil
}

// DecodeValue decodes one value written by EncodeValue.
func DecodeValue(raw []byte) (starlark.Value, error) {
	var x any
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	if err := d.Decode(&x); err != nil {
		return nil, err
	}
	return decodeValue(x)
}

func decodeValue(x any) (starlark.Value, error) {
	switch x := x.(type) {
	case nil:
		return starlark.None, nil
	case bool:
		return starlark.Bool(x), nil
	case string:
		return starlark.String(x), nil
	case map[string]any:
		for tag, v := range x {
			switch tag {
			case "int":
				s, _ := v.(string)
				i, ok := new(big.Int).SetString(s, 10)
				if !ok {
					return nil, fmt.Errorf("bad int %v", v)
				}
				return starlark.MakeBigInt(i), nil
			case "float":
				switch f := v.(type) {
				case json.Number:
					g, err := f.Float64()
					return starlark.Float(g), err
				case string:
					g, err := strconv.ParseFloat(f, 64)
					return starlark.Float(g), err
				}
			case "list", "tuple":
				items, _ := v.([]any)
				vals := make([]starlark.Value, len(items))
				for i, it := range items {
					e, err := decodeValue(it)
					if err != nil {
						return nil, err
					}
					vals[i] = e
				}
				if tag == "tuple" {
					return starlark.Tuple(vals), nil
				}
				return starlark.NewList(vals), nil
			case "dict":
				pairs, _ := v.([]any)
				d := starlark.NewDict(len(pairs))
				for _, p := range pairs {
					kv, _ := p.([]any)
					if len(kv) != 2 {
						return nil, fmt.Errorf("bad dict entry %v", p)
					}
					k, err := decodeValue(kv[0])
					if err != nil {
						return nil, err
					}
					val, err := decodeValue(kv[1])
					if err != nil {
						return nil, err
					}
					if err := d.SetKey(k, val); err != nil {
						return nil, err
					}
				}
				return d, nil
			}
		}
	}
	return nil, fmt.Errorf("cannot decode %v", x)
}
