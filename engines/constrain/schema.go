package constrain

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// types is a set of JSON types.
type types uint8

const (
	tObject types = 1 << iota
	tArray
	tString
	tNumber
	tInteger
	tBoolean
	tNull
	tAll = tObject | tArray | tString | tNumber | tInteger | tBoolean | tNull
)

func (t types) has(u types) bool { return t&u != 0 }

var typeNames = map[string]types{"object": tObject, "array": tArray, "string": tString, "number": tNumber,
	"integer": tInteger, "boolean": tBoolean, "null": tNull}

// node is a compiled schema: the value is one of lits (enum, const), or follows one of anyOf, or
// is of one of types with the object's and array's rules below.
type node struct {
	id    int
	types types
	lits  *litTrie
	anyOf []*node
	// Objects: the properties (keys their index in props), the required ones (a bit per
	// property) and the schema of other keys (nil: none allowed).
	props      []prop
	keys       *litTrie
	required   uint64
	additional *node
	// Arrays: the items' schema.
	items *node
}

type prop struct {
	name string
	n    *node
}

func (n *node) addProp(name string, v *node) {
	n.props = append(n.props, prop{name, v})
}

// finish indexes the property names.
func (n *node) finish() {
	n.keys = newLitTrie()
	n.keys.id = n.id
	for _, p := range n.props {
		n.keys.add([]byte(p.name))
	}
}

// maxProps is the most properties an object schema may have (a bit each in a frame's mask).
const maxProps = 64

// ignored are the schema keywords that say nothing about which values are valid.
var ignored = map[string]bool{"title": true, "description": true, "default": true, "examples": true,
	"$schema": true, "$id": true, "$comment": true, "$defs": true, "definitions": true,
	"deprecated": true, "readOnly": true, "writeOnly": true}

type compiler struct {
	root     json.RawMessage
	rootPath string
	refs     map[string]*node
	any      *node
	count    int
}

func newCompiler(root json.RawMessage, rootPath string) *compiler {
	return &compiler{root: root, rootPath: rootPath, refs: map[string]*node{}}
}

func (c *compiler) newNode() *node {
	c.count++
	return &node{id: c.count}
}

// anyValue is the schema of any JSON value.
func (c *compiler) anyValue() *node {
	if c.any == nil {
		c.any = c.newNode()
		c.any.types = tAll
		c.any.additional, c.any.items = c.any, c.any
		c.any.finish()
	}
	return c.any
}

func unsupported(path string) error { return fmt.Errorf("%s is not supported", path) }

func (c *compiler) compile(raw json.RawMessage, path string) (*node, error) {
	raw = bytes.TrimSpace(raw)
	switch string(raw) {
	case "true":
		return c.anyValue(), nil
	case "false":
		return nil, fmt.Errorf("%s: the schema false allows no value", path)
	}
	var kw map[string]json.RawMessage
	if err := json.Unmarshal(raw, &kw); err != nil {
		return nil, fmt.Errorf("%s: a schema must be a JSON object: %v", path, err)
	}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range kw {
			if !yield(k) {
				return
			}
		}
	})
	n := c.newNode()
	for _, k := range keys {
		switch k {
		case "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref":
		default:
			if !ignored[k] {
				return nil, unsupported(path + "." + k)
			}
		}
	}
	if ref, ok := kw["$ref"]; ok {
		for _, k := range keys {
			if k != "$ref" && !ignored[k] {
				return nil, fmt.Errorf("%s.%s beside $ref is not supported", path, k)
			}
		}
		return c.ref(ref, path+".$ref")
	}
	if alts, ok := kw["anyOf"]; ok {
		for _, k := range keys {
			if k != "anyOf" && !ignored[k] {
				return nil, fmt.Errorf("%s.%s beside anyOf is not supported", path, k)
			}
		}
		var list []json.RawMessage
		if err := json.Unmarshal(alts, &list); err != nil || len(list) == 0 {
			return nil, fmt.Errorf("%s.anyOf: want a non-empty list of schemas", path)
		}
		for i, a := range list {
			an, err := c.compile(a, fmt.Sprintf("%s.anyOf[%d]", path, i))
			if err != nil {
				return nil, err
			}
			n.anyOf = append(n.anyOf, an)
		}
		return n, nil
	}
	n.types = tAll
	if t, ok := kw["type"]; ok {
		var one string
		var list []string
		if json.Unmarshal(t, &one) == nil {
			list = []string{one}
		} else if err := json.Unmarshal(t, &list); err != nil || len(list) == 0 {
			return nil, fmt.Errorf("%s.type: want a type name or a list of them", path)
		}
		n.types = 0
		for _, name := range list {
			tt, ok := typeNames[name]
			if !ok {
				return nil, fmt.Errorf("%s.type: unknown type %q", path, name)
			}
			n.types |= tt
		}
	}
	var lits []json.RawMessage
	if e, ok := kw["enum"]; ok {
		if err := json.Unmarshal(e, &lits); err != nil || len(lits) == 0 {
			return nil, fmt.Errorf("%s.enum: want a non-empty list of values", path)
		}
	}
	if v, ok := kw["const"]; ok {
		if lits != nil {
			return nil, fmt.Errorf("%s: enum and const together are not supported", path)
		}
		lits = []json.RawMessage{v}
	}
	if lits != nil {
		n.lits = newLitTrie()
		n.lits.id = n.id
		for _, v := range lits {
			var b bytes.Buffer
			if err := json.Compact(&b, v); err != nil {
				return nil, fmt.Errorf("%s.enum: %v", path, err)
			}
			if n.types.has(typeOf(b.Bytes())) {
				n.lits.add(b.Bytes())
			}
		}
		if len(n.lits.nodes[0].next) == 0 {
			return nil, fmt.Errorf("%s: no value of enum or const has the schema's type", path)
		}
		return n, nil
	}
	if p, ok := kw["properties"]; ok {
		var props map[string]json.RawMessage
		if err := json.Unmarshal(p, &props); err != nil {
			return nil, fmt.Errorf("%s.properties: want an object of schemas", path)
		}
		if len(props) > maxProps {
			return nil, fmt.Errorf("%s.properties: %d properties; at most %d are supported", path, len(props), maxProps)
		}
		for _, name := range slices.Sorted(func(yield func(string) bool) {
			for k := range props {
				if !yield(k) {
					return
				}
			}
		}) {
			if strings.ContainsAny(name, "\"\\") || strings.ContainsFunc(name, func(r rune) bool { return r < 0x20 }) {
				return nil, fmt.Errorf("%s.properties: the name %q (with a quote, a backslash or a control character) is not supported", path, name)
			}
			pn, err := c.compile(props[name], path+".properties."+name)
			if err != nil {
				return nil, err
			}
			n.addProp(name, pn)
		}
	}
	if r, ok := kw["required"]; ok {
		var names []string
		if err := json.Unmarshal(r, &names); err != nil {
			return nil, fmt.Errorf("%s.required: want a list of property names", path)
		}
		for _, name := range names {
			i := slices.IndexFunc(n.props, func(p prop) bool { return p.name == name })
			if i < 0 {
				return nil, fmt.Errorf("%s.required: %q is not in properties, which is not supported", path, name)
			}
			n.required |= 1 << i
		}
	}
	n.additional = c.anyValue()
	if a, ok := kw["additionalProperties"]; ok {
		switch string(bytes.TrimSpace(a)) {
		case "false":
			n.additional = nil
		case "true":
		default:
			an, err := c.compile(a, path+".additionalProperties")
			if err != nil {
				return nil, err
			}
			n.additional = an
		}
	}
	n.items = c.anyValue()
	if it, ok := kw["items"]; ok {
		if t := bytes.TrimSpace(it); len(t) > 0 && t[0] == '[' {
			return nil, fmt.Errorf("%s.items as a list (tuple items) is not supported", path)
		}
		in, err := c.compile(it, path+".items")
		if err != nil {
			return nil, err
		}
		n.items = in
	}
	n.finish()
	return n, nil
}

// ref compiles a $ref: a JSON pointer into the root schema ("#/$defs/Name"). A schema that
// refers to itself (directly or not) compiles to a recursive grammar.
func (c *compiler) ref(raw json.RawMessage, path string) (*node, error) {
	var ref string
	if err := json.Unmarshal(raw, &ref); err != nil || !strings.HasPrefix(ref, "#") {
		return nil, fmt.Errorf("%s: only references into this schema (\"#/$defs/Name\") are supported", path)
	}
	if n, ok := c.refs[ref]; ok {
		return n, nil
	}
	target := c.root
	for _, tok := range strings.Split(strings.TrimPrefix(ref, "#"), "/")[1:] {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		var obj map[string]json.RawMessage
		var list []json.RawMessage
		if json.Unmarshal(target, &obj) == nil {
			t, ok := obj[tok]
			if !ok {
				return nil, fmt.Errorf("%s: %q is not in the schema", path, ref)
			}
			target = t
		} else if i, err := strconv.Atoi(tok); err == nil && json.Unmarshal(target, &list) == nil && i >= 0 && i < len(list) {
			target = list[i]
		} else {
			return nil, fmt.Errorf("%s: %q is not in the schema", path, ref)
		}
	}
	n := c.newNode()
	c.refs[ref] = n
	t, err := c.compile(target, c.rootPath+strings.ReplaceAll(strings.TrimPrefix(ref, "#"), "/", "."))
	if err != nil {
		return nil, err
	}
	*n = *t
	return n, nil
}

// typeOf is the type of a compact JSON value (a number's as integer when it has no fraction or
// exponent; an integer is also a number).
func typeOf(v []byte) types {
	switch v[0] {
	case '{':
		return tObject
	case '[':
		return tArray
	case '"':
		return tString
	case 't', 'f':
		return tBoolean
	case 'n':
		return tNull
	}
	if bytes.ContainsAny(v, ".eE") {
		return tNumber
	}
	return tNumber | tInteger
}

// litTrie is a set of byte strings as a trie: node 0 is the root; term is the index of the
// string that ends at a node (-1: none) and below the bits of the strings ending at or under it
// (the first 64).
type litTrie struct {
	id    int // names the set in a state's key: the node's id, or negative for the fixed sets
	nodes []litNode
	count int
}

type litNode struct {
	next  map[byte]int32
	term  int32
	below uint64
}

func newLitTrie() *litTrie {
	return &litTrie{nodes: []litNode{{term: -1}}}
}

func (t *litTrie) add(s []byte) {
	idx := t.count
	t.count++
	var bit uint64
	if idx < 64 {
		bit = 1 << idx
	}
	at := int32(0)
	t.nodes[0].below |= bit
	for _, b := range s {
		nx, ok := t.nodes[at].next[b]
		if !ok {
			if t.nodes[at].next == nil {
				t.nodes[at].next = map[byte]int32{}
			}
			nx = int32(len(t.nodes))
			t.nodes = append(t.nodes, litNode{term: -1})
			t.nodes[at].next[b] = nx
		}
		at = nx
		t.nodes[at].below |= bit
	}
	if t.nodes[at].term < 0 {
		t.nodes[at].term = int32(idx)
	}
}
