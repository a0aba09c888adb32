"""The tiny engine's checkpoints are ordinary Hugging Face Llama checkpoints.

testdata/tiny_compat/ holds model folders written by the Go engine (engines/tiny) together with
what the Go side computed for them: logits for some token sequences, token ids for some texts and
chat renderings. transformers must load the folders as they are and find the same numbers.
Regenerate the fixture with `go test ./engines/tiny -run TestCompatFixture -update`.

The embedded base checkpoint builtin:tiny-arith (engines/tiny/builtin/tiny-arith, the folder
compiled into the slimen binary) is checked the same way against tiny_arith.json, which the Go
engine writes for it: `go test ./engines/tiny -run TestCompatTinyArith -update`.
"""

import json
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = pathlib.Path(__file__).resolve().parents[3]
FIXTURE = REPO / "testdata" / "tiny_compat"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
MODELS = sorted(EXPECTED["models"])
BUILTIN = REPO / "engines" / "tiny" / "builtin" / "tiny-arith"
TINY_ARITH = json.loads((FIXTURE / "tiny_arith.json").read_text())


def relative_error(got, ref):
    """The largest elementwise difference relative to the largest |logit| of the reference: an
    elementwise relative error is meaningless for logits near zero."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


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
        err = relative_error(got, torch.tensor(logits))
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


@pytest.fixture(scope="module")
def tiny_arith():
    model = AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(BUILTIN)


def test_builtin_tiny_arith_fixture_is_for_it():
    assert TINY_ARITH["model"] == "builtin:tiny-arith"
    assert len(TINY_ARITH["cases"]) >= 2


@pytest.mark.parametrize("case", TINY_ARITH["cases"], ids=lambda c: c["messages"][-1]["content"][:20])
def test_builtin_tiny_arith_matches_go(tiny_arith, case):
    """transformers loads the embedded checkpoint folder as it is, renders and tokenizes the chat
    as the Go engine does, and computes the Go engine's logits at every position."""
    model, tok = tiny_arith
    assert type(model).__name__ == "LlamaForCausalLM"
    rendered = tok.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
    assert rendered + case["response"] == case["text"]
    ids = tok(case["text"], add_special_tokens=True)["input_ids"]
    assert ids == case["ids"]
    assert tok.decode(ids) == case["text"]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
    ref = torch.tensor(case["logits"])
    assert got.shape == ref.shape
    err = relative_error(got, ref)
    assert err < 1e-4, f"builtin:tiny-arith, {len(ids)} tokens: relative error {err:.2e}"


# A tiny model with the byte-level BPE vocabulary and the Qwen3-form chat template
# (engines/tiny/bpe.go, template.go): bpe.json holds what the Go engine computes for the folder
# bpe_chat/. Regenerate both with `go test ./engines/tiny -run TestCompatBPE -update`.
BPE = json.loads((FIXTURE / "bpe.json").read_text())
BPE_DIR = FIXTURE / BPE["model"]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return AutoTokenizer.from_pretrained(BPE_DIR)


@pytest.fixture(scope="module")
def bpe_raw():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BPE_DIR / "tokenizer.json"))


@pytest.mark.parametrize("case", BPE["texts"], ids=lambda c: repr(c["text"])[:30])
def test_bpe_token_ids_match_go(bpe_tokenizer, bpe_raw, case):
    """The tokenizers library, reading tokenizer.json, splits and merges every text as the Go
    encoder does (added tokens in the text included), and decodes the ids back to the text."""
    raw = bpe_raw
    assert raw.encode(case["text"], add_special_tokens=False).ids == case["ids"]
    ids = bpe_tokenizer(case["text"], add_special_tokens=True)["input_ids"]
    assert ids == case["ids"]
    assert bpe_tokenizer.decode(ids) == case["text"]


def test_bpe_special_tokens(bpe_tokenizer):
    config = json.loads((BPE_DIR / "config.json").read_text())
    assert bpe_tokenizer.eos_token == "<|im_end|>"
    assert bpe_tokenizer.eos_token_id == config["eos_token_id"]
    assert bpe_tokenizer.pad_token == "<|endoftext|>"
    assert len(bpe_tokenizer) == config["vocab_size"]
    for t in ["<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]:
        assert len(bpe_tokenizer(t, add_special_tokens=False)["input_ids"]) == 1, t
    # A generated tool call survives decoding without special tokens: the tool tags are not special.
    ids = bpe_tokenizer('<tool_call>\n{"name": "calc"}\n</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    assert bpe_tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "calc"}\n</tool_call>'


def openai_form(messages):
    """The messages as an OpenAI client sends them: an assistant's <tool_call> blocks as
    tool_calls with parsed arguments, the rest of its text as content."""
    out = []
    for m in messages:
        if m["role"] != "assistant" or "<tool_call>" not in m["content"]:
            out.append(dict(m))
            continue
        head, *blocks = m["content"].split("<tool_call>")
        calls = []
        for b in blocks:
            call = json.loads(b.split("</tool_call>")[0])
            calls.append({"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
        out.append({"role": "assistant", "content": head.rstrip("\n"), "tool_calls": calls})
    return out


def chat_ids(tok, messages, tools, add_generation_prompt):
    got = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if hasattr(got, "keys"):
        got = got["input_ids"]
    return list(got)


SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("case", BPE["chats"], ids=lambda c: f"{len(c['messages'])}msgs-{len(c['tools'] or [])}tools")
def test_bpe_chat_template_matches_go(bpe_tokenizer, case):
    """transformers' apply_chat_template with the folder's template gives the Go renderer's ids,
    with the tool calls in the content as slimen keeps them and as OpenAI tool_calls; and so does
    the PyTorch worker's renderer (slimen_torch.tokenizer), which keeps special-token text in a
    message as text, as the Go renderer does, where transformers would make it a turn."""
    from slimen_torch.tokenizer import Tokenizer as WorkerTokenizer

    tools = [json.loads(t) for t in case["tools"]] if case["tools"] else None
    gen = case["add_generation_prompt"]
    worker = WorkerTokenizer(BPE_DIR)
    assert worker.encode_chat(case["messages"], gen, tools) == case["ids"]
    if any(s in m["content"] for m in case["messages"] for s in SPECIAL_TEXT):
        assert chat_ids(bpe_tokenizer, case["messages"], tools, gen) != case["ids"]
        return
    assert chat_ids(bpe_tokenizer, case["messages"], tools, gen) == case["ids"]
    assert chat_ids(bpe_tokenizer, openai_form(case["messages"]), tools, gen) == case["ids"]


def test_bpe_chat_fixture_is_the_issue_case():
    """One conversation holds a system prompt, three tool schemas, tool calls, tool responses and
    eight turns or more, and passes 512 tokens."""
    big = BPE["chats"][0]
    roles = [m["role"] for m in big["messages"]]
    assert roles[0] == "system" and len(big["tools"]) == 3 and "tool" in roles
    assert sum(1 for m in big["messages"] if m["role"] in ("user", "assistant")) >= 8
    assert len(big["ids"]) > 512


def test_bpe_logits_match_go():
    model = AutoModelForCausalLM.from_pretrained(BPE_DIR, dtype=torch.float32)
    model.eval()
    for seq, positions, logits in zip(BPE["sequences"], BPE["positions"], BPE["logits"]):
        with torch.no_grad():
            got = model(torch.tensor([seq])).logits[0][positions]
        err = relative_error(got, torch.tensor(logits))
        assert err < 1e-4, f"bpe_chat: sequence of {len(seq)} tokens, relative error {err:.2e}"


def test_bpe_folder_in_the_worker():
    """The PyTorch worker opens the folder: it renders the chats with tools to the Go ids and
    scores a 936-token conversation with the log-probs of the Go engine's logits."""
    from slimen_torch.engine import Engine, Options
    from slimen_torch.types import ScoreRequest

    e = Engine(str(BPE_DIR), Options(device="cpu"))
    try:
        reqs = [(c["messages"], c["tools"] or [], c["add_generation_prompt"]) for c in BPE["chats"]]
        assert e.render(reqs) == [c["ids"] for c in BPE["chats"]]
        seq, positions, logits = BPE["sequences"][1], BPE["positions"][1], BPE["logits"][1]
        got = e.score([ScoreRequest(tokens=seq[1:], prompt_tokens=seq[:1])])[0]
        for p, row in zip(positions, logits):
            if p + 1 < len(seq):
                want = torch.log_softmax(torch.tensor(row, dtype=torch.float64), -1)[seq[p + 1]].item()
                assert abs(got[p] - want) < 1e-3, f"position {p}: worker {got[p]}, Go {want}"
    finally:
        e.close()
