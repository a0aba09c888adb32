"""agent() against clients nobody here wrote: the official `openai` package, the agent
frameworks smolagents (its own command line, `smolagent`, unchanged) and openai-agents (with its
defaults: the Responses API), and langchain-openai's ChatOpenAI.

Each test runs the Go binary (`slimen exec` on the embedded engine, or `slimen test` on scripted
policies) with a script whose agent() runs the client in this very Python (SLIMEN_PYTHON). The
scripts check, in Starlark, that the tokens each recorded conversation holds at loss mask 1 are
exactly the turns the policy sampled, and that every call was recorded; the tests read what the
scripts logged."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


BIN = pathlib.Path(sys.executable).parent


def env():
    # agent() runs argv "python3" with $SLIMEN_PYTHON: this interpreter, which has the clients;
    # its bin/ (smolagent) goes first on PATH.
    return dict(os.environ, SLIMEN_PYTHON=sys.executable, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")


# Starlark: the tokens at loss mask 1 of each recorded chat are its turns' sampled tokens, in order.
CHECK = '''
load("@std//json.star", "decode")

def check_exact(chats):
    for c in chats:
        sampled = []
        for t in c.turns:
            sampled += list(t.tokens)
        masked = [x for x, m in zip(c.tokens, c.loss_mask) if m == 1]
        if masked != sampled or not sampled:
            fail("chat tokens at mask 1 %r are not the sampled turns %r" % (masked, sampled))
'''

OPENAI_CLIENT = r'''
import json, sys
from openai import OpenAI

client = OpenAI()
messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": sys.stdin.read()}]
got = []
for i in range(3):
    if i < 2:
        r = client.chat.completions.create(model="any-name", messages=messages, max_tokens=8,
                                           extra_body={"return_token_ids": True})
        text, ids = r.choices[0].message.content, r.choices[0].model_extra["token_ids"]
    else:  # the last call streamed
        text, ids = "", []
        for chunk in client.chat.completions.create(model="any-name", messages=messages, max_tokens=8, stream=True,
                                                    extra_body={"return_token_ids": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    got.append(ids)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
print(json.dumps(got))
'''


def run_exec(slimen, tmp_path, script, config, steps=1):
    (tmp_path / "run.star").write_text(script)
    (tmp_path / "config.yaml").write_text(config)
    out = tmp_path / "out"
    p = subprocess.run([str(slimen), "exec", str(tmp_path / "run.star"), "--config", str(tmp_path / "config.yaml"),
                        "--steps", str(steps), "--out", str(out)], env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    # The first step's lines (one per policy, and the run's with what the script logged) merged.
    step = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("step") == 1:
            step.update(m)
    return step


def test_openai_client_tokens_are_the_sampled_ones(slimen, tmp_path):
    """Three calls of the official client, each sending the whole history back (the last one
    streamed), make one conversation on the embedded engine; the token ids the client received
    are the recorded turns, which are the conversation's tokens at loss mask 1."""
    (tmp_path / "client.py").write_text(OPENAI_CLIENT)
    script = CHECK + '''
def rollout(task):
    r = agent(["python3", "client.py"], task.prompt, policy = "p", timeout = 120)
    got = decode(r.output)
    check_exact(r.chats)
    if len(r.chats) != 1:
        fail("%d chats; the history continued the recorded conversation, so want 1" % len(r.chats))
    turns = [list(t.tokens) for t in r.chats[0].turns]
    if turns != got:
        fail("the client received %r, the chat recorded %r" % (got, turns))
    reward(r.chats[0], 1.0)
    train(r.chats[0])
    log(exact = 1.0, turns = len(turns))
'''
    config = '''
policies:
  - {name: p, hf_checkpoint: builtin:tiny-arith, engine: {kind: tiny}}
rollout: {batch_size: 2, max_response_len: 16, max_failed_fraction: 0}
data: {path: synthetic:arith}
'''
    step = run_exec(slimen, tmp_path, script, config)
    assert step.get("exact") == 1.0 and step.get("turns") == 3, step


def test_openai_client_tool_calls(slimen, tmp_path):
    """A policy's Hermes tool call reaches the official client as tool_calls, streamed and not;
    the client's assistant message with tool_calls and its tool message continue the chat."""
    (tmp_path / "client.py").write_text(r'''
import json, sys
from openai import OpenAI

client = OpenAI()
tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object",
          "properties": {"expr": {"type": "string"}}}}}]
messages = [{"role": "user", "content": sys.stdin.read()}]
r = client.chat.completions.create(model="m", messages=messages, tools=tools)
assert r.choices[0].finish_reason == "tool_calls", r
call = r.choices[0].message.tool_calls[0]
messages.append(r.choices[0].message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(json.loads(call.function.arguments)["expr"]))})
# The same history streamed: the call arrives as a delta.
streamed = [c.choices[0].delta.tool_calls for c in client.chat.completions.create(model="m", messages=messages[:1], tools=tools, stream=True)
            if c.choices and c.choices[0].delta.tool_calls]
assert streamed and streamed[0][0].function.name == "calc", streamed
r = client.chat.completions.create(model="m", messages=messages, tools=tools)
print(call.function.name, call.function.arguments, r.choices[0].message.content)
''')
    (tmp_path / "tools_test.star").write_text(CHECK + r'''
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'

def rollout(task):
    r = agent(["python3", "client.py"], task.prompt, policy = "p", tools_prompt = "system", timeout = 120,
              call_max_tokens = 96)
    check_exact(r.chats)
    if r.output != 'calc {"expr":"12*34"} \\boxed{408}\n':
        fail("the client printed %r" % r.output)
    roles = [m["role"] for m in r.chats[0].messages]
    if roles != ["system", "user", "assistant", "tool", "assistant"]:
        fail("roles %r" % roles)
    log(chats = len(r.chats), turns = len(r.chats[0].turns))

def respond(prompt, i):
    return "\\boxed{%s}" % prompt if prompt.isdigit() else CALL

def test_tool_call_round_trip():
    out = simulate(rollout, task = {"prompt": "Ann has 12 bags of 34 pens."}, responses = {"p": respond})
    assert.eq(out.logs["chats"], 2)  # the streamed call of the first message alone: a conversation of its own
    assert.eq(out.logs["turns"], 2)
''')
    p = subprocess.run([str(slimen), "test", str(tmp_path / "tools_test.star")], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "1 passed, 0 failed" in p.stdout, p.stdout + p.stderr


def test_smolagents_cli_unchanged(slimen, tmp_path):
    """smolagents' own command line, `smolagent`, unchanged: its OpenAIModel and ToolCallingAgent
    (which streams) pointed at agent()'s endpoint by its --api-base and --api-key flags. The
    scripted policy answers smolagents' first call with a Hermes call of its final_answer tool;
    smolagents reads it from the streamed tool_calls, finishes and prints the answer. Every call
    it made is recorded, with the tokens the policy sampled."""
    (tmp_path / "smol_test.star").write_text(CHECK + r"""
SMOLAGENT = 'exec smolagent "$SLIMEN_TASK_INPUT" --model-type OpenAIModel --model-id slimen --action-type tool_calling --tools --api-base "$OPENAI_BASE_URL" --api-key "$OPENAI_API_KEY"'

def rollout(task):
    r = agent(["sh", "-c", SMOLAGENT], task.prompt, policy = "p", tools_prompt = "system", timeout = 240,
              call_max_tokens = 128)
    check_exact(r.chats)
    turns = 0
    for c in r.chats:
        turns += len(c.turns)
        reward(c, 1.0 if "408" in r.output else 0.0)
        train(c)
    if turns != r.calls:
        fail("%d calls recorded as %d turns" % (r.calls, turns))
    log(calls = r.calls, answered = 1.0 if "408" in r.output else 0.0)

FINAL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "408"}}</tool_call>'

def test_smolagent_answers_with_the_policys_tool_call():
    out = simulate(rollout, task = {"prompt": "How many pens are 12 bags of 34 pens?"}, responses = {"p": [FINAL]})
    assert.eq(out.logs["answered"], 1.0)
    assert.eq(out.logs["calls"], 1)
    assert.eq([s.reward for s in out.samples["p"]], [1.0])
""")
    p = subprocess.run([str(slimen), "test", str(tmp_path / "smol_test.star")], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "1 passed, 0 failed" in p.stdout, p.stdout + p.stderr


def test_openai_client_on_a_torch_qwen3_policy(slimen, tmp_path, model_dirs):
    """The same client with tools offered, on a torch worker with a Qwen3 chat template (its
    tools variable, and the <think> handling of earlier turns): three calls continue one
    conversation whose tokens at loss mask 1 are what the client received, and the run trains it."""
    (tmp_path / "client.py").write_text(OPENAI_CLIENT.replace(
        'extra_body={"return_token_ids": True}',
        'extra_body={"return_token_ids": True}, tools=[{"type": "function", "function": {"name": "calc", '
        '"parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]'))
    script = CHECK + '''
def rollout(task):
    r = agent(["python3", "client.py"], task.prompt, policy = "p", timeout = 300)
    got = decode(r.output)
    check_exact(r.chats)
    turns = [list(t.tokens) for t in r.chats[0].turns]
    if len(r.chats) != 1 or turns != got:
        fail("%d chats; the client received %r, the chat recorded %r" % (len(r.chats), got, turns))
    reward(r.chats[0], 1.0)
    train(r.chats[0])
    log(exact = 1.0, turns = len(turns))
'''
    config = f'''
policies:
  - name: p
    hf_checkpoint: {model_dirs["tiny-qwen3"]}
    engine: {{kind: torch, python: {sys.executable!r}, device: cpu, args: [--max-seq-len, "2048"]}}
    train: {{lr: 1.0e-3, global_batch_size: 0}}
rollout: {{batch_size: 1, max_response_len: 8, max_failed_fraction: 0}}
data: {{path: synthetic:arith}}
'''
    step = run_exec(slimen, tmp_path, script, config)
    assert step.get("exact") == 1.0 and step.get("turns") == 3, step


# openai-agents with its defaults (the Responses API, POST /v1/responses) as agent()'s program: a
# function tool the scripted policy calls, the tool's result sent back, the final answer; run()
# and run_streamed(); and an output_type, which needs structured output.
AGENTS_PROGRAM = r'''
import asyncio, json, os, sys
from pydantic import BaseModel
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_tracing_disabled

set_tracing_disabled(True)  # no traces sent anywhere
mode = sys.argv[1]
if len(sys.argv) > 2:
    set_default_openai_api(sys.argv[2])  # "chat_completions"; the default is the Responses API
called = []

@function_tool
def multiply(a: int, b: int) -> int:
    """Multiplies two integers."""
    called.append([a, b])
    return a * b

class Answer(BaseModel):
    value: int

agent = Agent(name="calc", instructions="Use the tools.", tools=[multiply], model=os.environ["OPENAI_MODEL"],
              model_settings=ModelSettings(max_tokens=256), output_type=Answer if mode == "output_type" else None)

async def main():
    q = sys.stdin.read()
    if mode == "streamed":
        r = Runner.run_streamed(agent, q)
        kinds = [e.item.type async for e in r.stream_events() if e.type == "run_item_stream_event"]
    else:
        r = await Runner.run(agent, q)
        kinds = [i.type for i in r.new_items]
    print(json.dumps({"called": called, "kinds": kinds, "output": str(r.final_output)}))

try:
    asyncio.run(main())
except Exception as e:  # what the client raised, for the script to check
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
'''

# The policy: a call of multiply until the conversation holds the tool's result, then the answer.
TOOL_POLICY = r'''
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'

def respond(prompt, i):
    return "It is %s." % prompt if prompt.isdigit() else CALL
'''


def agents_test(slimen, tmp_path, args, check, program=AGENTS_PROGRAM):
    """Runs AGENTS_PROGRAM with args under agent() on the scripted TOOL_POLICY (`slimen test`);
    check is Starlark run in the rollout, reading `got` (what the program printed), `r` (agent()'s
    result) and `turns` (the recorded turns, all trained)."""
    (tmp_path / "program.py").write_text(program)
    check = "\n".join("    " + line for line in check.strip().splitlines())
    (tmp_path / "agents_test.star").write_text(CHECK + TOOL_POLICY + f'''
def rollout(task):
    r = agent(["python3", "program.py"] + {list(args)!r}, task.prompt, policy = "p", tools_prompt = "system",
              timeout = 120, call_max_tokens = 256)
    got = decode(r.output)
    check_exact(r.chats)
    turns = 0
    for c in r.chats:
        turns += len(c.turns)
        reward(c, 1.0 if "408" in got.get("output", "") else 0.0)
        train(c)
{check}
    log(calls = r.calls, turns = turns)

def test_agents():
    out = simulate(rollout, task = {{"prompt": "What is 12 times 34?"}}, responses = {{"p": respond}})
    assert.eq(len(out.samples.get("p", [])), len([s for s in out.samples.get("p", []) if s.reward == 1.0]))
''')
    p = subprocess.run([str(slimen), "test", str(tmp_path / "agents_test.star")], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "1 passed, 0 failed" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("args", [["run"], ["streamed"], ["run", "chat_completions"], ["streamed", "chat_completions"]],
                         ids=["responses", "responses-streamed", "chat-completions", "chat-completions-streamed"])
def test_openai_agents_tool_loop(slimen, tmp_path, args):
    """openai-agents runs its loop against agent()'s endpoint: the policy's call reaches the
    function tool with its arguments, the tool's result goes back, the policy's answer ends the
    run; both calls are recorded with the tokens the policy sampled and trained."""
    agents_test(slimen, tmp_path, args, '''
assert.eq(got.get("message"), None)
assert.eq(got["called"], [[12, 34]])
assert.eq(got["kinds"], ["tool_call_item", "tool_call_output_item", "message_output_item"])
assert.eq(got["output"], "It is 408.")
assert.eq(r.calls, 2)
assert.eq(turns, 2)
''')


def test_openai_agents_output_type(slimen, tmp_path):
    """An output_type asks for structured output (text.format json_schema): the endpoint refuses
    it with a 400 naming the field, which the client raises; it is never ignored."""
    agents_test(slimen, tmp_path, ["output_type"], '''
assert.eq(got["error"], "BadRequestError")
assert.true("text.format" in got["message"], got["message"])
assert.eq(len(r.chats), 0)  # nothing recorded, nothing trained
''')


# langchain-openai's ChatOpenAI as agent()'s program: bind_tools (invoked and streamed), the tool's
# result sent back as a ToolMessage, and with_structured_output.
LANGCHAIN_PROGRAM = r'''
import json, os, sys
import openai
os.environ["LANGSMITH_TRACING"] = os.environ["LANGCHAIN_TRACING_V2"] = "false"  # nothing sent to LangSmith
from pydantic import BaseModel
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

mode, api = sys.argv[1], sys.argv[2]

@tool
def multiply(a: int, b: int) -> int:
    """Multiplies two integers."""
    return a * b

class Answer(BaseModel):
    """The answer."""
    value: int

llm = ChatOpenAI(model=os.environ["OPENAI_MODEL"], max_tokens=256, max_retries=0, use_responses_api=api == "responses")
messages = [HumanMessage(sys.stdin.read())]
try:
    if mode in ("json_schema", "function_calling"):
        out = {"output": repr(llm.with_structured_output(Answer, method=mode).invoke(messages))}
    else:
        bound = llm.bind_tools([multiply])
        if mode == "stream":
            chunks = list(bound.stream(messages))
            msg = chunks[0]
            for c in chunks[1:]:
                msg = msg + c
            out = {"chunks": len(chunks)}
        else:
            msg, out = bound.invoke(messages), {}
        (call,) = msg.tool_calls
        messages += [msg, ToolMessage(str(multiply.invoke(call["args"])), tool_call_id=call["id"])]
        answer = "".join(c.text for c in bound.stream(messages)) if mode == "stream" else bound.invoke(messages).text
        out.update(call=[call["name"], call["args"]], output=answer)
except Exception as e:  # what the client raised (langchain's subclass of the 400's), for the script to check
    out = {"error": "BadRequestError" if isinstance(e, openai.BadRequestError) else type(e).__name__, "message": str(e)}
print(json.dumps(out))
'''


@pytest.mark.parametrize("mode", ["invoke", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_tools(slimen, tmp_path, mode, api):
    """ChatOpenAI.bind_tools against agent()'s endpoint, on the chat completions and the
    Responses API, invoked and streamed: the policy's call arrives as the message's tool_calls
    (streamed: as chunks that add up to it), the ToolMessage goes back, the answer is the text."""
    agents_test(slimen, tmp_path, [mode, api], '''
assert.eq(got.get("message"), None)
assert.eq(got["call"], ["multiply", {"a": 12, "b": 34}])
assert.eq(got["output"], "It is 408.")
assert.eq(r.calls, 2)
assert.eq(turns, 2)
''' + ('assert.true(got["chunks"] > 1)\n' if mode == "stream" else ""), program=LANGCHAIN_PROGRAM)


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(slimen, tmp_path, api, method):
    """with_structured_output asks for structured output: by its default method (json_schema) as
    response_format (text.format on the Responses API); by function_calling as a forced call of
    the schema's tool with parallel_tool_calls false. Where the engine cannot constrain its
    decoding (this scripted policy) the endpoint refuses either with a 400 naming the field, which
    the client raises; it never ignores it."""
    field = {"json_schema": "response_format" if api == "chat" else "text.format",
             "function_calling": "parallel_tool_calls"}[method]
    agents_test(slimen, tmp_path, [method, api], f'''
assert.eq(got["error"], "BadRequestError")
assert.true({field!r} in got["message"], got["message"])
assert.eq(len(r.chats), 0)  # nothing recorded, nothing trained
''', program=LANGCHAIN_PROGRAM)
