"""sft.py on the host's chat corpus: its lines tokenize as the Go tiny engine trains on them, the
schedule and batching options, the held-out exact match, and a model it trains loads in the Go
engine with the same log-probs."""

import json
import random
import re
import subprocess
import types

import pytest
import torch

from slimen_torch import sft
from slimen_torch.__main__ import main
from slimen_torch.engine import Engine
from slimen_torch.make_model import like_config, make_like
from slimen_torch.tokenizer import Tokenizer
from slimen_torch.types import ScoreRequest

from conftest import REPO

TINY_CHAT = REPO / "engines" / "tiny" / "builtin" / "tiny-chat"
EOS = json.loads((TINY_CHAT / "config.json").read_text())["eos_token_id"]  # its <|im_end|>


def export(slimen, out, *args):
    subprocess.run([str(slimen), "export", "--task", "synthetic:chat", "--out", str(out), *args],
                   cwd=REPO, check=True, capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_chat_export_tokenizes_as_the_go_engine_trains(slimen, tmp_path):
    """For exported chat lines (tools, tool calls and results, memory chunks), the ids sft.py
    trains on are the ids `slimen export --token-ids` says the tiny engine trains on."""
    data = tmp_path / "chat.jsonl"
    rows = export(slimen, data, "--n", "1100", "--seed", "5", "--token-ids", str(TINY_CHAT))
    # The pairs `sft --data` trains on: the tools are in the prompt, rendered as Go renders them.
    pairs = sft.read_pairs(str(data), types.SimpleNamespace(tokenizer=Tokenizer(TINY_CHAT), eos=[EOS]))
    for r, (prompt, response) in zip(rows[:60], pairs):
        assert (prompt, response) == (r["prompt_ids"], r["response_ids"]), r["prompt"]
    # Two forked processes tokenize the two chunks of 1000 lines and fewer.
    examples = sft.read_examples(str(data), Tokenizer(TINY_CHAT), EOS, workers=2)
    assert len(examples) == len(rows) == 1100
    assert {r["kind"] for r in rows} >= {"calc", "orchestra", "planner", "memory"}
    assert any("tools" in r for r in rows) and any(m["role"] == "tool" for r in rows for m in r["prompt"])
    for r, e in zip(rows, examples):
        assert e.prompt == r["prompt_ids"], r["prompt"]
        assert e.response == r["response_ids"], r["response"]
        assert (e.kind, e.right, e.text) == (r["kind"], r["right"], r["response"])
    # The same lines with only their ids (no text to render: what a pretraining run on a GPU
    # sends instead of tokenizing there) give the same examples.
    ids_only = tmp_path / "ids.jsonl"
    ids_only.write_text("".join(json.dumps({k: r[k] for k in ("prompt_ids", "response_ids", "kind", "right")}) + "\n"
                                for r in rows[:50]))
    for r, e in zip(rows, sft.read_examples(str(ids_only), None, EOS)):
        assert (e.prompt, e.response, e.kind, e.right) == (r["prompt_ids"], r["response_ids"], r["kind"], r["right"])


def test_read_examples_forms_and_errors(tmp_path):
    tok = Tokenizer(TINY_CHAT)
    schema = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+1?", "label": "2"},
        {"messages": [{"role": "user", "content": "2+2?"}], "tools": [json.dumps(schema)],
         "response": "4"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "tools": [schema], "response": "4",
         "kind": "calc", "right": False},
    ]) + "\n")
    a, b, c = sft.read_examples(str(good), tok, EOS)
    assert a.text == "\\boxed{2}" and a.right and a.kind == ""
    assert b.prompt == c.prompt == tok.encode_chat([{"role": "user", "content": "2+2?"}], tools=[schema])
    assert b.prompt != tok.encode_chat([{"role": "user", "content": "2+2?"}])  # the tools are in it
    assert (c.kind, c.right) == ("calc", False)
    for row, want in [({"prompt": "x", "tools": {"a": 1}, "response": "y"}, "list of JSON tool schemas"),
                      ({"prompt": "x", "tools": ["{bad"], "response": "y"}, "tool 0 is a string but not JSON"),
                      ({"prompt": "x", "tools": [3], "response": "y"}, "tool 0 must be a JSON object"),
                      ({"prompt": [{"content": "x"}], "response": "y"}, "list of messages"),
                      ({"prompt": "x", "messages": [], "response": "y"}, "not both"),
                      ({"prompt": "x", "response": "y", "right": "yes"}, "true or false"),
                      ({"prompt": "x"}, "needs \"response\""),
                      ({"prompt_ids": [1, 2]}, "response_ids\" must be a non-empty list"),
                      ({"prompt_ids": [1, "a"], "response_ids": [3]}, "prompt_ids\" must be a non-empty list"),
                      ({"prompt_ids": [1], "response_ids": [3], "right": 1}, "true or false")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "ok", "response": "ok"}\n' + json.dumps(row) + "\n")
        with pytest.raises(SystemExit, match=f"bad.jsonl:2: .*{re.escape(want)}"):
            sft.read_examples(str(bad), tok, EOS)


def test_lr_schedule():
    lr = lambda step, decay, progress=0.0: sft.lr_at(step, 100, 1.0, 10, decay, 0.1, progress)
    assert lr(5, "cosine") == pytest.approx(0.5) and lr(10, "linear") == pytest.approx(1.0)
    assert lr(60, "constant") == 1.0 and lr(100, "constant") == 1.0
    assert lr(55, "linear") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr(55, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr(100, "linear") == pytest.approx(0.1) and lr(100, "cosine") == pytest.approx(0.1)
    assert lr(32.5, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 2 ** -0.5))
    # A time budget three quarters spent at a quarter of the steps: the fall follows the time.
    assert lr(32.5, "linear", 0.75) == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr(20, "linear", 2.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        lr(50, "step")


def test_batches_by_examples_and_by_tokens():
    exs = [sft.Example([1] * n, [2], "") for n in (3, 9, 5, 1, 7)]
    it = sft.batches(exs, random.Random(0), 2, 0)
    first = [next(it) for _ in range(5)]
    assert all(len(b) == 2 for b in first)
    assert sorted(i for b in first[:2] for i in b) + [first[2][0]] != []  # epochs in fresh orders
    assert sorted(first[0] + first[1] + first[2][:1]) == [0, 1, 2, 3, 4]
    it = sft.batches(exs, random.Random(0), 2, 12)
    for _ in range(20):
        b = next(it)
        size = sum(len(exs[i].prompt) + len(exs[i].response) for i in b)
        assert size <= 12 or len(b) == 1


def test_evaluate_scores_right_lines_per_kind():
    """evaluate compares greedy answers with the right lines' responses, per kind; lines not
    marked right are not scored."""
    tok = Tokenizer(TINY_CHAT)
    exs = [sft.Example([1, 2], [], "\\boxed{7}", "calc", True),
           sft.Example([1, 3], [], " \\boxed{8}", "calc", True),
           sft.Example([1, 4], [], "Cy's room is 55.", "memory", True),
           sft.Example([1, 5], [], "\\boxed{1}", "memory", False)]
    answers = {2: "\\boxed{7}\n", 3: "\\boxed{9}", 4: "Cy's room is 55.", 5: "\\boxed{1}"}
    seen = []

    def generate(reqs):
        seen.extend(reqs)
        return [types.SimpleNamespace(tokens=tok.encode(answers[r.prompt_tokens[1]]) + [EOS])
                for r in reqs]

    engine = types.SimpleNamespace(tokenizer=tok, eos=[EOS], generate=generate)
    acc, sample = sft.evaluate(engine, exs, 12)
    assert len(seen) == 3 and all(r.sampling.temperature == 0 and r.sampling.max_tokens == 12 for r in seen)
    assert acc == {"all": pytest.approx(2 / 3), "calc": 0.5, "memory": 1.0}
    line = sft.eval_line(4, "held.jsonl", acc, 3)
    assert line == ("step 4: held-out held.jsonl, greedy answers equal to the right ones: 66.7% of 3 "
                    "(calc 50.0%, memory 100.0%)")


def test_make_like_tiny_chat(tmp_path):
    raw = like_config(TINY_CHAT, hidden=128, layers=3)
    base = json.loads((TINY_CHAT / "config.json").read_text())
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["head_dim"], raw["intermediate_size"]) == (128, 3, 32, 384)
    for k in ("vocab_size", "eos_token_id", "pad_token_id", "rope_parameters", "rms_norm_eps", "architectures"):
        assert raw[k] == base[k], k
    q = like_config(TINY_CHAT, "qwen3-50m", layers=11)
    assert q["architectures"] == ["Qwen3ForCausalLM"] and q["vocab_size"] == base["vocab_size"]
    assert q["eos_token_id"] == base["eos_token_id"] and q["num_hidden_layers"] == 11
    with pytest.raises(ValueError, match="--layers 0"):
        like_config(TINY_CHAT, layers=0)
    with pytest.raises(ValueError, match="no readable config.json"):
        like_config(tmp_path)
    out = make_like(TINY_CHAT, tmp_path / "m", seed=3, positions=1024)
    assert (out / "tokenizer.json").read_bytes() == (TINY_CHAT / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 1024
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 1024


def test_sft_on_chat_then_go_engine_gives_the_same_logprobs(slimen, tmp_path, capsys):
    """Pretraining with the torch worker: a small model of tiny-chat's form (make-model --like) is
    trained a few steps on exported chat lines with tools, held-out lines are scored, and the saved
    folder loads in the Go tiny engine, whose log-probs of those lines equal the torch engine's."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    export(slimen, train, "--n", "40")
    rows = export(slimen, held, "--n", "6", "--seed", "1001")
    model, out = tmp_path / "m", tmp_path / "out"
    main(["make-model", "--like", str(TINY_CHAT), "--hidden", "32", "--layers", "1", "--seed", "2",
          "--out", str(model)])
    main(["sft", "--model", str(model), "--data", str(train), "--out", str(out), "--steps", "4",
          "--batch-tokens", "3000", "--lr", "3e-3", "--warmup", "1", "--decay", "cosine",
          "--eval-data", str(held), "--eval-max-tokens", "8", "--device", "cpu",
          "--compile-train", "off"])
    printed = capsys.readouterr().out
    n_right = sum(r["right"] for r in rows)
    assert re.search(rf"^step 4: held-out {re.escape(str(held))}, greedy answers equal to the right "
                     rf"ones: [0-9.]+% of {n_right}", printed, re.M), printed
    assert (out / "model.safetensors").exists()
    assert (out / "tokenizer.json").read_bytes() == (TINY_CHAT / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    # The held-out lines in the Go pretrain's corpus form, scored by both engines.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"messages": r["prompt"], "tools": r.get("tools", []),
                                          "response": r["response"]}) + "\n" for r in rows))
    go = subprocess.run([str(slimen), "pretrain", "--init", str(out), "--corpus", str(corpus),
                         "--eval-only", "--eval-n", "0"], cwd=REPO, check=True,
                        capture_output=True, text=True).stdout
    got = [(int(n), float(lp)) for n, lp in
           re.findall(r"line \d+: (\d+) response tokens, log-prob (-?[0-9.]+)", go)]
    e = Engine(str(out))
    try:
        exs = sft.read_examples(str(held), e.tokenizer, e.eos[0])
        lps = e.score([ScoreRequest(prompt_tokens=x.prompt, tokens=x.response) for x in exs])
    finally:
        e.close()
    assert len(got) == len(exs) == 6, go
    trained = False
    for (n, go_lp), x, lp in zip(got, exs, lps):
        assert n == len(x.response)
        assert go_lp == pytest.approx(sum(lp), abs=1e-4), go
        trained |= abs(go_lp / n + 6.686) > 0.05  # ln 801: the random model's loss per token
    assert trained
    # The chat corpus's own held-out evaluation runs on the folder as well.
    go = subprocess.run([str(slimen), "pretrain", "--init", str(out), "--task", "synthetic:chat",
                         "--eval-only", "--eval-n", "3"], cwd=REPO, check=True,
                        capture_output=True, text=True).stdout
    assert "step 0: held-out chat corpus, greedy answers equal to the right ones:" in go


def test_held_out_exact_match_equals_go_chat_eval(slimen, tmp_path):
    """sft's held-out score of builtin:tiny-chat on exported held-out lines is the Go engine's
    ChatEval on the same examples (its first right examples of the seed), kind by kind."""
    held = tmp_path / "held.jsonl"
    rows = export(slimen, held, "--n", "24", "--seed", "1001")
    n = sum(r["right"] for r in rows)
    e = Engine(str(TINY_CHAT))
    try:
        acc, _ = sft.evaluate(e, sft.read_examples(str(held), e.tokenizer, e.eos[0]), 96)
    finally:
        e.close()
    go = subprocess.run([str(slimen), "pretrain", "--init", str(TINY_CHAT), "--task", "synthetic:chat",
                         "--seed", "1", "--eval-only", "--eval-n", str(n)], cwd=REPO, check=True,
                        capture_output=True, text=True).stdout
    m = re.search(r"equal to the right ones: ([0-9.]+)% \((.*)\)", go)
    assert m, go
    assert float(m.group(1)) == pytest.approx(100 * acc["all"], abs=0.05), (go, acc)
    assert 0 < acc["all"] < 1  # some right, some not: a comparison that can fail
    for kind, pct in re.findall(r"(\w+) ([0-9.]+)%", m.group(2)):
        if kind in acc:
            assert float(pct) == pytest.approx(100 * acc[kind], abs=0.05), (kind, go, acc)
