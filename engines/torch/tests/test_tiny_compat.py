"""The tiny engine's checkpoints are ordinary Hugging Face Llama checkpoints.

testdata/tiny_compat/ holds model folders written by the Go engine (engines/tiny) together with
what the Go side computed for them: logits for some token sequences, token ids for some texts and
chat renderings. transformers must load the folders as they are and find the same numbers.
Regenerate the fixture with `go test ./engines/tiny -run TestCompatFixture -update`.
"""

import json
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / "testdata" / "tiny_compat"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
MODELS = sorted(EXPECTED["models"])


@pytest.fixture(scope="module")
def tokenizer():
    # Every folder carries the same character vocabulary; any one will do.
    return AutoTokenizer.from_pretrained(FIXTURE / MODELS[0])


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_go(name):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE / name, dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    want = EXPECTED["models"][name]
    for seq, logits in zip(want["sequences"], want["logits"]):
        with torch.no_grad():
            got = model(torch.tensor([seq])).logits[0]
        ref = torch.tensor(logits)
        # Relative to the scale of the logits: elementwise relative error is meaningless for
        # logits near zero.
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, f"{name}: sequence of {len(seq)} tokens, relative error {err:.2e}"


@pytest.mark.parametrize("name", MODELS)
def test_special_tokens(name):
    tok = AutoTokenizer.from_pretrained(FIXTURE / name)
    config = json.loads((FIXTURE / name / "config.json").read_text())
    assert tok.eos_token == "<|end|>"
    assert tok.eos_token_id == config["eos_token_id"]
    assert tok.pad_token == "<|pad|>"
    assert tok.convert_tokens_to_ids("<|assistant|>") != tok.unk_token_id


@pytest.mark.parametrize("case", EXPECTED["texts"], ids=lambda c: repr(c["text"])[:30])
def test_token_ids_match_go(tokenizer, case):
    ids = tokenizer(case["text"], add_special_tokens=True)["input_ids"]
    assert ids == case["ids"]
    if tokenizer.unk_token_id not in ids:
        assert tokenizer.decode(ids) == case["text"]


@pytest.mark.parametrize("case", EXPECTED["chats"], ids=lambda c: str(len(c["messages"])))
def test_chat_template_matches_go(tokenizer, case):
    rendered = tokenizer.apply_chat_template(
        case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"]
    )
    assert rendered == case["rendered"]
    assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == case["ids"]
