package starlib

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// Answers is @slimen//answers.star: final-answer extraction and math grading.
var Answers = &starlarkstruct.Module{
	Name: "answers",
	Members: starlark.StringDict{
		"boxed":     starlark.NewBuiltin("answers.boxed", answersBoxed),
		"extract":   starlark.NewBuiltin("answers.extract", answersExtract),
		"normalize": starlark.NewBuiltin("answers.normalize", answersNormalize),
		"equal":     starlark.NewBuiltin("answers.equal", answersEqual),
		"grade":     starlark.NewBuiltin("answers.grade", answersGrade),
	},
}

var boxCommands = []string{`\boxed`, `\fbox`}

// Boxed returns the content of the last well-formed `\boxed{…}` or `\fbox{…}` in text, braces
// matched (escaped `\{` and `\}` do not count) and the content trimmed. A box whose braces never
// close, as in a response cut off by the length limit, is skipped in favour of an earlier one.
// The brace-less form `\boxed 5` reads up to the next `$` or end of line.
func Boxed(text string) (string, bool) {
	end := len(text)
	for {
		i, cmd := lastBoxCommand(text[:end])
		if i < 0 {
			return "", false
		}
		if content, ok := boxArgument(text[i+len(cmd):]); ok {
			return content, true
		}
		end = i
	}
}

// lastBoxCommand finds the last box command in s that is not the prefix of a longer name.
func lastBoxCommand(s string) (int, string) {
	best, bestCmd := -1, ""
	for _, cmd := range boxCommands {
		for end := len(s); ; {
			i := strings.LastIndex(s[:end], cmd)
			if i < 0 {
				break
			}
			if after := i + len(cmd); after == len(s) || !isLetter(s[after]) {
				if i > best {
					best, bestCmd = i, cmd
				}
				break
			}
			end = i
		}
	}
	return best, bestCmd
}

// boxArgument reads the argument following a box command.
func boxArgument(rest string) (string, bool) {
	trimmed := strings.TrimLeft(rest, " \t")
	if strings.HasPrefix(trimmed, "{") {
		end := matchBrace(trimmed)
		if end < 0 {
			return "", false
		}
		return strings.TrimSpace(trimmed[1:end]), true
	}
	if trimmed == rest { // `\boxed5` is not a box; `\boxed 5` is
		return "", false
	}
	line, _, _ := strings.Cut(trimmed, "\n")
	line, _, _ = strings.Cut(line, "$")
	line = strings.TrimSpace(line)
	return line, line != ""
}

// matchBrace returns the index of the brace closing s[0] == '{', or -1.
func matchBrace(s string) int {
	if !strings.HasPrefix(s, "{") {
		return -1
	}
	depth := 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++ // an escaped character, \{ included, is content
		case '{':
			depth++
		case '}':
			depth--
			if depth == 0 {
				return i
			}
		}
	}
	return -1
}

var answerLine = regexp.MustCompile(`(?i)\banswer\s*:\s*([^\n]+)`)

// Extract returns the answer of the last `Answer: …` line of text (case-insensitive, as in
// "Final answer: 5"), trimmed. As in DAPO's grader, the answer may start on the next line.
func Extract(text string) (string, bool) {
	all := answerLine.FindAllStringSubmatch(text, -1)
	if len(all) == 0 {
		return "", false
	}
	return strings.TrimSpace(all[len(all)-1][1]), true
}

// Grading modes of Grade.
const (
	GradeMath       = "math"       // \boxed{} anywhere in the response: 1 or 0
	GradeDeepscaler = "deepscaler" // \boxed{} after the thinking: 1 or 0
	GradeDAPO       = "dapo"       // "Answer: …" in the last 300 characters: 1 or -1
)

// dapoWindow is how many trailing characters DAPO's grader reads.
const dapoWindow = 300

// Grade scores a response against a label the way slime's rm_hub graders do:
//
//   - "math": the last \boxed{} of the whole response equals the label → 1, else 0.
//   - "deepscaler": the same, on the text after the last `</think>` → 1, else 0. A response with
//     an unclosed `<think>` (cut off while thinking) scores 0. A response with no think tags at
//     all is graded whole, because small models write none; requireThink makes it score 0, as
//     slime does.
//   - "dapo": the last `Answer: …` in the last 300 characters equals the label → 1, else -1,
//     like slime's DAPO score (a missing answer is -1).
//
// Equality is Equal: normalised strings, or numbers within 1e-9. requireThink is only meaningful
// for "deepscaler"; with another mode it is an error rather than silently ignored.
func Grade(response, label, mode string, requireThink bool) (float64, error) {
	if requireThink && mode != GradeDeepscaler {
		return 0, fmt.Errorf("require_think applies to mode %q only, not %q", GradeDeepscaler, mode)
	}
	switch mode {
	case GradeMath:
		return gradeBoxed(response, label), nil
	case GradeDeepscaler:
		visible, ok := afterThinking(response, requireThink)
		if !ok {
			return 0, nil
		}
		return gradeBoxed(visible, label), nil
	case GradeDAPO:
		tail := response
		if r := []rune(response); len(r) > dapoWindow {
			tail = string(r[len(r)-dapoWindow:])
		}
		if pred, ok := Extract(tail); ok && Equal(pred, label) {
			return 1, nil
		}
		return -1, nil
	}
	return 0, fmt.Errorf("unknown mode %q (want %q, %q or %q)", mode, GradeMath, GradeDeepscaler, GradeDAPO)
}

func gradeBoxed(text, label string) float64 {
	if ans, ok := Boxed(text); ok && Equal(ans, label) {
		return 1
	}
	return 0
}

// afterThinking returns the visible answer of a response: the text after the last </think>.
func afterThinking(response string, requireThink bool) (string, bool) {
	if i := strings.LastIndex(response, "</think>"); i >= 0 {
		return response[i+len("</think>"):], true
	}
	if requireThink || strings.Contains(response, "<think>") {
		return "", false
	}
	return response, true
}

// answerArg unpacks an answer: a string, a number (so a label of 42 compares to "42"), or None
// for no answer.
type answerArg struct {
	s  string
	ok bool
}

func (a *answerArg) Unpack(v starlark.Value) error {
	switch v := v.(type) {
	case starlark.NoneType:
		*a = answerArg{}
	case starlark.String:
		*a = answerArg{string(v), true}
	case starlark.Int:
		*a = answerArg{v.String(), true}
	case starlark.Float:
		*a = answerArg{strconv.FormatFloat(float64(v), 'g', -1, 64), true}
	default:
		return fmt.Errorf("got %s, want string, int, float or None", v.Type())
	}
	return nil
}

// stringOrNone is the Starlark result of an extraction.
func stringOrNone(s string, ok bool) starlark.Value {
	if !ok {
		return starlark.None
	}
	return starlark.String(s)
}

func answersBoxed(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text); err != nil {
		return nil, err
	}
	return stringOrNone(Boxed(text)), nil
}

func answersExtract(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text); err != nil {
		return nil, err
	}
	return stringOrNone(Extract(text)), nil
}

// answersNormalize passes None through, so normalize(boxed(t)) needs no check.
func answersNormalize(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var s answerArg
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "s", &s); err != nil {
		return nil, err
	}
	if !s.ok {
		return starlark.None, nil
	}
	return starlark.String(Normalize(s.s)), nil
}

func answersEqual(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x, y answerArg
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "a", &x, "b", &y); err != nil {
		return nil, err
	}
	return starlark.Bool(x.ok && y.ok && Equal(x.s, y.s)), nil
}

// answersGrade accepts a list of labels too (any match counts), as slime's graders do for
// problems with several accepted answers.
func answersGrade(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		response     string
		label        starlark.Value
		mode         = GradeMath
		requireThink bool
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs,
		"response", &response, "label", &label, "mode?", &mode, "require_think?", &requireThink); err != nil {
		return nil, err
	}
	labels, err := gradeLabels(label)
	if err != nil {
		return nil, fmt.Errorf("%s: for parameter label: %v", b.Name(), err)
	}
	best := 0.0
	for i, l := range labels {
		score, err := Grade(response, l, mode, requireThink)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", b.Name(), err)
		}
		if i == 0 || score > best {
			best = score
		}
	}
	return starlark.Float(best), nil
}

func gradeLabels(v starlark.Value) ([]string, error) {
	if _, ok := v.(starlark.NoneType); ok {
		return nil, fmt.Errorf("got None; this task has no label to grade against")
	}
	seq, isSeq := v.(starlark.Sequence)
	if _, isStr := v.(starlark.String); !isSeq || isStr {
		var a answerArg
		if err := a.Unpack(v); err != nil {
			return nil, fmt.Errorf("got %s, want string, int, float or a list of them", v.Type())
		}
		return []string{a.s}, nil
	}
	var labels []string
	it := seq.Iterate()
	defer it.Done()
	var x starlark.Value
	for i := 0; it.Next(&x); i++ {
		var a answerArg
		if err := a.Unpack(x); err != nil || !a.ok {
			return nil, fmt.Errorf("element %d is %s, want string, int or float", i, x.Type())
		}
		labels = append(labels, a.s)
	}
	if len(labels) == 0 {
		return nil, fmt.Errorf("got an empty %s; give at least one accepted answer", v.Type())
	}
	return labels, nil
}
