"""Issue 21's in-worker weights versions on one device (slimen_torch/versions.py), one table.

    python engines/torch/bench_versions.py --device cuda:0 [--shape qwen3-0.6b] [--quick]

On a random model of --shape (make-model; bf16 on a GPU): KeepVersion's device copy (seconds and
s/GB, the median of --copies copies after one warm-up; the issue's target ≤ 0.01 s/GB, the device
does 1.19 GB in about 0.6 ms); that a kept version samples what the weights sampled before a
training step (tokens equal, largest log-prob difference) while the current weights sample
something else; and the overlap the versions are for: a versioned generation round alone, a
training step alone, and both at once (the round on the rollout model's stream while the trainer
steps), with (alone + alone) / together. --quick is the CPU check (tiny-qwen3, small batch).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402
from slimen_torch.types import (Batch, GenerateRequest, LossConfig, Sample,  # noqa: E402
                                Sampling, ScoreRequest)


def requests(n: int, prompt_len: int, max_tokens: int, vocab: int, tag: str):
    g = torch.Generator().manual_seed(1)
    return [GenerateRequest(id=f"{tag}{i}", n=1,
                            prompt_tokens=torch.randint(10, min(vocab, 4000), (prompt_len,),
                                                        generator=g).tolist(),
                            sampling=Sampling(max_tokens=max_tokens, temperature=1.0, seed=i))
            for i in range(n)]


def versioned(e: Engine, v: int, reqs) -> list:
    done = threading.Condition()
    got, errs = {}, []

    def ok(c, i):
        with done:
            got[i] = c
            done.notify()

    def fail(code, msg):
        with done:
            errs.append(f"{code}: {msg}")
            done.notify()

    for i, r in enumerate(reqs):
        e.submit_version(v, r, lambda c, i=i: ok(c, i), fail)
    with done:
        done.wait_for(lambda: errs or len(got) == len(reqs))
    if errs:
        raise RuntimeError(errs[0])
    return [got[i] for i in range(len(reqs))]


def batch_of(comps, lr: float) -> Batch:
    samples = [Sample(list(c.prompt_tokens), list(c.tokens), [1.0] * len(c.tokens),
                      list(c.logprobs), [1.0 if i % 2 else -1.0] * len(c.tokens), group=f"g{i // 2}")
               for i, c in enumerate(comps)]
    return Batch(samples=samples, loss=LossConfig(lr=lr))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--copies", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0, help="generate requests in a round")
    ap.add_argument("--tokens", type=int, default=0, help="sampled tokens per request")
    a = ap.parse_args()
    shape = a.shape or ("tiny-qwen3" if a.quick else "qwen3-0.6b")
    copies = a.copies or (3 if a.quick else 20)
    B = a.batch or (4 if a.quick else 64)
    T = a.tokens or (8 if a.quick else 128)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(shape, pathlib.Path(tmp) / "m", seed=3)
        e = Engine(str(model), Options(device=a.device, max_seq_len=512))
        try:
            run(e, shape, a.device, copies, B, T)
        finally:
            e.close()


def divergence(a, b) -> str:
    """How many responses of a differ from b's, and the first differing token's position."""
    at = [next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
               min(len(x.tokens), len(y.tokens))) for x, y in zip(a, b) if x.tokens != y.tokens]
    if not at:
        return f"all {len(a)} responses equal"
    return (f"{len(at)}/{len(a)} responses differ, first at token {min(at)} "
            f"(median {statistics.median(at):.0f})")


def run(e: Engine, shape: str, device: str, copies: int, B: int, T: int) -> None:
    V = e.cfg.vocab_size
    rows = []
    # The copy: a warm-up (allocates the version's buffers and the rollout model), then copies.
    e.keep_version(0)
    secs, gb = [], 0.0
    for _ in range(copies):
        got = e.keep_version(0)
        secs.append(got["seconds"])
        gb = got["gb"]
    med = statistics.median(secs)
    rows.append(("KeepVersion device copy", f"{gb:.4g} GB in {med * 1e3:.3f} ms (median of {copies}, "
                 f"min {min(secs) * 1e3:.3f}): {med / gb:.5f} s/GB"
                 + ("" if device == "cpu" else f" — target ≤ 0.01 s/GB: {'met' if med / gb <= 0.01 else 'NOT met'}")))

    # A kept version samples what the weights sampled before a training step.
    reqs = requests(B, 32, T, V, "a")
    before = e.generate(reqs)
    e.keep_version(0)
    # The rollout model against the weights' generator on the same weights (before the step):
    # the same tokens, and its log-probs against the weights' own score of its tokens.
    same_w = versioned(e, 0, requests(B, 32, T, V, "e"))
    scored = e.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens) for c in same_w])
    dsc = max((abs(p - q) for c, s in zip(same_w, scored) for p, q in zip(c.logprobs, s)), default=0.0)
    rows.append(("version 0 before the step (the same weights)", f"{divergence(before, same_w)}; "
                 f"its log-probs against the weights' score of its tokens: largest difference {dsc:.2e}"))
    st = e.train(batch_of(before, 1e-3 if device != "cpu" else 5e-2))
    now = e.generate(requests(B, 32, T, V, "b"))
    old = versioned(e, 0, requests(B, 32, T, V, "c"))
    same = all(x.tokens == y.tokens for x, y in zip(before, old))
    dlp = max((abs(p - q) for x, y in zip(before, old) for p, q in zip(x.logprobs, y.logprobs)
               if x.tokens == y.tokens), default=0.0)
    moved = sum(x.tokens != y.tokens for x, y in zip(before, now))
    rows.append(("version 0 after a step", f"tokens {'equal' if same else 'DIFFER'} to the "
                 f"weights' before the step{'' if same else ' ' + divergence(before, old)} (largest "
                 f"log-prob difference where equal {dlp:.2e}); the trained weights "
                 f"differ in {moved}/{B} responses (step skipped: {st.skipped})"))
    if not same:
        # Which generator differs: the weights' own generator on a second run of the same requests
        # (batch invariance), or the rollout model's (its own KV cache and graphs).
        again = e.generate(requests(B, 32, T, V, "d"))
        rows.append(("the weights' generator, the same requests again", divergence(now, again)))

    # Overlap: a versioned round alone, a training step alone, both at once.
    e.keep_version(1)
    batch = batch_of(now, 1e-6)
    versioned(e, 1, requests(B, 32, T, V, "w"))  # warm-up: graphs, compilation
    e.train(batch)
    _, g_alone = timed(lambda: versioned(e, 1, requests(B, 32, T, V, "d")))
    _, t_alone = timed(lambda: e.train(batch))
    th = threading.Thread(target=lambda: e.train(batch))

    def both():
        th.start()
        versioned(e, 1, requests(B, 32, T, V, "e"))
        th.join()
    _, together = timed(both)
    rows.append(("overlap on one device", f"round of {B}×{T} tokens {g_alone:.3f} s, train step "
                 f"{t_alone:.3f} s, both at once {together:.3f} s: "
                 f"{(g_alone + t_alone) / together:.2f}× the serial time"))
    print(f"| {shape} on {device} | |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
