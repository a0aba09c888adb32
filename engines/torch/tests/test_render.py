"""The worker's Render (a conversation's turns, engines.Renderer): the chat template applied to
messages and tools as transformers' apply_chat_template applies it, for a Qwen-style template that
drops the reasoning of earlier assistant turns, and over gRPC."""

import json
import shutil

import grpc
import pytest

from slimen_torch.engine import Engine, Options
from slimen_torch.proto import engine_pb2 as pb
from slimen_torch.proto import engine_pb2_grpc as pb_grpc
from slimen_torch.server import make_server

# A Qwen3-style template written for this test: tool schemas in a system block, tool results in
# user blocks, the <think> part of assistant turns before the last user query dropped, and an
# empty think block added to the last assistant turn when it has none.
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{% set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last and (loop.last or reasoning) %}"
    "<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content }}"
    "{%- else %}<|im_start|>assistant\n{{ content }}{% endif %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluates arithmetic.",
                                              "parameters": {"type": "object", "properties": {
                                                  "expr": {"type": "string"}}}}}]

CONVERSATION = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "<think>\nuse the tool\n</think>\n\n<tool_call>\n"
                                     "{\"name\": \"calc\", \"arguments\": {\"expr\": \"12*34\"}}\n</tool_call>"},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "<think>\nthe tool says 408\n</think>\n\n408"},
    {"role": "user", "content": "And 408 + 1?"},
]


@pytest.fixture(scope="module")
def qwen_style(model_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwenstyle") / "m"
    shutil.copytree(model_dirs["tiny-qwen3"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_STYLE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    e = Engine(str(d), Options(device="cpu"))
    yield d, e
    e.close()


def test_render_matches_transformers(qwen_style):
    transformers = pytest.importorskip("transformers")
    d, eng = qwen_style
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    cases = []
    for k in range(2, len(CONVERSATION) + 1):
        for tools in (None, TOOLS):
            for gen in (False, True):
                cases.append((CONVERSATION[:k], tools, gen))
    got = eng.render([(msgs, [json.dumps(t) for t in (tools or [])], gen) for msgs, tools, gen in cases])
    for (msgs, tools, gen), ids in zip(cases, got):
        want = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=True)
        if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
            want = want["input_ids"]
        assert ids == list(want), (len(msgs), tools is not None, gen)


def test_render_strips_earlier_reasoning(qwen_style):
    # The template the chat's token bookkeeping exists for: once a new user query follows, the
    # earlier turns render without their reasoning, so a re-rendered history is not a prefix
    # of the conversation the model sampled.
    _, eng = qwen_style
    before, after = eng.render([(CONVERSATION[:5], [], False), (CONVERSATION, [], True)])
    assert after[:len(before)] != before
    text = eng.tokenizer.decode(after)
    assert "use the tool" not in text and "the tool says 408" not in text


def test_render_over_grpc(qwen_style):
    _, eng = qwen_style
    server, service, port = make_server("127.0.0.1:0")
    service.engine, service.loading = eng, False
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.EngineStub(channel)
        req = pb.RenderBatchRequest(requests=[
            pb.RenderRequest(messages=[pb.Message(role=m["role"], content=m["content"]) for m in CONVERSATION],
                             tools=[json.dumps(t) for t in TOOLS], add_generation_prompt=True),
            pb.RenderRequest(messages=[pb.Message(role="user", content="hi")])])
        got = stub.Render(req)
        want = eng.render([(CONVERSATION, [json.dumps(t) for t in TOOLS], True),
                           ([{"role": "user", "content": "hi"}], [], False)])
        assert [list(t.ids) for t in got.tokens] == want
        with pytest.raises(grpc.RpcError) as e:
            stub.Render(pb.RenderBatchRequest(requests=[pb.RenderRequest(
                messages=[pb.Message(role="user", content="hi")], tools=["{not json"])]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        server.stop(0).wait()


def test_render_errors_name_the_request(qwen_style):
    _, eng = qwen_style
    with pytest.raises(Exception) as e:
        eng.render([(CONVERSATION[:2], [], True), (CONVERSATION[:2], ["{not json"], True)])
    assert "render request 1" in str(e.value)
