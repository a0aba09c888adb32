package config

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// modelFlag is one `--key value…` of a model-args shell file.
type modelFlag struct {
	key    string   // snake_case: --num-layers → num_layers
	values []string // none for a bare switch
	line   int
}

// readModelArgs applies a policy's model_args_path: slime's scripts/models/*.sh, a bash array of
// Megatron flags (`MODEL_ARGS=( --num-layers 28 --swiglu … )`). As in slime-n, a flag that names
// a train setting fills it when the YAML did not, and every other flag goes to train's pass-through
// keys unless the YAML gives that key; `--no-x` reads as x: false and `${VAR:-default}` as its
// default. A missing file is a warning, not an error: the flags are only passed through.
func (r *resolver) readModelArgs(i int) {
	p := &r.c.Policies[i]
	pp := fmt.Sprintf("policies[%d].train", i)
	if p.Train.ModelArgsPath == "" {
		return
	}
	line := r.line(pp+".model_args_path", p.Line)
	path, data, err := findModelArgs(p.Train.ModelArgsPath, r.c.File)
	if err != nil {
		r.warnf(line, pp+".model_args_path", "%v; its flags are not applied", err)
		return
	}
	flags, skipped := parseModelArgs(data)
	for _, s := range skipped {
		r.warnf(line, pp+".model_args_path", "%s:%d: %s", path, s.line, s.msg)
	}
	train := r.d.spec(reflect.TypeFor[TrainConfig]())
	sub := &decoder{file: path, given: map[string]int{}, specs: r.d.specs}
	tv := reflect.ValueOf(&p.Train).Elem()
	for _, f := range flags {
		if idx, ok := train.fields[f.key]; ok {
			if r.given(pp + "." + f.key) {
				continue // the YAML wins
			}
			flag := pathName{"--" + f.key, "--" + strings.ReplaceAll(f.key, "_", "-")}
			if len(f.values) > 1 {
				sub.errorf(f.line, flag, "takes one value, got %d (%s)", len(f.values), strings.Join(f.values, " "))
				continue
			}
			sub.decode(scalarNode(f.values, f.line), tv.Field(idx), flag)
			r.d.given[pp+"."+f.key] = line
			continue
		}
		if _, ok := p.Train.Extra[f.key]; ok {
			continue
		}
		if p.Train.Extra == nil {
			p.Train.Extra = map[string]any{}
		}
		p.Train.Extra[f.key] = flagValue(f.values)
		r.d.given[pp+"."+f.key] = line
	}
	r.d.errs = append(r.d.errs, sub.errs...)
}

// findModelArgs looks for the file as written (relative to the working directory, as slime-n
// resolves it against its checkout), then next to the config file.
func findModelArgs(name, configFile string) (string, []byte, error) {
	tried := []string{name}
	if !filepath.IsAbs(name) && configFile != "" {
		tried = append(tried, filepath.Join(filepath.Dir(configFile), name))
	}
	for _, path := range tried {
		if data, err := os.ReadFile(path); err == nil {
			return path, data, nil
		}
	}
	return "", nil, fmt.Errorf("model_args_path %q not found (looked in %s)", name, strings.Join(tried, ", "))
}

type skippedFlag struct {
	line int
	msg  string
}

// parseModelArgs reads the `--flag [values]` words of a shell file: those inside its bash arrays
// (`NAME=( … )`), or every one when it has no array. It does not run the shell: it splits words
// (with '…' and "…" quoting and # comments) and takes the words after a flag, up to the next flag
// or the end of the array, as its values.
func parseModelArgs(data []byte) (flags []modelFlag, skipped []skippedFlag) {
	hasArray := bytes.Contains(data, []byte("=("))
	inArray := false
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	var cur *modelFlag
	end := func() {
		if cur != nil {
			flags = append(flags, *cur)
			cur = nil
		}
	}
	for n := 1; sc.Scan(); n++ {
		for _, w := range shellWords(sc.Text()) {
			if _, after, ok := strings.Cut(w, "=("); ok { // MODEL_ARGS=( or MODEL_ARGS=(--flag
				end()
				inArray = true
				if w = after; w == "" {
					continue
				}
			}
			switch {
			case hasArray && !inArray:
				continue
			case w == `\`:
				continue
			case w == ")":
				end()
				inArray = false
				continue
			case strings.HasPrefix(w, "--") && len(w) > 2:
				end()
				cur = &modelFlag{key: strings.ReplaceAll(w[2:], "-", "_"), line: n}
				continue
			case cur == nil:
				continue
			}
			if v, ok := expandDefault(w); ok {
				cur.values = append(cur.values, v)
			} else {
				skipped = append(skipped, skippedFlag{n, fmt.Sprintf("--%s uses %s, which only the shell can expand; "+
					"give the value inline under train: instead", strings.ReplaceAll(cur.key, "_", "-"), w)})
				cur = nil
			}
		}
	}
	end()
	for i := range flags {
		if k, ok := strings.CutPrefix(flags[i].key, "no_"); ok && len(flags[i].values) == 0 {
			flags[i].key, flags[i].values = k, []string{"false"}
		}
	}
	return flags, skipped
}

// shellWords splits one line into words, honouring quotes and dropping a # comment.
func shellWords(line string) []string {
	var words []string
	var w strings.Builder
	inWord := false
	var quote rune
	for _, ch := range line {
		switch {
		case quote != 0:
			if ch == quote {
				quote = 0
			} else {
				w.WriteRune(ch)
			}
		case ch == '\'' || ch == '"':
			quote, inWord = ch, true
		case ch == '#' && !inWord:
			return words
		case ch == ' ' || ch == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(ch)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words
}

// expandDefault reads ${VAR:-default} as default; a word with any other $ expansion is not
// readable without the shell.
func expandDefault(w string) (string, bool) {
	if inner, ok := strings.CutPrefix(w, "${"); ok && strings.HasSuffix(inner, "}") {
		if _, def, ok := strings.Cut(strings.TrimSuffix(inner, "}"), ":-"); ok {
			return def, true
		}
		return "", false
	}
	return w, !strings.Contains(w, "$")
}

// scalarNode makes a YAML scalar of a flag's value so the YAML decoder checks its type.
func scalarNode(values []string, line int) *yaml.Node {
	if len(values) == 0 {
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "true", Line: line}
	}
	v := values[0]
	tag := "!!str"
	switch {
	case v == "true" || v == "false":
		tag = "!!bool"
	case isInt(v):
		tag = "!!int"
	case isFloat(v):
		tag = "!!float"
	}
	return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: v, Line: line}
}

func isInt(s string) bool   { _, err := strconv.ParseInt(s, 10, 64); return err == nil }
func isFloat(s string) bool { _, err := strconv.ParseFloat(s, 64); return err == nil }

// flagValue is a flag's pass-through value: true for a switch, a number or bool where the word
// reads as one, a list for several words.
func flagValue(values []string) any {
	one := func(v string) any {
		if i, err := strconv.ParseInt(v, 10, 64); err == nil {
			return int(i)
		}
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			return f
		}
		if b, err := strconv.ParseBool(v); err == nil && (v == "true" || v == "false") {
			return b
		}
		return v
	}
	switch len(values) {
	case 0:
		return true
	case 1:
		return one(values[0])
	}
	out := make([]any, len(values))
	for i, v := range values {
		out[i] = one(v)
	}
	return out
}
