"""The deterministic mode's training pieces timed alone on one device, in one table.

    python engines/torch/bench_det_train.py [--device cuda|cpu] [--small] [--sections a,b]
        [--layers N] [--reps N] [--dq Q,K,W,S;…] [--dkdv Q,K,W,S;…]
        [--dq2 R,K,W,S;…] [--dkdv2 R,K,W,S;…]

Qwen3-0.6B's layer shape in bf16 (--small: a tiny one in fp16, for the CPU under Triton's
interpreter and the test that runs this; its times mean nothing):

  attention  the Triton attention of a training pass (8 × 2,048 tokens, causal): its forward and
             its backward pass's two kernels, device ms (median of --reps after a warm-up), for
             batch_invariant's switches: the forward's log-sum-exp kept for the dQ kernel or
             recomputed (ATTN_LSE), the blocks whose queries see all their keys unmasked or not
             (ATTN_BWD_FULL_BLOCKS), and the backward kernels' blocks (--dq, --dkdv: lists of
             queries,keys,warps,stages separated by ";", each tried with the defaults' other);
             then the second form's backward (ATTN_BWD "triton2": rows of the query heads of a
             key head together, the causal bounds by arithmetic) with the log-sum-exp kept and
             recomputed, and its blocks (--dq2, --dkdv2: rows,keys,warps,stages, rows being
             queries × the 2 heads of a key head). Each row says whether two calls gave the
             same gradients bit for bit, and the largest difference from the first form's
             default (relative to the gradient's largest entry; bf16 rounding, ~1e-2, is fine)
  layers     --layers decoder layers (random weights) forward and backward over 16,384 tokens in
             micro-batches of 4,096 and of 16,384, each layer one autograd node (LAYER_FN) or an
             operation a node: wall ms for the 16,384 tokens and the process's CPU ms meanwhile
             (CPU ms near wall ms: the step waits for the host's launches)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

if not torch.cuda.is_available():  # Triton's interpreter runs the kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slimen_torch import batch_invariant as bi  # noqa: E402
from slimen_torch import kernels  # noqa: E402,F401  (the interpreter's fixes, on the CPU)
from slimen_torch.config import ModelConfig  # noqa: E402
from slimen_torch.model import Block, block_forward, inv_frequencies  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:
    """The median ms of fn() over reps calls after one warm-up (on a GPU, where kernels compile):
    CUDA events on a GPU, wall time elsewhere."""
    if dev.type == "cuda":
        fn()
        sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def config(small: bool, layers: int) -> ModelConfig:
    if small:
        return ModelConfig("Qwen3ForCausalLM", 512, 32, 64, layers, 4, 2, 16, 512, 1e-6, 1e6, True,
                           qk_norm=True)
    return ModelConfig("Qwen3ForCausalLM", 151936, 1024, 3072, layers, 16, 8, 128, 4096, 1e-6,
                       1e6, True, qk_norm=True)


def blocks(text: str) -> list[tuple]:
    return [tuple(int(x) for x in b.split(",")) for b in text.split(";") if b]


def attention_rows(a, dev, dtype) -> list[str]:
    cfg = config(a.small, 1)
    B, T = (1, 24) if a.small else (8, 2048)
    H, KV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, T, H, D, generator=g, device=dev).to(dtype)
    # k and v as a training pass has them: [B, KV, T, D] views of [B, T, KV, D].
    k = torch.randn(B, T, KV, D, generator=g, device=dev).to(dtype).transpose(1, 2)
    v = torch.randn(B, T, KV, D, generator=g, device=dev).to(dtype).transpose(1, 2)
    go = torch.randn(B, T, H, D, generator=g, device=dev).to(dtype)
    pos = torch.arange(T, device=dev).expand(B, T)
    scale = D ** -0.5
    dq0, dkdv0 = bi.ATTN_BWD_DQ, bi.ATTN_BWD_DKDV
    dq20, dkdv20 = bi.ATTN_BWD2_DQ, bi.ATTN_BWD2_DKDV
    if a.small:
        dq0, dkdv0 = (16, 16, 4, 1), (16, 16, 4, 1)
        dq20, dkdv20 = (16, 16, 4, 1), (16, 16, 4, 1)
    runs = [("triton", lse, full, dq0, dkdv0) for lse in (True, False) for full in (True, False)]
    runs += [("triton", True, True, b, dkdv0) for b in blocks(a.dq)]
    runs += [("triton", True, True, dq0, b) for b in blocks(a.dkdv)]
    runs += [("triton2", lse, True, dq20, dkdv20) for lse in (True, False)]
    runs += [("triton2", True, True, b, dkdv20) for b in blocks(a.dq2)]
    runs += [("triton2", True, True, dq20, b) for b in blocks(a.dkdv2)]
    rows = [f"| attention ({B}×{T}, causal) | forward ms | backward ms | total ms | repeats "
            "| max diff |", "|---|---:|---:|---:|---|---:|"]
    first, saved = None, {name: getattr(bi, name) for name in SWITCHES}
    try:
        for form, lse, full, dq, dkdv in runs:
            bi.ATTN_BWD, bi.ATTN_LSE, bi.ATTN_BWD_FULL_BLOCKS = form, lse, full
            if form == "triton":
                bi.ATTN_BWD_DQ = bi.ATTN_BWD_DQ_F32 = dq
                bi.ATTN_BWD_DKDV = bi.ATTN_BWD_DKDV_F32 = dkdv
            else:
                bi.ATTN_BWD2_DQ = bi.ATTN_BWD2_DQ_F32 = dq
                bi.ATTN_BWD2_DKDV = bi.ATTN_BWD2_DKDV_F32 = dkdv
            buf = bi._attention_lse(q)
            o = bi.attention_triton(q, k, v, pos, scale, lse=buf)

            def bwd_call():
                return bi.attention_backward_triton(q, k, v, o, pos, go, scale, lse=buf,
                                                    causal=True)
            fwd = timed(lambda: bi.attention_triton(q, k, v, pos, scale, lse=buf), dev, a.reps)
            bwd = timed(bwd_call, dev, a.reps)
            # Two more calls: the same bits? And how far from the first row's gradients (the
            # first form's defaults), relative to each gradient's largest entry.
            one, two = bwd_call(), bwd_call()
            same = all(torch.equal(x, y) for x, y in zip(one, two))
            first = first or one
            diff = max(((x.float() - w.float()).abs().max() / w.float().abs().max()).item()
                       for x, w in zip(one, first))
            name = (f"lse {'kept' if lse else 'recomputed'}, full blocks "
                    f"{'on' if full else 'off'}, dQ {','.join(map(str, dq))}, "
                    f"dK/dV {','.join(map(str, dkdv))}")
            if form == "triton2":
                name = (f"triton2: lse {'kept' if lse else 'recomputed'}, "
                        f"dQ2 {','.join(map(str, dq))}, dK/dV2 {','.join(map(str, dkdv))}")
            rows.append(f"| {name} | {fwd:.2f} | {bwd:.2f} | {fwd + bwd:.2f} | "
                        f"{'yes' if same else 'NO'} | {diff:.1e} |")
    finally:  # the next section with the defaults
        for name, val in saved.items():
            setattr(bi, name, val)
    return rows


def layer_rows(a, dev, dtype) -> list[str]:
    cfg = config(a.small, a.layers)
    seq, total, sizes = (8, 16, (8, 16)) if a.small else (2048, 16384, (4096, 16384))
    g = torch.Generator(device=dev).manual_seed(2)
    layers = [Block(cfg, device=dev, dtype=dtype) for _ in range(cfg.layers)]
    for blk in layers:
        for name, p in blk.named_parameters():
            with torch.no_grad():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=g, device=dev) * 0.02)
    ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv_frequencies(cfg)
    ang = torch.cat((ang, ang), dim=-1).to(dev)
    cos, sin = ang.cos(), ang.sin()
    xs = torch.randn(total // seq, seq, cfg.hidden, generator=g, device=dev).to(dtype)

    def step(mbt: int):
        rows = mbt // seq
        for i in range(0, xs.shape[0], rows):
            x = xs[i:i + rows].clone().requires_grad_()
            with bi.mode():
                y = x
                for blk in layers:
                    y = block_forward(cfg, y, blk.weights(), cos, sin)[0]
            y.float().square().mean().backward()
        for blk in layers:
            for p in blk.parameters():
                p.grad = None

    out = [f"| {cfg.layers} layers, {total} tokens | micro-batch | wall ms | host CPU ms |",
           "|---|---:|---:|---:|"]
    for mbt in sizes:
        for one in (True, False):
            bi.LAYER_FN = one
            if dev.type == "cuda":
                step(mbt)
                sync(dev)
            walls, cpus = [], []
            for _ in range(a.reps):
                t0, c0 = time.perf_counter(), time.process_time()
                step(mbt)
                sync(dev)
                walls.append((time.perf_counter() - t0) * 1e3)
                cpus.append((time.process_time() - c0) * 1e3)
            name = "one node a layer" if one else "a node an operation"
            out.append(f"| {name} | {mbt} | {statistics.median(walls):.1f} | "
                       f"{statistics.median(cpus):.1f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU, tests)")
    p.add_argument("--sections", default="attention,layers")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default 28; --small 1)")
    p.add_argument("--reps", type=int, default=0, help="timed calls (default 5; --small 1)")
    p.add_argument("--dq", default="", help="more dQ blocks to try, e.g. 64,64,4,3;128,64,8,3")
    p.add_argument("--dkdv", default="", help="more dK/dV blocks to try, e.g. 64,128,8,2")
    p.add_argument("--dq2", default="",
                   help="more dQ blocks of the second form, e.g. 128,32,8,3;64,64,4,3")
    p.add_argument("--dkdv2", default="",
                   help="more dK/dV blocks of the second form, e.g. 64,64,8,2;32,128,8,3")
    a = p.parse_args(argv)
    a.layers = a.layers or (1 if a.small else 28)
    a.reps = a.reps or (1 if a.small else 5)
    dev = torch.device(a.device)
    dtype = torch.float16 if a.small else torch.bfloat16
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    saved = {k: getattr(bi, k) for k in SWITCHES}
    try:
        bi.FORCE_TRITON = dev.type != "cuda"
        for sec in a.sections.split(","):
            print()
            print("\n".join({"attention": attention_rows, "layers": layer_rows}[sec](a, dev,
                                                                                     dtype)))
    finally:  # as they were (a test's process goes on)
        for k, v in saved.items():
            setattr(bi, k, v)
    return 0


SWITCHES = ("FORCE_TRITON", "LAYER_FN", "ATTN_LSE", "ATTN_BWD_FULL_BLOCKS", "ATTN_BWD_DQ",
            "ATTN_BWD_DQ_F32", "ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32", "ATTN_BWD",
            "ATTN_BWD2_DQ", "ATTN_BWD2_DQ_F32", "ATTN_BWD2_DKDV", "ATTN_BWD2_DKDV_F32")


if __name__ == "__main__":
    sys.exit(main())
