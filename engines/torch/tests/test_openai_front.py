"""`slimen serve --openai` against a client nobody here wrote: the official `openai` package.

The Go binary serves the Go tiny engine on a checkpoint folder of testdata/tiny_compat; this
engine (PyTorch) loads the same folder and scores the tokens the server says it sampled, so the
token ids and log-probs that come back through the OpenAI API are checked against an independent
implementation of the model, not against themselves."""

import pathlib

import openai
import pytest

from slimen_torch.engine import Engine
from slimen_torch.types import ScoreRequest

from conftest import REPO, start_serve

MODEL = REPO / "testdata" / "tiny_compat" / "gqa_untied"
KEY = "sk-slimen-test"


@pytest.fixture(scope="module")
def server(slimen):
    proc, url = start_serve(slimen, KEY, "--model", str(MODEL), "--threads", "1")
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def torch_engine():
    e = Engine(str(MODEL))
    yield e
    e.close()


def model_name(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def check_logprobs(engine, prompt_ids, token_ids, logprobs):
    """The server's log-probs are what an independent implementation of the model assigns."""
    assert len(token_ids) == len(logprobs) > 0
    want = engine.score([ScoreRequest(prompt_tokens=list(prompt_ids), tokens=list(token_ids))])[0]
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < 1e-3


def test_chat(client, torch_engine):
    model = model_name(client)
    assert model == str(MODEL)
    kw = dict(model=model, messages=[{"role": "user", "content": "12+30="}], n=2, max_tokens=8,
              seed=5, temperature=1.0, logprobs=True)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    assert len(r.choices) == 2 and r.object == "chat.completion"
    extra = r.model_extra
    prompt_ids = extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        lps = [t.logprob for t in c.logprobs.content]
        check_logprobs(torch_engine, prompt_ids, ids, lps)
        assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"

    # The same seed samples the same tokens; streamed, the deltas add up to the same answer.
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    text, finish = {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[i] for i in range(2)] == [c.message.content for c in r.choices]
    assert [finish[i] for i in range(2)] == [c.finish_reason for c in r.choices]


def test_completions_with_token_ids(client, torch_engine):
    model = model_name(client)
    prompt = [5, 6, 7, 8]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, seed=3, logprobs=0,
                                  extra_body={"return_token_ids": True,
                                              "return_tokens_as_token_ids": True})
    (c,) = r.choices
    ids = c.model_extra["token_ids"]
    assert c.model_extra["prompt_token_ids"] == prompt
    assert c.logprobs.tokens == [f"token_id:{i}" for i in ids]
    check_logprobs(torch_engine, prompt, ids, c.logprobs.token_logprobs)


def test_errors(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="sk-wrong", max_retries=0).models.list()
