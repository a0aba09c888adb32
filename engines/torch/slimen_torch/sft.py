"""Supervised warm-up of a model on prompt/response pairs (before RL, so rewards are not all 0).

`python -m slimen_torch sft --model DIR --data FILE.jsonl [--out DIR]` reads one JSON object per
line:

    {"prompt": "Ann has 3 pens and gets 2 more. How many pens?", "response": "\\boxed{5}"}
    {"prompt": [{"role": "user", "content": "..."}], "label": "5"}

`prompt` is one user turn (a string) or a message list, rendered with the model's chat template
and its generation prompt; the target is `response`, or `\\boxed{label}` when only a label is given
(the format of the host's synthetic:arith export), followed by the end-of-sequence token. The loss
is the token-mean negative log-likelihood of the targets; the result is saved as a model folder.
--max-seconds ends the run early (after the step that crosses it), keeping the learning-rate
schedule of --steps.
"""

from __future__ import annotations

import json
import logging
import random
import time

from .engine import Engine, Options
from .types import LossConfig

log = logging.getLogger("slimen_torch")


def read_pairs(path: str, engine: Engine) -> list[tuple[list[int], list[int]]]:
    tok = engine.tokenizer
    eos = engine.eos[0] if engine.eos else None
    pairs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not JSON: {e}") from None
            prompt = row.get("prompt")
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            if not isinstance(prompt, list) or not prompt:
                raise SystemExit(f"{path}:{lineno}: \"prompt\" must be a string or a message list")
            if "response" in row:
                response = str(row["response"])
            elif "label" in row:
                response = "\\boxed{" + str(row["label"]) + "}"
            else:
                raise SystemExit(f"{path}:{lineno}: needs \"response\" or \"label\"")
            ids = tok.encode(response) + ([eos] if eos is not None else [])
            pairs.append((tok.encode_chat(prompt), ids))
    if not pairs:
        raise SystemExit(f"{path}: no examples")
    return pairs


def run(args) -> None:
    engine = Engine(args.model, Options(device=args.device, dtype=args.dtype,
                                        compile_train=getattr(args, "compile_train", "block")))
    try:
        pairs = read_pairs(args.data, engine)
        rng = random.Random(args.seed)
        steps = args.steps or max(1, args.epochs * len(pairs) // args.batch_size)
        loss = LossConfig(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0)
        order: list[int] = []
        start = time.time()
        for step in range(1, steps + 1):
            if args.max_seconds and time.time() - start > args.max_seconds:
                log.info("sft stopped after %d steps: --max-seconds %g reached", step - 1,
                         args.max_seconds)
                break
            if len(order) < args.batch_size:
                more = list(range(len(pairs)))
                rng.shuffle(more)
                order += more
            batch, order = order[:args.batch_size], order[args.batch_size:]
            # A linear warm-up over the first 5% of the steps, then constant: large early steps
            # on a random model overshoot.
            loss.lr = args.lr * min(1.0, step / max(1, steps // 20))
            st = engine.sft_step([pairs[i] for i in batch], loss)
            if step % args.log_every == 0 or step == steps:
                log.info("sft step %d/%d loss %.4f grad_norm %.3f (%.0fs)", step, steps, st.loss,
                         st.grad_norm, time.time() - start)
        engine.save(args.out or args.model)
        log.info("saved %s", args.out or args.model)
    finally:
        engine.close()
