package starlib

import (
	"fmt"
	"math"
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

// Boxed is slimen's lenient reading of a box (answers.boxed with lenient=True; the default is
// slime's SlimeBoxed). It returns the content of the last well-formed `\boxed{…}` or `\fbox{…}` in text, braces
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

// Extract is slimen's lenient reading of an answer line (answers.extract with lenient=True; the
// default is DAPO's SlimeExtract). It returns the answer of the last `Answer: …` line of text
// (case-insensitive, as in "Final answer: 5", "Answer" starting a word), trimmed. As in DAPO's grader, the answer may start on the next line.
func Extract(text string) (string, bool) {
	all := answerLine.FindAllStringSubmatch(text, -1)
	if len(all) == 0 {
		return "", false
	}
	return strings.TrimSpace(all[len(all)-1][1]), true
}

// Grading modes of Grade, named after slime's rm_hub reward types.
const (
	GradeMath       = "math"       // the last \boxed{} of the response: 1 or 0
	GradeDeepscaler = "deepscaler" // the last \boxed{} after </think>: 1 or 0
	GradeDAPO       = "dapo"       // "Answer: …" in the last 300 characters, as an integer: 1 or -1
	GradeF1         = "f1"         // token F1 of the response against the label
	GradeGPQA       = "gpqa"       // the chosen letter of a multiple-choice answer: 1 or 0
)

// GradeOptions are Grade's departures from slime's verdict, all off by default.
type GradeOptions struct {
	// Lenient compares answers with Equal (normalised text, or numbers within 1e-9, so 2/4 and
	// 0.3333333333 pass for 1/2 and 1/3) and reads answers with Boxed and Extract (an earlier box
	// when the last is cut off, \fbox, a trimmed "Answer:" after a word boundary), instead of
	// slime's SlimeEqual, SlimeBoxed and SlimeExtract. For math, deepscaler and dapo.
	Lenient bool
	// NoThinkOK makes deepscaler grade a response with no </think> whole (unless it opens a
	// <think> it never closes), for models that write no think tags; slime scores it 0.
	NoThinkOK bool
	// StrictBox is DAPO's strict_box_verify: the last \boxed{…} of the last 100 characters must
	// be the label, character for character. For dapo.
	StrictBox bool
	// GPQA is the sample's metadata for gpqa (slime's "choices", "valid_letters",
	// "correct_letter", "correct_answer", "answer_text"), so that a label may be the text or the
	// index of the correct option and a response may name the option instead of its letter.
	GPQA *GPQAMetadata
}

// Label is what Grade grades against: text, or a number as a script gives it.
type Label struct {
	Text   string
	Number bool    // the label was a number; Text is Python's str() of it
	Value  float64 // the number, when Number
}

// TextLabel is a label given as a string.
func TextLabel(s string) Label { return Label{Text: s} }

// Grade scores a response against a label as slime's rm_hub does for the reward type mode:
//
//   - "math": the last \boxed{…} of the response equals the label (SlimeEqual) → 1, else 0. A label
//     in a box is unboxed; an empty or zero label scores 0.
//   - "deepscaler": the same on the text after the last </think> (or after the first
//     "###Response"); a response with neither scores 0.
//   - "dapo": the last "Answer: …" of the last 300 characters, normalised as DAPO does, is the
//     integer part of the label → 1, else -1. A label that is not a finite number is an error, as
//     it is in slime.
//   - "f1": F1 of the response and the label.
//   - "gpqa": the letter the response chooses (or, failing that, the text of the correct option
//     in the response) is the label's → 1, else 0. The label is a letter, an option's text, or the
//     index of the correct option.
func Grade(response string, label Label, mode string, opts GradeOptions) (float64, error) {
	if opts.NoThinkOK && mode != GradeDeepscaler {
		return 0, fmt.Errorf("require_think applies to mode %q only, not %q", GradeDeepscaler, mode)
	}
	if opts.Lenient && mode != GradeMath && mode != GradeDeepscaler && mode != GradeDAPO {
		return 0, fmt.Errorf("lenient applies to modes %q, %q and %q, not %q", GradeMath, GradeDeepscaler, GradeDAPO, mode)
	}
	if opts.GPQA != nil && mode != GradeGPQA {
		return 0, fmt.Errorf("choices and metadata apply to mode %q only, not %q", GradeGPQA, mode)
	}
	if opts.StrictBox && mode != GradeDAPO {
		return 0, fmt.Errorf("strict_box applies to mode %q only, not %q", GradeDAPO, mode)
	}
	switch mode {
	case GradeMath:
		if opts.Lenient {
			return gradeBoxed(response, label.Text), nil
		}
		return slimeMath(response, label.Text, label.Text == "" || label.Number && label.Value == 0), nil
	case GradeDeepscaler:
		if opts.Lenient {
			visible, ok := afterThinking(response, !opts.NoThinkOK)
			if !ok {
				return 0, nil
			}
			return gradeBoxed(visible, label.Text), nil
		}
		if opts.NoThinkOK && !strings.Contains(response, "</think>") && strings.Contains(response, "<think>") {
			return 0, nil
		}
		return slimeDeepscaler(response, label.Text, !opts.NoThinkOK), nil
	case GradeDAPO:
		if opts.Lenient {
			tail := Truncate(response, dapoWindow, true)
			if pred, ok := Extract(tail); ok && Equal(pred, label.Text) {
				return 1, nil
			}
			return -1, nil
		}
		if opts.StrictBox {
			return slimeDAPOStrictBox(response, label.Text), nil
		}
		score, ok := slimeDAPO(response, label.Text)
		if !ok {
			return 0, fmt.Errorf("mode %q needs a label that is a finite number (DAPO compares integers), got %q", GradeDAPO, label.Text)
		}
		return score, nil
	case GradeF1:
		return F1(response, label.Text), nil
	case GradeGPQA:
		l := gpqaLabel{text: label.Text, isText: !label.Number}
		if label.Number {
			l.isIndex, l.index = true, int(label.Value)
		}
		var meta GPQAMetadata
		if opts.GPQA != nil {
			meta = *opts.GPQA
		}
		return slimeGPQA(response, l, meta), nil
	}
	return 0, fmt.Errorf("unknown mode %q (want %q, %q, %q, %q or %q)", mode, GradeMath, GradeDeepscaler, GradeDAPO, GradeF1, GradeGPQA)
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

// answerArg unpacks an answer: a string, a number (so a label of 42 compares to "42", written as
// Python's str() writes it, as slime sees it), or None for no answer.
type answerArg struct {
	s  string
	ok bool
	l  Label
}

func (a *answerArg) Unpack(v starlark.Value) error {
	switch v := v.(type) {
	case starlark.NoneType:
		*a = answerArg{}
	case starlark.String:
		*a = answerArg{s: string(v), ok: true, l: TextLabel(string(v))}
	case starlark.Int:
		f, _ := starlark.AsFloat(v)
		*a = answerArg{s: v.String(), ok: true, l: Label{Text: v.String(), Number: true, Value: f}}
	case starlark.Float:
		s := pyFloatRepr(float64(v))
		*a = answerArg{s: s, ok: true, l: Label{Text: s, Number: true, Value: float64(v)}}
	default:
		return fmt.Errorf("got %s, want string, int, float or None", v.Type())
	}
	return nil
}

// pyFloatRepr writes a float as Python's repr does: "5.0", "0.0001", "1e-05", "1e+16".
func pyFloatRepr(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case math.IsNaN(f):
		return "nan"
	}
	sci := strconv.FormatFloat(f, 'e', -1, 64)
	mant, expText, _ := strings.Cut(sci, "e")
	exp, _ := strconv.Atoi(expText)
	if exp < -4 || exp >= 16 {
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		return fmt.Sprintf("%se%s%02d", mant, sign, exp)
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return s
}

// stringOrNone is the Starlark result of an extraction.
func stringOrNone(s string, ok bool) starlark.Value {
	if !ok {
		return starlark.None
	}
	return starlark.String(s)
}

// answersBoxed is slime's reading of a box unless lenient=True.
func answersBoxed(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text string
	var lenient bool
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text, "lenient?", &lenient); err != nil {
		return nil, err
	}
	if lenient {
		return stringOrNone(Boxed(text)), nil
	}
	return stringOrNone(SlimeBoxed(text)), nil
}

// answersExtract is DAPO's reading of an "Answer:" line unless lenient=True.
func answersExtract(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var text string
	var lenient bool
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "text", &text, "lenient?", &lenient); err != nil {
		return nil, err
	}
	if lenient {
		return stringOrNone(Extract(text)), nil
	}
	return stringOrNone(SlimeExtract(text)), nil
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

// answersEqual is slime's comparison of an answer a with a true answer b unless lenient=True.
func answersEqual(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x, y answerArg
	var lenient bool
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "a", &x, "b", &y, "lenient?", &lenient); err != nil {
		return nil, err
	}
	if !x.ok || !y.ok {
		return starlark.False, nil
	}
	if lenient {
		return starlark.Bool(Equal(x.s, y.s)), nil
	}
	return starlark.Bool(SlimeEqual(x.s, y.s)), nil
}

// answersGrade accepts a list of labels too (the best score counts), for problems with several
// accepted answers.
func answersGrade(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		response     string
		label        starlark.Value
		mode         = GradeMath
		requireThink = true
		lenient      bool
		strictBox    bool
		choices      starlark.Value
		metadata     *starlark.Dict
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs,
		"response", &response, "label", &label, "mode?", &mode, "require_think?", &requireThink,
		"lenient?", &lenient, "strict_box?", &strictBox, "choices?", &choices, "metadata?", &metadata); err != nil {
		return nil, err
	}
	opts := GradeOptions{Lenient: lenient, NoThinkOK: !requireThink, StrictBox: strictBox}
	if choices != nil || metadata != nil {
		meta, err := gpqaMetadata(choices, metadata)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", b.Name(), err)
		}
		opts.GPQA = meta
	}
	labels, err := gradeLabels(label)
	if err != nil {
		return nil, fmt.Errorf("%s: for parameter label: %v", b.Name(), err)
	}
	best := 0.0
	for i, l := range labels {
		score, err := Grade(response, l, mode, opts)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", b.Name(), err)
		}
		if i == 0 || score > best {
			best = score
		}
	}
	return starlark.Float(best), nil
}

// gpqaMetadata reads gpqa's choices= and metadata= arguments.
func gpqaMetadata(choices starlark.Value, metadata *starlark.Dict) (*GPQAMetadata, error) {
	meta := &GPQAMetadata{}
	text := func(where string, v starlark.Value) (string, error) {
		var a answerArg
		if err := a.Unpack(v); err != nil || !a.ok {
			return "", fmt.Errorf("for parameter %s: got %s, want string or number", where, v.Type())
		}
		return a.s, nil
	}
	readChoices := func(where string, v starlark.Value) error {
		if d, ok := v.(*starlark.Dict); ok {
			var values []starlark.Value // a dict's options are its values, in order
			for _, item := range d.Items() {
				values = append(values, item[1])
			}
			v = starlark.NewList(values)
		}
		seq, ok := v.(starlark.Indexable)
		if _, isStr := v.(starlark.String); !ok || isStr {
			return fmt.Errorf("for parameter %s: got %s, want a list or dict of options", where, v.Type())
		}
		meta.Choices = []string{}
		for i := 0; i < seq.Len(); i++ {
			s, err := text(fmt.Sprintf("%s[%d]", where, i), seq.Index(i))
			if err != nil {
				return err
			}
			meta.Choices = append(meta.Choices, s)
		}
		return nil
	}
	if metadata != nil {
		for _, item := range metadata.Items() {
			key, ok := starlark.AsString(item[0])
			if !ok {
				return nil, fmt.Errorf("for parameter metadata: key %s is not a string", item[0])
			}
			where := "metadata[" + strconv.Quote(key) + "]"
			v := item[1]
			if v == starlark.None {
				continue
			}
			var err error
			switch key {
			case "choices":
				err = readChoices(where, v)
			case "valid_letters":
				seq, ok := v.(starlark.Indexable)
				if !ok {
					return nil, fmt.Errorf("for parameter %s: got %s, want a list of letters", where, v.Type())
				}
				for i := 0; i < seq.Len(); i++ {
					s, err := text(fmt.Sprintf("%s[%d]", where, i), seq.Index(i))
					if err != nil {
						return nil, err
					}
					meta.ValidLetters = append(meta.ValidLetters, s)
				}
			case "correct_letter":
				if s, ok := starlark.AsString(v); ok {
					meta.CorrectLetter = &s
				}
			case "correct_answer":
				meta.CorrectAnswer, err = text(where, v)
			case "answer_text":
				meta.AnswerText, err = text(where, v)
			}
			if err != nil {
				return nil, err
			}
		}
	}
	if choices != nil {
		if meta.Choices != nil {
			return nil, fmt.Errorf("give the options once, as choices or as metadata[\"choices\"]")
		}
		if err := readChoices("choices", choices); err != nil {
			return nil, err
		}
	}
	return meta, nil
}

func gradeLabels(v starlark.Value) ([]Label, error) {
	if _, ok := v.(starlark.NoneType); ok {
		return nil, fmt.Errorf("got None; this task has no label to grade against")
	}
	seq, isSeq := v.(starlark.Sequence)
	if _, isStr := v.(starlark.String); !isSeq || isStr {
		var a answerArg
		if err := a.Unpack(v); err != nil {
			return nil, fmt.Errorf("got %s, want string, int, float or a list of them", v.Type())
		}
		return []Label{a.l}, nil
	}
	var labels []Label
	it := seq.Iterate()
	defer it.Done()
	var x starlark.Value
	for i := 0; it.Next(&x); i++ {
		var a answerArg
		if err := a.Unpack(x); err != nil || !a.ok {
			return nil, fmt.Errorf("element %d is %s, want string, int or float", i, x.Type())
		}
		labels = append(labels, a.l)
	}
	if len(labels) == 0 {
		return nil, fmt.Errorf("got an empty %s; give at least one accepted answer", v.Type())
	}
	return labels, nil
}
