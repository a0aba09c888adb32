package starlib

import (
	"math"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The graders of slime's rm_hub (slime/rollout/rm_hub), reimplemented so that slimen gives the
// same verdict on the same input. testdata/slime/rewards.jsonl holds slime's verdicts on several
// thousand inputs; TestSlimeRewardVectors checks these functions against them.

// SlimeBoxed returns the answer slime's math grader reads: the content of the last `\boxed`,
// which must be written `\boxed{…}` and close (braces counted, escapes not). A last box that is
// cut off, `\boxed 5` and `\fbox{…}` give no answer: slime does not fall back to an earlier box.
func SlimeBoxed(text string) (string, bool) {
	if !strings.Contains(text, `\boxed`) {
		return "", false
	}
	idx := strings.LastIndex(text, `\boxed`)
	depth := 0
	for i := idx; i < len(text); i++ {
		switch text[i] {
		case '{':
			depth++
		case '}':
			depth--
			if depth == 0 {
				box := text[idx : i+1]
				if content, ok := strings.CutPrefix(box, `\boxed{`); ok {
					return content[:len(content)-1], true
				}
				return "", false
			}
		}
	}
	return "", false
}

// pyFloat parses a string as Python's float() does: surrounding white space, a sign, "_" between
// digits, "inf", "infinity" and "nan" in any case.
func pyFloat(s string) (float64, bool) {
	s = strings.Map(asciiDigit, strings.TrimFunc(s, pyIsSpace))
	t := strings.TrimLeft(s, "+-")
	if len(s)-len(t) > 1 {
		return 0, false
	}
	switch strings.ToLower(t) {
	case "inf", "infinity":
		if strings.HasPrefix(s, "-") {
			return math.Inf(-1), true
		}
		return math.Inf(1), true
	case "nan":
		return math.NaN(), true
	}
	if !pyFloatSyntax.MatchString(t) {
		return 0, false
	}
	f, err := strconv.ParseFloat(strings.ReplaceAll(s, "_", ""), 64)
	if err != nil && !strings.Contains(err.Error(), "range") {
		return 0, false
	}
	return f, true
}

// asciiDigit writes a decimal digit of any script ("١٢") as the ASCII digit Python reads it as.
func asciiDigit(r rune) rune {
	if r < 0x80 || !unicode.Is(unicode.Nd, r) {
		return r
	}
	start := r
	for unicode.Is(unicode.Nd, start-1) {
		start--
	}
	return '0' + (r-start)%10
}

var pyFloatSyntax = regexp.MustCompile(`^(?:[0-9](?:_?[0-9])*(?:\.(?:[0-9](?:_?[0-9])*)?)?|\.[0-9](?:_?[0-9])*)(?:[eE][+-]?[0-9](?:_?[0-9])*)?$`)

func pyIsSpace(r rune) bool {
	return unicode.IsSpace(r) || r >= 0x1c && r <= 0x1f
}

// pyIntString is str(int(x)) for a finite float: its integer part, exactly.
func pyIntString(x float64) string {
	i, _ := new(big.Float).SetFloat64(math.Trunc(x)).Int(nil)
	return i.String()
}

// pyRound is Python's round(x) for a float: to the nearest integer, ties to even.
func pyRound(x float64) float64 { return math.RoundToEven(x) }

// --- math_utils: Hendrycks' MATH normalisation (grade_answer_mathd) ---

var (
	mathdText = regexp.MustCompile(`^\\text\{(.+?)\}\n?$`)
	slashInt  = regexp.MustCompile(`^(-?(?:0|[1-9][0-9]*))/(-?(?:0|[1-9][0-9]*))$`)
)

// mathdNormalize is slime's mathd_normalize_answer.
func mathdNormalize(answer string) string {
	answer = strings.TrimFunc(answer, pyIsSpace)
	if m := mathdText.FindStringSubmatch(answer); m != nil {
		answer = strings.TrimFunc(m[1], pyIsSpace)
	}
	if s, ok := mathdStrip(answer); ok {
		return s
	}
	return answer
}

// mathdStrip is slime's _strip_string; false where it raises.
func mathdStrip(s string) (string, bool) {
	s = strings.ReplaceAll(s, "\n", "")
	s = strings.ReplaceAll(s, `\!`, "")
	s = strings.ReplaceAll(s, `\\`, `\`)
	s = strings.ReplaceAll(s, "tfrac", "frac")
	s = strings.ReplaceAll(s, "dfrac", "frac")
	s = strings.ReplaceAll(s, `\left`, "")
	s = strings.ReplaceAll(s, `\right`, "")
	s = strings.ReplaceAll(s, `^{\circ}`, "")
	s = strings.ReplaceAll(s, `^\circ`, "")
	s = strings.ReplaceAll(s, `\$`, "")
	if strings.Contains(s, `\text{ `) { // units on the right
		parts := strings.Split(s, `\text{ `)
		if len(parts) != 2 {
			return "", false
		}
		s = parts[0]
	}
	s = strings.ReplaceAll(s, `\%`, "")
	s = strings.ReplaceAll(s, " .", " 0.")
	s = strings.ReplaceAll(s, "{.", "{0.")
	if s == "" {
		return s, true
	}
	if s[0] == '.' {
		s = "0" + s
	}
	if parts := strings.Split(s, "="); len(parts) == 2 && utf8.RuneCountInString(parts[0]) <= 2 {
		s = parts[1]
	}
	if strings.Contains(s, `\sqrt`) {
		parts := strings.Split(s, `\sqrt`)
		var b strings.Builder
		b.WriteString(parts[0])
		for _, p := range parts[1:] {
			if p == "" {
				return "", false // slime indexes an empty string
			}
			if p[0] != '{' {
				_, size := utf8.DecodeRuneInString(p)
				b.WriteString(`\sqrt{` + p[:size] + "}" + p[size:])
			} else {
				b.WriteString(`\sqrt` + p)
			}
		}
		s = b.String()
	}
	s = strings.ReplaceAll(s, " ", "")
	s, ok := mathdFixFracs(s)
	if !ok {
		return "", false
	}
	if s == "0.5" {
		s = `\frac{1}{2}`
	}
	if m := slashInt.FindStringSubmatch(s); m != nil && strings.Count(s, "/") == 1 {
		s = `\frac{` + m[1] + "}{" + m[2] + "}"
	}
	return s, true
}

// mathdFixFracs writes \frac12 as \frac{1}{2}; false where slime raises.
func mathdFixFracs(s string) (string, bool) {
	parts := strings.Split(s, `\frac`)
	var b strings.Builder
	b.WriteString(parts[0])
	for _, p := range parts[1:] {
		b.WriteString(`\frac`)
		if p == "" {
			return "", false
		}
		if p[0] == '{' {
			b.WriteString(p)
			continue
		}
		r := []rune(p)
		if len(r) < 2 {
			return s, true // slime gives up and keeps the string
		}
		a, c := string(r[0]), string(r[1])
		if c != "{" {
			b.WriteString("{" + a + "}{" + c + "}" + string(r[2:]))
		} else {
			b.WriteString("{" + a + "}" + c + string(r[2:]))
		}
	}
	return b.String(), true
}

// gradeMathd is slime's grade_answer_mathd.
func gradeMathd(given, truth string) bool { return mathdNormalize(truth) == mathdNormalize(given) }

// --- math_utils: the sympy grader (grade_answer_sympy) ---

var (
	sympyTextOnly   = regexp.MustCompile(`^\\text\{(.+?)\}\n?$`)
	sympyUnitWords  []*regexp.Regexp
	circPattern     = regexp.MustCompile(`\^ *\\circ`)
	commaBang       = regexp.MustCompile(`,\\! *`)
	dashSpaces      = regexp.MustCompile(`- *`)
	mixedNumber     = regexp.MustCompile(`([0-9]) +([0-9])`)
	properCommas    = regexp.MustCompile(`([0-9])(,)([0-9][0-9][0-9])($|[^0-9])`)
	isFracPattern   = regexp.MustCompile(`^-?[0-9]+.?/0*[1-9][0-9]*.?\n?$`)
	badExponent     = regexp.MustCompile(`\^[0-9]+\^|\^[0-9][0-9]+`)
	latexUnicodeOps = strings.NewReplacer("√", "sqrt", "π", "pi", "∞", "inf", "∪", "U", "·", "*", "×", "*")
)

func init() {
	for _, unit := range []string{"degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour",
		"day", "week", "month", "year", "foot", "feet", "inch", "yard"} {
		sympyUnitWords = append(sympyUnitWords, regexp.MustCompile(unit+`(es)?(s)? *(\^[0-9]+)?`))
	}
}

// slimeParseLatex is slime's _parse_latex: LaTeX rendered as text (latexToText), with the
// characters sympy cannot read written as names (√ → sqrt, π → pi, ∞ → inf, ∪ → U, ·, × → *).
// \frac gets a space before it, so that a mixed number 1\frac{1}{2} reads as 1+1/2.
func slimeParseLatex(expr string) (string, error) {
	expr = strings.ReplaceAll(expr, `\tfrac`, `\frac`)
	expr = strings.ReplaceAll(expr, `\dfrac`, `\frac`)
	expr = strings.ReplaceAll(expr, `\frac`, ` \frac`)
	text, err := latexToText(expr)
	if err != nil {
		return "", err
	}
	return strings.TrimFunc(latexUnicodeOps.Replace(text), pyIsSpace), nil
}

// sympyNormalize is slime's _normalize.
func sympyNormalize(expr string) string {
	if m := sympyTextOnly.FindStringSubmatch(expr); m != nil {
		expr = m[1]
	}
	expr = strings.ReplaceAll(expr, `\%`, "%")
	expr = strings.ReplaceAll(expr, `\$`, "$")
	expr = strings.ReplaceAll(expr, "$", "")
	expr = strings.ReplaceAll(expr, "%", "")
	expr = strings.ReplaceAll(expr, " or ", " , ")
	expr = strings.ReplaceAll(expr, " and ", " , ")
	expr = strings.ReplaceAll(expr, "million", "*10^6")
	expr = strings.ReplaceAll(expr, "billion", "*10^9")
	expr = strings.ReplaceAll(expr, "trillion", "*10^12")
	for _, re := range sympyUnitWords {
		expr = re.ReplaceAllString(expr, "")
	}
	expr = circPattern.ReplaceAllString(expr, "")
	if len(expr) > 0 && expr[0] == '{' && expr[len(expr)-1] == '}' {
		expr = expr[1 : len(expr)-1]
	}
	expr = commaBang.ReplaceAllString(expr, "")
	if f, ok := pyFloat(expr); ok && isNearInt(f) {
		expr = pyIntString(pyRound(f))
	}
	if strings.Contains(expr, `\`) {
		if text, err := slimeParseLatex(expr); err == nil {
			expr = text
		}
	}
	expr = dashSpaces.ReplaceAllString(expr, "-")
	expr = mixedNumber.ReplaceAllString(expr, "$1+$2")
	expr = strings.ReplaceAll(expr, " ", "")
	expr = strings.ReplaceAll(expr, "{", "")
	expr = strings.ReplaceAll(expr, "}", "")
	expr = strings.ToLower(expr)
	if strIsInt(expr) {
		f, _ := pyFloat(strings.ReplaceAll(expr, ",", ""))
		expr = pyIntString(f)
	}
	return expr
}

func isNearInt(x float64) bool {
	if math.IsInf(x, 0) || math.IsNaN(x) {
		return false
	}
	return math.Abs(x-pyRound(x)) <= 1e-7
}

func stripProperCommas(expr string) string {
	for {
		next := properCommas.ReplaceAllString(expr, "$1$3$4")
		if next == expr {
			return next
		}
		expr = next
	}
}

// strIsInt is slime's _str_is_int.
func strIsInt(x string) bool {
	f, ok := pyFloat(stripProperCommas(x))
	return ok && isNearInt(f)
}

func isFrac(expr string) bool { return isFracPattern.MatchString(expr) }

// splitTuple is slime's split_tuple.
func splitTuple(expr string) []string {
	expr = stripProperCommas(expr)
	if expr == "" {
		return nil
	}
	const tupleChars = "()[]"
	if len(expr) > 2 && strings.ContainsRune(tupleChars, rune(expr[0])) && strings.ContainsRune(tupleChars, rune(expr[len(expr)-1])) &&
		!strings.ContainsAny(expr[1:len(expr)-1], tupleChars) {
		var out []string
		for _, e := range strings.Split(expr[1:len(expr)-1], ",") {
			out = append(out, strings.TrimFunc(e, pyIsSpace))
		}
		return out
	}
	return []string{expr}
}

// shouldAllowEval is slime's should_allow_eval: at most two distinct letters, no braced or
// parenthesised exponent, no stacked or multi-digit exponent.
func shouldAllowEval(expr string) bool {
	letters := map[rune]bool{}
	for _, r := range strings.ReplaceAll(strings.ReplaceAll(expr, "sqrt", ""), "frac", "") {
		if unicode.IsLetter(r) {
			letters[r] = true
		}
	}
	if len(letters) > 2 {
		return false
	}
	if strings.Contains(expr, "^{") || strings.Contains(expr, "^(") {
		return false
	}
	return !badExponent.MatchString(expr)
}

func equalUnderSympy(truth, given string) bool {
	expr := "(" + truth + ")-(" + given + ")"
	if !shouldAllowEval(expr) {
		return false
	}
	return sympyDifferenceIsZero(strings.ReplaceAll(expr, "^", "**"))
}

// gradeSympy is slime's grade_answer_sympy.
func gradeSympy(given, truth string) bool {
	t, g := sympyNormalize(truth), sympyNormalize(given)
	if t == g {
		return true
	}
	if g == "" {
		return false
	}
	te, ge := splitTuple(t), splitTuple(g)
	if len(te) > 1 && (t[0] != g[0] || t[len(t)-1] != g[len(g)-1]) {
		return false
	}
	if len(te) != len(ge) {
		return false
	}
	for i := range te {
		var ok bool
		switch {
		case isFrac(te[i]) && isFrac(ge[i]):
			ok = te[i] == ge[i] // unreduced fractions are wrong
		case strIsInt(te[i]) != strIsInt(ge[i]):
			ok = false // an integer answer must be written as one
		default:
			ok = equalUnderSympy(te[i], ge[i])
		}
		if !ok {
			return false
		}
	}
	return true
}

// SlimeEqual is slime's comparison of a given answer with the true one (math_utils'
// grade_answer_mathd or grade_answer_sympy): the same after Hendrycks' MATH normalisation, or
// after slime's own normalisation the same text, or element by element (tuples and intervals)
// equal numbers or expressions whose difference simplifies to 0. A fraction must be reduced as
// the truth is, and an integer answer written as an integer.
func SlimeEqual(given, truth string) bool {
	return gradeMathd(given, truth) || gradeSympy(given, truth)
}

// slimeMath is rm_type "math" (grade_answer_verl): 1 when the last box equals the label.
func slimeMath(response, label string, labelFalsy bool) float64 {
	if labelFalsy {
		return 0
	}
	if strings.Contains(label, `\boxed`) {
		var ok bool
		if label, ok = SlimeBoxed(label); !ok {
			return 0
		}
	}
	given, ok := SlimeBoxed(response)
	if !ok || !SlimeEqual(given, label) {
		return 0
	}
	return 1
}

// slimeDeepscaler is rm_type "deepscaler": the box after the last </think> (or after the first
// "###Response"), 0 when the response has neither.
func slimeDeepscaler(response, label string, requireThink bool) float64 {
	var solution string
	if i := strings.LastIndex(response, "</think>"); i >= 0 {
		solution = response[i+len("</think>"):]
	} else if parts := strings.Split(response, "###Response"); len(parts) > 1 {
		solution = parts[1]
	} else if requireThink {
		return 0
	} else {
		solution = response
	}
	given, ok := SlimeBoxed(solution)
	if !ok || label == "" {
		return 0
	}
	if strings.Contains(label, `\boxed`) {
		if label, ok = SlimeBoxed(label); !ok {
			return 0
		}
	}
	if SlimeEqual(given, label) {
		return 1
	}
	return 0
}

// --- math_dapo_utils ---

// pyS is Python's \s for str patterns.
const pyS = `[\t\n\v\f\r\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]`

var (
	dapoAnswer   = regexp.MustCompile(`(?i)Answer` + pyS + `*:` + pyS + `*([^\n]+)`)
	dapoDollars  = regexp.MustCompile(`(.*?)(\$)(.*?)(\$)(.*)`)
	dapoText     = regexp.MustCompile(`(\\text\{)(.*?)(\})`)
	dapoTextbf   = regexp.MustCompile(`(\\textbf\{)(.*?)(\})`)
	dapoOverline = regexp.MustCompile(`(\\overline\{)(.*?)(\})`)
	dapoBoxed    = regexp.MustCompile(`(\\boxed\{)(.*)(\})`)
	dapoFrac     = regexp.MustCompile(`(frac)([^{])(.)`)
	dapoSqrt     = regexp.MustCompile(`(sqrt)([^{])`)
)

var dapoSubstitutions = [][2]string{
	{"an ", ""}, {"a ", ""}, {".$", "$"}, {`\$`, ""}, {`\ `, ""}, {" ", ""}, {"mbox", "text"},
	{`,\text{and}`, ","}, {`\text{and}`, ","}, {`\text{m}`, `\text{}`},
}

var dapoRemoved = []string{
	"square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", `\ldots`, "sue",
	"points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
	"edges", "students", "childrentickets", "multiples", `\text{s}`, `\text{.}`, "\\text{\ns}",
	`\text{}^2`, `\text{}^3`, "\\text{\n}", `\text{}`, `\mathrm{th}`, `^\circ`, `^{\circ}`, `\;`, `,\!`,
	"{,}", `"`, `\dots`, "<|im_end|>", "<|endoftext|>",
}

// SlimeExtract returns the answer DAPO's grader reads: the rest of the line after the last
// "Answer:" (any case, also inside a word such as "FinalAnswer:"), untrimmed.
func SlimeExtract(text string) (string, bool) {
	all := dapoAnswer.FindAllStringSubmatch(text, -1)
	if len(all) == 0 {
		return "", false
	}
	return all[len(all)-1][1], true
}

// dapoNormalize is slime's normalize_final_answer.
func dapoNormalize(s string) string {
	parts := strings.Split(s, "=")
	s = parts[len(parts)-1]
	for _, sub := range dapoSubstitutions {
		s = strings.ReplaceAll(s, sub[0], sub[1])
	}
	for _, r := range dapoRemoved {
		s = strings.ReplaceAll(s, r, "")
	}
	s = dapoDollars.ReplaceAllString(s, "$$$3$$")
	s = dapoText.ReplaceAllString(s, "$2")
	s = dapoTextbf.ReplaceAllString(s, "$2")
	s = dapoOverline.ReplaceAllString(s, "$2")
	s = dapoBoxed.ReplaceAllString(s, "$2")
	s = dapoFrac.ReplaceAllString(s, "frac{$2}{$3}")
	s = dapoSqrt.ReplaceAllString(s, "sqrt{$2}")
	s = strings.ReplaceAll(s, "$", "")
	if pyIsDigits(strings.ReplaceAll(s, ",", "")) {
		s = strings.ReplaceAll(s, ",", "")
	}
	return strings.TrimFunc(s, pyIsSpace)
}

// pyIsDigits is Python's str.isdigit: not empty, every character a digit (superscripts too).
func pyIsDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !unicode.IsDigit(r) && !strings.ContainsRune("²³¹⁰⁴⁵⁶⁷⁸⁹₀₁₂₃₄₅₆₇₈₉", r) {
			return false
		}
	}
	return true
}

// dapoWindow is how many trailing characters DAPO's grader reads.
const dapoWindow = 300

// slimeDAPO is rm_type "dapo": 1 when the answer of the last "Answer:" line in the last 300
// characters, normalised, is the integer of the label; -1 otherwise. ok is false where slime
// raises: a label that is not a finite number.
func slimeDAPO(response, label string) (float64, bool) {
	if r := []rune(response); len(r) > dapoWindow {
		response = string(r[len(r)-dapoWindow:])
	}
	pred := "[INVALID]"
	if a, ok := SlimeExtract(response); ok {
		pred = a
	}
	pred = dapoNormalize(pred)
	f, ok := pyFloat(dapoNormalize(label))
	if !ok || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, false
	}
	if pred == pyIntString(f) {
		return 1, true
	}
	return -1, true
}

// slimeDAPOStrictBox is DAPO's compute_score with strict_box_verify: the content of the last
// `\boxed{…}` in the last 100 of the last 300 characters is the label, as text → 1, else -1.
func slimeDAPOStrictBox(response, label string) float64 {
	response = Truncate(Truncate(response, dapoWindow, true), 100, true)
	idx := strings.LastIndex(response, `\boxed{`)
	if idx < 0 {
		return -1
	}
	depth := 0
	for i := idx; i < len(response); i++ {
		switch response[i] {
		case '{':
			depth++
		case '}':
			depth--
			if depth == 0 {
				if response[idx+len(`\boxed{`):i] == label {
					return 1
				}
				return -1
			}
		}
	}
	return -1
}

// --- f1 ---

// slimeF1Tokens normalises as slime's f1 grader: lowercased, ASCII punctuation deleted, the
// words a/an/the removed, split on white space.
func slimeF1Tokens(s string) []string {
	s = strings.Map(func(r rune) rune {
		if r < 128 && strings.ContainsRune("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", r) {
			return -1
		}
		return r
	}, pyLower(s))
	var b strings.Builder
	rs := []rune(s)
	for i := 0; i < len(rs); {
		if isWordStart(rs, i) {
			j := i
			for j < len(rs) && pyIsWord(rs[j]) {
				j++
			}
			if w := string(rs[i:j]); w == "a" || w == "an" || w == "the" {
				b.WriteString(" ")
			} else {
				b.WriteString(w)
			}
			i = j
			continue
		}
		b.WriteRune(rs[i])
		i++
	}
	return strings.FieldsFunc(b.String(), pyIsSpace)
}

func isWordStart(rs []rune, i int) bool { return pyIsWord(rs[i]) && (i == 0 || !pyIsWord(rs[i-1])) }

// pyIsWord is Python's \w for str patterns.
func pyIsWord(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) }

// pyLower is Python's str.lower, which differs from Go's for İ.
func pyLower(s string) string { return strings.ToLower(strings.ReplaceAll(s, "\u0130", "i\u0307")) }

// F1 is slime's f1 grader (the SQuAD token F1): the harmonic mean of the precision and recall of
// the tokens prediction and reference share, counted with multiplicity, after slime's
// normalisation (lowercased, ASCII punctuation deleted so "don't" is "dont", the words a/an/the
// removed, split on white space). It is 0 when no token is shared (so also when either side is
// empty, both included), and when either side is "yes", "no" or "noanswer" and the other is not
// the same.
func F1(prediction, reference string) float64 {
	p, r := slimeF1Tokens(prediction), slimeF1Tokens(reference)
	np, nr := strings.Join(p, " "), strings.Join(r, " ")
	special := func(s string) bool { return s == "yes" || s == "no" || s == "noanswer" }
	if (special(np) || special(nr)) && np != nr {
		return 0
	}
	counts := map[string]int{}
	for _, t := range r {
		counts[t]++
	}
	common := 0
	for _, t := range p {
		if counts[t] > 0 {
			counts[t]--
			common++
		}
	}
	if common == 0 {
		return 0
	}
	precision := float64(common) / float64(len(p))
	recall := float64(common) / float64(len(r))
	return 2 * precision * recall / (precision + recall)
}

// --- gpqa ---

var (
	// pyI makes a pattern's "i" match as Python's case-insensitive "i" does: also İ and ı (Go's matches neither).
	pyI          = strings.NewReplacer("i", "[iİı]", "[A-Z]", "[A-Zİı]")
	gpqaPatterns = []*regexp.Regexp{
		regexp.MustCompile(`(?i)` + pyI.Replace(`(?:answer|option|choice)`+pyS+`*(?:is|:)?`+pyS+`*([A-Z])`)),
		regexp.MustCompile(`(?i)` + pyI.Replace(`([A-Z])`+pyS+`*(?:is`+pyS+`*(?:the)?`+pyS+`*correct)`)),
		regexp.MustCompile(`(?i)` + pyI.Replace(`final`+pyS+`*(?:answer|option)`+pyS+`*(?:is|:)?`+pyS+`*([A-Z])`)),
	}
	gpqaNonAlnum = regexp.MustCompile(`[^a-z0-9]+`)
)

func gpqaStripThinking(text string) string {
	if i := strings.LastIndex(text, "</think>"); i >= 0 {
		return text[i+len("</think>"):]
	}
	return text
}

func gpqaNormalize(text string) string {
	return strings.TrimFunc(gpqaNonAlnum.ReplaceAllString(pyLower(text), " "), pyIsSpace)
}

func gpqaLetter(response string, valid map[string]bool) string {
	if response == "" {
		return ""
	}
	text := gpqaStripThinking(response)
	for _, re := range gpqaPatterns {
		if m := re.FindStringSubmatch(text); m != nil {
			if l := strings.ToUpper(m[1]); valid[l] {
				return l
			}
		}
	}
	rs := []rune(text)
	for i := len(rs) - 1; i >= 0; i-- { // the last standalone capital letter that is valid
		if rs[i] >= 'A' && rs[i] <= 'Z' && (i == 0 || !pyIsWord(rs[i-1])) && (i == len(rs)-1 || !pyIsWord(rs[i+1])) && valid[string(rs[i])] {
			return string(rs[i])
		}
	}
	return ""
}

// gpqaLabel is a GPQA label: a string (a letter or an answer text) or a number (the index of the
// correct choice).
type gpqaLabel struct {
	text    string
	isText  bool
	index   int
	isIndex bool
}

// GPQAMetadata is what slime's gpqa grader reads from a sample's metadata.
type GPQAMetadata struct {
	Choices       []string // the options, in order (slime's "choices", a list or a dict's values)
	ValidLetters  []string // the letters a response may choose; A… for the choices, else A–J
	CorrectLetter *string  // the correct option's letter, over a letter label
	CorrectAnswer string   // the correct option's text
	AnswerText    string   // another accepted text
}

// slimeGPQA is rm_type "gpqa" (compute_gpqa_reward).
func slimeGPQA(response string, label gpqaLabel, meta GPQAMetadata) float64 {
	choices := meta.Choices
	var letters []string
	switch {
	case len(meta.ValidLetters) > 0:
		for _, l := range meta.ValidLetters {
			letters = append(letters, strings.ToUpper(l))
		}
	case len(choices) > 0:
		for i := 0; i < len(choices) && i < 26; i++ {
			letters = append(letters, string(rune('A'+i)))
		}
	default:
		letters = strings.Split("ABCDEFGHIJ", "")
	}
	valid := map[string]bool{}
	for _, l := range letters {
		valid[strings.ToUpper(l)] = true
	}
	inLetters := func(l string) bool { return slices.Contains(letters, l) }
	correct, labelText := "", ""
	if meta.CorrectLetter != nil {
		correct = strings.ToUpper(strings.TrimFunc(*meta.CorrectLetter, pyIsSpace))
	}
	correctAnswer := meta.CorrectAnswer
	if label.isText {
		labelText = strings.TrimFunc(label.text, pyIsSpace)
		if utf8.RuneCountInString(labelText) == 1 && inLetters(strings.ToUpper(labelText)) && correct == "" {
			correct = strings.ToUpper(labelText)
		}
	} else if label.isIndex && label.index >= 0 && label.index < len(letters) {
		correct = letters[label.index]
	}
	if correct == "" && len(choices) > 0 && labelText != "" {
		for i, c := range choices {
			if gpqaNormalize(c) == gpqaNormalize(labelText) {
				correct = letters[i]
				if correctAnswer == "" {
					correctAnswer = c
				}
				break
			}
		}
	}
	extracted := gpqaLetter(response, valid)
	if extracted != "" && correct != "" {
		if extracted == correct {
			return 1
		}
		return 0
	}
	var candidates []string
	if correct != "" && len(choices) > 0 {
		if i := slices.Index(letters, correct); i >= 0 && i < len(choices) {
			candidates = append(candidates, choices[i])
		}
	}
	for _, c := range []string{correctAnswer, meta.AnswerText, labelText} {
		if c != "" {
			candidates = append(candidates, c)
		}
	}
	resp := gpqaNormalize(gpqaStripThinking(response))
	for _, c := range candidates {
		if t := gpqaNormalize(c); t != "" && strings.Contains(resp, t) {
			return 1
		}
	}
	if extracted != "" && correct == "" && labelText != "" && extracted == strings.ToUpper(labelText) {
		return 1
	}
	return 0
}
