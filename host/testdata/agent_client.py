"""A stand-in agent for host/agent_test.go: a chat-completions client on the standard library
only (urllib), so the Go tests need nothing but python3. The tests against the official openai
package and an agent framework are engines/torch/tests/test_agent_frameworks.py."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


def call(messages, stream=False, **extra):
    body = dict(model="anything", messages=messages, return_token_ids=True, stream=stream, **extra)
    req = urllib.request.Request(BASE + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        if not stream:
            return json.load(r)["choices"][0]
        # Server-sent events: the deltas of choice 0, put together.
        msg, ids, finish = {"role": "assistant", "content": ""}, [], None
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"]
            if not ch:
                continue
            d = ch[0].get("delta") or {}
            msg["content"] += d.get("content") or ""
            if d.get("tool_calls"):
                msg["tool_calls"] = d["tool_calls"]
            ids += ch[0].get("token_ids") or []
            finish = ch[0].get("finish_reason") or finish
        return {"message": msg, "token_ids": ids, "finish_reason": finish}


def respond(body):
    """POST /v1/responses; a streamed answer is read from its events to response.completed."""
    req = urllib.request.Request(BASE + "/responses", data=json.dumps(dict(model="anything", **body)).encode(),
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        if not body.get("stream"):
            return json.load(r)
        events = [json.loads(line[6:]) for line in (raw.decode().strip() for raw in r) if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), events
        assert events[-1]["type"] == "response.completed", events
        return events[-1]["response"]


def main():
    mode = sys.argv[1]
    task = sys.stdin.read()
    assert task == os.environ["SLIMEN_TASK_INPUT"], "stdin and $SLIMEN_TASK_INPUT differ"
    if mode == "turns":  # three calls, each sending the whole history back; the last one streamed
        msgs = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": task}]
        got = []
        for i, stream in enumerate([False, False, True]):
            ch = call(msgs, stream=stream, max_tokens=8)
            got.append(ch["token_ids"])
            msgs.append({"role": "assistant", "content": ch["message"]["content"]})
            msgs.append({"role": "user", "content": "And then %d?" % i})
        print(json.dumps(got))
    elif mode == "tools":  # the scripted policy calls calc, gets its result and answers
        msgs = [{"role": "user", "content": task}]
        ch = call(msgs, tools=TOOLS)
        assert ch["finish_reason"] == "tool_calls", ch
        m = ch["message"]
        tc = m["tool_calls"][0]
        args = json.loads(tc["function"]["arguments"])
        msgs.append({"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]})
        msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": str(eval(args["expr"]))})
        ch = call(msgs, tools=TOOLS, stream=True)
        print(ch["message"]["content"])
    elif mode == "responses":  # the tools mode through the Responses API, as openai-agents calls it
        tools = [dict(type="function", **TOOLS[0]["function"])]
        items = [{"role": "user", "content": [{"type": "input_text", "text": task}]}]
        r = respond(dict(input=items, tools=tools, max_output_tokens=100))
        calls = [o for o in r["output"] if o["type"] == "function_call"]
        assert r["status"] == "completed" and len(calls) == 1, r
        items += r["output"]  # the items as they came, sent back
        args = json.loads(calls[0]["arguments"])
        items.append({"type": "function_call_output", "call_id": calls[0]["call_id"], "output": str(eval(args["expr"]))})
        r = respond(dict(input=items, tools=tools, stream=True))
        print("".join(c["text"] for o in r["output"] if o["type"] == "message" for c in o["content"]))
    elif mode == "branch":  # the same first turn asked twice: two conversations
        msgs = [{"role": "user", "content": task}]
        a = call(msgs, max_tokens=4)
        b = call(msgs, max_tokens=4)
        print(json.dumps([a["token_ids"], b["token_ids"]]))
    elif mode == "bench":  # calls in conversations of 8 turns, each sending its history back
        calls = int(sys.argv[2])
        msgs = []
        for i in range(calls):
            if i % 8 == 0:
                msgs = [{"role": "user", "content": task}]
            ch = call(msgs, max_tokens=4)
            msgs += [{"role": "assistant", "content": ch["message"]["content"]}, {"role": "user", "content": "more"}]
            if len(sys.argv) > 3:
                time.sleep(float(sys.argv[3]))  # the agent's own work between calls (a tool, say)
        print(calls)
    elif mode == "parallel":  # four conversations at once, two calls each
        import threading

        def talk(k):
            msgs = [{"role": "user", "content": "%s %d" % (task, k)}]
            ch = call(msgs, max_tokens=4)
            msgs += [{"role": "assistant", "content": ch["message"]["content"]}, {"role": "user", "content": "more"}]
            call(msgs, max_tokens=4)

        threads = [threading.Thread(target=talk, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("done")
    elif mode == "crash":
        call([{"role": "user", "content": task}], max_tokens=2)
        sys.stderr.write("something broke\n")
        sys.exit(3)
    elif mode == "hang":
        time.sleep(600)
    elif mode == "flood":
        while True:
            try:
                call([{"role": "user", "content": task}], max_tokens=2)
            except urllib.error.HTTPError as e:
                print(e.code, flush=True)
                time.sleep(600)
    elif mode == "overflow":  # a call past the policy's context, then a short one: the rollout goes on
        out = {"long": refused([{"role": "user", "content": "1+" * 400}])}
        out["short"] = call([{"role": "user", "content": task}], max_tokens=4)["finish_reason"]
        print(json.dumps(out))
    elif mode == "required":  # tool_choice "required": the answer makes the call
        c = call([{"role": "user", "content": task}], tools=TOOLS, tool_choice="required")
        print(json.dumps([c["finish_reason"], [t["function"]["name"] for t in c["message"].get("tool_calls") or []]]))
    elif mode == "constrained":  # response_format and tool_choice kept by constrained decoding
        user = [{"role": "user", "content": task}]
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}
        a = call(user, response_format={"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}, max_tokens=120)
        # The tool's schema is rendered into the system prompt: a short one leaves room in the
        # model's 512 tokens.
        pick = [{"type": "function", "function": {"name": "go", "parameters": {"type": "object", "additionalProperties": False}}}]
        b = call(user, tools=pick, tool_choice="required", parallel_tool_calls=False, max_tokens=160)
        calls = [[t["function"]["name"], sorted(json.loads(t["function"]["arguments"]))] for t in b["message"].get("tool_calls") or []]
        print(json.dumps([a["finish_reason"], sorted(json.loads(a["message"]["content"])), b["finish_reason"], calls]))
    elif mode == "api":  # what the endpoint names, refuses and accepts
        req = urllib.request.Request(BASE + "/models", headers={"Authorization": "bearer " + KEY})
        with urllib.request.urlopen(req) as r:
            out = {"models": [m["id"] for m in json.load(r)["data"]], "model_env": os.environ["OPENAI_MODEL"]}
        user = [{"role": "user", "content": task}]
        # The embedded engine constrains decoding: a required call cut by max_tokens is answered
        # cut (finish_reason "length"), as one call a turn and JSON are.
        out["required"] = refused(user, tools=TOOLS, tool_choice="required", max_tokens=4)
        out["parallel"] = refused(user, tools=TOOLS, parallel_tool_calls=False, max_tokens=4)
        out["json"] = refused(user, response_format={"type": "json_object"}, max_tokens=4)
        out["robot"] = refused([{"role": "robot", "content": task}])
        out["developer"] = refused([{"role": "developer", "content": "Be brief."}] + user, tools=TOOLS, tool_choice="none", max_tokens=4)
        print(json.dumps(out))


def refused(messages, **extra):
    """The status, param and code of a refused call, or "answered"."""
    try:
        call(messages, **extra)
        return "answered"
    except urllib.error.HTTPError as e:
        err = json.load(e)["error"]
        return [e.code, err["param"], err["code"]]


main()
