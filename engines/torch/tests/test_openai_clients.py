"""`slimen serve --openai` against agent frameworks nobody here wrote: openai-agents with its
defaults (the Responses API) and langchain-openai's ChatOpenAI, through tools, streaming and
structured output. (agent()'s endpoint runs the same clients in test_agent_frameworks.py; the
official openai client is in test_openai_front.py.)

The served policy is a remote engine: a worker of this package in this process whose model (the
tiny Qwen3 folder: its tokenizer and chat template) answers from a script instead of sampling,
so that a framework's loop runs the same way every time: a call of the offered tool until the
conversation holds the tool's result, then the answer; it follows a request's constraint (the
worker lists "constrain"), so structured output is asked of it as of a sampling worker. `slimen serve --config` serves it, so
every request goes through the Go front and the engine protocol as a sampled one does."""

import json
import os
import shutil
import sys

import openai
import pytest

from slimen_torch.engine import Engine, Options
from slimen_torch.server import make_server
from slimen_torch.types import Completion

from conftest import start_serve

os.environ.setdefault("OPENAI_API_KEY", "sk-unused")  # clients refuse to start without one
os.environ["LANGSMITH_TRACING"] = os.environ["LANGCHAIN_TRACING_V2"] = "false"  # nothing sent to LangSmith
KEY = "sk-slimen-test"

ARGS = {"multiply": {"a": 12, "b": 34}, "Answer": {"value": 408}}
ANSWER = "It is 408."


def call(name):
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(ARGS[name]))


class ScriptedEngine(Engine):
    """The engine with a scripted policy that follows a request's constraint (structured
    output): a call of the first tool where a call is required; with tools described in the
    prompt (the system message the front writes for a template without a tools variable) and no
    tool message yet, a call of multiply; else the answer, as JSON where a schema is asked for.
    Its tokens are the script's text as the model's tokenizer encodes it, ended by the
    end-of-sequence token."""

    def submit(self, req, on_completion, on_error=None):
        prompt = self.prompt_of(req.messages, req.prompt_tokens, f"request {req.id!r}")
        text = self.tokenizer.tk.decode(prompt, skip_special_tokens=False)
        spec = json.loads(req.sampling.constraint or "{}")
        calls = spec.get("tool_calls") or {}
        if calls.get("min"):
            reply = call(calls["tools"][0]["name"])
        elif "<tools>" in text and "<|im_start|>tool" not in text:
            reply = call("multiply")
        elif "json_schema" in spec:
            reply = json.dumps(ARGS["Answer"])
        else:
            reply = ANSWER
        tokens = self.tokenizer.encode(reply)[: req.sampling.max_tokens - 1] + [self.eos[0]]
        for i in range(req.n or 1):
            on_completion(Completion(req.id, i, prompt, tokens, [0.0] * len(tokens), reply, "stop"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dirs, slimen):
    """The base URL of `slimen serve --openai` serving the scripted engine."""
    tmp = tmp_path_factory.mktemp("serve")
    # The frameworks' system prompts and tool schemas are longer than the model's 512 positions.
    model = tmp / "model"
    shutil.copytree(model_dirs["tiny-qwen3"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (model / "config.json").write_text(json.dumps(cfg))
    eng = ScriptedEngine(str(model), Options(device="cpu", max_seq_len=4096, slots=2))
    grpc_server, service, port = make_server("127.0.0.1:0")
    service.engine, service.loading = eng, False
    (tmp / "config.yaml").write_text(f"""
policies:
  - {{name: scripted, hf_checkpoint: {model}, engine: {{kind: remote, address: "127.0.0.1:{port}"}}}}
""")
    proc, url = start_serve(slimen, KEY, "--config", str(tmp / "config.yaml"))
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    grpc_server.stop(None)
    eng.close()


def test_scripted_policy_is_served(server):
    """The fixture's own check: the official client gets the script's call through the front."""
    c = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}]
    r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "12*34?"}], tools=tools)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "multiply"


# ---- openai-agents ----

@pytest.fixture
def agents(server):
    """openai-agents pointed at the server, its tracing off; yields the package and the tool's
    calls, and puts its defaults back after the test."""
    import agents as sdk

    sdk.set_tracing_disabled(True)
    sdk.set_default_openai_client(openai.AsyncOpenAI(base_url=server, api_key=KEY, max_retries=0),
                                  use_for_tracing=False)
    yield sdk
    sdk.set_default_openai_api("responses")


def calc_agent(sdk, called, **kw):
    @sdk.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers."""
        called.append([a, b])
        return a * b

    return sdk.Agent(name="calc", instructions="Use the tools.", tools=[multiply], model="scripted",
                     model_settings=sdk.ModelSettings(max_tokens=256), **kw)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_tool_loop(agents, api):
    """Runner.run with the SDK's default API (the Responses API) and with chat completions: the
    policy's call reaches the function tool with its arguments, the tool's result goes back,
    the answer is the run's final output."""
    agents.set_default_openai_api(api)
    called = []
    r = agents.Runner.run_sync(calc_agent(agents, called), "What is 12 times 34?")
    assert called == [[12, 34]]
    assert [i.type for i in r.new_items] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert r.final_output == ANSWER


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_streamed(agents, api):
    """Runner.run_streamed on the Responses API and on chat completions: the run's items arrive
    as events, and the answer's text as output_text deltas that add up to it."""
    import asyncio

    agents.set_default_openai_api(api)
    called = []

    async def run():
        r = agents.Runner.run_streamed(calc_agent(agents, called), "What is 12 times 34?")
        items, text = [], ""
        async for e in r.stream_events():
            if e.type == "run_item_stream_event":
                items.append(e.item.type)
            elif e.type == "raw_response_event" and e.data.type == "response.output_text.delta":
                text += e.data.delta
        return r.final_output, items, text

    final, items, text = asyncio.run(run())
    assert called == [[12, 34]]
    assert items == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert final == text == ANSWER


def test_openai_agents_output_type(agents):
    """An output_type asks for structured output (text.format json_schema), which the worker
    keeps by constrained decoding: the tool loop runs, and the final answer is the schema's
    object."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    called = []
    r = agents.Runner.run_sync(calc_agent(agents, called, output_type=Answer), "What is 12 times 34?")
    assert called == [[12, 34]]
    assert r.final_output == Answer(value=408)


# ---- langchain-openai ----

@pytest.fixture
def chat(server):
    from langchain_openai import ChatOpenAI

    return lambda **kw: ChatOpenAI(model="scripted", base_url=server, api_key=KEY, max_tokens=256, max_retries=0, **kw)


def multiply_tool():
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers."""
        return a * b

    return multiply


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
def test_langchain_tools(chat, api, streamed):
    """ChatOpenAI.bind_tools on the chat completions and the Responses API, invoked and streamed:
    the policy's call arrives as the message's tool_calls (streamed: as chunks that add up to
    it), the ToolMessage goes back, and the answer is the text."""
    from langchain_core.messages import HumanMessage, ToolMessage

    tool = multiply_tool()
    bound = chat(use_responses_api=api == "responses").bind_tools([tool])
    messages = [HumanMessage("What is 12 times 34?")]
    if streamed:
        chunks = list(bound.stream(messages))
        assert len(chunks) > 1
        msg = chunks[0]
        for c in chunks[1:]:
            msg = msg + c
    else:
        msg = bound.invoke(messages)
    (call,) = msg.tool_calls
    assert (call["name"], call["args"]) == ("multiply", {"a": 12, "b": 34})
    messages += [msg, ToolMessage(str(tool.invoke(call["args"])), tool_call_id=call["id"])]
    if streamed:
        chunks = list(bound.stream(messages))
        assert "".join(c.text for c in chunks) == ANSWER
    else:
        assert bound.invoke(messages).text == ANSWER


def test_langchain_plain_stream(chat):
    """No tools: ChatOpenAI.stream's chunks add up to what invoke answers."""
    llm = chat()
    assert "".join(c.text for c in llm.stream("Hello")) == llm.invoke("Hello").text == ANSWER


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat, api, method):
    """with_structured_output asks for structured output: by its default method (json_schema) as
    response_format (text.format on the Responses API); by function_calling as a forced call of
    the schema's tool with parallel_tool_calls false. The worker keeps either by constrained
    decoding, and the client parses the schema's object."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        """The answer."""
        value: int

    llm = chat(use_responses_api=api == "responses").with_structured_output(Answer, method=method)
    assert llm.invoke("What is 12 times 34?") == Answer(value=408)


def test_structured_output_refused_without_constraint(server):
    """An engine that cannot constrain its decoding (agent()'s scripted policies in
    test_agent_frameworks.py) refuses structured output with a 400 naming the field; this one
    refuses a schema feature the constraint lacks the same way, never ignoring it."""
    c = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "format": "email"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], response_format=fmt)


# ---- token by token, on the embedded engine ----

@pytest.fixture(scope="module")
def tiny_server(slimen):
    """`slimen serve --openai` on the embedded engine, which streams as it samples."""
    proc, url = start_serve(slimen, KEY, "--model", "builtin:tiny-arith", "--threads", "1")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


QUESTION = "Cal has 8 eggs and gets 5 more. How many eggs?"


def test_langchain_streams_token_by_token(tiny_server):
    """On the embedded engine ChatOpenAI.stream gets the answer in many chunks, which add up to
    what invoke answers (greedy)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="builtin:tiny-arith", base_url=tiny_server, api_key=KEY, temperature=0, max_tokens=24, max_retries=0)
    chunks = [c.text for c in llm.stream(QUESTION)]
    assert len([c for c in chunks if c]) > 3, chunks
    assert "".join(chunks) == llm.invoke(QUESTION).text


def test_openai_agents_stream_token_by_token(tiny_server):
    """On the embedded engine openai-agents' run_streamed gets the answer in many output_text
    deltas (the Responses API), which add up to its final output."""
    import asyncio

    import agents as sdk

    sdk.set_tracing_disabled(True)
    model = sdk.OpenAIResponsesModel("builtin:tiny-arith", openai.AsyncOpenAI(base_url=tiny_server, api_key=KEY, max_retries=0))
    agent = sdk.Agent(name="a", model=model, model_settings=sdk.ModelSettings(temperature=0, max_tokens=24))

    async def run():
        r = sdk.Runner.run_streamed(agent, QUESTION)
        deltas = [e.data.delta async for e in r.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return deltas, r.final_output

    deltas, final = asyncio.run(run())
    assert len(deltas) > 3 and "".join(deltas) == final, (deltas, final)
