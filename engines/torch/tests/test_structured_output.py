"""Structured output and tool_choice through the official `openai` client, on `slimen serve
--openai` and inside agent(), with the embedded arithmetic model: a model that answers in
\\boxed{} prose and never calls a tool by itself, so every JSON answer and every call here is
the constrained decoding's doing (engines/constrain)."""

import json
import os
import subprocess
import sys
import typing

import openai
import pydantic
import pytest

from conftest import start_serve

KEY = "sk-slimen-structured"


class Verdict(pydantic.BaseModel):
    answer: int
    sure: bool
    unit: typing.Literal["apples", "pens"]


@pytest.fixture(scope="module")
def client(slimen):
    proc, url = start_serve(slimen, KEY, "--model", "builtin:tiny-arith", "--threads", "1")
    yield openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    proc.terminate()
    assert proc.wait(timeout=30) == 0


QUESTION = [{"role": "user", "content": "Tom has 5 apples and buys 8 more. How many?"}]
SHORT = [{"role": "user", "content": "2+3="}]


def test_parse_pydantic_on_serve(client):
    """client.chat.completions.parse with a pydantic model: the strict json_schema it sends is
    kept, so message.parsed is a Verdict for every seed; unconstrained the model writes prose."""
    for seed in range(4):
        r = client.chat.completions.parse(model="builtin:tiny-arith", messages=QUESTION, response_format=Verdict,
                                          max_tokens=200, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Verdict), r
    free = client.chat.completions.create(model="builtin:tiny-arith", messages=QUESTION, max_tokens=60, seed=1)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_unsupported_schema_is_a_400(client):
    class Aged(pydantic.BaseModel):
        age: int = pydantic.Field(ge=0)

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.parse(model="builtin:tiny-arith", messages=QUESTION, response_format=Aged, max_tokens=20)
    assert "response_format.json_schema.schema.properties.age.minimum is not supported" in str(e.value)


def test_tool_choice_required_one_call(client):
    """tool_choice "required" with parallel_tool_calls false, and a named function: exactly one
    call of the tool, its arguments of its schema, on a model that never calls by itself. (The
    tool's schema is written into the system prompt of the model's 512 tokens: a short one.)"""
    tools = [{"type": "function", "function": {"name": "go", "parameters": {"type": "object", "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "go"}}):
        for seed in range(3):
            r = client.chat.completions.create(model="builtin:tiny-arith", messages=SHORT, tools=tools, tool_choice=choice,
                                               parallel_tool_calls=False, seed=seed)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            assert ch.message.tool_calls[0].function.name == "go"
            assert json.loads(ch.message.tool_calls[0].function.arguments) == {}
    r = client.chat.completions.create(model="builtin:tiny-arith", messages=SHORT, tools=tools, seed=1)
    assert not r.choices[0].message.tool_calls  # left to itself, no call


AGENT_PROGRAM = r'''
import json, sys, typing
import pydantic
from openai import OpenAI

class Verdict(pydantic.BaseModel):
    answer: int
    sure: bool

client = OpenAI()
r = client.chat.completions.parse(model="policy", messages=[{"role": "user", "content": sys.stdin.read()}],
                                  response_format=Verdict, max_tokens=120)
print(json.dumps({"parsed": r.choices[0].message.parsed.model_dump(), "ids": r.choices[0].model_extra.get("token_ids")}))
'''


def test_parse_pydantic_inside_agent(slimen, tmp_path):
    """Inside agent() the same call is kept by the same constraint, and the turn recorded (and
    trained) is the constrained JSON the client parsed."""
    (tmp_path / "client.py").write_text(AGENT_PROGRAM)
    (tmp_path / "run.star").write_text('''
load("@std//json.star", "decode")

def rollout(task):
    r = agent(["python3", "client.py"], task.prompt, policy = "p", timeout = 120)
    got = decode(r.output)
    if len(r.chats) != 1 or len(r.chats[0].turns) != 1:
        fail("want one conversation of one turn, got %r" % r.chats)
    text = r.chats[0].turns[0].text
    parsed = decode(text)
    if parsed != got["parsed"]:
        fail("the recorded turn %r is not what the client parsed %r" % (text, got["parsed"]))
    reward(r.chats[0], 1.0)
    train(r.chats[0])
    log(structured = 1.0)
''')
    (tmp_path / "config.yaml").write_text('''
policies:
  - {name: p, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
rollout: {batch_size: 2, max_response_len: 128, max_failed_fraction: 0}
data: {path: synthetic:arith}
''')
    env = dict(os.environ, SLIMEN_PYTHON=sys.executable)
    out = tmp_path / "out"
    p = subprocess.run([str(slimen), "exec", str(tmp_path / "run.star"), "--config", str(tmp_path / "config.yaml"),
                        "--steps", "1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    step = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("step") == 1:
            step.update(m)
    assert step.get("structured") == 1.0, step
