package starlib

import (
	"math/big"
	"regexp"
	"strings"
	"unicode"
)

// Normalize returns the canonical form of a final answer, so that answers a grader should accept
// as the same compare equal as strings. In order, it:
//
//   - removes `$` and `\$`, and unwraps an answer that is entirely `\boxed{…}` or `\fbox{…}`;
//   - removes `\left`, `\right`, `\displaystyle` and the spacing commands `\!`, `\,`, `\;`, `\:`,
//     `\ `, `\quad`, `\qquad`;
//   - rewrites `\dfrac` and `\tfrac` as `\frac`;
//   - drops a trailing units wrapper (`5\text{ cm}` → `5`) and unwraps `\text{…}`, `\mbox{…}`,
//     `\textbf{…}`, `\mathrm{…}` elsewhere;
//   - removes degree marks (`^\circ`, `^{\circ}`) and percent signs (`\%`, `%`);
//   - removes all white space, `{,}` thousands separators, trailing periods, a leading `+` and a
//     one-letter assignment prefix (`x=5` → `5`);
//   - writes shorthand `\frac12` and `\sqrt2` with braces, an integer ratio `3/4` as `\frac{3}{4}`;
//   - writes a plain number canonically: no thousands commas (`1,000`), no leading zeros, no
//     trailing fractional zeros (`1.50` → `1.5`, `3.0` → `3`, `.5` → `0.5`, `-0` → `0`).
//
// It never fails: text that is not mathematics passes through with only the steps above applied.
func Normalize(s string) string {
	s = strings.TrimSpace(s)
	s = strings.ReplaceAll(s, `\$`, "")
	s = strings.ReplaceAll(s, "$", "")
	s = strings.TrimSpace(s)
	s = unwrapBoxed(s)

	s = stripCommand(s, `\left`)
	s = stripCommand(s, `\right`)
	s = stripCommand(s, `\displaystyle`)
	s = stripCommand(s, `\qquad`)
	s = stripCommand(s, `\quad`)
	for _, sp := range []string{`\!`, `\,`, `\;`, `\:`, `\ `} {
		s = strings.ReplaceAll(s, sp, "")
	}
	s = strings.ReplaceAll(s, `\dfrac`, `\frac`)
	s = strings.ReplaceAll(s, `\tfrac`, `\frac`)

	// Units go before unwrapping so "5 \text{cm}" loses "cm" rather than keeping "5cm".
	if m := unitsSuffix.FindStringSubmatch(s); m != nil && endsLikeValue(m[1]) {
		s = m[1]
	}
	s = textWrapper.ReplaceAllString(s, "$1")
	for _, deg := range []string{`^{\circ}`, `^\circ`, `\%`, "%"} {
		s = strings.ReplaceAll(s, deg, "")
	}

	s = strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return -1
		}
		return r
	}, s)
	s = strings.ReplaceAll(s, "{,}", "")
	s = strings.TrimRight(s, ".")
	s = strings.TrimPrefix(s, "+")
	if assignment.MatchString(s) {
		s = s[2:]
	}

	s = fracShorthand.ReplaceAllString(s, `\frac{$1}{$2}`)
	s = sqrtShorthand.ReplaceAllString(s, `\sqrt{$1}`)
	if m := intRatio.FindStringSubmatch(s); m != nil {
		s = m[1] + `\frac{` + m[2] + "}{" + m[3] + "}"
	}
	if thousands.MatchString(s) {
		s = strings.ReplaceAll(s, ",", "")
	}
	if plainNumber.MatchString(s) {
		s = canonicalDecimal(s)
	}
	return s
}

var (
	// unitsSuffix is a units suffix: a value, then \text{…} of words (optionally squared or cubed) at the end.
	unitsSuffix = regexp.MustCompile(`^(.*\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s.]*\}(?:\^\{?[23]\}?)?$`)
	textWrapper = regexp.MustCompile(`\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}`)
	assignment  = regexp.MustCompile(`^[A-Za-z]=.`)
	// fracShorthand is \frac12: one-character arguments written without braces.
	fracShorthand = regexp.MustCompile(`\\frac([0-9A-Za-z])([0-9A-Za-z])`)
	sqrtShorthand = regexp.MustCompile(`\\sqrt([0-9A-Za-z])`)
	intRatio      = regexp.MustCompile(`^(-?)([0-9]+)/([0-9]+)$`)
	thousands     = regexp.MustCompile(`^-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]*)?$`)
	plainNumber   = regexp.MustCompile(`^-?([0-9]+\.?[0-9]*|\.[0-9]+)$`)
)

// endsLikeValue reports whether the text before a units wrapper is a quantity, so "\text{cm}"
// alone, or "x \text{ and } y", keeps its words.
func endsLikeValue(s string) bool {
	last := s[len(s)-1]
	return last >= '0' && last <= '9' || last == '}' || last == '.'
}

// stripCommand removes a LaTeX command name where it is not the prefix of a longer one
// (`\left(` loses `\left`, `\leftarrow` stays).
func stripCommand(s, cmd string) string {
	var b strings.Builder
	for {
		i := strings.Index(s, cmd)
		if i < 0 {
			b.WriteString(s)
			return b.String()
		}
		end := i + len(cmd)
		if end < len(s) && isLetter(s[end]) {
			b.WriteString(s[:end])
		} else {
			b.WriteString(s[:i])
		}
		s = s[end:]
	}
}

func isLetter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

// unwrapBoxed returns the content of s when all of s is one \boxed{…} or \fbox{…}.
func unwrapBoxed(s string) string {
	for _, cmd := range boxCommands {
		rest, ok := strings.CutPrefix(s, cmd)
		if !ok {
			continue
		}
		rest = strings.TrimLeft(rest, " ")
		if end := matchBrace(rest); end == len(rest)-1 {
			return strings.TrimSpace(rest[1:end])
		}
	}
	return s
}

// canonicalDecimal rewrites a string matching plainNumber without leading zeros, trailing
// fractional zeros or a bare point, working on the digits so long integers stay exact.
func canonicalDecimal(s string) string {
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	whole, frac, _ := strings.Cut(s, ".")
	whole = strings.TrimLeft(whole, "0")
	frac = strings.TrimRight(frac, "0")
	if whole == "" {
		whole = "0"
	}
	out := whole
	if frac != "" {
		out += "." + frac
	}
	if neg && out != "0" {
		out = "-" + out
	}
	return out
}

// equalTolerance is the relative difference under which two numbers count as equal: tight enough
// that 0.333333 is not 1/3, loose enough that a ten-digit decimal of 1/3 is.
var equalTolerance = big.NewRat(1, 1_000_000_000)

// Equal is slimen's lenient comparison (answers.equal and answers.grade with lenient=True; the
// default is slime's SlimeEqual): two answers are the same when equal after Normalize, or both
// numbers (integers, decimals, `\frac{a}{b}`, `a/b`, with signs) within a relative difference of
// 1e-9, so 2/4 passes for 1/2 and 0.3333333333 for 1/3. An empty answer equals nothing, not even
// another empty answer: it means the model gave none.
func Equal(a, b string) bool {
	na, nb := Normalize(a), Normalize(b)
	if na == "" || nb == "" {
		return false
	}
	if na == nb {
		return true
	}
	x, ok := parseNumber(na)
	if !ok {
		return false
	}
	y, ok := parseNumber(nb)
	if !ok {
		return false
	}
	if x.Cmp(y) == 0 {
		return true
	}
	diff := new(big.Rat).Sub(x, y)
	diff.Abs(diff)
	scale := new(big.Rat).Abs(x)
	if ay := new(big.Rat).Abs(y); ay.Cmp(scale) > 0 {
		scale = ay
	}
	return diff.Cmp(scale.Mul(scale, equalTolerance)) <= 0
}

var (
	decimalNumber = regexp.MustCompile(`^([+-]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]{1,3}))?$`)
	latexFraction = regexp.MustCompile(`^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$`)
)

// parseNumber reads a normalised answer as an exact rational: a decimal (with an exponent of at
// most three digits, so "1e999999" cannot allocate a huge number), \frac{p}{q} or p/q.
func parseNumber(s string) (*big.Rat, bool) {
	if m := latexFraction.FindStringSubmatch(s); m != nil {
		r, ok := ratio(m[2], m[3])
		if ok && m[1] == "-" {
			r.Neg(r)
		}
		return r, ok
	}
	if p, q, ok := strings.Cut(s, "/"); ok {
		return ratio(p, q)
	}
	return parseDecimal(s)
}

func ratio(p, q string) (*big.Rat, bool) {
	x, ok := parseDecimal(p)
	if !ok {
		return nil, false
	}
	y, ok := parseDecimal(q)
	if !ok || y.Sign() == 0 {
		return nil, false
	}
	return x.Quo(x, y), true
}

func parseDecimal(s string) (*big.Rat, bool) {
	m := decimalNumber.FindStringSubmatch(s)
	if m == nil || m[2] == "" && m[3] == "" {
		return nil, false
	}
	digits := m[2] + m[3]
	n, ok := new(big.Int).SetString(digits, 10)
	if !ok {
		return nil, false
	}
	exp := -len(m[3])
	if m[4] != "" {
		e, ok := new(big.Int).SetString(strings.TrimPrefix(m[4], "+"), 10)
		if !ok {
			return nil, false
		}
		exp += int(e.Int64())
	}
	r := new(big.Rat).SetInt(n)
	pow := new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(abs(exp))), nil)
	if exp >= 0 {
		r.Mul(r, new(big.Rat).SetInt(pow))
	} else {
		r.Quo(r, new(big.Rat).SetInt(pow))
	}
	if m[1] == "-" {
		r.Neg(r)
	}
	return r, true
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}
