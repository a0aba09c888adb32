package constrain

// The automaton reads the response byte by byte. Its state is a stack of frames (persistent:
// a step makes new frames and shares the ones below), the top one reading the innermost value.

type kind uint8

const (
	kValue  kind = iota // a value of n begins, after at most MaxSpace whitespace bytes
	kObject             // inside an object of n (st: objOpen…)
	kKey                // inside a key of the object of n (i: the node in n.keys, -1: another key)
	kArray              // inside an array of n (st: 0 after '[', 1 after an item, 2 after ',')
	kString             // inside a string (st: 0 text, 1 after '\', 2-5 the hex digits of \u)
	kNumber             // inside a number (st: numStart…, i: its length)
	kLit                // inside one of lit's strings (i: the node in lit)
	kEnd                // the bottom of a JSON response: st 0 before the value, 1 after it
	kCalls              // the bottom of a tool-call response (st: callsBefore…, i: calls made)
)

const (
	objOpen  = iota // after '{': a key or '}'
	objKey          // a key being read
	objColon        // after a key: ':'
	objValue        // a value being read
	objNext         // after a value: ',' or '}'
	objComma        // after ',': a key
)

const (
	callsBefore = iota // before a call (or the end, once Min calls are made)
	callsOpen          // the opening tag being read
	callsBody          // after the tag: the call's JSON object
	callsInBody        // the call's JSON object being read
	callsAfter         // after the object: the closing tag
	callsClose         // the closing tag being read
	callsEnd           // after the last call: whitespace, then the end
	callsText          // free text, until the opening tag
	callsAnswer        // the JSON value that stands instead of calls being read
)

type frame struct {
	kind kind
	st   uint8
	ws   uint8 // whitespace bytes in the current run
	n    *node
	lit  *litTrie
	i    int32
	cur  int32  // kObject: the property whose value is read (-1: another key); kKey: the key read
	seen uint64 // kObject: the properties seen
}

type stack struct {
	f  frame
	up *stack
}

// accepted is what a step on eof returns where the response may end.
var accepted = &stack{}

const eof = -1

var (
	boolLits = litsOf(-1, "true", "false")
	nullLits = litsOf(-2, "null")
)

func litsOf(id int, ss ...string) *litTrie {
	t := newLitTrie()
	t.id = id
	for _, s := range ss {
		t.add([]byte(s))
	}
	return t
}

func isSpace(b int) bool { return b == ' ' || b == '\n' || b == '\t' || b == '\r' }

func isDigit(b int) bool { return b >= '0' && b <= '9' }

func isHex(b int) bool { return isDigit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F') }

// space steps a frame over a whitespace byte: the same frame with its run one longer, if the run
// may grow.
func space(f frame, up *stack, out []*stack) []*stack {
	if f.ws >= MaxSpace {
		return out
	}
	f.ws++
	return append(out, &stack{f, up})
}

// step appends to out the stacks s becomes after byte b (eof: the end of the response).
func (g *Grammar) step(s *stack, b int, out []*stack) []*stack {
	f := s.f
	switch f.kind {
	case kValue:
		if isSpace(b) {
			return space(f, s.up, out)
		}
		return g.start(f.n, s.up, b, out, 0)

	case kString:
		switch {
		case f.st == 0 && b == '"':
			return g.done(f, s.up, b, false, out)
		case f.st == 0 && b == '\\':
			f.st = 1
		case f.st == 0 && b >= 0x20:
			return append(out, s)
		case f.st == 1 && (b == '"' || b == '\\' || b == '/' || b == 'b' || b == 'f' || b == 'n' || b == 'r' || b == 't'):
			f.st = 0
		case f.st == 1 && b == 'u':
			f.st = 2
		case f.st >= 2 && isHex(b):
			f.st = (f.st + 1) % 6
		default:
			return out
		}
		return append(out, &stack{f, s.up})

	case kNumber:
		integer := !f.n.types.has(tNumber)
		next := numNext(f.st, b, integer)
		if next >= 0 && !(next == int(f.st) && f.i >= MaxNumber) {
			f.st, f.i = uint8(next), f.i+1
			return append(out, &stack{f, s.up})
		}
		if numAccepts(f.st) {
			return g.done(f, s.up, b, true, out)
		}
		return out

	case kLit:
		t := &f.lit.nodes[f.i]
		if b >= 0 {
			if nx, ok := t.next[byte(b)]; ok {
				f.i = nx
				if len(f.lit.nodes[nx].next) == 0 {
					return g.done(f, s.up, b, false, out)
				}
				return append(out, &stack{f, s.up})
			}
		}
		if t.term >= 0 && f.i != 0 {
			return g.done(f, s.up, b, true, out)
		}
		return out

	case kObject:
		n := f.n
		if isSpace(b) && f.st != objKey && f.st != objValue {
			return space(f, s.up, out)
		}
		f.ws = 0
		switch {
		case (f.st == objOpen || f.st == objComma) && b == '"' && keysLeft(n, f.seen):
			f.st = objKey
			return append(out, &stack{frame{kind: kKey, n: n}, &stack{f, s.up}})
		case (f.st == objOpen || f.st == objNext) && b == '}' && n.required&^f.seen == 0:
			return g.done(f, s.up, b, false, out)
		case f.st == objNext && b == ',' && keysLeft(n, f.seen):
			f.st = objComma
			return append(out, &stack{f, s.up})
		case f.st == objColon && b == ':':
			f.st = objValue
			v := n.additional
			if f.cur >= 0 {
				v = n.props[f.cur].n
			}
			return append(out, &stack{frame{kind: kValue, n: v}, &stack{f, s.up}})
		}
		return out

	case kKey:
		n, seen := f.n, s.up.f.seen
		switch {
		case b == '"':
			if f.i >= 0 {
				if t := n.keys.nodes[f.i].term; t >= 0 {
					if seen&(1<<t) != 0 {
						return out // a property given twice
					}
					f.cur = t
					return g.done(f, s.up, b, false, out)
				}
			}
			if n.additional == nil {
				return out
			}
			f.cur = -1
			return g.done(f, s.up, b, false, out)
		case b < 0x20 || b == '\\':
			return out // keys are plain text
		}
		if f.i >= 0 {
			if nx, ok := n.keys.nodes[f.i].next[byte(b)]; ok && (n.additional != nil || n.keys.nodes[nx].below&^seen != 0) {
				f.i = nx
				return append(out, &stack{f, s.up})
			}
		}
		if n.additional == nil {
			return out
		}
		f.i = -1
		return append(out, &stack{f, s.up})

	case kArray:
		if f.st == 2 {
			f.st = 1
			return g.step(&stack{frame{kind: kValue, n: f.n.items}, &stack{f, s.up}}, b, out)
		}
		if isSpace(b) {
			return space(f, s.up, out)
		}
		f.ws = 0
		switch {
		case b == ']':
			return g.done(f, s.up, b, false, out)
		case f.st == 1 && b == ',':
			f.st = 2
			return append(out, &stack{f, s.up})
		case f.st == 0:
			f.st = 1
			return g.start(f.n.items, &stack{f, s.up}, b, out, 0)
		}
		return out

	case kEnd:
		switch {
		case b == eof:
			return append(out, accepted)
		case isSpace(b):
			return space(f, s.up, out)
		}
		return out

	case kCalls:
		c := g.calls
		switch f.st {
		case callsText:
			switch {
			case b == eof:
				return append(out, accepted)
			case b == int(callOpen[f.i]):
				f.i++
			case b == '<':
				f.i = 1
			default:
				f.i = 0
			}
			if int(f.i) == len(callOpen) {
				f.st, f.i = callsBody, 0
			}
			return append(out, &stack{f, s.up})
		case callsBody:
			f.st = callsInBody
			return g.step(&stack{frame{kind: kValue, n: g.body}, &stack{f, s.up}}, b, out)
		}
		switch {
		case b == eof && (f.st == callsEnd || (f.st == callsBefore && int(f.cur) >= c.min && (f.cur > 0 || g.answer == nil))):
			return append(out, accepted)
		case isSpace(b) && (f.st == callsBefore || f.st == callsAfter || f.st == callsEnd):
			return space(f, s.up, out)
		case b == '<' && f.st == callsBefore:
			f.st, f.ws = callsOpen, 0
			return g.step(&stack{frame{kind: kLit, lit: c.open}, &stack{f, s.up}}, b, out)
		case f.st == callsBefore && f.cur == 0 && g.answer != nil && b != eof && b != '<' && !isSpace(b):
			f.st, f.ws = callsAnswer, 0
			return g.start(g.answer, &stack{f, s.up}, b, out, 0)
		case b == '<' && f.st == callsAfter:
			f.st, f.ws = callsClose, 0
			return g.step(&stack{frame{kind: kLit, lit: c.close}, &stack{f, s.up}}, b, out)
		}
		return out
	}
	return out
}

// keysLeft says whether an object of n that has seen the properties seen may take another key.
func keysLeft(n *node, seen uint64) bool {
	return n.additional != nil || n.keys.nodes[0].below&^seen != 0
}

// start steps the first byte b (not whitespace) of a value of n, whose frame goes on up.
func (g *Grammar) start(n *node, up *stack, b int, out []*stack, depth int) []*stack {
	if depth > 32 {
		return out // anyOf nested (or referring to itself) past any sense
	}
	switch {
	case n.lits != nil:
		return g.step(&stack{frame{kind: kLit, lit: n.lits}, up}, b, out)
	case len(n.anyOf) > 0:
		for _, a := range n.anyOf {
			out = g.start(a, up, b, out, depth+1)
		}
		return out
	}
	t := n.types
	switch {
	case b == '{' && t.has(tObject):
		return append(out, &stack{frame{kind: kObject, n: n, cur: -1}, up})
	case b == '[' && t.has(tArray):
		return append(out, &stack{frame{kind: kArray, n: n}, up})
	case b == '"' && t.has(tString):
		return append(out, &stack{frame{kind: kString, n: n}, up})
	case (b == '-' || isDigit(b)) && t.has(tNumber|tInteger):
		return g.step(&stack{frame{kind: kNumber, n: n}, up}, b, out)
	case (b == 't' || b == 'f') && t.has(tBoolean):
		return g.step(&stack{frame{kind: kLit, lit: boolLits}, up}, b, out)
	case b == 'n' && t.has(tNull):
		return g.step(&stack{frame{kind: kLit, lit: nullLits}, up}, b, out)
	}
	return out
}

// done ends the top frame child: its parent up goes on, and reads b when fwd (b ended the child
// without being part of it, as the byte after a number).
func (g *Grammar) done(child frame, up *stack, b int, fwd bool, out []*stack) []*stack {
	p := up.f
	p.ws = 0
	switch p.kind {
	case kEnd:
		p.st = 1
	case kObject:
		switch p.st {
		case objKey:
			p.st, p.cur = objColon, child.cur
			if child.cur >= 0 {
				p.seen |= 1 << child.cur
			}
		case objValue:
			p.st = objNext
		}
	case kArray:
		p.st = 1
	case kCalls:
		switch p.st {
		case callsOpen:
			p.st = callsBody
		case callsInBody:
			p.st = callsAfter
		case callsAnswer:
			p.st = callsEnd
		case callsClose:
			p.cur++
			p.st = callsBefore
			if g.calls.max > 0 && int(p.cur) >= g.calls.max {
				p.st = callsEnd
			}
		}
	}
	ns := &stack{p, up.up}
	if fwd {
		return g.step(ns, b, out)
	}
	return append(out, ns)
}

// numNext is the state of a JSON number after b (-1: b does not continue it): 0 start, 1 after
// '-', 2 a leading 0, 3 integer digits, 4 after '.', 5 fraction digits, 6 after 'e', 7 after the
// exponent's sign, 8 exponent digits. An integer has no fraction or exponent.
func numNext(st uint8, b int, integer bool) int {
	d := isDigit(b)
	switch st {
	case 0:
		if b == '-' {
			return 1
		}
		fallthrough
	case 1:
		switch {
		case b == '0':
			return 2
		case d:
			return 3
		}
	case 2, 3:
		switch {
		case d && st == 3:
			return 3
		case integer:
		case b == '.':
			return 4
		case b == 'e' || b == 'E':
			return 6
		}
	case 4, 5:
		switch {
		case d:
			return 5
		case st == 5 && (b == 'e' || b == 'E'):
			return 6
		}
	case 6:
		switch {
		case b == '+' || b == '-':
			return 7
		case d:
			return 8
		}
	case 7, 8:
		if d {
			return 8
		}
	}
	return -1
}

func numAccepts(st uint8) bool { return st == 2 || st == 3 || st == 5 || st == 8 }
