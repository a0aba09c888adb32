"""Issue 38 on one device, in one call: the default and the deterministic mode side by side.

    python engines/torch/determinism.py [--device cuda|cpu] [--small] [--out DIR] [--check]
        [--mode both|default|deterministic] [--tile BM,BN,BK,warps,stages] [--tile-large T|none]
        [--tile-by-shape on|off]
        [--row-kernels on|off] [--attn-grouped on|off] [--attn-bm N]
        [--attn-bwd triton|triton2|sdpa] [--attn-bwd-dq Q,K,W,S] [--attn-bwd-dkdv Q,K,W,S]
        [--attn-bwd2-dq R,K,W,S] [--attn-bwd2-dkdv R,K,W,S]
        [--norm-bwd triton|torch] [--head-bwd triton|torch] [--fused-elementwise on|off]
        [--attn-large BM,warps] [--micro-batch-tokens N] [--split-k S] [--layer-fn on|off]
        [--attn-lse on|off] [--attn-full-blocks on|off] [--fused-qk on|off]
        [--fused-add-norm on|off] [--matmul-form plain|tma|persistent|persistent-ws]
        [--tile-form T|none] [--profile]

On a random model (make-model: Qwen3-0.6B's shape, bf16 on a GPU; --small: the tiny Qwen3, for
the CPU and the test that runs this), with no end-of-sequence token so every response has its
asked length, for each mode (an Engine with Options.deterministic off, then on):

  (a) the rollout/trainer log-prob mismatch: max |trainer − rollout| over every sampled token of
      a mixed batch (prompts of several lengths, n > 1, top-p on some), from Score and from a
      training step's own forward (TrainStats.logprob_diff_max); the same with a LoRA adapter
      (trained a step first, so that its update is not zero) and on a conversation's second turn
      prefilled from the prefix cache; whether a request's samples are the same alone and in a
      batch of others; and whether two training steps on one batch of the size of (b)'s give
      the same loss and gradient norm bit for bit (the backward passes repeatable);
  (b) decode tokens/s at --batch rows (--prompt-len prompt + --new sampled tokens, wall time from
      submission to the last completion, best of two after a warm-up) and training tokens/s
      (one AdamW step on --train-samples × --train-len tokens, best of two after a warm-up);
  (c) a table of both, and the deterministic mode's cost as ratios.

--check exits 1 unless the deterministic mode's mismatches are all 0, its samples do not depend
on their batch and its gradients repeat. --out DIR keeps the model folder and writes determinism.json there; a
later call into the same DIR (--mode deterministic with other knobs) adds a row named by its
knobs, so that settings compare side by side in one table, each with its cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import no_eos  # noqa: E402
from slimen_torch import lora  # noqa: E402
from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402
from slimen_torch.types import (Batch, GenerateRequest, LossConfig, Sample, Sampling,  # noqa: E402
                                ScoreRequest)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rand_prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def request(rid: str, prompt: list[int], seed: int, new: int, n: int = 1, top_p: float = 1.0,
            adapter: str = "") -> GenerateRequest:
    return GenerateRequest(id=rid, prompt_tokens=prompt, n=n, adapter=adapter,
                           sampling=Sampling(max_tokens=new, temperature=1.0, top_p=top_p,
                                             seed=seed))


def mixed_requests(vocab: int, new: int, adapter: str = "") -> list[GenerateRequest]:
    """Prompts of 5 to 150 tokens (past the attention's first 64-position split), n of 1 to 4,
    top-p on one."""
    return [request(f"m{i}", rand_prompt(vocab, length, 10 + i), 20 + i, new, n=n, top_p=p,
                    adapter=adapter)
            for i, (length, n, p) in enumerate([(5, 1, 1.0), (70, 4, 1.0), (150, 2, 0.9),
                                                (33, 3, 1.0)])]


def samples_of(completions, lr_adv=1.0) -> list[Sample]:
    return [Sample(c.prompt_tokens, c.tokens, [1.0] * len(c.tokens), list(c.logprobs),
                   [lr_adv if c.index % 2 else -lr_adv] * len(c.tokens), group=c.request_id)
            for c in completions]


def mismatch(e: Engine, completions, adapter: str = "") -> dict:
    """max |Score − rollout| and the training step's logprob_diff_max (lr 0: nothing changes)
    over the completions' tokens."""
    score = 0.0
    got = e.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens, adapter=adapter)
                   for c in completions])
    for c, lp in zip(completions, got):
        score = max([score] + [abs(a - b) for a, b in zip(lp, c.logprobs)])
    st = e.train(Batch(samples=samples_of(completions), loss=LossConfig(lr=0.0),
                       adapter=adapter))
    return {"score": score, "train": st.logprob_diff_max, "train_mean": st.logprob_diff_mean}


def lora_identity(e: Engine, vocab: int, new: int) -> dict:
    """(a) with a LoRA adapter, on an engine of its own (a worker whose base has trained takes
    no adapters, and one that holds adapters trains no base): the adapter trained one step (its
    B starts at zero), sampled among base rows."""
    out = {}
    e.add_adapter("det", lora.LoRAConfig(rank=8, alpha=16,
                                         targets=("q_proj", "v_proj", "o_proj", "down_proj")), 1)
    warm = e.generate([request("w", rand_prompt(vocab, 20, 3), 4, new, n=4, adapter="det")])
    e.train(Batch(samples=samples_of(warm), loss=LossConfig(lr=1e-2), adapter="det"))
    lreqs = mixed_requests(vocab, new, adapter="det")
    lcs = [c for c in e.generate(lreqs + [request("b", rand_prompt(vocab, 40, 5), 6, new)])
           if c.request_id != "b"]
    out["lora"] = mismatch(e, lcs, adapter="det")
    return out


def identities(e: Engine, vocab: int, new: int) -> dict:
    """(a) of the module comment, without LoRA (lora_identity)."""
    out = {}
    reqs = mixed_requests(vocab, new)
    cs = e.generate(reqs)
    out["base"] = mismatch(e, cs)
    alone = {(c.request_id, c.index): (c.tokens, c.logprobs) for c in e.generate([reqs[1]])}
    mixed = {(c.request_id, c.index): (c.tokens, c.logprobs) for c in cs}
    out["batch_invariant"] = all(mixed[k] == v for k, v in alone.items())
    # The prefix cache: a second turn extends the first; its prompt's start comes from the kept
    # row, only the new tokens are prefilled.
    first = e.generate([request("t1", rand_prompt(vocab, 90, 7), 8, new)])[0]
    turn2 = first.prompt_tokens + first.tokens + rand_prompt(vocab, 6, 9)
    e.gen.take_prefix_stats()
    second = e.generate([request("t2", turn2, 11, new, n=2)])
    out["prefix_hits"] = e.gen.take_prefix_stats().get("hits", 0)
    out["prefix"] = mismatch(e, second)
    return out


def best_rate(e: Engine, run) -> float:
    """Tokens / s of run() (which returns its tokens): the best of two calls after a warm-up."""
    best = 0.0
    for rep in range(3):
        sync(str(e.device))
        t0 = time.perf_counter()
        tokens = run()
        sync(str(e.device))
        if rep:
            best = max(best, tokens / (time.perf_counter() - t0))
    return best


def decode_speed(e: Engine, vocab: int, batch: int, prompt_len: int, new: int) -> float:
    """Sampled tokens / s at batch rows: best of two after a warm-up."""
    reqs = [request(f"s{i}", rand_prompt(vocab, prompt_len, 100 + i), i, new)
            for i in range(batch)]
    return best_rate(e, lambda: sum(len(c.tokens) for c in e.generate(reqs)))


def train_batch(vocab: int, samples: int, length: int) -> Batch:
    """samples random sequences of length tokens (64 or a quarter of them prompt), advantages ±1
    in groups of 4: the batch train_speed and the profile train on."""
    g = torch.Generator().manual_seed(4)
    p = min(64, length // 4)
    ss = []
    for i in range(samples):
        seq = torch.randint(3, vocab, (length,), generator=g).tolist()
        r = length - p
        ss.append(Sample(seq[:p], seq[p:], [1.0] * r, [-5.0] * r, [1.0 if i % 2 else -1.0] * r,
                         group=f"g{i // 4}"))
    return Batch(samples=ss, loss=LossConfig(lr=1e-6, max_grad_norm=1.0))


def repeatable(e: Engine, vocab: int, samples: int, length: int) -> bool:
    """Whether two training steps on the same batch (train_batch's, at lr 0: the weights stay)
    give the same loss and gradient norm, bit for bit: the backward passes are repeatable."""
    b = train_batch(vocab, samples, length)
    b.loss.lr = 0.0
    one, two = e.train(b), e.train(b)
    return (one.loss, one.grad_norm) == (two.loss, two.grad_norm)


def train_speed(e: Engine, vocab: int, samples: int, length: int) -> float:
    """Trained tokens / s of one AdamW step on samples × length tokens: best of two after a
    warm-up."""
    b = train_batch(vocab, samples, length)
    return best_rate(e, lambda: e.train(b).tokens)


def profile(e: Engine, vocab: int, a, out: pathlib.Path) -> None:
    """--profile: the kernels of one decode run at --batch rows and one training step, by their
    own device time (CPU time on the CPU), the top 25 of each written to out."""
    from torch.profiler import ProfilerActivity
    cuda = str(e.device).startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    reqs = [request(f"p{i}", rand_prompt(vocab, a.prompt_len, 300 + i), i, a.new)
            for i in range(a.batch)]
    parts = []
    for name, fn in (("decode", lambda: e.generate(reqs)),
                     ("train", lambda: e.train(train_batch(vocab, a.train_samples, a.train_len)))):
        sync(str(e.device))
        # Started and stopped on the engine's thread, where its model work runs (the profiler
        # records the operators of the thread that starts it).
        prof = torch.profiler.profile(activities=acts)
        e._call(prof.start)
        fn()
        e._call(lambda: (sync(str(e.device)), prof.stop()))
        parts.append(f"== {name}\n" + prof.key_averages().table(sort_by=key, row_limit=25))
    out.write_text("\n".join(parts))
    log(f"   profile: {out}")


def run_mode(model_dir: pathlib.Path, a, deterministic: bool) -> dict:
    name = "deterministic" if deterministic else "default"
    log(f"== {name}")
    # A cache of --batch rows × 1,024 positions (enough for every request here; 256 rows of
    # Qwen3-0.6B's keys and values are 15 GB in bf16).
    opts = Options(device=a.device, deterministic=deterministic, prefix_cache=8, prefix_min=16,
                   slots=max(a.batch, 16), max_seq_len=1024,
                   micro_batch_tokens=a.micro_batch_tokens if deterministic else 0)
    t0 = time.perf_counter()
    res = {"mode": name, "config": a.config if deterministic else ""}
    e = Engine(str(model_dir), opts)
    try:
        res.update(lora_identity(e, e.cfg.vocab_size, a.check_new))
    finally:
        e.close()
    e = Engine(str(model_dir), opts)
    try:
        vocab = e.cfg.vocab_size
        res.update(identities(e, vocab, a.check_new))
        res["repeatable"] = repeatable(e, vocab, a.train_samples, a.train_len)
        log(f"   identities: {json.dumps(res)}")
        res["decode_tok_s"] = decode_speed(e, vocab, a.batch, a.prompt_len, a.new)
        log(f"   decode: {res['decode_tok_s']:.0f} tok/s")
        res["train_tok_s"] = train_speed(e, vocab, a.train_samples, a.train_len)
        log(f"   train: {res['train_tok_s']:.0f} tok/s")
        if a.profile:
            # A deterministic row's knobs in the name: calls of other settings keep their own.
            tag = re.sub(r"[^A-Za-z0-9.,]+", "-", res["config"]).strip("-")
            profile(e, vocab, a, pathlib.Path(a.out or model_dir.parent)
                    / f"profile-{name}{'-' + tag if tag else ''}.txt")
        res["seconds"] = time.perf_counter() - t0
        return res
    finally:
        e.close()


def table(rows: list[dict], a, device_name: str) -> str:
    def g(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    head = ["mode", "max abs Δ Score", "max abs Δ train", "LoRA", "prefix cache",
            "batch-invariant", "repeatable grads", f"decode tok/s (batch {a.batch})",
            f"train tok/s ({a.train_samples}×{a.train_len})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            label(r), g(r["base"]["score"]), g(r["base"]["train"]),
            g(max(r["lora"]["score"], r["lora"]["train"])),
            g(max(r["prefix"]["score"], r["prefix"]["train"])) + f" ({r['prefix_hits']} hits)",
            "yes" if r["batch_invariant"] else "no",
            {True: "yes", False: "no"}.get(r.get("repeatable"), "?"),
            f"{r['decode_tok_s']:.0f}", f"{r['train_tok_s']:.0f}"]) + " |")
    if len(rows) < 2 or rows[0]["mode"] != "default":
        return "\n".join([f"device: {device_name}; torch {torch.__version__}", *lines])
    d, cost = rows[0], []
    for t in rows[1:]:
        cost.append(
            f"{label(t)} / default: decode {t['decode_tok_s'] / d['decode_tok_s']:.3f} "
            f"({(1 - t['decode_tok_s'] / d['decode_tok_s']) * 100:.1f}% slower), training "
            f"{t['train_tok_s'] / d['train_tok_s']:.3f} "
            f"({(1 - t['train_tok_s'] / d['train_tok_s']) * 100:.1f}% slower)")
    return "\n".join([f"device: {device_name}; torch {torch.__version__}", *lines, "", *cost])


def label(r: dict) -> str:
    """A row's name in the table: its mode, and the deterministic mode's non-default knobs."""
    return r["mode"] + (f" ({r['config']})" if r.get("config") else "")


# The deterministic mode's knobs (flag, attribute, default): a row records those set otherwise,
# so that runs of other settings into one --out keep a row each.
KNOBS = [("--tile", "tile", ""), ("--tile-large", "tile_large", ""),
         ("--row-kernels", "row_kernels", "on"), ("--attn-grouped", "attn_grouped", "on"),
         ("--attn-bm", "attn_bm", 0), ("--attn-bwd", "attn_bwd", "triton2"),
         ("--attn-bwd-dq", "attn_bwd_dq", ""), ("--attn-bwd-dkdv", "attn_bwd_dkdv", ""),
         ("--attn-bwd2-dq", "attn_bwd2_dq", ""), ("--attn-bwd2-dkdv", "attn_bwd2_dkdv", ""),
         ("--norm-bwd", "norm_bwd", "triton"),
         ("--head-bwd", "head_bwd", "triton"), ("--fused-elementwise", "fused_elementwise", "on"),
         ("--attn-large", "attn_large", ""), ("--micro-batch-tokens", "micro_batch_tokens", 0),
         ("--split-k", "split_k", 1), ("--tile-by-shape", "tile_by_shape", "on"), ("--layer-fn", "layer_fn", "on"),
         ("--attn-lse", "attn_lse", "on"), ("--attn-full-blocks", "attn_full_blocks", "on"),
         ("--fused-qk", "fused_qk", "on"), ("--fused-add-norm", "fused_add_norm", "on"),
         ("--matmul-form", "matmul_form", "persistent"), ("--tile-form", "tile_form", "")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true",
                   help="the tiny Qwen3 model and small batches (the CPU, tests)")
    p.add_argument("--out", default="", help="keep the model here and write determinism.json")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless the deterministic mode's identities hold")
    p.add_argument("--batch", type=int, default=0, help="decode rows (default 256; --small 8)")
    p.add_argument("--prompt-len", type=int, default=0, help="default 128; --small 16")
    p.add_argument("--new", type=int, default=0, help="sampled tokens a row (default 128; 8)")
    p.add_argument("--check-new", type=int, default=0,
                   help="sampled tokens a response in (a) (default 32; --small 8)")
    p.add_argument("--train-samples", type=int, default=0, help="default 8; --small 2")
    p.add_argument("--train-len", type=int, default=0, help="default 2048; --small 64")
    p.add_argument("--mode", default="both", choices=["both", "default", "deterministic"],
                   help="run one mode only (two calls within a time limit); with --out the "
                   "other's results, if there, complete the table")
    p.add_argument("--tile", default="",
                   help="the deterministic products' tile BM,BN,BK,warps,stages (default "
                   "64,64,64,4,3)")
    p.add_argument("--profile", action="store_true",
                   help="after each mode's speeds, the top kernels of one decode run and one "
                   "training step by device time, in profile-MODE.txt next to determinism.json")
    p.add_argument("--tile-large", default="",
                   help="the tile BM,BN,BK,warps,stages of products of at least 1,024 rows "
                   "(training; default 128,128,64,8,3), none for --tile's")
    p.add_argument("--tile-by-shape", default="on", choices=["on", "off"],
                   help="decode steps' products of few outputs over a long K and the vocabulary "
                   "head in their own tiles (on, the default) or all in --tile's (off)")
    p.add_argument("--row-kernels", default="on", choices=["on", "off"],
                   help="the deterministic sums over a row (RMSNorm, log-softmax, sampler) in "
                   "Triton row kernels on a GPU (on, the default) or as tree sums of PyTorch "
                   "operations (off)")
    p.add_argument("--attn-grouped", default="on", choices=["on", "off"],
                   help="a program of the deterministic attention takes the query heads sharing "
                   "a key head (on, the default: keys and values read once for them) or one "
                   "head's queries (off)")
    p.add_argument("--attn-bm", type=int, default=0,
                   help="queries a program of the deterministic attention takes, decode and "
                   "training alike (default 16; a power of two ≥ 16)")
    p.add_argument("--attn-bwd", default="triton2", choices=["triton", "triton2", "sdpa"],
                   help="the deterministic attention's backward pass (training): two Triton "
                   "kernels without atomics (triton, the first form), their second form (triton2, "
                   "the default: a program's rows the query heads of a key head together, a "
                   "causal pass's bounds by arithmetic) or PyTorch's attention recomputed in its strict "
                   "deterministic mode (sdpa, the first version)")
    p.add_argument("--attn-bwd-dq", default="",
                   help="the Triton backward's dQ kernel's block: queries,keys,warps,stages "
                   "(default 128,32,8,3)")
    p.add_argument("--attn-bwd-dkdv", default="",
                   help="the Triton backward's dK/dV kernel's block: queries,keys,warps,stages "
                   "(default 32,128,8,2)")
    p.add_argument("--attn-bwd2-dq", default="",
                   help="--attn-bwd triton2's dQ kernel's block: rows (queries × the query heads "
                   "of a key head),keys,warps,stages (default 128,64,8,2)")
    p.add_argument("--attn-bwd2-dkdv", default="",
                   help="--attn-bwd triton2's dK/dV kernel's block: rows,keys,warps,stages "
                   "(default 32,128,8,2)")
    p.add_argument("--norm-bwd", default="triton", choices=["triton", "torch"],
                   help="the deterministic RMSNorm's backward pass: one Triton kernel (triton, "
                   "the default) or autograd of its PyTorch form (torch, the first version)")
    p.add_argument("--head-bwd", default="triton", choices=["triton", "torch"],
                   help="the deterministic log-prob head's backward pass: one Triton pass over "
                   "the logits (triton, the default) or autograd of the chunked fp32 form "
                   "(torch, the first version)")
    p.add_argument("--fused-elementwise", default="on", choices=["on", "off"],
                   help="the deterministic rotary embedding and residual add in one Triton "
                   "kernel each, rounding as eager mode does, and SwiGLU's backward pass in one "
                   "(on, the default), or eager PyTorch operations (off, the first version)")
    p.add_argument("--attn-large", default="",
                   help="an experiment: another block BM,warps of the deterministic attention "
                   "for passes of at least 64 queries (training, prefills); the check says "
                   "whether the identities hold")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="the deterministic mode's training micro-batches in padded tokens "
                   "(default: the largest of 16,384..4,096 whose whole logits and activations "
                   "fit half the free memory; 4096 the first version's)")
    p.add_argument("--split-k", type=int, default=1,
                   help="an experiment: the deterministic products of K >= 2,048 split along K "
                   "into S parts added in order (every pass alike; default 1, unsplit)")
    p.add_argument("--layer-fn", default="on", choices=["on", "off"],
                   help="the deterministic training layer as one autograd node with its backward "
                   "pass written out (on, the default; the same forward numbers) or a node an "
                   "operation (off, the first version)")
    p.add_argument("--attn-lse", default="on", choices=["on", "off"],
                   help="a training pass's attention forward keeps each row's log-sum-exp for the "
                   "backward pass's dQ kernel (on, the default; the same output) or the dQ "
                   "kernel computes it again in a pass over the keys (off, the first version)")
    p.add_argument("--attn-full-blocks", default="on", choices=["on", "off"],
                   help="the attention backward kernels' blocks whose queries see all their keys "
                   "without the masks' work (on, the default; the same numbers) or every block "
                   "masked (off, the first version)")
    p.add_argument("--fused-qk", default="on", choices=["on", "off"],
                   help="the deterministic q and k heads' norms and rope in one kernel a layer, "
                   "every pass alike (on, the default) or two norms and two ropes (off, the "
                   "first version)")
    p.add_argument("--fused-add-norm", default="on", choices=["on", "off"],
                   help="the deterministic residual add after the attention and the MLP's norm "
                   "in one kernel, every pass alike (on, the default) or two kernels (off, the "
                   "first version)")
    p.add_argument("--matmul-form", default="persistent",
                   choices=["plain", "tma", "persistent", "persistent-ws"],
                   help="the deterministic products of at least 1,024 rows (training, long "
                   "prefills) in the plain Triton kernel (plain) or on Hopper's TMA descriptors: "
                   "a program a tile (tma), one program an SM (persistent, the default), that "
                   "warp-specialized (persistent-ws); the same arithmetic, the check says "
                   "whether the bits are")
    p.add_argument("--tile-form", default="",
                   help="the tile BM,BN,BK,warps,stages of the --matmul-form kernels (default "
                   "128,256,64,8,3), none for --tile-large's")
    a = p.parse_args(argv)
    from slimen_torch import batch_invariant
    batch_invariant.MATMUL_FORM = a.matmul_form
    def tile(flag: str, text: str, name: str, none_ok: bool = True) -> None:
        # A tile flag's BM,BN,BK,warps,stages into batch_invariant.<name>; "none": None; "": as is.
        if none_ok and text == "none":
            setattr(batch_invariant, name, None)
        elif text:
            t = tuple(int(x) for x in text.split(","))
            if len(t) != 5:
                p.error(f"{flag} {text}: give BM,BN,BK,warps,stages")
            setattr(batch_invariant, name, t)
    tile("--tile", a.tile, "TILE", none_ok=False)
    batch_invariant.TILE_BY_SHAPE = a.tile_by_shape == "on"
    tile("--tile-large", a.tile_large, "TILE_LARGE")
    tile("--tile-form", a.tile_form, "TILE_FORM")
    batch_invariant.ROW_KERNELS = a.row_kernels == "on"
    batch_invariant.ATTN_GROUPED = a.attn_grouped == "on"
    if a.attn_bm:
        if a.attn_bm < 16 or a.attn_bm & (a.attn_bm - 1):
            p.error(f"--attn-bm {a.attn_bm}: give a power of two ≥ 16")
        batch_invariant.ATTN_BM = a.attn_bm
    batch_invariant.ATTN_BWD = a.attn_bwd
    for flag, name in (("bwd-dq", "ATTN_BWD_DQ"), ("bwd-dkdv", "ATTN_BWD_DKDV"),
                       ("bwd2-dq", "ATTN_BWD2_DQ"), ("bwd2-dkdv", "ATTN_BWD2_DKDV")):
        got = getattr(a, f"attn_{flag.replace('-', '_')}")
        if got:
            setattr(batch_invariant, name, tuple(int(x) for x in got.split(",")))
            if len(getattr(batch_invariant, name)) != 4:
                p.error(f"--attn-{flag} {got}: give queries,keys,warps,stages")
    a.config = " ".join(f"{flag} {getattr(a, k)}" for flag, k, d in KNOBS
                        if getattr(a, k) != d)
    batch_invariant.RMS_BWD_TRITON = a.norm_bwd == "triton"
    batch_invariant.HEAD_BWD_TRITON = a.head_bwd == "triton"
    batch_invariant.FUSED_ELEMENTWISE = a.fused_elementwise == "on"
    batch_invariant.LAYER_FN = a.layer_fn == "on"
    batch_invariant.FUSED_QK = a.fused_qk == "on"
    batch_invariant.FUSED_ADD_NORM = a.fused_add_norm == "on"
    batch_invariant.ATTN_LSE = a.attn_lse == "on"
    batch_invariant.ATTN_BWD_FULL_BLOCKS = a.attn_full_blocks == "on"
    if a.split_k < 1:
        p.error(f"--split-k {a.split_k}: give a count ≥ 1")
    batch_invariant.SPLIT_K = a.split_k
    if a.attn_large:
        batch_invariant.ATTN_LARGE = tuple(int(x) for x in a.attn_large.split(","))
        bm = batch_invariant.ATTN_LARGE[0]
        if len(batch_invariant.ATTN_LARGE) != 2 or bm < 16 or bm & (bm - 1):
            p.error(f"--attn-large {a.attn_large}: give BM,warps, BM a power of two ≥ 16")
    small = dict(batch=8, prompt_len=16, new=8, check_new=8, train_samples=2, train_len=64)
    full = dict(batch=256, prompt_len=128, new=128, check_new=32, train_samples=8,
                train_len=2048)
    for k, v in (small if a.small else full).items():
        if not getattr(a, k):
            setattr(a, k, v)
    root = pathlib.Path(a.out) if a.out else pathlib.Path(tempfile.mkdtemp(prefix="determinism-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    if not (model_dir / "config.json").exists():
        make_model("tiny-qwen3" if a.small else "qwen3-0.6b", model_dir, seed=7,
                   dtype="" if a.small else "bfloat16")
        no_eos(model_dir)
    if a.device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(torch.device(a.device))
    else:
        device_name = "cpu"
    saved = root / "determinism.json"
    before = {}
    if saved.exists():
        before = {label(r): r for r in json.loads(saved.read_text())["modes"]}
    det = None
    for mode in ("default", "deterministic"):
        if a.mode in ("both", mode):
            r = run_mode(model_dir, a, mode == "deterministic")
            before[label(r)] = r
            det = r if mode == "deterministic" else det
    # The default mode first, then the deterministic rows in the order they were first run.
    rows = sorted(before.values(), key=lambda r: r["mode"] != "default")
    text = table(rows, a, device_name)
    print(text)
    saved.write_text(json.dumps({"device": device_name, "args": vars(a), "modes": rows},
                                indent=2))
    if det is None:
        return 0
    ok = (det["batch_invariant"] and det["prefix_hits"] > 0 and det["repeatable"]
          and all(det[k][m] == 0.0 for k in ("base", "lora", "prefix") for m in ("score", "train")))
    if a.check and not ok:
        print("deterministic mode: the identities do not hold", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
