package tasks

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/slimen/slimen/engines"
)

// maxWarnings bounds what a source keeps of its skipped lines; the rest are counted.
const maxWarnings = 100

// jsonlSource is a JSONL file read into memory.
type jsonlSource struct {
	path     string
	tasks    []Task
	warnings []string
	shuffle  bool
	seed     uint64

	mu    sync.Mutex
	perms map[int][]int // epoch → order, the last two epochs (a batch can straddle a boundary)
}

func openJSONL(path string, o Options) (Source, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("data: %s does not exist; give a JSONL file or synthetic:arith", path)
		}
		return nil, fmt.Errorf("data: %w", err)
	}
	s := &jsonlSource{path: path, shuffle: o.Shuffle, seed: o.Seed, perms: map[int][]int{}}
	base := strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
	raw = bytes.TrimPrefix(raw, []byte("\xef\xbb\xbf")) // a UTF-8 byte-order mark
	skipped, problems := 0, 0
	warn := func(format string, args ...any) {
		if problems++; problems <= maxWarnings {
			s.warnings = append(s.warnings, fmt.Sprintf(format, args...))
		}
	}
	ids := map[string]int{}   // id → line, to warn about repeats
	keys := map[string]bool{} // every key of the usable lines
	labelled := false         // some usable line has the label key
	for n, line := range bytes.Split(raw, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		t, obj, err := parseLine(line, o)
		if err != nil {
			skipped++
			warn("%s:%d: %v; line skipped", path, n+1, err)
			continue
		}
		if t.ID == "" {
			t.ID = base + "-" + strconv.Itoa(n+1)
		}
		if prev, dup := ids[t.ID]; dup {
			warn("%s:%d: id %q is also the id of line %d; tasks sharing an id share a GRPO group by default", path, n+1, t.ID, prev)
		}
		ids[t.ID] = n + 1
		s.tasks = append(s.tasks, t)
		for k := range obj {
			keys[k] = true
			labelled = labelled || k == o.LabelKey
		}
	}
	if problems > maxWarnings {
		s.warnings = append(s.warnings, fmt.Sprintf("%s: … and %d more problems", path, problems-maxWarnings))
	}
	if len(s.tasks) == 0 {
		if skipped == 0 {
			return nil, fmt.Errorf("data: %s has no tasks; write one JSON object per line, with the prompt under %q", path, o.InputKey)
		}
		return nil, fmt.Errorf("data: %s has no usable task: all %d lines were skipped; the first:\n  %s", path, skipped, s.warnings[0])
	}
	if !labelled {
		// A label under another key reads as no label at all: a script comparing answers with
		// task.label would reward whatever does not parse. Said first, before the lines' problems.
		s.warnings = append([]string{fmt.Sprintf("%s: no line has the label key %q, so every task.label is None (set "+
			"%s.label_key if the label is under another key; the lines have the keys %s)",
			path, o.LabelKey, o.Keys, strings.Join(slices.Sorted(maps.Keys(keys)), ", "))}, s.warnings...)
	}
	return s, nil
}

// parseLine reads one JSON object into a task: the prompt under inputKey, the label under
// labelKey, an optional "id", and the other keys as metadata. It returns the object too.
func parseLine(line []byte, o Options) (Task, map[string]json.RawMessage, error) {
	inputKey, labelKey := o.InputKey, o.LabelKey
	var obj map[string]json.RawMessage
	if line[0] != '{' {
		return Task{}, nil, errors.New("not a JSON object (each line must be one {…})")
	}
	if err := json.Unmarshal(line, &obj); err != nil {
		return Task{}, nil, fmt.Errorf("not valid JSON: %v", err)
	}
	t := Task{Metadata: map[string]any{}}
	p, ok := obj[inputKey]
	if !ok {
		return Task{}, nil, fmt.Errorf("no %q key (the prompt; set %s.input_key if it is under another key)", inputKey, o.Keys)
	}
	prompt, err := parsePrompt(p)
	if err != nil {
		return Task{}, nil, fmt.Errorf("%q: %v", inputKey, err)
	}
	t.Prompt = prompt
	if l, ok := obj[labelKey]; ok {
		if t.Label, t.HasLabel, err = parseLabel(l); err != nil {
			return Task{}, nil, fmt.Errorf("%q: %v", labelKey, err)
		}
	}
	if id, ok := obj["id"]; ok && inputKey != "id" && labelKey != "id" {
		if t.ID, _, err = parseLabel(id); err != nil {
			return Task{}, nil, fmt.Errorf(`"id": %v`, err)
		}
	}
	for k, v := range obj {
		if k == inputKey || k == labelKey || k == "id" {
			continue
		}
		t.Metadata[k] = parseValue(v)
	}
	return t, obj, nil
}

// parsePrompt reads a prompt: a string, or a list of {"role", "content"} messages.
func parsePrompt(raw json.RawMessage) (any, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		if strings.TrimSpace(s) == "" {
			return nil, errors.New("the prompt is empty")
		}
		return s, nil
	}
	var msgs []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, errors.New(`the prompt must be a string or a list of {"role": …, "content": …} messages`)
	}
	if len(msgs) == 0 {
		return nil, errors.New("the prompt is an empty list of messages")
	}
	out := make([]engines.Message, len(msgs))
	for i, m := range msgs {
		var role, content string
		if json.Unmarshal(m["role"], &role) != nil || role == "" {
			return nil, fmt.Errorf("message %d has no \"role\" string", i)
		}
		if json.Unmarshal(m["content"], &content) != nil {
			return nil, fmt.Errorf("message %d has no \"content\" string", i)
		}
		for k := range m {
			if k != "role" && k != "content" {
				return nil, fmt.Errorf("message %d has a %q key; messages hold only role and content", i, k)
			}
		}
		out[i] = engines.Message{Role: role, Content: content}
	}
	return out, nil
}

// parseLabel reads a label or an id: a string, or a number written as the shortest decimal that
// reads back the same (2.50 → "2.5", 1e3 → "1000"). null means none.
func parseLabel(raw json.RawMessage) (string, bool, error) {
	var v any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return "", false, err
	}
	switch v := v.(type) {
	case nil:
		return "", false, nil
	case string:
		return v, true, nil
	case json.Number:
		return formatNumber(v), true, nil
	}
	return "", false, errors.New("must be a string or a number")
}

func formatNumber(n json.Number) string {
	if i, err := strconv.ParseInt(n.String(), 10, 64); err == nil {
		return strconv.FormatInt(i, 10)
	}
	if !strings.ContainsAny(n.String(), ".eE") {
		return n.String() // an integer too long for int64: keep its digits
	}
	f, err := n.Float64()
	if err != nil {
		return n.String()
	}
	return strconv.FormatFloat(f, 'f', -1, 64)
}

// parseValue decodes a metadata value with integers as int64 and other numbers as float64.
func parseValue(raw json.RawMessage) any {
	var v any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if dec.Decode(&v) != nil {
		return nil // unreachable: the line parsed as JSON already
	}
	return numbers(v)
}

func numbers(v any) any {
	switch v := v.(type) {
	case json.Number:
		if i, err := v.Int64(); err == nil {
			return i
		}
		f, _ := v.Float64()
		return f
	case []any:
		for i := range v {
			v[i] = numbers(v[i])
		}
	case map[string]any:
		for k := range v {
			v[k] = numbers(v[k])
		}
	}
	return v
}

func (s *jsonlSource) Name() string       { return s.path }
func (s *jsonlSource) Len() int           { return len(s.tasks) }
func (s *jsonlSource) Warnings() []string { return s.warnings }

func (s *jsonlSource) Task(i int) Task {
	if i < 0 {
		panic(fmt.Sprintf("data: task index %d < 0", i))
	}
	n := len(s.tasks)
	k := i % n
	if s.shuffle {
		k = s.perm(i / n)[k]
	}
	t := s.tasks[k]
	t.Index = i
	t.Metadata = maps.Clone(t.Metadata)
	return t
}

// perm is the order of an epoch's tasks: a pure function of the seed and the epoch.
func (s *jsonlSource) perm(epoch int) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.perms[epoch]; ok {
		return p
	}
	p := rand.New(rand.NewPCG(s.seed, uint64(epoch))).Perm(len(s.tasks))
	for e := range s.perms {
		if e < epoch-1 {
			delete(s.perms, e)
		}
	}
	s.perms[epoch] = p
	return p
}
