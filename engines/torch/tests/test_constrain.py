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


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
USER = [{"role": "user", "content": "Describe it."}]


def _valid(v):
    return (isinstance(v, dict) and set(v) == {"name", "n", "ok", "tags"} and isinstance(v["name"], str)
            and isinstance(v["n"], int) and not isinstance(v["n"], bool) and isinstance(v["ok"], bool)
            and all(t in ("a", "b") for t in v["tags"]))


def test_engine_constrained_json(engine):
    """The torch worker samples under a constraint: a random model's answers are the schema's
    JSON (those that end before max_tokens), the log-probs are the model's own over the whole
    vocabulary (what scoring computes), and a request samples alike alone and in a batch."""
    from slimen_torch.types import GenerateRequest, Sampling, ScoreRequest
    spec = json.dumps({"json_schema": SCHEMA})
    reqs = [GenerateRequest(id=f"r{i}", messages=USER, sampling=Sampling(
        seed=i, max_tokens=200, temperature=0.0 if i == 5 else 1.0, constraint=spec)) for i in range(8)]
    cs = engine.generate(reqs)
    finished = [c for c in cs if c.finish_reason == "stop"]
    assert len(finished) >= 2, [c.text for c in cs]
    for c in finished:
        assert _valid(json.loads(c.text)), c.text
    g = constrain.Grammar.compile(spec)
    for c in cs:
        assert not g.start().feed(c.text).dead(), c.text
    free = engine.generate([GenerateRequest(id="f", messages=USER, sampling=Sampling(seed=1, max_tokens=40))])
    with pytest.raises(ValueError):
        json.loads(free[0].text)  # unconstrained, the random model writes no JSON
    c = cs[1]
    scores = engine.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
    assert max(abs(a - b) for a, b in zip(scores, c.logprobs)) < 1e-4
    alone = engine.generate([reqs[3]])[0]
    assert alone.tokens == cs[3].tokens


def test_engine_tool_call_and_refusal(engine):
    """tool_choice "required" with parallel_tool_calls false: one call, then the end; a constraint
    that does not compile is the request's INVALID_ARGUMENT naming its place."""
    from slimen_torch.types import GenerateRequest, RequestError, Sampling
    spec = json.dumps({"tool_calls": {"min": 1, "max": 1, "tools": [{"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}]}})
    cs = engine.generate([GenerateRequest(id=f"t{i}", messages=USER, sampling=Sampling(
        seed=i, max_tokens=240, constraint=spec)) for i in range(6)])
    done = [c for c in cs if c.finish_reason == "stop"]
    assert done, [c.text for c in cs]
    for c in done:
        body = c.text.strip()
        assert body.startswith("<tool_call>") and body.endswith("</tool_call>") and body.count("<tool_call>") == 1, body
        call = json.loads(body[len("<tool_call>"):-len("</tool_call>")])
        assert call["name"] == "add" and isinstance(call["arguments"]["a"], int), body
    bad = json.dumps({"json_schema": {"type": "string", "pattern": "x"}})
    with pytest.raises(RequestError, match="json_schema.pattern is not supported"):
        engine.generate([GenerateRequest(id="b", messages=USER, sampling=Sampling(max_tokens=4, constraint=bad))])
    assert "constrain" in engine.info()["capabilities"]


def test_walk_shortcut_keeps_the_masks():
    """The vocabulary walk's shortcut inside strings and free text (bytes that leave the state as
    it is are not stepped) gives the masks a plain walk gives, along random constrained answers."""
    from bench_constrain import SPEC, vocab

    class Plain(constrain.Matcher):
        def _walk(self, at, s, ids):
            ids.extend(self.v.toks[at])
            for b, to in self.v.next[at].items():
                ns = s.feed_byte(b)
                if ns.alts:
                    self._walk(to, ns, ids)

    texts = vocab(1024) + ["\\n", "\\q", "\\u00e9", "a\\", '\\"}', "x<", "<tool", "_call>{"]
    v = constrain.Vocab(texts, [True] + [False] * (len(texts) - 1))
    rng = random.Random(5)
    calls = {"tool_calls": {"text": True, "max": 1, "tools": [{"name": "name"}]}}
    for spec in (SPEC, calls):
        g = constrain.Grammar.compile(spec)
        fast, plain = constrain.Matcher(g, v, [0]), Plain(g, v, [0])
        for _ in range(4):
            s = g.start()
            for _ in range(40):
                got = fast.allowed(s)
                assert got == plain.allowed(s)
                if not got or got == [0]:
                    break
                s = s.feed(texts[rng.choice([t for t in got if t != 0])])
