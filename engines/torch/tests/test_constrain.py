"""The constrained-decoding automaton's Python port against the cases the Go package runs
(testdata/constrain/cases.json), and its token masks."""

import json
import pathlib
import random

import pytest

from slimen_torch import constrain

CASES = json.loads((pathlib.Path(__file__).resolve().parents[3] / "testdata/constrain/cases.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_fixture(case):
    if "error" in case:
        with pytest.raises(constrain.ConstraintError) as e:
            constrain.Grammar.compile(case["spec"])
        assert case["error"] in str(e.value)
        return
    g = constrain.Grammar.compile(json.dumps(case["spec"]))
    for s in case.get("accept", []):
        assert g.match(s), s
        b = s.encode()
        for i in range(len(b)):
            assert not g.start().feed(b[:i]).dead(), (s, b[:i])
    for s in case.get("reject", []) + case.get("dead", []):
        assert not g.match(s), s
    for s in case.get("dead", []):
        assert g.start().feed(s).dead(), s


def test_no_dead_ends():
    """From every state a random walk of allowed bytes reaches, some byte (or the end) goes on."""
    rng = random.Random(3)
    for case in CASES:
        if "error" in case:
            continue
        g = constrain.Grammar.compile(case["spec"])
        for _ in range(4):
            s, text = g.start(), b""
            for _ in range(60):
                nxt = [b for b in range(256) if not s.feed_byte(b).dead()]
                if not nxt:
                    assert s.accepts(), (case["name"], text)
                    break
                if s.accepts() and rng.random() < 0.1:
                    break
                b = rng.choice(nxt)
                s, text = s.feed_byte(b), text + bytes([b])


def test_matcher_tokens():
    """A token is allowed when its whole text walks the automaton, whatever its length; special
    tokens (and those that are part of a character) only as EOS where the grammar accepts."""
    g = constrain.Grammar.compile({"json_schema": {"type": "object", "properties": {"name": {"type": "string"}},
                                                   "required": ["name"], "additionalProperties": False}})
    texts = ["<|end|>", "{", '{"', '{"name', '{"nome', '": "', '"', "}", '"}', "x", "\ufffd", '{"name": "Bo"}']
    special = [True] + [False] * 11
    m = constrain.Matcher(g, constrain.Vocab(texts, special), [0])

    def allowed(s):
        return [texts[i] for i in m.allowed(s)]

    s = g.start()
    assert allowed(s) == ["{", '{"', '{"name', '{"name": "Bo"}']
    s = s.feed('{"name": "Bo')
    assert allowed(s) == ["{", '{"', '"', "}", '"}', "x"]
    s = s.feed('"')
    assert allowed(s) == ["}"]
    assert allowed(s.feed("}")) == ["<|end|>"]
