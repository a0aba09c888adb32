package starlib

import (
	"errors"
	"math"
	"math/big"
	"math/cmplx"
	"sort"
	"strings"
	"unicode"
)

// This file decides what slime's math grader decides with sympy: whether sympy.simplify of
// "(a)-(b)", parsed by sympy's parse_expr with implicit multiplication and application, is 0.
// Instead of a computer algebra system it evaluates the difference: exactly, in rationals, while
// the expression stays rational (symbols take fixed rational values, two sets of them); with
// sympy's Float precision where the answer has decimals; numerically, in complex numbers, once a
// square root, pi or a logarithm makes it irrational. An identity sympy proves evaluates to 0 at
// every point; a difference that is not 0 for all values almost never is at these points.

// exprKind is how a value is known.
type exprKind int

const (
	exactValue  exprKind = iota // a rational number, exactly
	floatValue                  // a sympy Float: a binary float of a given precision
	approxValue                 // an irrational number, in complex128
)

type exprValue struct {
	kind     exprKind
	r        *big.Rat
	f        *big.Float
	c        complex128
	hasFloat bool // a Float took part
}

var errNotEvaluable = errors.New("not an expression slimen evaluates")

func exactOf(r *big.Rat) exprValue { return exprValue{kind: exactValue, r: r} }

func (v exprValue) complex() complex128 {
	switch v.kind {
	case exactValue:
		f, _ := v.r.Float64()
		return complex(f, 0)
	case floatValue:
		f, _ := v.f.Float64()
		return complex(f, 0)
	}
	return v.c
}

func approxOf(c complex128, hasFloat bool) (exprValue, error) {
	if cmplx.IsNaN(c) || cmplx.IsInf(c) {
		return exprValue{}, errNotEvaluable
	}
	return exprValue{kind: approxValue, c: c, hasFloat: hasFloat}, nil
}

// floatPair converts both operands to sympy Floats of the larger precision.
func floatPair(a, b exprValue) (*big.Float, *big.Float, uint) {
	prec := uint(0)
	for _, v := range []exprValue{a, b} {
		if v.kind == floatValue && v.f.Prec() > prec {
			prec = v.f.Prec()
		}
	}
	conv := func(v exprValue) *big.Float {
		if v.kind == floatValue {
			return v.f
		}
		return new(big.Float).SetPrec(prec).SetRat(v.r)
	}
	return conv(a), conv(b), prec
}

func binaryOp(op byte, a, b exprValue) (exprValue, error) {
	hasFloat := a.hasFloat || b.hasFloat || a.kind == floatValue || b.kind == floatValue
	if op == '/' {
		if b.kind == exactValue && b.r.Sign() == 0 || b.kind == floatValue && b.f.Sign() == 0 {
			return exprValue{}, errNotEvaluable // sympy's zoo: never equal to anything
		}
	}
	if a.kind == approxValue || b.kind == approxValue {
		x, y := a.complex(), b.complex()
		switch op {
		case '+':
			return approxOf(x+y, hasFloat)
		case '-':
			return approxOf(x-y, hasFloat)
		case '*':
			return approxOf(x*y, hasFloat)
		case '/':
			if y == 0 {
				return exprValue{}, errNotEvaluable
			}
			return approxOf(x/y, hasFloat)
		}
	}
	if a.kind == exactValue && b.kind == exactValue {
		z := new(big.Rat)
		switch op {
		case '+':
			z.Add(a.r, b.r)
		case '-':
			z.Sub(a.r, b.r)
		case '*':
			z.Mul(a.r, b.r)
		case '/':
			z.Quo(a.r, b.r)
		}
		return exactOf(z), nil
	}
	x, y, prec := floatPair(a, b)
	z := new(big.Float).SetPrec(prec)
	switch op {
	case '+':
		z.Add(x, y)
	case '-':
		z.Sub(x, y)
	case '*':
		z.Mul(x, y)
	case '/':
		z.Quo(x, y)
	}
	if z.IsInf() {
		return exprValue{}, errNotEvaluable
	}
	return exprValue{kind: floatValue, f: z, hasFloat: true}, nil
}

// maxExactBits bounds the size of exact powers and factorials; larger ones are evaluated
// numerically.
const maxExactBits = 1 << 14

func powValue(a, b exprValue) (exprValue, error) {
	hasFloat := a.hasFloat || b.hasFloat || a.kind == floatValue || b.kind == floatValue
	if b.kind == exactValue && b.r.IsInt() && b.r.Num().IsInt64() {
		n := b.r.Num().Int64()
		switch a.kind {
		case exactValue:
			if a.r.Sign() == 0 && n < 0 {
				return exprValue{}, errNotEvaluable
			}
			if bits := int64(a.r.Num().BitLen()+a.r.Denom().BitLen()) * abs64(n); bits <= maxExactBits {
				return exactOf(ratPow(a.r, n)), nil
			}
		case floatValue:
			if abs64(n) <= 64 && !(a.f.Sign() == 0 && n < 0) {
				z := new(big.Float).SetPrec(a.f.Prec()).SetInt64(1)
				for i := int64(0); i < abs64(n); i++ {
					z.Mul(z, a.f)
				}
				if n < 0 {
					z.Quo(new(big.Float).SetPrec(a.f.Prec()).SetInt64(1), z)
				}
				return exprValue{kind: floatValue, f: z, hasFloat: true}, nil
			}
		}
	}
	if a.kind == exactValue && b.kind == exactValue && a.r.Sign() > 0 {
		// A rational power of a rational that is a perfect power stays exact: 4^(1/2) = 2.
		q := b.r.Denom()
		if q.IsInt64() && q.Int64() > 1 && q.Int64() <= 16 && b.r.Num().IsInt64() {
			num, ok1 := intRoot(a.r.Num(), q.Int64())
			den, ok2 := intRoot(a.r.Denom(), q.Int64())
			if ok1 && ok2 {
				return powValue(exactOf(new(big.Rat).SetFrac(num, den)), exactOf(new(big.Rat).SetInt(b.r.Num())))
			}
		}
	}
	x, y := a.complex(), b.complex()
	if x == 0 {
		if real(y) > 0 {
			return approxOf(0, hasFloat)
		}
		return exprValue{}, errNotEvaluable
	}
	if imag(x) == 0 && real(x) > 0 && imag(y) == 0 {
		return approxOf(complex(math.Pow(real(x), real(y)), 0), hasFloat)
	}
	return approxOf(cmplx.Pow(x, y), hasFloat)
}

func abs64(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

func ratPow(r *big.Rat, n int64) *big.Rat {
	num := new(big.Int).Exp(r.Num(), big.NewInt(abs64(n)), nil)
	den := new(big.Int).Exp(r.Denom(), big.NewInt(abs64(n)), nil)
	if n < 0 {
		if num.Sign() < 0 {
			num.Neg(num)
			den.Neg(den)
		}
		return new(big.Rat).SetFrac(den, num)
	}
	return new(big.Rat).SetFrac(num, den)
}

// intRoot returns the q-th root of a non-negative integer when it is an integer.
func intRoot(x *big.Int, q int64) (*big.Int, bool) {
	if x.Sign() < 0 {
		return nil, false
	}
	if q == 2 {
		r := new(big.Int).Sqrt(x)
		return r, new(big.Int).Mul(r, r).Cmp(x) == 0
	}
	f, _ := new(big.Float).SetInt(x).Float64()
	guess := big.NewInt(int64(math.Round(math.Pow(f, 1/float64(q)))))
	if math.IsInf(f, 0) || f > 1<<62 {
		return nil, false
	}
	for _, d := range []int64{-1, 0, 1} {
		g := new(big.Int).Add(guess, big.NewInt(d))
		if g.Sign() >= 0 && new(big.Int).Exp(g, big.NewInt(q), nil).Cmp(x) == 0 {
			return g, true
		}
	}
	return nil, false
}

// exprNode is a parsed expression.
type exprNode struct {
	op       byte // 'n' number, 's' symbol, 'p' pi, 'f' function call, '+', '-', '*', '/', '^', '~' negation, '!' factorial
	value    exprValue
	name     string
	children []*exprNode
}

type exprToken struct {
	kind byte // 'n' number, 'a' name, 'o' operator
	text string
}

// pythonKeywords cannot be names in a Python expression.
var pythonKeywords = map[string]bool{
	"False": true, "None": true, "True": true, "and": true, "as": true, "assert": true, "async": true,
	"await": true, "break": true, "class": true, "continue": true, "def": true, "del": true, "elif": true,
	"else": true, "except": true, "finally": true, "for": true, "from": true, "global": true, "if": true,
	"import": true, "in": true, "is": true, "lambda": true, "nonlocal": true, "not": true, "or": true,
	"pass": true, "raise": true, "return": true, "try": true, "while": true, "with": true, "yield": true,
}

// sympyFunctions are the sympy functions slimen evaluates; sympyOtherNames are the other sympy
// names an answer that passes slime's two-letter gate can spell, which slimen does not evaluate.
var (
	sympyFunctions  = map[string]bool{"sqrt": true, "ln": true, "log": true, "exp": true}
	sympyOtherNames = map[string]bool{"nan": true, "oo": true, "zoo": true, "gff": true, "rf": true, "ff": true,
		"re": true, "im": true, "csc": true, "li": true, "jn": true, "yn": true, "hn1": true, "hn2": true,
		"fft": true, "ntt": true, "fu": true, "eye": true, "sin": true, "cos": true, "tan": true, "E": true,
		"I": true, "S": true, "N": true, "O": true, "Q": true}
	// greekNames are names sympy keeps whole instead of splitting into letters.
	greekNames = map[string]bool{"mu": true, "nu": true, "xi": true, "pi": true}
)

func isNameStart(r rune) bool { return r == '_' || unicode.IsLetter(r) }
func isNameChar(r rune) bool {
	return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mn, r) || unicode.Is(unicode.Mc, r)
}

// tokenizeExpr splits a Python expression, sympy's transformations applied: a name that is not a
// sympy name is split into one symbol per letter and numbers for runs of digits ("x2" is x*2).
func tokenizeExpr(s string) ([]exprToken, error) {
	var out []exprToken
	rs := []rune(s)
	for i := 0; i < len(rs); {
		r := rs[i]
		switch {
		case r == ' ' || r == '\t':
			i++
		case r >= '0' && r <= '9' || r == '.' && i+1 < len(rs) && rs[i+1] >= '0' && rs[i+1] <= '9':
			j := i
			for j < len(rs) && (rs[j] >= '0' && rs[j] <= '9' || rs[j] == '_' && j+1 < len(rs) && rs[j+1] >= '0' && rs[j+1] <= '9') {
				j++
			}
			if j < len(rs) && rs[j] == '.' {
				j++
				for j < len(rs) && rs[j] >= '0' && rs[j] <= '9' {
					j++
				}
			}
			if j < len(rs) && (rs[j] == 'e' || rs[j] == 'E') {
				k := j + 1
				if k < len(rs) && (rs[k] == '+' || rs[k] == '-') {
					k++
				}
				if k < len(rs) && rs[k] >= '0' && rs[k] <= '9' {
					for k < len(rs) && rs[k] >= '0' && rs[k] <= '9' {
						k++
					}
					j = k
				}
			}
			if j < len(rs) && (rs[j] == 'j' || rs[j] == 'J' || rs[j] == 'x' || rs[j] == 'o' || rs[j] == 'b') && string(rs[i:j]) == "0" {
				return nil, errNotEvaluable // 0x, 0o, 0b literals
			}
			if j < len(rs) && (rs[j] == 'j' || rs[j] == 'J') {
				return nil, errNotEvaluable // an imaginary literal
			}
			text := strings.ReplaceAll(string(rs[i:j]), "_", "")
			if len(text) > 1 && text[0] == '0' && !strings.ContainsAny(text, ".eE") && strings.Trim(text, "0") != "" {
				return nil, errNotEvaluable // Python rejects 07
			}
			out = append(out, exprToken{'n', text})
			i = j
		case isNameStart(r):
			j := i
			for j < len(rs) && isNameChar(rs[j]) {
				j++
			}
			name := string(rs[i:j])
			i = j
			if pythonKeywords[name] {
				return nil, errNotEvaluable
			}
			if name == "pi" || sympyFunctions[name] || sympyOtherNames[name] || greekNames[name] ||
				strings.Contains(name, "_") || len([]rune(name)) == 1 {
				out = append(out, exprToken{'a', name})
				continue
			}
			nr := []rune(name)
			for k := 0; k < len(nr); {
				if nr[k] >= '0' && nr[k] <= '9' {
					m := k
					for m < len(nr) && nr[m] >= '0' && nr[m] <= '9' {
						m++
					}
					out = append(out, exprToken{'n', string(nr[k:m])})
					k = m
					continue
				}
				out = append(out, exprToken{'a', string(nr[k])})
				k++
			}
		case r == '*' && i+1 < len(rs) && rs[i+1] == '*':
			out = append(out, exprToken{'o', "**"})
			i += 2
		case strings.ContainsRune("+-*/()!", r):
			if r == '/' && i+1 < len(rs) && rs[i+1] == '/' {
				return nil, errNotEvaluable
			}
			out = append(out, exprToken{'o', string(r)})
			i++
		default:
			return nil, errNotEvaluable
		}
	}
	return out, nil
}

type exprParser struct {
	toks []exprToken
	i    int
}

// parseExpr parses a Python expression with sympy's implicit multiplication ("2x", "x(x+1)",
// "(1)(2)") and application ("sqrt 2").
func parseExpr(s string) (*exprNode, error) {
	toks, err := tokenizeExpr(s)
	if err != nil {
		return nil, err
	}
	p := &exprParser{toks: toks}
	n, err := p.sum()
	if err != nil {
		return nil, err
	}
	if p.i != len(p.toks) {
		return nil, errNotEvaluable
	}
	return n, nil
}

func (p *exprParser) peek() (exprToken, bool) {
	if p.i < len(p.toks) {
		return p.toks[p.i], true
	}
	return exprToken{}, false
}

func (p *exprParser) isOp(s string) bool {
	t, ok := p.peek()
	return ok && t.kind == 'o' && t.text == s
}

func (p *exprParser) sum() (*exprNode, error) {
	left, err := p.product()
	if err != nil {
		return nil, err
	}
	for p.isOp("+") || p.isOp("-") {
		op := p.toks[p.i].text[0]
		p.i++
		right, err := p.product()
		if err != nil {
			return nil, err
		}
		left = &exprNode{op: op, children: []*exprNode{left, right}}
	}
	return left, nil
}

// startsAtom reports whether the next token can begin a factor multiplied implicitly.
func (p *exprParser) startsAtom() bool {
	t, ok := p.peek()
	return ok && (t.kind != 'o' || t.text == "(")
}

func (p *exprParser) product() (*exprNode, error) {
	left, err := p.unary()
	if err != nil {
		return nil, err
	}
	for {
		var op byte
		switch {
		case p.isOp("*"):
			op = '*'
			p.i++
		case p.isOp("/"):
			op = '/'
			p.i++
		case p.startsAtom():
			op = '*'
		default:
			return left, nil
		}
		right, err := p.unary()
		if err != nil {
			return nil, err
		}
		left = &exprNode{op: op, children: []*exprNode{left, right}}
	}
}

func (p *exprParser) unary() (*exprNode, error) {
	if p.isOp("-") || p.isOp("+") {
		neg := p.toks[p.i].text == "-"
		p.i++
		x, err := p.unary()
		if err != nil || !neg {
			return x, err
		}
		return &exprNode{op: '~', children: []*exprNode{x}}, nil
	}
	return p.power()
}

func (p *exprParser) power() (*exprNode, error) {
	base, err := p.postfix()
	if err != nil {
		return nil, err
	}
	if p.isOp("**") {
		p.i++
		exp, err := p.unary()
		if err != nil {
			return nil, err
		}
		return &exprNode{op: '^', children: []*exprNode{base, exp}}, nil
	}
	return base, nil
}

func (p *exprParser) postfix() (*exprNode, error) {
	x, err := p.atom()
	if err != nil {
		return nil, err
	}
	for p.isOp("!") {
		p.i++
		x = &exprNode{op: '!', children: []*exprNode{x}}
	}
	return x, nil
}

func (p *exprParser) atom() (*exprNode, error) {
	t, ok := p.peek()
	if !ok {
		return nil, errNotEvaluable
	}
	p.i++
	switch t.kind {
	case 'n':
		v, err := numberLiteral(t.text)
		if err != nil {
			return nil, err
		}
		return &exprNode{op: 'n', value: v}, nil
	case 'a':
		switch {
		case t.text == "pi":
			return &exprNode{op: 'p'}, nil
		case sympyFunctions[t.text]:
			var arg *exprNode
			var err error
			if p.isOp("(") {
				arg, err = p.atom()
			} else if p.startsAtom() {
				arg, err = p.postfix() // sympy's implicit application: "sqrt 2" is sqrt(2)
			} else {
				err = errNotEvaluable
			}
			if err != nil {
				return nil, err
			}
			return &exprNode{op: 'f', name: t.text, children: []*exprNode{arg}}, nil
		case sympyOtherNames[t.text]:
			return nil, errNotEvaluable
		}
		return &exprNode{op: 's', name: t.text}, nil
	}
	if t.text != "(" {
		return nil, errNotEvaluable
	}
	x, err := p.sum()
	if err != nil {
		return nil, err
	}
	if !p.isOp(")") {
		return nil, errNotEvaluable
	}
	p.i++
	return x, nil
}

// numberLiteral is sympy's reading of a number: an Integer, or a Float of at least 15 significant
// digits' precision (more when the literal has more digits).
func numberLiteral(text string) (exprValue, error) {
	if !strings.ContainsAny(text, ".eE") {
		n, ok := new(big.Int).SetString(text, 10)
		if !ok {
			return exprValue{}, errNotEvaluable
		}
		return exactOf(new(big.Rat).SetInt(n)), nil
	}
	mant := text
	if i := strings.IndexAny(mant, "eE"); i >= 0 {
		mant = mant[:i]
	}
	digits := strings.TrimLeft(strings.ReplaceAll(mant, ".", ""), "0")
	dps := max(15, len(digits))
	prec := uint(max(1, int(math.Round(float64(dps+1)*3.3219280948873626))))
	r, ok := new(big.Rat).SetString(text)
	if !ok {
		return exprValue{}, errNotEvaluable
	}
	f := new(big.Float).SetPrec(prec).SetRat(r)
	return exprValue{kind: floatValue, f: f, hasFloat: true}, nil
}

// symbolPoints are the values symbols take, one set per evaluation: rationals of both signs, so
// that sqrt(x^2) is not x.
var symbolPoints = [][]*big.Rat{
	{big.NewRat(37, 17), big.NewRat(-41, 13), big.NewRat(23, 29)},
	{big.NewRat(-19, 11), big.NewRat(53, 31), big.NewRat(-7, 43)},
}

func (n *exprNode) eval(symbols map[string]*big.Rat) (exprValue, error) {
	switch n.op {
	case 'n':
		return n.value, nil
	case 's':
		v, ok := symbols[n.name]
		if !ok {
			return exprValue{}, errNotEvaluable
		}
		return exactOf(v), nil
	case 'p':
		return approxOf(complex(math.Pi, 0), false)
	}
	args := make([]exprValue, len(n.children))
	for i, c := range n.children {
		v, err := c.eval(symbols)
		if err != nil {
			return exprValue{}, err
		}
		args[i] = v
	}
	switch n.op {
	case '+', '-', '*', '/':
		return binaryOp(n.op, args[0], args[1])
	case '^':
		if args[1].kind == floatValue && n.children[0].hasSymbol() {
			return exprValue{}, errNotEvaluable // sympy keeps x**2.0 apart from x**2
		}
		return powValue(args[0], args[1])
	case '~':
		return binaryOp('*', exactOf(big.NewRat(-1, 1)), args[0])
	case '!':
		a := args[0]
		if a.kind != exactValue || !a.r.IsInt() || a.r.Sign() < 0 || a.r.Num().Cmp(big.NewInt(1000)) > 0 {
			return exprValue{}, errNotEvaluable
		}
		return exactOf(new(big.Rat).SetInt(new(big.Int).MulRange(1, a.r.Num().Int64()))), nil
	case 'f':
		a := args[0]
		switch n.name {
		case "sqrt":
			return powValue(a, exactOf(big.NewRat(1, 2)))
		case "ln", "log":
			if a.kind == exactValue && a.r.Cmp(big.NewRat(1, 1)) == 0 {
				return exactOf(new(big.Rat)), nil
			}
			if a.complex() == 0 {
				return exprValue{}, errNotEvaluable
			}
			return approxOf(cmplx.Log(a.complex()), a.hasFloat || a.kind == floatValue)
		case "exp":
			if a.kind == exactValue && a.r.Sign() == 0 {
				return exactOf(big.NewRat(1, 1)), nil
			}
			return approxOf(cmplx.Exp(a.complex()), a.hasFloat || a.kind == floatValue)
		}
	}
	return exprValue{}, errNotEvaluable
}

func (n *exprNode) hasSymbol() bool {
	if n.op == 's' {
		return true
	}
	for _, c := range n.children {
		if c.hasSymbol() {
			return true
		}
	}
	return false
}

func (n *exprNode) collectSymbols(into map[string]bool) {
	if n.op == 's' {
		into[n.name] = true
	}
	for _, c := range n.children {
		c.collectSymbols(into)
	}
}

// sympyDifferenceIsZero reports whether sympy.simplify of the parsed expression, which is
// "(a)-(b)", is 0. An expression slimen cannot parse or evaluate is not 0, as in slime, where
// sympy's errors count as "not equal".
func sympyDifferenceIsZero(expr string) bool {
	n, err := parseExpr(expr)
	if err != nil {
		return false
	}
	if f, err := n.ratFunc(); err == nil {
		if len(f.num) == 0 {
			return true
		}
		// Not 0 in normal form is sympy's verdict too, unless an opaque square root may hide
		// an identity that simplify finds (then evaluate below). With decimals it is final:
		// sympy keeps their rounding, which no identity removes.
		if !f.hasOpaque() || n.hasFloat() {
			return false
		}
	}
	names := map[string]bool{}
	n.collectSymbols(names)
	if len(names) > len(symbolPoints[0]) {
		return false
	}
	sorted := make([]string, 0, len(names))
	for name := range names {
		sorted = append(sorted, name)
	}
	sort.Strings(sorted)
	points := symbolPoints
	if len(names) == 0 {
		points = points[:1]
	}
	for _, point := range points {
		symbols := map[string]*big.Rat{}
		for i, name := range sorted {
			symbols[name] = point[i]
		}
		d, err := n.eval(symbols)
		if err != nil {
			return false
		}
		scale := 0.0 // the larger magnitude of the two sides: a tolerance relative to the answer
		if (n.op == '-' || n.op == '+') && len(n.children) == 2 {
			for _, c := range n.children {
				if v, err := c.eval(symbols); err == nil {
					scale = math.Max(scale, cmplx.Abs(v.complex()))
				}
			}
		}
		if !valueIsZero(d, scale, len(names) > 0) {
			return false
		}
	}
	return true
}

func valueIsZero(d exprValue, scale float64, symbolic bool) bool {
	switch {
	case d.kind == exactValue:
		return d.r.Sign() == 0
	case d.kind == floatValue && !symbolic:
		return d.f.Sign() == 0
	}
	tol := 1e-10
	if d.hasFloat || d.kind == floatValue {
		tol = 1e-13
	}
	return cmplx.Abs(d.complex()) <= tol*scale
}

// A polyTerm is a term of a polynomial in symbols, π and square roots, with sympy's number
// coefficients. Where an answer has decimals, sympy combines like terms with Float arithmetic:
// 0.5x - x/2 is 0, but 167.0(0.00598802395209581y - 1.0) - (y - 167) is not, because the
// coefficient of y is off by a rounding. Evaluating at points cannot tell these apart; expanding into terms can.
type polyTerm struct {
	exps map[string]int // atom → exponent: a symbol, "π", or "√n" for a square-free n > 1
	coef exprValue      // exact or a sympy Float
}

type poly map[string]polyTerm

func monomialKey(exps map[string]int) string {
	names := make([]string, 0, len(exps))
	for a, e := range exps {
		if e != 0 {
			names = append(names, a)
		}
	}
	sort.Strings(names)
	var b strings.Builder
	for _, a := range names {
		b.WriteString(a)
		b.WriteByte('^')
		b.WriteString(big.NewInt(int64(exps[a])).String())
		b.WriteByte(' ')
	}
	return b.String()
}

func isZeroNumber(v exprValue) bool {
	return v.kind == exactValue && v.r.Sign() == 0 || v.kind == floatValue && v.f.Sign() == 0
}

// addTerm adds c·monomial to p, dropping a term whose coefficient becomes 0 as sympy does.
func (p poly) addTerm(exps map[string]int, c exprValue) error {
	// Fold square roots: √a·√b = √(ab) with square factors taken out, √n² = n.
	rad := big.NewInt(1)
	clean := map[string]int{}
	for a, e := range exps {
		if strings.HasPrefix(a, "√") {
			n, _ := new(big.Int).SetString(a[len("√"):], 10)
			if e%2 != 0 {
				rad.Mul(rad, n)
			}
			half := e / 2
			if e < 0 && e%2 != 0 {
				half = (e - 1) / 2 // √n^-1 = √n / n
			}
			var err error
			if c, err = binaryOp('*', c, exactOf(ratPow(new(big.Rat).SetInt(n), int64(half)))); err != nil {
				return err
			}
			continue
		}
		if e != 0 {
			clean[a] = e
		}
	}
	if rad.Cmp(big.NewInt(1)) != 0 {
		s, r := squareFree(rad)
		var err error
		if c, err = binaryOp('*', c, exactOf(new(big.Rat).SetInt(s))); err != nil {
			return err
		}
		if r.Cmp(big.NewInt(1)) != 0 {
			clean["√"+r.String()] = 1
		}
	}
	key := monomialKey(clean)
	if t, ok := p[key]; ok {
		sum, err := binaryOp('+', t.coef, c)
		if err != nil {
			return err
		}
		c = sum
	}
	if isZeroNumber(c) {
		delete(p, key)
		return nil
	}
	p[key] = polyTerm{exps: clean, coef: c}
	return nil
}

// squareFree splits n = s²·r with r square-free (trial division; n is small in answers).
func squareFree(n *big.Int) (*big.Int, *big.Int) {
	s, r := big.NewInt(1), new(big.Int).Set(n)
	if r.BitLen() > 64 {
		return s, r
	}
	v := r.Uint64()
	out := uint64(1)
	for f := uint64(2); f*f <= v; f++ {
		for v%(f*f) == 0 {
			v /= f * f
			out *= f
		}
	}
	return new(big.Int).SetUint64(out), new(big.Int).SetUint64(v)
}

func polyConst(v exprValue) (poly, error) {
	if v.kind == approxValue {
		return nil, errNotEvaluable
	}
	p := poly{}
	return p, p.addTerm(map[string]int{}, v)
}

func polyAdd(a, b poly, sign int64) (poly, error) {
	out := poly{}
	for _, t := range a {
		if err := out.addTerm(t.exps, t.coef); err != nil {
			return nil, err
		}
	}
	for _, t := range b {
		c := t.coef
		if sign < 0 {
			var err error
			if c, err = binaryOp('*', exactOf(big.NewRat(-1, 1)), c); err != nil {
				return nil, err
			}
		}
		if err := out.addTerm(t.exps, c); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func polyMul(a, b poly) (poly, error) {
	if len(a)*len(b) > maxPolyTerms*maxPolyTerms/4 {
		return nil, errNotEvaluable
	}
	out := poly{}
	for _, x := range a {
		for _, y := range b {
			exps := map[string]int{}
			for k, e := range x.exps {
				exps[k] += e
			}
			for k, e := range y.exps {
				exps[k] += e
			}
			c, err := coefMul(x.coef, y.coef)
			if err != nil {
				return nil, err
			}
			if err := out.addTerm(exps, c); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// coefMul multiplies coefficients. A Float times an exact number is rounded once, from the exact
// product: sympy multiplies a product's rational factors together before a Float meets them, so
// 36·0.5/49 is 18/49 rounded, not 18.0 times 1/49 rounded.
func coefMul(a, b exprValue) (exprValue, error) {
	if a.kind == floatValue && b.kind == exactValue {
		a, b = b, a
	}
	if a.kind == exactValue && b.kind == floatValue {
		r, _ := b.f.Rat(nil)
		z := new(big.Float).SetPrec(b.f.Prec()).SetRat(r.Mul(r, a.r))
		return exprValue{kind: floatValue, f: z, hasFloat: true}, nil
	}
	return binaryOp('*', a, b)
}

// polyInverse inverts a single term; a sum in a denominator is not a polynomial.
func polyInverse(a poly) (poly, error) {
	if len(a) != 1 {
		return nil, errNotEvaluable
	}
	for _, t := range a {
		c, err := binaryOp('/', exactOf(big.NewRat(1, 1)), t.coef)
		if err != nil {
			return nil, err
		}
		exps := map[string]int{}
		for k, e := range t.exps {
			exps[k] = -e
		}
		out := poly{}
		return out, out.addTerm(exps, c)
	}
	return nil, errNotEvaluable
}

const maxPolyTerms = 256

// ratFunc is a quotient of polynomials: sympy's simplify brings a difference over a common
// denominator, so it is 0 exactly when the numerator is.
type ratFunc struct{ num, den poly }

func polyOne() poly {
	p, _ := polyConst(exactOf(big.NewRat(1, 1)))
	return p
}

func atomPoly(name string) ratFunc {
	exps := map[string]int{name: 1}
	return ratFunc{poly{monomialKey(exps): {exps: exps, coef: exactOf(big.NewRat(1, 1))}}, polyOne()}
}

// simplify moves a one-term denominator into the numerator, so that a polynomial's numerator is
// its normal form, and bounds the sizes.
func (f ratFunc) simplify() (ratFunc, error) {
	if len(f.num) > maxPolyTerms || len(f.den) > maxPolyTerms {
		return ratFunc{}, errNotEvaluable // too large to expand; evaluated at points instead
	}
	if len(f.den) == 1 {
		inv, err := polyInverse(f.den)
		if err != nil {
			return ratFunc{}, err
		}
		num, err := polyMul(f.num, inv)
		if err != nil {
			return ratFunc{}, err
		}
		return ratFunc{num, polyOne()}, nil
	}
	return f, nil
}

func ratMul(a, b ratFunc) (ratFunc, error) {
	num, err := polyMul(a.num, b.num)
	if err != nil {
		return ratFunc{}, err
	}
	den, err := polyMul(a.den, b.den)
	if err != nil {
		return ratFunc{}, err
	}
	return ratFunc{num, den}.simplify()
}

func ratAdd(a, b ratFunc, sign int64) (ratFunc, error) {
	if len(a.den) == 1 && len(b.den) == 1 { // simplify leaves a one-term denominator only as 1
		num, err := polyAdd(a.num, b.num, sign)
		return ratFunc{num, polyOne()}, err
	}
	x, err := polyMul(a.num, b.den)
	if err != nil {
		return ratFunc{}, err
	}
	y, err := polyMul(b.num, a.den)
	if err != nil {
		return ratFunc{}, err
	}
	num, err := polyAdd(x, y, sign)
	if err != nil {
		return ratFunc{}, err
	}
	den, err := polyMul(a.den, b.den)
	if err != nil {
		return ratFunc{}, err
	}
	return ratFunc{num, den}.simplify()
}

func ratInverse(a ratFunc) (ratFunc, error) {
	if len(a.num) == 0 {
		return ratFunc{}, errNotEvaluable // division by 0: sympy's zoo
	}
	return ratFunc{a.den, a.num}.simplify()
}

// ratFunc evaluates the expression as a quotient of polynomials in symbols, π and square roots
// of integers, with exact or Float coefficients; an error where it is not one (a logarithm, the
// square root of a symbol).
func (n *exprNode) ratFunc() (ratFunc, error) {
	switch n.op {
	case 'n':
		p, err := polyConst(n.value)
		return ratFunc{p, polyOne()}, err
	case 's':
		return atomPoly(n.name), nil
	case 'p':
		return atomPoly("π"), nil
	case '!':
		v, err := n.eval(nil)
		if err != nil {
			return ratFunc{}, err
		}
		p, err := polyConst(v)
		return ratFunc{p, polyOne()}, err
	case 'f':
		if n.name != "sqrt" {
			return ratFunc{}, errNotEvaluable
		}
		a, err := n.children[0].ratFunc()
		if err != nil {
			return ratFunc{}, err
		}
		return ratSqrt(a)
	}
	a, err := n.children[0].ratFunc()
	if err != nil {
		return ratFunc{}, err
	}
	switch n.op {
	case '~':
		num, err := polyAdd(poly{}, a.num, -1)
		return ratFunc{num, a.den}, err
	case '^':
		if n.children[1].hasSymbol() {
			return ratFunc{}, errNotEvaluable
		}
		e, err := n.children[1].eval(nil)
		if err != nil || e.kind != exactValue {
			return ratFunc{}, errNotEvaluable
		}
		if e.r.Cmp(big.NewRat(1, 2)) == 0 {
			return ratSqrt(a)
		}
		if !e.r.IsInt() || e.r.Num().BitLen() > 5 {
			return ratFunc{}, errNotEvaluable
		}
		k := e.r.Num().Int64()
		if k < 0 {
			if a, err = ratInverse(a); err != nil {
				return ratFunc{}, err
			}
			k = -k
		}
		out := ratFunc{polyOne(), polyOne()}
		for i := int64(0); i < k; i++ {
			if out, err = ratMul(out, a); err != nil {
				return ratFunc{}, err
			}
		}
		return out, nil
	}
	b, err := n.children[1].ratFunc()
	if err != nil {
		return ratFunc{}, err
	}
	switch n.op {
	case '+':
		return ratAdd(a, b, 1)
	case '-':
		return ratAdd(a, b, -1)
	case '*':
		return ratMul(a, b)
	case '/':
		inv, err := ratInverse(b)
		if err != nil {
			return ratFunc{}, err
		}
		return ratMul(a, inv)
	}
	return ratFunc{}, errNotEvaluable
}

// ratSqrt is a square root: of a positive exact rational, r·√n. The square root of anything else (√(√2+3), √(x+1)) is an opaque atom named after its
// argument's normal form: sympy leaves it alone, and combines the terms it multiplies.
func ratSqrt(a ratFunc) (ratFunc, error) {
	a, err := a.simplify()
	if err != nil {
		return ratFunc{}, err
	}
	if len(a.den) == 1 {
		if p, err := polySqrt(a.num); err == nil {
			return ratFunc{p, polyOne()}, nil
		}
	}
	if len(a.num) == 0 {
		return ratFunc{poly{}, polyOne()}, nil
	}
	return atomPoly(opaqueSqrt + a.key() + "]"), nil
}

// opaqueSqrt begins the name of an opaque square-root atom.
const opaqueSqrt = "sqrt["

// key is a canonical text of a quotient: its terms in order, with their coefficients.
func (f ratFunc) key() string {
	write := func(b *strings.Builder, p poly) {
		keys := make([]string, 0, len(p))
		for k := range p {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			c := p[k].coef
			if c.kind == exactValue {
				b.WriteString(c.r.String())
			} else {
				b.WriteString(c.f.Text('p', 0))
			}
			b.WriteString("·" + k + ";")
		}
	}
	var b strings.Builder
	write(&b, f.num)
	b.WriteString("/")
	write(&b, f.den)
	return b.String()
}

// hasOpaque reports whether a quotient has an opaque atom, whose relations to other terms
// (√(x+1)² = x+1) the normal form does not see.
func (f ratFunc) hasOpaque() bool {
	for _, p := range []poly{f.num, f.den} {
		for _, t := range p {
			for a := range t.exps {
				if strings.HasPrefix(a, opaqueSqrt) {
					return true
				}
			}
		}
	}
	return false
}

// polySqrt is the square root of a positive exact rational: r·√n.
func polySqrt(p poly) (poly, error) {
	if len(p) == 0 {
		return p, nil
	}
	t, ok := p[""]
	if len(p) != 1 || !ok || t.coef.kind != exactValue || t.coef.r.Sign() < 0 {
		return nil, errNotEvaluable
	}
	// √(a/b) = √(ab)/b
	ab := new(big.Int).Mul(t.coef.r.Num(), t.coef.r.Denom())
	out := poly{}
	return out, out.addTerm(map[string]int{"√" + ab.String(): 1}, exactOf(new(big.Rat).SetFrac(big.NewInt(1), t.coef.r.Denom())))
}

func (n *exprNode) hasFloat() bool {
	if n.op == 'n' && n.value.kind == floatValue {
		return true
	}
	for _, c := range n.children {
		if c.hasFloat() {
			return true
		}
	}
	return false
}
