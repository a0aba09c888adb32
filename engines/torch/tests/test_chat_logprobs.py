"""A multi-turn chat sample as the host builds it (engines.Renderer, host/script/chat.go): every
turn sampled from the conversation's own token ids, the messages between turns rendered by the
template. The log-probs the trainer recomputes at the sample's masked-in positions (the sampled
tokens) must be the rollout's, for a plain ChatML template and for a Qwen3-style one that strips
<think> from earlier turns (whose re-rendered history is not a prefix of the conversation)."""

import json
import shutil

import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.types import GenerateRequest, Sampling

from test_render import QWEN_STYLE


@pytest.fixture(scope="module", params=["chatml", "qwen-style"])
def chat_engine(request, model_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "m"
    shutil.copytree(model_dirs["tiny-qwen3"], d)
    if request.param == "qwen-style":
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = QWEN_STYLE
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    e = Engine(str(d), Options(device="cpu"))
    yield e
    e.close()


def injected(eng, new, sampled_end):
    """The tokens a chat adds after a sampled assistant turn: the template's closing of that turn,
    <|im_end|>\n (less the end token when the model sampled it), then the new messages with the
    generation prompt, which both templates render on their own as they render them in a
    conversation."""
    closing = eng.tokenize(["<|im_end|>\n"])[0]
    return (closing[1:] if sampled_end else closing) + eng.render([(new, [], True)])[0]


def test_trainer_logprobs_match_rollout_at_masked_positions(chat_engine):
    eng = chat_engine
    msgs = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 12 * 34?"}]
    tokens = eng.render([(msgs, [], True)])[0]
    prompt = list(tokens)
    response, mask, old = [], [], []
    for turn, follow in enumerate(([{"role": "tool", "content": "408"}],
                                   [{"role": "user", "content": "And 408 + 1?"}], None)):
        c = eng.generate([GenerateRequest(id=f"t{turn}", prompt_tokens=tokens,
                                          sampling=Sampling(max_tokens=12, temperature=1.0, seed=turn + 3))])[0]
        assert c.prompt_tokens == tokens  # sampled from the conversation's own ids
        response += c.tokens
        mask += [1.0] * len(c.tokens)
        old += c.logprobs
        tokens = tokens + c.tokens
        if follow is None:
            break
        add = injected(eng, follow, bool(c.tokens) and c.tokens[-1] in eng.eos)
        response += add
        mask += [0.0] * len(add)
        old += [0.0] * len(add)
        tokens = tokens + add
    assert 0 < sum(mask) < len(mask)  # turns trained, injections masked out
    with torch.no_grad():
        logp, _, targets = eng.trainer._logprobs(eng.model, [(prompt, response)], False)
    assert targets.tolist() == response
    got = [lp for lp, m in zip(logp.tolist(), mask) if m]
    want = [lp for lp, m in zip(old, mask) if m]
    assert got == pytest.approx(want, abs=2e-4)
    # The masked-out positions are where the rollout has no log-prob: a wrong mask (shifted by one)
    # would pair sampled log-probs with template tokens and fail the comparison above.
    shifted = [lp for lp, m in zip(logp.tolist()[1:] + [0.0], mask) if m]
    assert shifted != pytest.approx(want, abs=2e-4)
