"""Cross-engine: the Go tiny engine (engines/tiny) and this engine give the same logits on the
same checkpoint. testdata/tiny_compat/ holds folders the Go engine wrote, with the logits, token
ids and chat renderings the Go side computed (regenerate with
`go test ./engines/tiny -run TestCompatFixture -update`)."""

import json

import pytest
import torch

from slimen_torch.engine import Engine
from slimen_torch.model import decode_layer, decode_step
from slimen_torch.types import ScoreRequest

from conftest import REPO

FIXTURE = REPO / "testdata" / "tiny_compat"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
MODELS = sorted(EXPECTED["models"])


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    e = Engine(str(FIXTURE / request.param))
    yield e, EXPECTED["models"][request.param]
    e.close()


def rel(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_forward_logits_match_go(case):
    e, want = case
    for seq, logits in zip(want["sequences"], want["logits"]):
        with torch.no_grad():
            got = e.model.logits(e.model(torch.tensor([seq])))[0]
        assert rel(got, torch.tensor(logits)) <= 1e-4, f"sequence of {len(seq)} tokens"


def test_decode_path_and_score_match_go(case):
    """The generation path (static KV cache, one token at a time) and Score give the Go logits."""
    e, want = case
    seq = max(want["sequences"], key=len)
    ref = torch.tensor(want["logits"][want["sequences"].index(seq)])
    m = e.model
    shape = (1, m.cfg.kv_heads, len(seq), m.cfg.head_dim)
    kc = [torch.zeros(shape) for _ in m.layers]
    vc = [torch.zeros(shape) for _ in m.layers]
    with torch.no_grad():
        for t, tok in enumerate(seq):
            out = m.logits(decode_step(m, decode_layer, torch.tensor([tok]), torch.tensor([t]),
                                       kc, vc, len(seq)))[0]
            assert rel(out, ref[t]) <= 1e-4, f"position {t}"
    lp = e.score([ScoreRequest(prompt_tokens=seq[:1], tokens=seq[1:])])[0]
    want_lp = torch.log_softmax(ref[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp), want_lp, atol=1e-4)


def test_tokenizer_and_chat_template_match_go(case):
    e, _ = case
    for t in EXPECTED["texts"]:
        assert e.tokenize([t["text"]])[0] == t["ids"], t["text"]
    for c in EXPECTED["chats"]:
        rendered = e.tokenizer.render(c["messages"], c["add_generation_prompt"])
        assert rendered == c["rendered"]
        assert e.tokenizer.encode(rendered) == c["ids"]
    # The end-of-sequence token of the Go engine's vocabulary ends our responses too.
    assert e.tokenizer.token_id("<|end|>") in e.eos
