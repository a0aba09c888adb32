package config

import (
	"fmt"
	"math"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// decoder fills the Config types from a yaml.Node tree. It exists (rather than yaml.Unmarshal)
// so that every error names its YAML line and path, unknown keys can be told from pass-through
// keys, and the keys that were written can be told from those left to defaults.
type decoder struct {
	file  string
	errs  errorList
	given map[string]int    // canonical path ("policies[0].train.lr") → line, for keys given a non-null value
	raw   map[string]string // canonical path → the path as written ("policies[0].megatron.lr")
	specs map[reflect.Type]*structSpec
}

func newDecoder(file string) *decoder {
	return &decoder{file: file, given: map[string]int{}, raw: map[string]string{}, specs: map[reflect.Type]*structSpec{}}
}

// structSpec is how one Go struct maps onto a YAML mapping.
type structSpec struct {
	name    string            // what the mapping is, for messages: "a policy entry"
	fields  map[string]int    // YAML key → field index
	order   []string          // YAML keys in field order, for messages
	aliases map[string]string // slime-n's key → ours (megatron → train)
	extra   int               // index of the inline Extra map, or -1
	// passKeys are the keys the Extra map accepts; nil accepts any key (train/engine blocks, whose
	// unknown keys go to the engine).
	passKeys map[string]bool
	line     int // index of the Line field, or -1
}

// Types whose unknown keys are collected instead of rejected, and which keys.
var (
	policyPassKeys = []string{"input_key", "label_key", "apply_chat_template", "eval_datasets"}
	evalPassKeys   = []string{"tool_key", "metadata_key", "policies", "top_k", "stop", "stop_token_ids",
		"min_new_tokens", "custom_generate_function_path", "app_service", "eval_task_timeout", "metadata_overrides"}
)

func (d *decoder) spec(t reflect.Type) *structSpec {
	if s, ok := d.specs[t]; ok {
		return s
	}
	s := &structSpec{name: "the " + t.Name() + " block", fields: map[string]int{}, extra: -1, line: -1}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		switch {
		case f.Name == "Extra":
			s.extra = i
		case f.Name == "Line":
			s.line = i
		case tag != "" && tag != "-":
			s.fields[tag] = i
			s.order = append(s.order, tag)
		}
	}
	switch t {
	case reflect.TypeFor[Config]():
		s.name = "the top level"
	case reflect.TypeFor[PolicyConfig]():
		s.name = "a policy entry"
		s.aliases = map[string]string{"megatron": "train", "sglang": "engine"}
		s.passKeys = setOf(policyPassKeys)
	case reflect.TypeFor[TrainConfig]():
		s.name = "train:"
	case reflect.TypeFor[EngineConfig]():
		s.name = "engine:"
	case reflect.TypeFor[ServerGroup]():
		s.name = "a server group"
	case reflect.TypeFor[RolloutConfig]():
		s.name = "rollout:"
	case reflect.TypeFor[DataConfig]():
		s.name = "data:"
	case reflect.TypeFor[EvalConfig]():
		s.name = "eval:"
	case reflect.TypeFor[EvalDefaults](), reflect.TypeFor[EvalDataset]():
		s.name = "an eval dataset"
		s.passKeys = setOf(evalPassKeys)
	case reflect.TypeFor[LoRAConfig]():
		s.name = "lora:"
	case reflect.TypeFor[RunConfig]():
		s.name = "run:"
	case reflect.TypeFor[SandboxConfig]():
		s.name = "sandbox:"
	}
	d.specs[t] = s
	return s
}

func setOf(keys []string) map[string]bool {
	m := make(map[string]bool, len(keys))
	for _, k := range keys {
		m[k] = true
	}
	return m
}

// pathName is a field path in two spellings: canonical (our key names, for looking up what was
// given) and shown (the user's key names, for messages).
type pathName struct{ canon, shown string }

func (p pathName) key(canon, shown string) pathName {
	if p.canon == "" {
		return pathName{canon, shown}
	}
	return pathName{p.canon + "." + canon, p.shown + "." + shown}
}

func (p pathName) index(i int) pathName {
	s := "[" + strconv.Itoa(i) + "]"
	return pathName{p.canon + s, p.shown + s}
}

func (d *decoder) errorf(line int, p pathName, format string, args ...any) {
	d.errs = append(d.errs, &Error{File: d.file, Line: line, Path: p.shown, Msg: fmt.Sprintf(format, args...)})
}

// resolve follows YAML aliases (*anchor) to the anchored node.
func resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

// pairs lists a mapping's key/value pairs with YAML merge keys (`<<: *defaults`) expanded: keys
// written in the mapping win over merged ones, and earlier merged mappings win over later ones.
func (d *decoder) pairs(n *yaml.Node, p pathName) [][2]*yaml.Node {
	var out, merged [][2]*yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind != yaml.ScalarNode || k.ShortTag() != "!!merge" {
			out = append(out, [2]*yaml.Node{k, v})
			continue
		}
		v = resolve(v)
		srcs := []*yaml.Node{v}
		if v.Kind == yaml.SequenceNode {
			srcs = v.Content
		}
		for _, src := range srcs {
			if src = resolve(src); src.Kind != yaml.MappingNode {
				d.errorf(k.Line, p, "a merge key (<<) needs a mapping or a list of mappings")
				continue
			}
			merged = append(merged, d.pairs(src, p)...)
		}
	}
	have := map[string]bool{}
	for _, kv := range out {
		have[kv[0].Value] = true
	}
	for _, kv := range merged {
		if !have[kv[0].Value] {
			have[kv[0].Value] = true
			out = append(out, kv)
		}
	}
	return out
}

// decode fills v from n. A null value leaves v as it is: in slime-n, `key: null` means "not set".
func (d *decoder) decode(n *yaml.Node, v reflect.Value, p pathName) {
	n = resolve(n)
	if isNull(n) {
		return
	}
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		d.decode(n, v.Elem(), p)
	case reflect.Struct:
		d.decodeStruct(n, v, p)
	case reflect.Slice:
		if v.Type().Elem().Kind() == reflect.String {
			d.decodeStrings(n, v, p)
			return
		}
		if n.Kind != yaml.SequenceNode {
			d.errorf(n.Line, p, "expected a list (lines starting with \"- \"), got %s", describe(n))
			return
		}
		if len(n.Content) == 0 {
			return // an empty list is the same as none
		}
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		for i, item := range n.Content {
			d.decode(item, s.Index(i), p.index(i))
		}
		v.Set(s)
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			d.errorf(n.Line, p, "expected a mapping (key: value lines), got %s", describe(n))
			return
		}
		m := map[string]any{}
		if err := n.Decode(&m); err != nil {
			d.errorf(n.Line, p, "%v", err)
			return
		}
		v.Set(reflect.ValueOf(m))
	default:
		d.decodeScalar(n, v, p)
	}
}

func (d *decoder) decodeStruct(n *yaml.Node, v reflect.Value, p pathName) {
	s := d.spec(v.Type())
	if n.Kind != yaml.MappingNode {
		d.errorf(n.Line, p, "expected a mapping (key: value lines), got %s", describe(n))
		return
	}
	if s.line >= 0 {
		v.Field(s.line).SetInt(int64(n.Line))
	}
	seen := map[string]*yaml.Node{} // canonical key → key node, to catch a key given twice
	for _, kv := range d.pairs(n, p) {
		k, val := kv[0], kv[1]
		if k.Kind != yaml.ScalarNode {
			d.errorf(k.Line, p, "a key must be a plain word, got %s", describe(k))
			continue
		}
		key := k.Value
		if v.Type() == reflect.TypeFor[Config]() && strings.HasPrefix(key, "_") {
			continue // a holder of YAML anchors, as slime-n's `_megatron_defaults: &m …`
		}
		canon := key
		if a, ok := s.aliases[key]; ok {
			canon = a
		}
		if prev, ok := seen[canon]; ok {
			if prev.Value == key {
				d.errorf(k.Line, p.key(canon, key), "given twice (lines %d and %d); keep one", prev.Line, k.Line)
			} else {
				d.errorf(k.Line, p, "%s: (line %d) and %s: (line %d) are the same block (%s: is slime-n's name for it); keep one",
					prev.Value, prev.Line, key, k.Line, prev.Value)
			}
			continue
		}
		seen[canon] = k
		fp := p.key(canon, key)
		if i, ok := s.fields[canon]; ok {
			if !isNull(resolve(val)) {
				d.given[fp.canon] = k.Line
				d.raw[fp.canon] = fp.shown
			}
			d.decode(val, v.Field(i), fp)
			continue
		}
		if msg := d.misplaced(v.Type(), key); msg != "" {
			d.errorf(k.Line, p, "%s", msg)
			continue
		}
		if s.extra >= 0 && (s.passKeys == nil || s.passKeys[key]) {
			var x any
			if err := val.Decode(&x); err != nil {
				d.errorf(k.Line, fp, "%v", err)
				continue
			}
			m := v.Field(s.extra)
			if m.IsNil() {
				m.Set(reflect.ValueOf(map[string]any{}))
			}
			m.SetMapIndex(reflect.ValueOf(key), reflect.ValueOf(&x).Elem())
			d.given[fp.canon] = k.Line
			continue
		}
		d.errorf(k.Line, p, "unknown key %q in %s; %s", key, s.name, d.hint(s, key))
	}
}

// misplaced explains a key that belongs to another block than the one it was found in; "" if
// it does not.
func (d *decoder) misplaced(t reflect.Type, key string) string {
	policy, train, engine := d.spec(reflect.TypeFor[PolicyConfig]()), d.spec(reflect.TypeFor[TrainConfig]()), d.spec(reflect.TypeFor[EngineConfig]())
	_, inPolicy := policy.fields[key]
	_, inTrain := train.fields[key]
	_, inEngine := engine.fields[key]
	switch t {
	case reflect.TypeFor[PolicyConfig]():
		if inTrain {
			return fmt.Sprintf("%s is a training setting: put it under train: (megatron: in slime-n)", key)
		}
		if inEngine {
			return fmt.Sprintf("%s is an engine setting: put it under engine: (sglang: in slime-n)", key)
		}
	case reflect.TypeFor[TrainConfig](), reflect.TypeFor[EngineConfig]():
		if inPolicy || policy.passKeys[key] {
			return fmt.Sprintf("%s belongs directly in the policy entry, not inside this block", key)
		}
		if t == reflect.TypeFor[TrainConfig]() && inEngine {
			return fmt.Sprintf("%s is an engine setting: put it under engine: (sglang: in slime-n)", key)
		}
		if t == reflect.TypeFor[EngineConfig]() && inTrain {
			return fmt.Sprintf("%s is a training setting: put it under train: (megatron: in slime-n)", key)
		}
	case reflect.TypeFor[Config]():
		switch {
		case inPolicy || inTrain || inEngine:
			return fmt.Sprintf("%s is a per-policy setting: put it in an entry of policies:", key)
		case has(d.spec(reflect.TypeFor[RolloutConfig]()), key):
			return fmt.Sprintf("%s belongs under rollout:", key)
		case has(d.spec(reflect.TypeFor[RunConfig]()), key):
			return fmt.Sprintf("%s belongs under run:", key)
		}
	}
	return ""
}

func has(s *structSpec, key string) bool { _, ok := s.fields[key]; return ok }

// hint is the end of an unknown-key message: the nearest known key, or the known keys.
func (d *decoder) hint(s *structSpec, key string) string {
	known := append([]string(nil), s.order...)
	for a := range s.aliases {
		known = append(known, a)
	}
	for k := range s.passKeys {
		known = append(known, k)
	}
	if best := nearest(key, known); best != "" {
		return fmt.Sprintf("did you mean %q?", best)
	}
	if len(s.order) <= 8 {
		return "known keys: " + strings.Join(s.order, ", ")
	}
	return "see docs/config.md for the keys it takes"
}

func (d *decoder) decodeStrings(n *yaml.Node, v reflect.Value, p pathName) {
	if n.Kind != yaml.SequenceNode {
		d.errorf(n.Line, p, "expected a list of strings, got %s", describe(n))
		return
	}
	if len(n.Content) == 0 {
		return
	}
	out := make([]string, 0, len(n.Content))
	for i, item := range n.Content {
		var s string
		d.decodeScalar(resolve(item), reflect.ValueOf(&s).Elem(), p.index(i))
		out = append(out, s)
	}
	v.Set(reflect.ValueOf(out))
}

func (d *decoder) decodeScalar(n *yaml.Node, v reflect.Value, p pathName) {
	tag := n.ShortTag()
	if n.Kind != yaml.ScalarNode {
		tag = ""
	}
	if v.Type() == reflect.TypeOf(time.Duration(0)) {
		dur, err := time.ParseDuration(n.Value)
		if n.Kind != yaml.ScalarNode || err != nil || dur < 0 {
			d.errorf(n.Line, p, "expected a duration such as 30s or 2m, got %s", describe(n))
			return
		}
		v.SetInt(int64(dur))
		return
	}
	switch v.Kind() {
	case reflect.String:
		// Numbers are read as their text (a policy named 7, a version "1.0"); true/false, lists
		// and mappings are mistakes.
		if tag != "!!str" && tag != "!!int" && tag != "!!float" {
			d.errorf(n.Line, p, "expected a string, got %s", describe(n))
			return
		}
		v.SetString(n.Value)
	case reflect.Bool:
		var b bool
		if tag != "!!bool" || n.Decode(&b) != nil {
			d.errorf(n.Line, p, "expected true or false, got %s", describe(n))
			return
		}
		v.SetBool(b)
	case reflect.Int:
		i, ok := scalarInt(n, tag)
		if !ok {
			d.errorf(n.Line, p, "expected an integer, got %s", describe(n))
			return
		}
		v.SetInt(i)
	case reflect.Uint64:
		i, ok := scalarInt(n, tag)
		if !ok || i < 0 {
			d.errorf(n.Line, p, "expected a non-negative integer, got %s", describe(n))
			return
		}
		v.SetUint(uint64(i))
	case reflect.Float64:
		var f float64
		if (tag != "!!int" && tag != "!!float") || n.Decode(&f) != nil {
			d.errorf(n.Line, p, "expected a number, got %s", describe(n))
			return
		}
		if math.IsNaN(f) || math.IsInf(f, 0) {
			d.errorf(n.Line, p, "expected a finite number, got %s", n.Value)
			return
		}
		v.SetFloat(f)
	default:
		panic(fmt.Sprintf("config: no YAML decoding for %s (%s)", v.Type(), p.canon))
	}
}

// scalarInt reads an integer; a float with an integral value (64.0) counts.
func scalarInt(n *yaml.Node, tag string) (int64, bool) {
	switch tag {
	case "!!int":
		var i int64
		return i, n.Decode(&i) == nil
	case "!!float":
		var f float64
		if n.Decode(&f) != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
			return 0, false
		}
		return int64(f), true
	}
	return 0, false
}

// describe names what a node holds, for "expected X, got Y".
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		if n.ShortTag() == "!!str" {
			return strconv.Quote(n.Value)
		}
		return n.Value
	}
	return "nothing"
}

// nearest returns the known key closest to key if it is close enough to be a typo, else "".
func nearest(key string, known []string) string {
	norm := func(s string) string { return strings.ReplaceAll(strings.ToLower(s), "-", "_") }
	sort.Strings(known)
	best, bestD := "", 3
	for _, k := range known {
		if norm(k) == norm(key) {
			return k
		}
		limit := 2
		if len(k) <= 4 {
			limit = 1
		}
		if dist := EditDistance(key, k); dist <= limit && dist < bestD {
			best, bestD = k, dist
		}
	}
	return best
}

// EditDistance is the Levenshtein distance of two names, for did-you-mean hints.
func EditDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
