package starlib

import (
	"fmt"
	"regexp"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// Text is @slimen//text.star: tags, thinking, token F1 and regular expressions.
var Text = &starlarkstruct.Module{
	Name: "text",
	Members: starlark.StringDict{
		"tag":         starlark.NewBuiltin("text.tag", textTag),
		"tags":        starlark.NewBuiltin("text.tags", textTags),
		"strip_think": starlark.NewBuiltin("text.strip_think", textStripThink),
		"f1":          starlark.NewBuiltin("text.f1", textF1),
		"find":        starlark.NewBuiltin("text.find", textFind),
		"find_all":    starlark.NewBuiltin("text.find_all", textFindAll),
		"sub":         starlark.NewBuiltin("text.sub", textSub),
		"truncate":    starlark.NewBuiltin("text.truncate", textTruncate),
	},
}

var tagName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.:-]*$`)

// tagPattern matches <name>…</name> (the opening tag may carry attributes), shortest content.
func tagPattern(name string) (*regexp.Regexp, error) {
	if !tagName.MatchString(name) {
		return nil, fmt.Errorf("%q is not a tag name (letters, digits, _ . : -, not starting with a digit)", name)
	}
	q := regexp.QuoteMeta(name)
	return regexp.MustCompile(`(?s)<` + q + `(?:\s[^>]*)?>(.*?)</` + q + `\s*>`), nil
}

// Tags returns the contents of every closed <name>…</name> in text, in order. An opening tag with
// no closing one, as in a truncated response, is not a tag.
func Tags(text, name string) ([]string, error) {
	re, err := tagPattern(name)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range re.FindAllStringSubmatch(text, -1) {
		out = append(out, m[1])
	}
	return out, nil
}

// Tag returns the content of the last closed <name>…</name> in text: the model's final word when
// it revised itself.
func Tag(text, name string) (string, bool, error) {
	all, err := Tags(text, name)
	if err != nil || len(all) == 0 {
		return "", false, err
	}
	return all[len(all)-1], true, nil
}

// StripThink returns the visible part of a response, trimmed:
//   - every <think>…</think> block is removed;
//   - a </think> with no <think> before it removes everything up to it, because chat templates
//     that open the thinking in the prompt leave only the closing tag in the response;
//   - an unclosed <think> removes everything after it: the response was cut off while thinking
//     and has nothing visible there.
func StripThink(text string) string {
	const open, closing = "<think>", "</think>"
	if i, j := strings.Index(text, closing), strings.Index(text, open); i >= 0 && (j < 0 || i < j) {
		text = text[i+len(closing):]
	}
	var b strings.Builder
	for {
		i := strings.Index(text, open)
		if i < 0 {
			b.WriteString(text)
			break
		}
		b.WriteString(text[:i])
		j := strings.Index(text[i:], closing)
		if j < 0 {
			break
		}
		text = text[i+j+len(closing):]
	}
	return strings.TrimSpace(b.String())
}

// Truncate keeps the first n characters of text (the last n when tail is set). Characters are
// Unicode code points, as Python counts them, so slime's "last 300 characters" carries over.
func Truncate(text string, n int, tail bool) string {
	r := []rune(text)
	if len(r) <= n {
		return text
	}
	if tail {
		return string(r[len(r)-n:])
	}
	return string(r[:n])
}

// compile compiles a pattern for the built-in fn, naming it in the error.
func compile(fn, pattern string) (*regexp.Regexp, error) {
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, fmt.Errorf("%s: bad pattern %q (Go RE2 syntax): %v", fn, pattern, err)
	}
	return re, nil
}

// matchValue turns a match into what find returns, following Python's re.findall: the whole match
// when the pattern has no groups, the group when it has one, a tuple of groups when it has more.
// A group that took no part in the match is None.
func matchValue(text string, loc []int) starlark.Value {
	group := func(g int) starlark.Value {
		if loc[2*g] < 0 {
			return starlark.None
		}
		return starlark.String(text[loc[2*g]:loc[2*g+1]])
	}
	switch groups := len(loc)/2 - 1; groups {
	case 0:
		return group(0)
	case 1:
		return group(1)
	default:
		t := make(starlark.Tuple, groups)
		for g := range t {
			t[g] = group(g + 1)
		}
		return t
	}
}

// textTag trims the content unless strip=False: models pad tag contents with new lines.
func textTag(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text, name string
	strip := true
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text, "name", &name, "strip?", &strip); err != nil {
		return nil, err
	}
	s, ok, err := Tag(text, name)
	if err != nil {
		return nil, fmt.Errorf("%s: for parameter name: %v", b.Name(), err)
	}
	if strip {
		s = strings.TrimSpace(s)
	}
	return stringOrNone(s, ok), nil
}

func textTags(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text, name string
	strip := true
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text, "name", &name, "strip?", &strip); err != nil {
		return nil, err
	}
	all, err := Tags(text, name)
	if err != nil {
		return nil, fmt.Errorf("%s: for parameter name: %v", b.Name(), err)
	}
	out := make([]starlark.Value, len(all))
	for i, s := range all {
		if strip {
			s = strings.TrimSpace(s)
		}
		out[i] = starlark.String(s)
	}
	return starlark.NewList(out), nil
}

func textStripThink(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text); err != nil {
		return nil, err
	}
	return starlark.String(StripThink(text)), nil
}

func textF1(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var prediction, reference string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "prediction", &prediction, "reference", &reference); err != nil {
		return nil, err
	}
	return starlark.Float(F1(prediction, reference)), nil
}

func textFind(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var pattern, text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "pattern", &pattern, "text", &text); err != nil {
		return nil, err
	}
	re, err := compile(b.Name(), pattern)
	if err != nil {
		return nil, err
	}
	loc := re.FindStringSubmatchIndex(text)
	if loc == nil {
		return starlark.None, nil
	}
	return matchValue(text, loc), nil
}

func textFindAll(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var pattern, text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "pattern", &pattern, "text", &text); err != nil {
		return nil, err
	}
	re, err := compile(b.Name(), pattern)
	if err != nil {
		return nil, err
	}
	var out []starlark.Value
	for _, loc := range re.FindAllStringSubmatchIndex(text, -1) {
		out = append(out, matchValue(text, loc))
	}
	return starlark.NewList(out), nil
}

// textSub replaces every match; repl uses Go's $1 / ${name} references, not Python's \1.
func textSub(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var pattern, repl, text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "pattern", &pattern, "repl", &repl, "text", &text); err != nil {
		return nil, err
	}
	re, err := compile(b.Name(), pattern)
	if err != nil {
		return nil, err
	}
	return starlark.String(re.ReplaceAllString(text, repl)), nil
}

func textTruncate(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		text string
		n    int
		tail bool
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text, "n", &n, "tail?", &tail); err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, fmt.Errorf("%s: for parameter n: got %d, want a count of characters ≥ 0 (use tail=True to keep the end)", b.Name(), n)
	}
	return starlark.String(Truncate(text, n, tail)), nil
}
