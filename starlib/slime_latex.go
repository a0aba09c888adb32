package starlib

import (
	"errors"
	"strings"
	"unicode"
	"unicode/utf8"
)

// latexToText renders LaTeX as plain text the way slime's math grader sees it (it runs
// pylatexenc's latex2text before handing an answer to sympy): \frac{a}{b} becomes "a/b" with no
// parentheses (so \frac{x+1}{2} reads as x+1/2), \sqrt{x} becomes "√(x)", symbols become their
// Unicode characters, formatting commands keep only their argument, a control word eats the
// spaces after it, and a command it does not know prints nothing. An error means the renderer
// would have failed (a \sqrt with no argument), in which case slime keeps the answer unrendered.
func latexToText(s string) (string, error) {
	p := latexParser{s: s}
	var b strings.Builder
	if err := p.render(&b, ""); err != nil {
		return "", err
	}
	return b.String(), nil
}

type latexParser struct {
	s string
	i int
}

var errLatexArgument = errors.New("a LaTeX command is missing its argument")

// latexSymbols are commands without arguments that print a character or a word.
var latexSymbols = map[string]string{
	"pi": "π", "infty": "∞", "cup": "∪", "cap": "∩", "cdot": "·", "times": "×", "div": "÷",
	"pm": "±", "mp": "∓", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "neq": "≠", "approx": "≈",
	"sim": "∼", "simeq": "≃", "cong": "≅", "equiv": "≡", "propto": "∝", "to": "→", "rightarrow": "→",
	"leftarrow": "←", "Rightarrow": "⇒", "Leftrightarrow": "⇔", "mapsto": "↦", "uparrow": "↑",
	"circ": "∘", "prime": "'", "ldots": "…", "dots": "…", "cdots": "⋯", "vdots": "⋮", "ddots": "⋱",
	"in": "∈", "subset": "⊂", "subseteq": "⊆", "setminus": "∖", "emptyset": "∅", "varnothing": "∅",
	"angle": "∠", "partial": "∂", "nabla": "∇", "int": "∫", "sum": "∑", "prod": "∏", "forall": "∀",
	"exists": "∃", "wedge": "∧", "vee": "∨", "lnot": "¬", "mid": "|", "vert": "|", "lvert": "|",
	"rvert": "|", "Vert": "‖", "lVert": "‖", "rVert": "‖", "langle": "⟨", "rangle": "⟩",
	"lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉", "perp": "⊥", "parallel": "∥",
	"square": "□", "oplus": "⊕", "otimes": "⊗", "gg": "≫", "ll": "≪", "leqslant": "⩽",
	"geqslant": "⩾", "nleq": "≰", "dagger": "†", "star": "⋆", "ast": "∗", "bullet": "∙",
	"aleph": "ℵ", "hbar": "ħ", "ell": "ℓ", "textdegree": "°", "backslash": "\\", "textbackslash": "\\",
	"sin": "sin", "cos": "cos", "tan": "tan", "arcsin": "arcsin", "arccos": "arccos", "arctan": "arctan",
	"sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "ln": "ln", "log": "log", "exp": "exp", "lim": "lim",
	"max": "max", "min": "min", "sup": "sup", "inf": "inf",
	"alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ϵ", "varepsilon": "ε",
	"zeta": "ζ", "eta": "η", "theta": "θ", "vartheta": "ϑ", "iota": "ι", "kappa": "κ", "lambda": "λ",
	"mu": "μ", "nu": "ν", "xi": "ξ", "rho": "ρ", "sigma": "σ", "tau": "τ", "upsilon": "υ",
	"phi": "ϕ", "varphi": "φ", "chi": "χ", "psi": "ψ", "omega": "ω", "Gamma": "Γ", "Delta": "Δ",
	"Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ", "Pi": "Π", "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
	// Spacing and escapes.
	",": " ", ";": " ", ":": " ", " ": " ", "!": "", "quad": "  ", "qquad": "    ",
	"{": "{", "}": "}", "%": "%", "$": "$", "&": "&", "#": "#", "_": "_", "\\": "\n",
}

// latexArgCommands print their one argument as is (formatting, boxes, bars).
var latexArgCommands = map[string]string{
	"text": "", "textbf": "", "textit": "", "textrm": "", "textsf": "", "texttt": "", "emph": "",
	"mathrm": "", "operatorname": "", "boxed": "", "fbox": "", "overline": "",
	"underline": "", "widehat": "", "widetilde": "", "phantom": "", "pmod": "",
	"hat": "\u0302", "bar": "\u0305", "vec": "\u20d7", "tilde": "\u0303", "dot": "\u0307",
}

// latexDropArgCommands take one argument and print nothing.
var latexDropArgCommands = map[string]bool{"hspace": true, "vspace": true, "color": true, "label": true, "mbox": true}

// mathStyles map letters and digits of \mathbf, \mathit and \mathbb to their Unicode forms.
var mathStyles = map[string]func(r rune) rune{
	"mathbf": func(r rune) rune {
		switch {
		case r >= 'A' && r <= 'Z':
			return 0x1D400 + r - 'A'
		case r >= 'a' && r <= 'z':
			return 0x1D41A + r - 'a'
		}
		return r
	},
	"mathit": func(r rune) rune {
		switch {
		case r == 'h':
			return 'ℎ'
		case r >= 'A' && r <= 'Z':
			return 0x1D434 + r - 'A'
		case r >= 'a' && r <= 'z':
			return 0x1D44E + r - 'a'
		}
		return r
	},
	"mathbb": func(r rune) rune {
		if s, ok := map[rune]rune{'C': 'ℂ', 'H': 'ℍ', 'N': 'ℕ', 'P': 'ℙ', 'Q': 'ℚ', 'R': 'ℝ', 'Z': 'ℤ'}[r]; ok {
			return s
		}
		switch {
		case r >= 'A' && r <= 'Z':
			return 0x1D538 + r - 'A'
		case r >= 'a' && r <= 'z':
			return 0x1D552 + r - 'a'
		case r >= '0' && r <= '9':
			return 0x1D7D8 + r - '0'
		}
		return r
	},
}

// render writes nodes until the end of input or the closing brace of the group being read (stop
// "}"). An unmatched "}" at the top level prints nothing.
func (p *latexParser) render(b *strings.Builder, stop string) error {
	for p.i < len(p.s) {
		c := p.s[p.i]
		switch c {
		case '}':
			p.i++
			if stop == "}" {
				return nil
			}
		case '{':
			p.i++
			if err := p.render(b, "}"); err != nil {
				return err
			}
		case '$':
			p.i++ // math mode delimiters print nothing
		case '%': // a comment, to the end of the line
			for p.i < len(p.s) && p.s[p.i] != '\n' {
				p.i++
			}
		case '~':
			p.i++
			b.WriteString("\u00a0")
		case '\\':
			if err := p.command(b, true); err != nil {
				return err
			}
		default:
			b.WriteByte(c)
			p.i++
		}
	}
	return nil
}

// command reads and renders the command at p.i (a backslash). A command that is itself the
// argument of another (\frac\frac12) takes no arguments of its own (withArgs false), and renders
// as pylatexenc renders a command whose arguments are missing.
func (p *latexParser) command(b *strings.Builder, withArgs bool) error {
	p.i++
	if p.i >= len(p.s) {
		return nil
	}
	start := p.i
	isAlpha := func(i int) (bool, int) {
		r, size := utf8.DecodeRuneInString(p.s[i:])
		return unicode.IsLetter(r), size
	}
	if ok, _ := isAlpha(p.i); ok { // a control word: letters, as Python's isalpha counts them
		for p.i < len(p.s) {
			ok, size := isAlpha(p.i)
			if !ok {
				break
			}
			p.i += size
		}
	} else {
		_, size := utf8.DecodeRuneInString(p.s[p.i:])
		p.i += size
	}
	name := p.s[start:p.i]
	if ok, _ := isAlpha(start); ok {
		p.skipSpaces() // a control word eats the spaces after it
	}
	if name == "(" || name == ")" || name == "[" || name == "]" {
		return nil // math mode delimiters
	}
	if s, ok := latexSymbols[name]; ok {
		b.WriteString(s)
		return nil
	}
	if !withArgs {
		switch name {
		case "frac":
			b.WriteString("%s/%s")
		case "sqrt":
			return errLatexArgument
		}
		if accent := latexArgCommands[name]; accent != "" {
			b.WriteString(" " + accent) // an accent over nothing
		}
		return nil
	}
	switch name {
	case "frac":
		num, ok1, err := p.arg()
		if err != nil {
			return err
		}
		den, ok2, err := p.arg()
		if err != nil {
			return err
		}
		if !ok1 || !ok2 {
			b.WriteString("%s/%s" + num + den)
			return nil
		}
		b.WriteString(num + "/" + den)
		return nil
	case "sqrt":
		p.skipSpaces()
		if p.i < len(p.s) && p.s[p.i] == '[' { // the index of \sqrt[3]{x} is dropped
			if j := strings.IndexByte(p.s[p.i:], ']'); j >= 0 {
				p.i += j + 1
			}
		}
		arg, ok, err := p.arg()
		if err != nil {
			return err
		}
		if !ok {
			return errLatexArgument
		}
		b.WriteString("√(" + arg + ")")
		return nil
	case "begin", "end":
		env, _, err := p.arg()
		if err != nil {
			return err
		}
		if strings.HasSuffix(env, "matrix") || env == "array" {
			return p.matrix(b, name, env)
		}
		return nil
	}
	if accent, ok := latexArgCommands[name]; ok {
		arg, _, err := p.arg()
		if err != nil {
			return err
		}
		b.WriteString(arg + accent)
		return nil
	}
	if latexDropArgCommands[name] {
		_, _, err := p.arg()
		return err
	}
	if style, ok := mathStyles[name]; ok {
		arg, _, err := p.arg()
		if err != nil {
			return err
		}
		b.WriteString(strings.Map(style, arg))
		return nil
	}
	return nil // an unknown command prints nothing; its arguments print as groups
}

// matrix renders the body of a matrix environment as "[ a b; c d ]".
func (p *latexParser) matrix(b *strings.Builder, kind, env string) error {
	if kind == "end" {
		return nil
	}
	if env == "array" { // the column specification
		if _, _, err := p.arg(); err != nil {
			return err
		}
	}
	end := strings.Index(p.s[p.i:], `\end{`+env+`}`)
	body := p.s[p.i:]
	if end >= 0 {
		body = p.s[p.i : p.i+end]
		p.i += end + len(`\end{`+env+`}`)
	} else {
		p.i = len(p.s)
	}
	var rows []string
	for _, row := range strings.Split(body, `\\`) {
		var cells []string
		for _, cell := range strings.Split(row, "&") {
			text, err := latexToText(cell)
			if err != nil {
				return err
			}
			if t := strings.TrimSpace(text); t != "" {
				cells = append(cells, t)
			}
		}
		if len(cells) > 0 {
			rows = append(rows, strings.Join(cells, " "))
		}
	}
	b.WriteString("[ " + strings.Join(rows, "; ") + " ]")
	return nil
}

func (p *latexParser) skipSpaces() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t' || p.s[p.i] == '\n') {
		p.i++
	}
}

// arg reads a command's argument: a {group}, a command, or one character, rendered. ok is false at
// the end of input. A "}" (the end of the enclosing group) is an empty argument, left in place.
func (p *latexParser) arg() (string, bool, error) {
	p.skipSpaces()
	if p.i >= len(p.s) {
		return "", false, nil
	}
	if p.s[p.i] == '}' {
		return "", true, nil
	}
	if p.s[p.i] == '\\' && p.i == len(p.s)-1 {
		return "", false, nil // a lone backslash at the end is no argument
	}
	var b strings.Builder
	switch c := p.s[p.i]; c {
	case '{':
		p.i++
		if err := p.render(&b, "}"); err != nil {
			return "", false, err
		}
	case '\\':
		if err := p.command(&b, false); err != nil {
			return "", false, err
		}
	default:
		_, size := utf8.DecodeRuneInString(p.s[p.i:])
		b.WriteString(p.s[p.i : p.i+size])
		p.i += size
	}
	return b.String(), true, nil
}
