package starlib

import (
	"errors"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
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
	"Leftarrow": "⇐", "Longrightarrow": "⟹", "longrightarrow": "⟶", "leftrightarrow": "↔", "downarrow": "↓",
	"hookrightarrow": "↪", "nearrow": "↗", "searrow": "↘", "Upsilon": "Υ", "omicron": "ο", "varkappa": "ϰ",
	"varpi": "ϖ", "varrho": "ϱ", "varsigma": "ς", "amalg": "⨿", "asymp": "≍", "beth": "ℶ", "blacksquare": "▪",
	"dag": "†", "dashv": "⊣", "diamond": "♢", "doteq": "≐", "dotsb": "…", "dotsc": "…", "gtrsim": "≳",
	"lesssim": "≲", "liminf": "lim inf", "limsup": "lim sup", "measuredangle": "∡", "nexists": "∄", "ngeq": "≱",
	"ngtr": "≯", "ni": "∋", "nless": "≮", "nmid": "∤", "notin": "∉", "odot": "⊙", "ominus": "⊖", "oslash": "⊘",
	"prec": "≺", "sqcap": "⊓", "sqcup": "⊔", "succ": "≻", "supset": "⊃", "supseteq": "⊇", "vdash": "⊢",
	"wp": "℘", "wr": "≀",
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

// latexArgCommands print their one argument, with an accent after each character where they have
// one (as pylatexenc does, then composed: \\hat{a} is â). A missing argument prints the accent
// over a space, or "%s" for the commands in latexMissingArgPercent.
var latexArgCommands = map[string]string{
	"text": "", "textbf": "", "textit": "", "textrm": "", "textsl": "", "textsc": "", "textnormal": "", "emph": "",
	"mathrm": "", "mathnormal": "", "boldsymbol": "", "bm": "", "operatorname": "", "boxed": "", "fbox": "",
	"overline": "", "underline": "", "widehat": "", "widetilde": "", "overbrace": "", "underbrace": "",
	"overleftarrow": "", "overrightarrow": "", "ensuremath": "", "phantom": "", "pmod": "", "mathring": "",
	"hat": "\u0302", "bar": "\u0305", "vec": "\u20d7", "tilde": "\u0303", "dot": "\u0307", "ddot": "\u0308",
	"acute": "\u0301", "grave": "\u0300", "check": "\u030c", "breve": "\u0306",
}

var latexMissingArgPercent = map[string]bool{
	"overline": true, "underline": true, "widehat": true, "widetilde": true, "overbrace": true,
	"underbrace": true, "overleftarrow": true, "overrightarrow": true, "ensuremath": true,
}

// latexDropArgCommands take one argument and print what is given here instead.
var latexDropArgCommands = map[string]string{
	"hspace": "", "vspace": "\n", "color": "", "label": "", "mbox": "", "textsf": "", "texttt": "", "textup": "",
	"hphantom": "", "vphantom": "", "cite": "<cit.>", "ref": "<ref>",
}

// mathStyles are the Unicode forms of the letters A–Z, a–z that \\mathbf and its kin print; digits
// and other characters stay as they are.
var mathStyles = map[string][]rune{
	"mathbf":   []rune("𝐀𝐁𝐂𝐃𝐄𝐅𝐆𝐇𝐈𝐉𝐊𝐋𝐌𝐍𝐎𝐏𝐐𝐑𝐒𝐓𝐔𝐕𝐖𝐗𝐘𝐙𝐚𝐛𝐜𝐝𝐞𝐟𝐠𝐡𝐢𝐣𝐤𝐥𝐦𝐧𝐨𝐩𝐪𝐫𝐬𝐭𝐮𝐯𝐰𝐱𝐲𝐳"),
	"mathit":   []rune("𝐴𝐵𝐶𝐷𝐸𝐹𝐺𝐻𝐼𝐽𝐾𝐿𝑀𝑁𝑂𝑃𝑄𝑅𝑆𝑇𝑈𝑉𝑊𝑋𝑌𝑍𝑎𝑏𝑐𝑑𝑒𝑓𝑔ℎ𝑖𝑗𝑘𝑙𝑚𝑛𝑜𝑝𝑞𝑟𝑠𝑡𝑢𝑣𝑤𝑥𝑦𝑧"),
	"mathbb":   []rune("𝔸𝔹ℂ𝔻𝔼𝔽𝔾ℍ𝕀𝕁𝕂𝕃𝕄ℕ𝕆ℙℚℝ𝕊𝕋𝕌𝕍𝕎𝕏𝕐ℤ𝕒𝕓𝕔𝕕𝕖𝕗𝕘𝕙𝕚𝕛𝕜𝕝𝕞𝕟𝕠𝕡𝕢𝕣𝕤𝕥𝕦𝕧𝕨𝕩𝕪𝕫"),
	"mathcal":  []rune("𝒜ℬ𝒞𝒟ℰℱ𝒢ℋℐ𝒥𝒦ℒℳ𝒩𝒪𝒫𝒬ℛ𝒮𝒯𝒰𝒱𝒲𝒳𝒴𝒵𝒶𝒷𝒸𝒹ℯ𝒻ℊ𝒽𝒾𝒿𝓀𝓁𝓂𝓃ℴ𝓅𝓆𝓇𝓈𝓉𝓊𝓋𝓌𝓍𝓎𝓏"),
	"mathscr":  []rune("𝒜ℬ𝒞𝒟ℰℱ𝒢ℋℐ𝒥𝒦ℒℳ𝒩𝒪𝒫𝒬ℛ𝒮𝒯𝒰𝒱𝒲𝒳𝒴𝒵𝒶𝒷𝒸𝒹ℯ𝒻ℊ𝒽𝒾𝒿𝓀𝓁𝓂𝓃ℴ𝓅𝓆𝓇𝓈𝓉𝓊𝓋𝓌𝓍𝓎𝓏"),
	"mathfrak": []rune("𝔄𝔅ℭ𝔇𝔈𝔉𝔊ℌℑ𝔍𝔎𝔏𝔐𝔑𝔒𝔓𝔔ℜ𝔖𝔗𝔘𝔙𝔚𝔛𝔜ℨ𝔞𝔟𝔠𝔡𝔢𝔣𝔤𝔥𝔦𝔧𝔨𝔩𝔪𝔫𝔬𝔭𝔮𝔯𝔰𝔱𝔲𝔳𝔴𝔵𝔶𝔷"),
	"mathsf":   []rune("𝖠𝖡𝖢𝖣𝖤𝖥𝖦𝖧𝖨𝖩𝖪𝖫𝖬𝖭𝖮𝖯𝖰𝖱𝖲𝖳𝖴𝖵𝖶𝖷𝖸𝖹𝖺𝖻𝖼𝖽𝖾𝖿𝗀𝗁𝗂𝗃𝗄𝗅𝗆𝗇𝗈𝗉𝗊𝗋𝗌𝗍𝗎𝗏𝗐𝗑𝗒𝗓"),
	"mathtt":   []rune("𝙰𝙱𝙲𝙳𝙴𝙵𝙶𝙷𝙸𝙹𝙺𝙻𝙼𝙽𝙾𝙿𝚀𝚁𝚂𝚃𝚄𝚅𝚆𝚇𝚈𝚉𝚊𝚋𝚌𝚍𝚎𝚏𝚐𝚑𝚒𝚓𝚔𝚕𝚖𝚗𝚘𝚙𝚚𝚛𝚜𝚝𝚞𝚟𝚠𝚡𝚢𝚣"),
}

func styled(table []rune, r rune) rune {
	switch {
	case r >= 'A' && r <= 'Z':
		return table[r-'A']
	case r >= 'a' && r <= 'z':
		return table[26+r-'a']
	}
	return r
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
		} else if latexMissingArgPercent[name] {
			b.WriteString("%s")
		} else if text, ok := latexDropArgCommands[name]; ok {
			b.WriteString(text)
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
		p.skipOptional() // the index of \sqrt[3]{x} is dropped
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
		arg, ok, err := p.arg()
		if err != nil {
			return err
		}
		switch {
		case !ok && latexMissingArgPercent[name]:
			b.WriteString("%s")
		case !ok && accent != "":
			b.WriteString(" " + accent)
		case accent == "":
			b.WriteString(arg)
		default:
			var acc strings.Builder
			for _, r := range arg {
				acc.WriteRune(r)
				acc.WriteString(accent)
			}
			b.WriteString(norm.NFC.String(acc.String()))
		}
		return nil
	}
	if text, ok := latexDropArgCommands[name]; ok {
		if name == "hphantom" || name == "vphantom" || name == "color" || name == "cite" {
			p.skipOptional()
		}
		_, _, err := p.arg()
		b.WriteString(text)
		return err
	}
	if name == "textcolor" { // \textcolor{color}{text}
		if p.skipSpaces(); p.i < len(p.s) && p.s[p.i] == '[' {
			return errLatexArgument
		}
		if _, ok, err := p.arg(); err != nil || !ok {
			return errLatexArgument
		}
		arg, ok, err := p.arg()
		if err != nil || !ok {
			return errLatexArgument
		}
		b.WriteString(arg)
		return nil
	}
	if table, ok := mathStyles[name]; ok {
		arg, _, err := p.arg()
		if err != nil {
			return err
		}
		b.WriteString(strings.Map(func(r rune) rune { return styled(table, r) }, arg))
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

// skipOptional skips an optional argument [..].
func (p *latexParser) skipOptional() {
	p.skipSpaces()
	if p.i < len(p.s) && p.s[p.i] == '[' {
		if j := strings.IndexByte(p.s[p.i:], ']'); j >= 0 {
			p.i += j + 1
		}
	}
}

func (p *latexParser) skipSpaces() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t' || p.s[p.i] == '\n') {
		p.i++
	}
}

// arg reads a command's argument: a {group}, a command, or one character, rendered. ok is false at
// the end of input. A "}" (the end of the enclosing group) is an empty argument, left in place.
func (p *latexParser) arg() (string, bool, error) {
	for p.skipSpaces(); p.i < len(p.s) && p.s[p.i] == '%'; p.skipSpaces() { // comments are skipped
		for p.i < len(p.s) && p.s[p.i] != '\n' {
			p.i++
		}
	}
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
	case '~':
		p.i++
		b.WriteString("\u00a0")
	default:
		_, size := utf8.DecodeRuneInString(p.s[p.i:])
		b.WriteString(p.s[p.i : p.i+size])
		p.i += size
	}
	return b.String(), true, nil
}
