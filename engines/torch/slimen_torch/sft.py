"""Supervised training of a model on prompt/response pairs: a warm-up before RL (so rewards are not
all 0), or the pretraining of a small chat model on the host's synthetic chat corpus.

`python -m slimen_torch sft --model DIR --data FILE.jsonl [--out DIR]` reads one JSON object per
line:

    {"prompt": "Ann has 3 pens and gets 2 more. How many pens?", "response": "\\boxed{5}"}
    {"prompt": [{"role": "user", "content": "..."}], "label": "5"}
    {"prompt": [{"role": "system", ...}, {"role": "user", ...}],
     "tools": [{"type": "function", ...}], "response": "<tool_call>...</tool_call>",
     "kind": "calc", "right": true}

`prompt` is one user turn (a string) or a message list ("messages" is read as well), rendered with
the model's chat template and its generation prompt; `tools`, JSON tool schemas (objects, or
strings holding one), go to the template as its `tools`, which Qwen3's form renders into the
system turn. The target is `response`, or `\\boxed{label}` when only a label is given (the format of
the host's synthetic:arith export), followed by the end-of-sequence token. The chat corpus lines
(`slimen export --task synthetic:chat`) tokenize exactly as the Go tiny engine trains on them.

A step takes --batch-size examples, or with --batch-tokens examples up to that many prompt and
response tokens. The loss is the token-mean negative log-likelihood of the targets. The learning
rate warms up linearly over --warmup steps, then stays (--decay constant) or falls to --min-lr
(linear or cosine) by the last step, or by --max-seconds when that comes first. --max-seconds ends
the run after the step that crosses it. --eval-data FILE scores held-out lines of the same form:
the greedy answer (--eval-max-tokens) of each line marked right (or with no "right"), compared with
its response after stripping whitespace, per "kind", as the host's ChatEval does. The result is
saved as a model folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import os
import random
import time

from .engine import Engine, Options
from .tokenizer import Tokenizer
from .types import GenerateRequest, LossConfig, Sampling

log = logging.getLogger("slimen_torch")

# The parts of the host's chat corpus, in the order its ChatEval prints them.
KINDS = ("calc", "orchestra", "planner", "verifier", "memory", "arith")


@dataclasses.dataclass
class Example:
    prompt: list[int]
    response: list[int]  # the target, ended by EOS
    text: str  # the response as text
    kind: str = ""
    right: bool = True


def read_examples(path: str, tokenizer, eos: int | None, workers: int = 1) -> list[Example]:
    """The lines of a JSONL file, tokenized as a training pair; errors name the file and line.
    With workers > 1 a long file is tokenized by that many forked processes (the chat template
    and the tokenizer take a millisecond or two a line)."""
    rows = []  # (where, prompt, tools, Example without its ids)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{where}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{where}: want a JSON object")
            if "prompt_ids" in row or "response_ids" in row:
                rows.append((where, None, None, _given_ids(row, where)))
                continue
            if "prompt" in row and "messages" in row:
                raise SystemExit(f"{where}: give \"prompt\" or \"messages\", not both")
            prompt = row.get("prompt", row.get("messages"))
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(m, dict) and "role" in m for m in prompt)):
                raise SystemExit(f"{where}: \"prompt\" must be a string or a list of messages "
                                 "({\"role\": …, \"content\": …})")
            tools = row.get("tools") or None
            if tools is not None:
                if not isinstance(tools, list):
                    raise SystemExit(f"{where}: \"tools\" must be a list of JSON tool schemas")
                tools = [_schema(t, f"{where}: tool {k}") for k, t in enumerate(tools)]
            if "response" in row:
                response = str(row["response"])
            elif "label" in row:
                response = "\\boxed{" + str(row["label"]) + "}"
            else:
                raise SystemExit(f"{where}: needs \"response\" or \"label\"")
            rows.append((where, prompt, tools, Example([], [], response, *_kind_right(row, where))))
    if not rows:
        raise SystemExit(f"{path}: no examples")
    todo = [r for r in rows if r[1] is not None]  # the rest came with their ids
    work = [(p, t, e.text) for _, p, t, e in todo]
    chunks = [work[i:i + 1000] for i in range(0, len(work), 1000)]
    if workers > 1 and len(chunks) > 1:
        global _pool_tokenizer
        _pool_tokenizer = tokenizer
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(chunks))) as pool:
                done = [r for chunk in pool.map(_encode_chunk, chunks) for r in chunk]
        finally:
            _pool_tokenizer = None
    else:
        done = _encode(work, tokenizer)
    for (where, _, _, ex), ids in zip(todo, done):
        if isinstance(ids, str):  # a template error: the line, not a traceback
            raise SystemExit(f"{where}: the chat template failed: {ids}")
        ex.prompt, ex.response = ids[0], ids[1] + ([eos] if eos is not None else [])
    return [ex for _, _, _, ex in rows]


_pool_tokenizer = None  # the tokenizer the forked processes of read_examples use


def _given_ids(row: dict, where: str) -> Example:
    """A line that brings its token ids (`slimen export --token-ids`: the prompt rendered with its
    tools, the response followed by the end-of-sequence token) trains on them as they are: no
    template or tokenizer pass, a millisecond or two a line saved."""
    ids = []
    for key in ("prompt_ids", "response_ids"):
        v = row.get(key)
        if not (isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v)):
            raise SystemExit(f"{where}: \"{key}\" must be a non-empty list of token ids "
                             "(give both prompt_ids and response_ids, or neither)")
        ids.append(v)
    return Example(ids[0], ids[1], str(row.get("response", "")), *_kind_right(row, where))


def _kind_right(row: dict, where: str) -> tuple[str, bool]:
    """A line's kind ("" when absent) and whether its response is a right one (default true)."""
    right = row.get("right", True)
    if not isinstance(right, bool):
        raise SystemExit(f"{where}: \"right\" must be true or false")
    return str(row.get("kind", "")), right


def _encode_chunk(work):
    return _encode(work, _pool_tokenizer)


def _encode(work, tokenizer) -> list:
    """(prompt ids, response ids) of each (messages, tools, response), or the error's message."""
    out = []
    for prompt, tools, response in work:
        try:
            out.append((tokenizer.encode_chat(prompt, tools=tools), tokenizer.encode(response)))
        except Exception as e:
            out.append(str(e) or type(e).__name__)
    return out


def _schema(t, where: str) -> dict:
    if isinstance(t, str):
        try:
            t = json.loads(t)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where} is a string but not JSON: {e}") from None
    if not isinstance(t, dict):
        raise SystemExit(f"{where} must be a JSON object (a tool schema)")
    return t


def read_pairs(path: str, engine: Engine) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of every line of path."""
    return [(e.prompt, e.response) for e in read_examples(path, engine.tokenizer, _eos(engine))]


def _eos(engine: Engine) -> int | None:
    return engine.eos[0] if engine.eos else None


def lr_at(step: int, steps: int, lr: float, warmup: int, decay: str, min_lr: float,
          progress: float = 0.0) -> float:
    """The learning rate of step (1-based) of steps: a linear warm-up over warmup steps, then lr
    (decay "constant") or a fall to min_lr by the last step ("linear", "cosine"). progress, the
    share of a time budget spent, moves the fall on when it is ahead of the steps."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if decay == "constant":
        return lr
    frac = (step - warmup) / max(1, steps - warmup)
    frac = min(1.0, max(frac, progress))
    if decay == "linear":
        return min_lr + (lr - min_lr) * (1 - frac)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    raise ValueError(f"decay {decay!r}: constant, linear or cosine")


def batches(examples: list[Example], rng: random.Random, size: int, tokens: int):
    """Endless batches of example indices, epoch after epoch in a fresh random order: size
    examples each, or with tokens > 0 as many as fit in tokens prompt and response tokens (at
    least one)."""
    order: list[int] = []
    while True:
        batch, used = [], 0
        while True:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            n = len(examples[order[-1]].prompt) + len(examples[order[-1]].response)
            if batch and (used + n > tokens if tokens > 0 else len(batch) == size):
                break
            batch.append(order.pop())
            used += n
        yield batch


def evaluate(engine: Engine, examples: list[Example], max_tokens: int) -> tuple[dict, list[str]]:
    """Greedy answers to the examples marked right: per kind and under "all", the share equal to
    the right response (whitespace stripped), and a few of the answers."""
    scored = [e for e in examples if e.right]
    reqs = [GenerateRequest(id=str(k), prompt_tokens=e.prompt,
                            sampling=Sampling(max_tokens=max_tokens, temperature=0.0))
            for k, e in enumerate(scored)]
    done = engine.generate(reqs)
    eos = set(engine.eos)
    right: dict[str, float] = {}
    total: dict[str, float] = {}
    sample = []
    for k, (e, c) in enumerate(zip(scored, done)):
        text = engine.tokenizer.decode([t for t in c.tokens if t not in eos])
        for kind in {e.kind or "all", "all"}:
            total[kind] = total.get(kind, 0) + 1
            right[kind] = right.get(kind, 0) + (text.strip() == e.text)
        if len(sample) < 6 and k % 7 == 0:
            sample.append(f"{e.kind}: {text}")
    return {k: right[k] / total[k] for k in total}, sample


def eval_line(step: int, path: str, acc: dict, n: int) -> str:
    kinds = [k for k in KINDS if k in acc] + sorted(k for k in acc if k not in KINDS and k != "all")
    parts = ", ".join(f"{k} {100 * acc[k]:.1f}%" for k in kinds)
    return (f"step {step}: held-out {path}, greedy answers equal to the right ones: "
            f"{100 * acc.get('all', 0):.1f}% of {n}" + (f" ({parts})" if parts else ""))


def run(args) -> None:
    if args.batch_size <= 0 or args.batch_tokens < 0 or args.warmup < -1 or args.lr <= 0:
        raise SystemExit("sft: --batch-size and --lr must be positive, --batch-tokens and "
                         "--warmup not negative")
    if args.decay not in ("constant", "linear", "cosine"):
        raise SystemExit(f"sft: --decay {args.decay!r}: constant, linear or cosine")
    # Tokenized before the engine starts (its threads and device are not to be forked); the
    # end-of-sequence token is added once the engine says which it is.
    tok, workers = Tokenizer(args.model), min(16, os.cpu_count() or 1)
    t0 = time.time()
    examples = read_examples(args.data, tok, None, workers)
    held = read_examples(args.eval_data, tok, None, workers) if args.eval_data else []
    log.info("tokenized %d + %d lines in %.1fs", len(examples), len(held), time.time() - t0)
    engine = Engine(args.model, Options(device=args.device, dtype=args.dtype,
                                        compile_train=getattr(args, "compile_train", "block")))
    try:
        if _eos(engine) is not None:
            for e in examples + held:
                e.response.append(_eos(engine))
        if args.eval_data:
            if args.eval_n:
                held = [e for e in held if e.right][:args.eval_n]
            if not any(e.right for e in held):
                raise SystemExit(f"{args.eval_data}: no line is marked right: nothing to score")
        n_scored = sum(e.right for e in held)
        rng = random.Random(args.seed)
        tokens = sum(len(e.prompt) + len(e.response) for e in examples)
        per_step = args.batch_tokens or args.batch_size * tokens / len(examples)
        steps = args.steps or max(1, int(args.epochs * tokens // per_step))
        warmup = steps // 20 if args.warmup < 0 else args.warmup
        loss = LossConfig(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=1.0)
        info = engine.info()
        per = (f"{args.batch_tokens} tokens" if args.batch_tokens
               else f"{args.batch_size} examples")
        log.info("sft on %s: %d examples (%d tokens), %d parameters, %d steps of %s, lr %g "
                 "(warm-up %d, %s decay)", args.data, len(examples), tokens, info["params"], steps,
                 per, args.lr, warmup, args.decay)

        def held_out(step: int) -> None:
            acc, sample = evaluate(engine, held, args.eval_max_tokens)
            for s in sample:
                log.info("  %r", s)
            line = eval_line(step, args.eval_data, acc, n_scored)
            log.info("%s", line)
            print(line, flush=True)

        it = batches(examples, rng, args.batch_size, args.batch_tokens)
        start = time.time()
        seen = step = 0
        for step in range(1, steps + 1):
            elapsed = time.time() - start
            if args.max_seconds and elapsed > args.max_seconds:
                log.info("sft stopped after %d steps: --max-seconds %g reached", step - 1,
                         args.max_seconds)
                step -= 1
                break
            batch = next(it)
            loss.lr = lr_at(step, steps, args.lr, warmup, args.decay, args.min_lr,
                            elapsed / args.max_seconds if args.max_seconds else 0.0)
            st = engine.sft_step([(examples[i].prompt, examples[i].response) for i in batch], loss)
            seen += sum(len(examples[i].prompt) + len(examples[i].response) for i in batch)
            if step % args.log_every == 0 or step == steps:
                t = time.time() - start
                log.info("sft step %d/%d loss %.4f grad_norm %.3f lr %.3g (%.0fs, %.0f tokens/s)",
                         step, steps, st.loss, st.grad_norm, loss.lr, t, seen / max(t, 1e-9))
            if held and args.eval_every and step % args.eval_every == 0 and step != steps:
                held_out(step)
        if held:
            held_out(step)
        engine.save(args.out or args.model)
        log.info("saved %s", args.out or args.model)
    finally:
        engine.close()
