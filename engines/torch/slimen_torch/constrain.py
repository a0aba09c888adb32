"""Constrained decoding: the automaton of engines/constrain (Go), ported line for line.

A request's constraint (engines.Sampling.Constraint: a JSON value of a JSON schema, or Hermes
tool calls) is compiled to a byte-level pushdown automaton; a Matcher pairs it with the
tokenizer's vocabulary and gives, for a state, the tokens that may come next: a token is allowed
when its text walks the automaton without a dead end, special tokens (which decode to "") only as
an end-of-sequence token where the automaton accepts. testdata/constrain/cases.json holds the
cases the Go and the Python tests both run, so that the two cannot drift apart. Read the Go
package's comments for the why of each rule; this file keeps its names.
"""

from __future__ import annotations

import json
import threading

MAX_SPACE = 4  # whitespace bytes in a run between two JSON tokens
MAX_NUMBER = 24  # bytes of a number (its digit loops stop there)
MAX_PROPS = 64
MAX_ALTS = 64
CALL_OPEN, CALL_CLOSE = b"<tool_call>", b"</tool_call>"

T_OBJECT, T_ARRAY, T_STRING, T_NUMBER, T_INTEGER, T_BOOLEAN, T_NULL = (1 << i for i in range(7))
T_ALL = (1 << 7) - 1
TYPE_NAMES = {"object": T_OBJECT, "array": T_ARRAY, "string": T_STRING, "number": T_NUMBER,
              "integer": T_INTEGER, "boolean": T_BOOLEAN, "null": T_NULL}
IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs",
           "definitions", "deprecated", "readOnly", "writeOnly"}
KNOWN = {"type", "properties", "required", "additionalProperties", "items", "enum", "const",
         "anyOf", "$ref"}


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the place in the spec."""


class LitTrie:
    """A set of byte strings: per node its children, the index of the string ending there (-1)
    and the bits of the strings at or under it (the first 64)."""

    def __init__(self, id_: int = 0, strings=()):
        self.id = id_
        self.next: list[dict[int, int]] = [{}]
        self.term = [-1]
        self.below = [0]
        self.count = 0
        for s in strings:
            self.add(s)

    def add(self, s: bytes) -> None:
        idx = self.count
        self.count += 1
        bit = 1 << idx if idx < 64 else 0
        at = 0
        self.below[0] |= bit
        for b in s:
            nx = self.next[at].get(b)
            if nx is None:
                nx = len(self.next)
                self.next.append({})
                self.term.append(-1)
                self.below.append(0)
                self.next[at][b] = nx
            at = nx
            self.below[at] |= bit
        if self.term[at] < 0:
            self.term[at] = idx


class Node:
    __slots__ = ("id", "types", "lits", "any_of", "props", "keys", "required", "additional",
                 "items")

    def __init__(self, id_: int):
        self.id = id_
        self.types = 0
        self.lits: LitTrie | None = None
        self.any_of: list[Node] = []
        self.props: list[tuple[str, Node]] = []
        self.keys: LitTrie | None = None
        self.required = 0
        self.additional: Node | None = None
        self.items: Node | None = None

    def finish(self) -> None:
        self.keys = LitTrie(self.id, [name.encode() for name, _ in self.props])

    def copy_from(self, o: "Node") -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(o, k))


def _compact(v) -> bytes:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()


def _type_of(v) -> int:
    if isinstance(v, dict):
        return T_OBJECT
    if isinstance(v, list):
        return T_ARRAY
    if isinstance(v, str):
        return T_STRING
    if isinstance(v, bool):
        return T_BOOLEAN
    if v is None:
        return T_NULL
    if isinstance(v, int):
        return T_NUMBER | T_INTEGER
    return T_NUMBER


class _Compiler:
    def __init__(self, root, root_path: str, count: int = 0):
        self.root, self.root_path, self.refs, self.any, self.count = root, root_path, {}, None, count

    def new(self) -> Node:
        self.count += 1
        return Node(self.count)

    def any_value(self) -> Node:
        if self.any is None:
            n = self.any = self.new()
            n.types, n.additional, n.items = T_ALL, n, n
            n.finish()
        return self.any

    def compile(self, schema, path: str) -> Node:
        if schema is True:
            return self.any_value()
        if schema is False:
            raise ConstraintError(f"{path}: the schema false allows no value")
        if not isinstance(schema, dict):
            raise ConstraintError(f"{path}: a schema must be a JSON object")
        keys = sorted(schema)
        n = self.new()
        for k in keys:
            if k not in KNOWN and k not in IGNORED:
                raise ConstraintError(f"{path}.{k} is not supported")
        if "$ref" in schema:
            for k in keys:
                if k != "$ref" and k not in IGNORED:
                    raise ConstraintError(f"{path}.{k} beside $ref is not supported")
            return self.ref(schema["$ref"], path + ".$ref")
        if "anyOf" in schema:
            for k in keys:
                if k != "anyOf" and k not in IGNORED:
                    raise ConstraintError(f"{path}.{k} beside anyOf is not supported")
            alts = schema["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise ConstraintError(f"{path}.anyOf: want a non-empty list of schemas")
            n.any_of = [self.compile(a, f"{path}.anyOf[{i}]") for i, a in enumerate(alts)]
            return n
        n.types = T_ALL
        if "type" in schema:
            t = schema["type"]
            names = [t] if isinstance(t, str) else t
            if not isinstance(names, list) or not names:
                raise ConstraintError(f"{path}.type: want a type name or a list of them")
            n.types = 0
            for name in names:
                if name not in TYPE_NAMES:
                    raise ConstraintError(f"{path}.type: unknown type {json.dumps(name)}")
                n.types |= TYPE_NAMES[name]
        lits = None
        if "enum" in schema:
            lits = schema["enum"]
            if not isinstance(lits, list) or not lits:
                raise ConstraintError(f"{path}.enum: want a non-empty list of values")
        if "const" in schema:
            if lits is not None:
                raise ConstraintError(f"{path}: enum and const together are not supported")
            lits = [schema["const"]]
        if lits is not None:
            n.lits = LitTrie(n.id)
            for v in lits:
                if n.types & _type_of(v):
                    n.lits.add(_compact(v))
            if not n.lits.next[0]:
                raise ConstraintError(f"{path}: no value of enum or const has the schema's type")
            return n
        if "properties" in schema:
            props = schema["properties"]
            if not isinstance(props, dict):
                raise ConstraintError(f"{path}.properties: want an object of schemas")
            if len(props) > MAX_PROPS:
                raise ConstraintError(f"{path}.properties: {len(props)} properties; at most {MAX_PROPS} are supported")
            for name in sorted(props):
                if '"' in name or "\\" in name or any(ord(c) < 0x20 for c in name):
                    raise ConstraintError(f"{path}.properties: the name {json.dumps(name)} (with a quote, a backslash or a control character) is not supported")
                n.props.append((name, self.compile(props[name], f"{path}.properties.{name}")))
        if "required" in schema:
            names = schema["required"]
            if not isinstance(names, list):
                raise ConstraintError(f"{path}.required: want a list of property names")
            for name in names:
                i = next((i for i, (p, _) in enumerate(n.props) if p == name), -1)
                if i < 0:
                    raise ConstraintError(f"{path}.required: {json.dumps(name)} is not in properties, which is not supported")
                n.required |= 1 << i
        n.additional = self.any_value()
        if "additionalProperties" in schema:
            a = schema["additionalProperties"]
            if a is False:
                n.additional = None
            elif a is not True:
                n.additional = self.compile(a, path + ".additionalProperties")
        n.items = self.any_value()
        if "items" in schema:
            if isinstance(schema["items"], list):
                raise ConstraintError(f"{path}.items as a list (tuple items) is not supported")
            n.items = self.compile(schema["items"], path + ".items")
        n.finish()
        return n

    def ref(self, ref, path: str) -> Node:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ConstraintError(f'{path}: only references into this schema ("#/$defs/Name") are supported')
        if ref in self.refs:
            return self.refs[ref]
        target = self.root
        for tok in ref[1:].split("/")[1:]:
            tok = tok.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and tok in target:
                target = target[tok]
            elif isinstance(target, list) and tok.isdigit() and int(tok) < len(target):
                target = target[int(tok)]
            else:
                raise ConstraintError(f"{path}: {json.dumps(ref)} is not in the schema")
        n = self.new()
        self.refs[ref] = n
        t = self.compile(target, self.root_path + ref[1:].replace("/", "."))
        n.copy_from(t)
        return n


# Frame kinds and states, as in the Go package.
K_VALUE, K_OBJECT, K_KEY, K_ARRAY, K_STRING, K_NUMBER, K_LIT, K_END, K_CALLS = range(9)
OBJ_OPEN, OBJ_KEY, OBJ_COLON, OBJ_VALUE, OBJ_NEXT, OBJ_COMMA = range(6)
(CALLS_BEFORE, CALLS_OPEN, CALLS_BODY, CALLS_IN_BODY, CALLS_AFTER, CALLS_CLOSE, CALLS_END,
 CALLS_TEXT, CALLS_ANSWER) = range(9)
EOF = -1
BOOL_LITS = LitTrie(-1, [b"true", b"false"])
NULL_LITS = LitTrie(-2, [b"null"])
OPEN_LITS = LitTrie(-3, [CALL_OPEN])
CLOSE_LITS = LitTrie(-4, [CALL_CLOSE])
SPACE = {0x20, 0x0A, 0x09, 0x0D}
HEX = set(b"0123456789abcdefABCDEF")
ESC = set(b'"\\/bfnrt')


class Frame:
    __slots__ = ("kind", "st", "ws", "n", "lit", "i", "cur", "seen")

    def __init__(self, kind, st=0, ws=0, n=None, lit=None, i=0, cur=0, seen=0):
        self.kind, self.st, self.ws, self.n, self.lit, self.i, self.cur, self.seen = (
            kind, st, ws, n, lit, i, cur, seen)

    def copy(self) -> "Frame":
        return Frame(self.kind, self.st, self.ws, self.n, self.lit, self.i, self.cur, self.seen)

    def key(self) -> tuple:
        return (self.kind, self.st, self.ws, self.n.id if self.n else 0,
                self.lit.id if self.lit else 0, self.i, self.cur, self.seen)


ACCEPTED = ("accepted",)


def _num_next(st: int, b: int, integer: bool) -> int:
    d = 0x30 <= b <= 0x39
    if st in (0, 1):
        if st == 0 and b == 0x2D:
            return 1
        if b == 0x30:
            return 2
        if d:
            return 3
    elif st in (2, 3):
        if d and st == 3:
            return 3
        if not integer:
            if b == 0x2E:
                return 4
            if b in (0x65, 0x45):
                return 6
    elif st in (4, 5):
        if d:
            return 5
        if st == 5 and b in (0x65, 0x45):
            return 6
    elif st == 6:
        if b in (0x2B, 0x2D):
            return 7
        if d:
            return 8
    elif st in (7, 8):
        if d:
            return 8
    return -1


class Grammar:
    """A compiled constraint; Grammar.compile(spec) takes engines.Sampling.Constraint's JSON."""

    def __init__(self, root: Frame, body: Node, calls: dict | None = None, answer: Node | None = None):
        self.root, self.body, self.calls, self.answer = root, body, calls, answer

    @staticmethod
    def compile(spec) -> "Grammar":
        if isinstance(spec, str):
            spec = json.loads(spec)
        if not isinstance(spec, dict) or set(spec) - {"json_schema", "tool_calls"}:
            raise ConstraintError("constraint: want an object with json_schema and/or tool_calls")
        schema, calls = spec.get("json_schema"), spec.get("tool_calls")
        if schema is None and calls is None:
            raise ConstraintError("constraint: set json_schema or tool_calls")
        if calls is None:
            return compile_schema(schema, "json_schema")
        g = compile_calls(calls, "tool_calls.tools")
        if schema is not None:
            if calls.get("text"):
                raise ConstraintError("tool_calls.text: free text and a json_schema answer together are not supported")
            g.answer = compile_schema(schema, "json_schema").body
        return g

    def start(self) -> "State":
        s = (self.root, None)
        if self.root.kind == K_END:
            s = (Frame(K_VALUE, n=self.body), s)
        return State(self, [s])

    def match(self, text: str | bytes) -> bool:
        s = self.start().feed(text)
        return not s.dead() and s.accepts()

    # ---- the step ----

    def step(self, s, b: int, out: list) -> list:
        f, up = s
        k = f.kind
        if k == K_VALUE:
            if b in SPACE:
                return _space(f, up, out)
            return self.start_value(f.n, up, b, out, 0)
        if k == K_STRING:
            st = f.st
            if st == 0 and b == 0x22:
                return self.done(f, up, b, False, out)
            if st == 0 and b == 0x5C:
                st = 1
            elif st == 0 and b >= 0x20:
                out.append(s)
                return out
            elif st == 1 and b in ESC:
                st = 0
            elif st == 1 and b == 0x75:
                st = 2
            elif st >= 2 and b in HEX:
                st = (st + 1) % 6
            else:
                return out
            f = f.copy()
            f.st = st
            out.append((f, up))
            return out
        if k == K_NUMBER:
            integer = not (f.n.types & T_NUMBER)
            nx = _num_next(f.st, b, integer)
            if nx >= 0 and not (nx == f.st and f.i >= MAX_NUMBER):
                f = f.copy()
                f.st, f.i = nx, f.i + 1
                out.append((f, up))
                return out
            if f.st in (2, 3, 5, 8):
                return self.done(f, up, b, True, out)
            return out
        if k == K_LIT:
            lit = f.lit
            if b >= 0:
                nx = lit.next[f.i].get(b)
                if nx is not None:
                    f = f.copy()
                    f.i = nx
                    if not lit.next[nx]:
                        return self.done(f, up, b, False, out)
                    out.append((f, up))
                    return out
            if lit.term[f.i] >= 0 and f.i != 0:
                return self.done(f, up, b, True, out)
            return out
        if k == K_OBJECT:
            n, st = f.n, f.st
            if b in SPACE and st != OBJ_KEY and st != OBJ_VALUE:
                return _space(f, up, out)
            f = f.copy()
            f.ws = 0
            if st in (OBJ_OPEN, OBJ_COMMA) and b == 0x22 and _keys_left(n, f.seen):
                f.st = OBJ_KEY
                out.append((Frame(K_KEY, n=n), (f, up)))
            elif st in (OBJ_OPEN, OBJ_NEXT) and b == 0x7D and n.required & ~f.seen == 0:
                return self.done(f, up, b, False, out)
            elif st == OBJ_NEXT and b == 0x2C and _keys_left(n, f.seen):
                f.st = OBJ_COMMA
                out.append((f, up))
            elif st == OBJ_COLON and b == 0x3A:
                f.st = OBJ_VALUE
                v = n.props[f.cur][1] if f.cur >= 0 else n.additional
                out.append((Frame(K_VALUE, n=v), (f, up)))
            return out
        if k == K_KEY:
            n, seen = f.n, up[0].seen
            if b == 0x22:
                if f.i >= 0:
                    t = n.keys.term[f.i]
                    if t >= 0:
                        if seen & (1 << t):
                            return out
                        f = f.copy()
                        f.cur = t
                        return self.done(f, up, b, False, out)
                if n.additional is None:
                    return out
                f = f.copy()
                f.cur = -1
                return self.done(f, up, b, False, out)
            if b < 0x20 or b == 0x5C:
                return out
            if f.i >= 0:
                nx = n.keys.next[f.i].get(b)
                if nx is not None and (n.additional is not None or n.keys.below[nx] & ~seen):
                    f = f.copy()
                    f.i = nx
                    out.append((f, up))
                    return out
            if n.additional is None:
                return out
            f = f.copy()
            f.i = -1
            out.append((f, up))
            return out
        if k == K_ARRAY:
            if f.st == 2:
                f = f.copy()
                f.st = 1
                return self.step((Frame(K_VALUE, n=f.n.items), (f, up)), b, out)
            if b in SPACE:
                return _space(f, up, out)
            f = f.copy()
            f.ws = 0
            if b == 0x5D:
                return self.done(f, up, b, False, out)
            if f.st == 1 and b == 0x2C:
                f.st = 2
                out.append((f, up))
                return out
            if f.st == 0:
                f.st = 1
                return self.start_value(f.n.items, (f, up), b, out, 0)
            return out
        if k == K_END:
            if b == EOF:
                out.append(ACCEPTED)
            elif b in SPACE:
                return _space(f, up, out)
            return out
        if k == K_CALLS:
            c = self.calls
            if f.st == CALLS_TEXT:
                if b == EOF:
                    out.append(ACCEPTED)
                    return out
                f = f.copy()
                if b == CALL_OPEN[f.i]:
                    f.i += 1
                elif b == 0x3C:
                    f.i = 1
                else:
                    f.i = 0
                if f.i == len(CALL_OPEN):
                    f.st, f.i = CALLS_BODY, 0
                out.append((f, up))
                return out
            if f.st == CALLS_BODY:
                f = f.copy()
                f.st = CALLS_IN_BODY
                return self.step((Frame(K_VALUE, n=self.body), (f, up)), b, out)
            st = f.st
            if b == EOF and (st == CALLS_END or (st == CALLS_BEFORE and f.cur >= c["min"] and
                                                 (f.cur > 0 or self.answer is None))):
                out.append(ACCEPTED)
            elif b in SPACE and st in (CALLS_BEFORE, CALLS_AFTER, CALLS_END):
                return _space(f, up, out)
            elif b == 0x3C and st == CALLS_BEFORE:
                f = f.copy()
                f.st, f.ws = CALLS_OPEN, 0
                return self.step((Frame(K_LIT, lit=OPEN_LITS), (f, up)), b, out)
            elif (st == CALLS_BEFORE and f.cur == 0 and self.answer is not None and b != EOF
                  and b != 0x3C and b not in SPACE):
                f = f.copy()
                f.st, f.ws = CALLS_ANSWER, 0
                return self.start_value(self.answer, (f, up), b, out, 0)
            elif b == 0x3C and st == CALLS_AFTER:
                f = f.copy()
                f.st, f.ws = CALLS_CLOSE, 0
                return self.step((Frame(K_LIT, lit=CLOSE_LITS), (f, up)), b, out)
            return out
        return out

    def start_value(self, n: Node, up, b: int, out: list, depth: int) -> list:
        if depth > 32:
            return out
        if n.lits is not None:
            return self.step((Frame(K_LIT, lit=n.lits), up), b, out)
        if n.any_of:
            for a in n.any_of:
                out = self.start_value(a, up, b, out, depth + 1)
            return out
        t = n.types
        if b == 0x7B and t & T_OBJECT:
            out.append((Frame(K_OBJECT, n=n, cur=-1), up))
        elif b == 0x5B and t & T_ARRAY:
            out.append((Frame(K_ARRAY, n=n), up))
        elif b == 0x22 and t & T_STRING:
            out.append((Frame(K_STRING, n=n), up))
        elif (b == 0x2D or 0x30 <= b <= 0x39) and t & (T_NUMBER | T_INTEGER):
            return self.step((Frame(K_NUMBER, n=n), up), b, out)
        elif b in (0x74, 0x66) and t & T_BOOLEAN:
            return self.step((Frame(K_LIT, lit=BOOL_LITS), up), b, out)
        elif b == 0x6E and t & T_NULL:
            return self.step((Frame(K_LIT, lit=NULL_LITS), up), b, out)
        return out

    def done(self, child: Frame, up, b: int, fwd: bool, out: list) -> list:
        p = up[0].copy()
        p.ws = 0
        k = p.kind
        if k == K_END:
            p.st = 1
        elif k == K_OBJECT:
            if p.st == OBJ_KEY:
                p.st, p.cur = OBJ_COLON, child.cur
                if child.cur >= 0:
                    p.seen |= 1 << child.cur
            elif p.st == OBJ_VALUE:
                p.st = OBJ_NEXT
        elif k == K_ARRAY:
            p.st = 1
        elif k == K_CALLS:
            if p.st == CALLS_OPEN:
                p.st = CALLS_BODY
            elif p.st == CALLS_IN_BODY:
                p.st = CALLS_AFTER
            elif p.st == CALLS_ANSWER:
                p.st = CALLS_END
            elif p.st == CALLS_CLOSE:
                p.cur += 1
                p.st = CALLS_BEFORE
                if self.calls["max"] > 0 and p.cur >= self.calls["max"]:
                    p.st = CALLS_END
        ns = (p, up[1])
        if fwd:
            return self.step(ns, b, out)
        out.append(ns)
        return out


def _space(f: Frame, up, out: list) -> list:
    if f.ws >= MAX_SPACE:
        return out
    f = f.copy()
    f.ws += 1
    out.append((f, up))
    return out


def _keys_left(n: Node, seen: int) -> bool:
    return n.additional is not None or bool(n.keys.below[0] & ~seen)


def compile_schema(schema, path: str) -> Grammar:
    """A grammar of one JSON value following schema; path names the schema in errors."""
    return Grammar(Frame(K_END), _Compiler(schema, path).compile(schema, path))


def compile_calls(calls: dict, path: str) -> Grammar:
    """A grammar of Hermes tool calls (engines/constrain's Calls as a dict)."""
    tools = calls.get("tools") or []
    if not tools:
        raise ConstraintError(f"{path}: no tools to call")
    lo, hi = calls.get("min", 0), calls.get("max", 0)
    if lo not in (0, 1) or hi < 0 or (hi > 0 and hi < lo):
        raise ConstraintError(f"{path}: calls min {lo}, max {hi}; want min 0 or 1 and max 0 (any) or at least min")
    c = _Compiler(None, path)
    body = c.new()
    for i, t in enumerate(tools):
        where = f"{path}[{i}]"
        name = t.get("name") or ""
        if not name:
            raise ConstraintError(f"{where}.name is empty")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object"}
        pc = _Compiler(params, where + ".parameters", c.count)
        args = pc.compile(params, where + ".parameters")
        c.count = pc.count
        if not args.types & T_OBJECT or args.lits is not None or args.any_of:
            raise ConstraintError(f"{where}.parameters: a function's parameters must be an object schema")
        if args.types != T_OBJECT:
            obj = Node(args.id)
            obj.copy_from(args)
            obj.types = T_OBJECT
            args = obj
        nn = c.new()
        nn.lits = LitTrie(nn.id, [_compact(name)])
        call = c.new()
        call.types = T_OBJECT
        call.props = [("name", nn), ("arguments", args)]
        call.required = 3
        call.finish()
        body.any_of.append(call)
    root = Frame(K_CALLS, st=CALLS_TEXT if calls.get("text") else CALLS_BEFORE)
    return Grammar(root, body, {"text": bool(calls.get("text")), "min": lo, "max": hi})


class State:
    """The ways the bytes so far can be read; feed returns a new State."""

    __slots__ = ("g", "alts")

    def __init__(self, g: Grammar, alts: list):
        self.g, self.alts = g, alts

    def dead(self) -> bool:
        return not self.alts

    def feed_byte(self, b: int) -> "State":
        out: list = []
        for a in self.alts:
            out = self.g.step(a, b, out)
            if len(out) > MAX_ALTS:
                del out[MAX_ALTS:]
        return State(self.g, out)

    def feed(self, text: str | bytes) -> "State":
        s = self
        for b in (text.encode() if isinstance(text, str) else text):
            if s.dead():
                break
            s = s.feed_byte(b)
        return s

    def accepts(self) -> bool:
        return any(t is ACCEPTED for a in self.alts for t in self.g.step(a, EOF, []))

    def key(self) -> tuple:
        out = []
        for a in self.alts:
            while a is not None:
                out.append(a[0].key())
                a = a[1]
            out.append(None)
        return tuple(out)


class Vocab:
    """A vocabulary's token texts in a trie (special and empty-text tokens left out)."""

    def __init__(self, texts: list[str], special: list[bool] | None = None):
        self.size = len(texts)
        self.next: list[dict[int, int]] = [{}]
        self.toks: list[list[int]] = [[]]
        for tid, t in enumerate(texts):
            if not t or (special is not None and special[tid]) or "\ufffd" in t:
                continue  # no text of its own, or part of a character: not sampled under a constraint
            at = 0
            for b in t.encode():
                nx = self.next[at].get(b)
                if nx is None:
                    nx = len(self.next)
                    self.next.append({})
                    self.toks.append([])
                    self.next[at][b] = nx
                at = nx
            self.toks[at].append(tid)


class Matcher:
    """A grammar on a vocabulary: the allowed tokens of a state, kept by state (up to 4096)."""

    def __init__(self, g: Grammar, v: Vocab, eos):
        self.g, self.v, self.eos = g, v, list(eos)
        self.texts: list[str] = []  # each token's text (Matchers sets it)
        self.cache: dict[tuple, list[int]] = {}
        self.lock = threading.Lock()

    def allowed(self, s: State) -> list[int]:
        """The ids of the tokens allowed in s, sorted."""
        key = s.key()
        with self.lock:
            got = self.cache.get(key)
        if got is not None:
            return got
        ids: list[int] = []
        if not s.dead():
            self._walk(0, s, ids)
            if s.accepts():
                ids.extend(t for t in self.eos if 0 <= t < self.v.size)
        ids.sort()
        with self.lock:
            if len(self.cache) >= 4096:
                self.cache.clear()
            self.cache[key] = ids
        return ids

    def _walk(self, at: int, s: State, ids: list[int]) -> None:
        ids.extend(self.v.toks[at])
        inert = _inert(s)
        for b, to in self.v.next[at].items():
            if inert is not None and b not in inert and b >= 0x20:
                self._walk(to, s, ids)  # a byte that leaves the state as it is
                continue
            ns = s.feed_byte(b)
            if ns.alts:
                self._walk(to, ns, ids)


_STRING_LIVE = frozenset(b'"\\')
_TEXT_LIVE = frozenset(b"<")


def _inert(s: State):
    """For a state whose one way is inside a string's text (or a calls answer's free text before
    any '<'), the bytes that change it: every other printable byte leaves it as it is, so the
    vocabulary walk need not step it (most of a response is such text). None otherwise."""
    if len(s.alts) != 1:
        return None
    f = s.alts[0][0]
    if f.kind == K_STRING and f.st == 0:
        return _STRING_LIVE
    if f.kind == K_CALLS and f.st == CALLS_TEXT and f.i == 0:
        return _TEXT_LIVE
    return None


class Matchers:
    """The matchers of one tokenizer's vocabulary, by constraint (the last 256 kept): the
    vocabulary is indexed once, on first use (each token's text is the tokenizer's decoding of
    it alone; special tokens decode to "" and are allowed only as EOS)."""

    def __init__(self, decode, size: int, eos):
        self.decode, self.size, self.eos = decode, size, list(eos)
        self.owner = None  # what the texts come from (the engine's tokenizer)
        self.vocab: Vocab | None = None
        self.texts: list[str] = []
        self.by_spec: dict[str, Matcher] = {}
        self.lock = threading.Lock()

    def get(self, spec: str) -> Matcher:
        """The matcher of a constraint; ConstraintError when it does not compile."""
        with self.lock:
            m = self.by_spec.get(spec)
            if m is not None:
                return m
            g = Grammar.compile(spec)
            if self.vocab is None:
                self.texts = [self.decode(i) for i in range(self.size)]
                self.vocab = Vocab(self.texts)
            if len(self.by_spec) >= 256:
                self.by_spec.clear()
            m = self.by_spec[spec] = Matcher(g, self.vocab, self.eos)
            m.texts = self.texts
            return m
