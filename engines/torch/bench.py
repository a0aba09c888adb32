"""The GPU engine's numbers in one run: kernel checks, generation and training throughput, one table.

    python engines/torch/bench.py [--out DIR] [--budget SECONDS] [--sections a,b,…]

On a random Qwen3-0.6B-shaped model (make-model, bf16, no EOS so every response has exactly the
asked length). Each section runs in its own process (a compiler crash or an out-of-memory error
costs that section only), in this order, skipping those that no longer fit in --budget:

  kernels        the Triton kernels against PyTorch in bf16 on the model's shapes (relative
                 error, sampled-token agreement) and their times against the PyTorch code
  gen            the engine's defaults (Triton attention and sampler, all-Triton batch-1 step,
                 compiled layer halves, CUDA graphs): 128 prompt + 256 sampled tokens (temperature
                 1, top_p 1) at batch 1 and 256, tok/s = sampled tokens / wall time from submission
                 to the last completion (prefill included), best of two after a warm-up run; GPU
                 time of one captured step; bf16 logit parity with transformers; generation
                 log-probs against Score at batch 1 and 4
  train          one AdamW step of the policy loss on 8 × 2,048 tokens (and 16 × 2,048 in one
                 micro-batch): tokens/s, model-FLOPs utilisation against 989 TFLOP/s, peak memory,
                 with the defaults (chunked log-prob head, fused RMSNorm, the layer compiled with
                 dynamic shapes; TORCHDYNAMO_VERBOSE=1, so a compiler failure is recorded with its
                 whole traceback before the trainer falls back)
  train_eager    the same with compilation off
  gen_before     generation as before this change (no Triton kernels: compiled decode layer,
                 PyTorch attention and sampler)
  train_before   training as before (whole fp32 logits, unfused RMSNorm)
  hf             HF generate (sdpa, dynamic cache, sampling) on 32 / 64 new tokens at batch 1 / 256
  train_regional the training layer's q/k/v and MLP halves compiled around eager attention
  gen_layer_b1   batch 1 with the Triton attention and sampler but the compiled layer halves
                 instead of the all-Triton step
  train_static   the whole layer compiled for static shapes (recompiles for every new shape)

Not in the default list (select with --sections):

  first_step     the first step of a new worker process, three times in a row on one model
                 shape, each a fresh process with the engine's defaults: with an empty compile
                 cache (cold), again with the cache the first one filled (warm), and with the
                 caches in a fresh folder the user named (TORCHINDUCTOR_CACHE_DIR and
                 TRITON_CACHE_DIR: a machine that never ran slimen_torch, as every machine was
                 before the cache was kept); each
                 times building the engine, a first generate (8 prompts × 32 tokens: the decode
                 layer compiled and captured) and a first and second training step (8 × 2,048
                 tokens), and records the compile cache's start-up line and hits

  gen_b1         batch 1 only, with the engine's defaults (the prefill of the lone 128-token
                 prompt replayed from a CUDA graph, its first token drawn by the Triton sampler),
                 then on the same engine the eager prefill with the Triton first-token sampler
                 and the eager prefill with the PyTorch sampler (as before); for each the time
                 an admission takes (prefill + first token, read back); the captured step's GPU
                 time; the checks: the graph prefill's logits and cache row against the eager
                 prefill's (bf16), generation log-probs against Score at batch 1, greedy tokens;
                 the prefill's layer eager (--no-compile-prefill); on a GPU also without
                 programmatic dependent launch: tok/s and step

  profile        where the GPU time goes (torch.profiler): kernel tables (out/profile_*.txt) of a
                 batch-1 and a batch-256 generation, of one captured decode step at each batch
                 and of one training step (8 × 2,048 tokens): time by kind of kernel (GEMM,
                 attention, compiled/Triton, optimizer, copies), kernels a run, and the GPU-busy
                 share of the wall time (below 1: the GPU waited for the host); and the training
                 step's Python under cProfile (out/profile_train_host.txt)

  sweep_b1       the batch-1 step's tunables on one engine (the products' tile and warps, the
                 attention's split length and split launch): tok/s and the captured step's GPU
                 time of each

  sweep_attn     the batched decode attention's tile, warps and pipeline stages over a bf16 and
                 an fp8 cache: the kernel alone at batch 256 and positions 0 to the last (GPU µs,
                 share of a copy's bandwidth), and bf16 tok/s of the default and fastest two

  gen_group      GRPO's shape at batch 256 (32 prompts × 8 samples): tok/s with a prompt's
                 samples reading its keys and values once as a group (the default) and each
                 reading its own (--no-shared-prompts), one engine; their agreement, and the
                 shared run's log-probs against Score's (gen_group_fp8: the same over an fp8
                 cache; gen_group_requests: a prompt's 8 samples as 8 requests)

  gen_attn_launch batch 256 with the batched attention's launch before 2026-11-26 (64 positions,
                 4 warps) beside the default, over a bf16 and an fp8 cache (tok/s, step ms)

  train_split    before the layer was traced whole: the training layer compiled with the
                 attention between two compiled halves (SDPA's grouping left symbolic)

  gen_fp8kv      the decode attention alone at batch 256 over a bf16 and an fp8 cache (GPU ms, GB/s,
                 at the middle and last position); then `gen` with the KV cache in fp8
                 (--kv-cache-dtype fp8): tok/s at batch 1 and 256, the captured steps' GPU time,
                 generation log-probs against Score's (bf16, no cache: the price of fp8 keys and
                 values); on the same engine a generator with the bf16 cache (8 rows) for the
                 sampled and greedy tokens of the same seeded requests: how far they agree; then the
                 PyTorch decode path (compiled decode_layer, --no-kernels) over an fp8 cache against
                 Score. Run beside `gen` (--sections gen,gen_fp8kv) for the table's comparison

Results: DIR/bench.json (everything, errors included), DIR/bench.md (the table, also printed last),
DIR/bench.log (all output). A dry run on the CPU: --device cpu --shape tiny --new 8 --train-len 64
(with TRITON_INTERPRET=1 for the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from slimen_torch import kernels as K  # noqa: E402
from slimen_torch import sampling as S  # noqa: E402
from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402
from slimen_torch.model import apply_rope, block_forward, decode_layer, rms_norm  # noqa: E402
from slimen_torch.train import token_logprobs  # noqa: E402
from slimen_torch.types import (Batch, GenerateRequest, LossConfig, Sample, Sampling,  # noqa: E402
                                ScoreRequest)

PEAK_BF16 = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (datasheet)
PROMPT = 128

# name → seconds it is expected to take (a section starts only if ~60% of that is left)
SECTIONS = {
    "kernels": 45, "gen": 110, "train": 100, "train_eager": 40, "gen_before": 90,
    "train_before": 40, "hf": 60, "train_regional": 60, "gen_layer_b1": 60,
    "train_static": 60, "gen_b1": 60, "first_step": 300, "first_step_run": 150,
    "profile": 150, "sweep_b1": 120, "train_split": 100, "sweep_attn": 120, "gen_fp8kv": 150,
    "gen_attn_launch": 150, "train_old_opt": 60, "gen_group": 120,
    "gen_group_fp8": 120, "gen_group_requests": 120,
}
DEFAULT_SECTIONS = ["kernels", "gen", "train", "train_eager", "gen_before", "train_before", "hf",
                    "train_regional", "gen_layer_b1", "train_static"]


def log(*a):
    print(*a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def no_eos(d: pathlib.Path) -> None:
    """Removes the end-of-sequence token so that every response runs to max_tokens."""
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):
        raw = json.loads((d / name).read_text())
        raw[key] = None
        (d / name).write_text(json.dumps(raw))


def prompts(n: int, vocab: int, seed: int, length: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def timed(fn, reps: int = 20) -> float:
    """Milliseconds per call: CUDA events around reps calls after two warm-ups (wall on CPU)."""
    fn()
    fn()
    sync()
    if torch.cuda.is_available():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        sync()
        return a.elapsed_time(b) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def graph_timed(fn, reps: int = 20) -> float:
    """Milliseconds per call of GPU time alone: reps calls captured in one CUDA graph, replayed
    five times between CUDA events (timed's per-call launch from Python can exceed a small
    kernel's time, and would then be what it measures)."""
    fn()
    sync()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    sync()
    return a.elapsed_time(b) / (5 * reps)


# ---- sections ------------------------------------------------------------------------------

def sec_kernels(a, res):
    from slimen_torch.config import read_config
    cfg, _ = read_config(a.model)
    dev, dt = a.device, torch.bfloat16 if a.device != "cpu" else torch.float32
    H, KV, D, Hd, I, V = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden, cfg.intermediate, \
        cfg.vocab_size
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)

    # Attention: new key written, rows at various lengths.
    for B, L in ((1, 384), (256, 384), (1, 4096), (8, 4096)):
        if dev == "cpu" and B * L > 2048:
            continue
        kc, vc = rn(B, KV, L, D), rn(B, KV, L, D)
        q, kn, vn = rn(B, H, D), rn(B, KV, D), rn(B, KV, D)
        pos = torch.randint(0, L, (B,), generator=g, device=dev)
        pos[0] = L - 1
        kc2, vc2 = kc.clone(), vc.clone()
        o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5)
        ref = K.decode_attention_reference(q.float(), kn.float(), vn.float(), kc2.float(),
                                           vc2.float(), pos, L, D ** -0.5)
        res[f"attn_rel_b{B}_L{L}"] = rel(o.float(), ref)
        res[f"attn_cache_ok_b{B}_L{L}"] = bool(torch.equal(kc[torch.arange(B), :, pos], kn))
        t_k = timed(lambda: K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5))
        t_r = timed(lambda: K.decode_attention_reference(q, kn, vn, kc2, vc2, pos, L, D ** -0.5))
        nbytes = ((pos + 1).sum().item()) * KV * D * 2 * dt.itemsize
        res[f"attn_ms_b{B}_L{L}"] = t_k
        res[f"attn_torch_ms_b{B}_L{L}"] = t_r
        res[f"attn_GBps_b{B}_L{L}"] = nbytes / t_k / 1e6
        log(f"attention B={B} L={L}: rel {res[f'attn_rel_b{B}_L{L}']:.2e}, {t_k:.4f} ms "
            f"({res[f'attn_GBps_b{B}_L{L}']:.0f} GB/s) vs torch {t_r:.4f} ms")
    # Sampler: tokens against sampling.sample on the same bf16 logits.
    for B in (1, 256):
        logits = rn(B, V, s=3.0)
        temp = torch.ones(B, device=dev)
        key = torch.tensor([S.row_key(9, i) for i in range(B)], device=dev)
        step = torch.randint(0, 1000, (B,), generator=g, device=dev)
        u = S.uniform(key, step)
        want, want_lp = S.sample(logits.float(), temp, temp, u, False)
        got, got_lp = K.sample_and_advance(logits, temp, key, step)
        res[f"sample_agree_b{B}"] = (got == want).float().mean().item()
        res[f"sample_lp_maxdiff_b{B}"] = (got_lp - want_lp).abs().max().item()
        res[f"sample_ms_b{B}"] = timed(lambda: K.sample_and_advance(logits, temp, key, step))
        res[f"sample_torch_ms_b{B}"] = timed(
            lambda: S.sample(logits.float(), temp, temp, S.uniform(key, step), False))
        log(f"sampler B={B}: agree {res[f'sample_agree_b{B}']:.4f}, lp Δ "
            f"{res[f'sample_lp_maxdiff_b{B}']:.2e}, {res[f'sample_ms_b{B}']:.4f} ms vs torch "
            f"{res[f'sample_torch_ms_b{B}']:.4f} ms")
    # Batch-1 products and rope.
    x, nw = rn(Hd), (1 + 0.1 * torch.randn(Hd, generator=g, device=dev)).to(dt)
    wqkv, w13, w2 = rn(H * D + 2 * KV * D, Hd, s=0.02), rn(2 * I, Hd, s=0.02), rn(Hd, I, s=0.02)
    qkv = torch.empty(H * D + 2 * KV * D, dtype=dt, device=dev)
    K.gemv(x, wqkv, qkv, norm_w=nw, eps=1e-6)
    res["gemv_norm_rel"] = rel(qkv.float(), torch.nn.functional.linear(
        rms_norm(x[None], nw, 1e-6), wqkv)[0].float())
    act = torch.empty(I, dtype=dt, device=dev)
    K.gemv(x, w13, act, norm_w=nw, eps=1e-6, swiglu=True)
    gt, up = torch.nn.functional.linear(rms_norm(x[None], nw, 1e-6), w13).chunk(2, -1)
    res["gemv_swiglu_rel"] = rel(act.float(), (torch.nn.functional.silu(gt) * up)[0].float())
    out = torch.empty(Hd, dtype=dt, device=dev)
    K.gemv(act, w2, out, res=x)
    res["gemv_res_rel"] = rel(out.float(), (x + torch.nn.functional.linear(act, w2)).float())
    for name, fn, nbytes in (
            ("qkv", lambda: K.gemv(x, wqkv, qkv, norm_w=nw, eps=1e-6), wqkv.numel() * 2),
            ("swiglu", lambda: K.gemv(x, w13, act, norm_w=nw, eps=1e-6, swiglu=True),
             w13.numel() * 2),
            ("down", lambda: K.gemv(act, w2, out, res=x), w2.numel() * 2)):
        t = timed(fn, reps=50)
        res[f"gemv_{name}_us"] = t * 1e3
        res[f"gemv_{name}_GBps"] = nbytes / t / 1e6
    res["gemv_torch_qkv_us"] = timed(
        lambda: torch.nn.functional.linear(rms_norm(x[None], nw, 1e-6), wqkv), reps=50) * 1e3
    log("gemv", {k: v for k, v in res.items() if k.startswith("gemv")})
    # The batch-1 attention with q/k norm and rope inside (rope=…) against PyTorch.
    ang = torch.arange(384.0, device=dev)[:, None] / 1e6 ** (
        torch.arange(0, D, 2, device=dev).float() / D)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    qn, kn_w = (1 + 0.1 * torch.randn(D, generator=g, device=dev)).to(dt), \
        (1 + 0.1 * torch.randn(D, generator=g, device=dev)).to(dt)
    qkv1 = rn(1, H * D + 2 * KV * D)
    q1, k1, v1 = (t.view(1, -1, D) for t in qkv1.split([H * D, KV * D, KV * D], -1))
    kc, vc = rn(1, KV, 384, D), rn(1, KV, 384, D)
    kc2, vc2 = kc.clone(), vc.clone()
    pos = torch.tensor([300], device=dev)
    o = K.decode_attention(q1, k1, v1, kc, vc, pos, 384, D ** -0.5,
                           rope=(qn if cfg.qk_norm else None, kn_w if cfg.qk_norm else None,
                                 cos, sin, 1e-6))
    qr, kr = q1, k1
    if cfg.qk_norm:
        qr, kr = rms_norm(q1, qn, 1e-6), rms_norm(k1, kn_w, 1e-6)
    c, s_ = cos[pos].to(dt), sin[pos].to(dt)
    ref = K.decode_attention_reference(apply_rope(qr, c, s_).float(), apply_rope(kr, c, s_).float(),
                                       v1.float(), kc2.float(), vc2.float(), pos, 384, D ** -0.5)
    res["attn_rope_rel"] = rel(o.float(), ref)
    log("attention with rope", res["attn_rope_rel"])
    # The chunked log-prob head against token_logprobs on the whole logits (values, gradients,
    # time of forward + backward, peak memory).
    N = 4096 if dev != "cpu" else 64
    h = rn(N, Hd).requires_grad_()
    W = rn(V, Hd, s=0.02).requires_grad_()
    tg = torch.randint(0, V, (N,), generator=g, device=dev)
    c = torch.randn(N, generator=g, device=dev)

    def run(fused):
        if fused:
            lp, ent = K.linear_logprobs(h, W, tg, entropy_grad=True)
        else:
            lp, ent = token_logprobs(h @ W.t(), tg, entropy_grad=True)
        ((lp * c).sum() + 0.01 * (ent * c).sum()).backward()
        return lp.detach(), ent.detach()

    outs = []
    for fused in (False, True):
        h.grad = W.grad = None
        if dev != "cpu":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        lp, ent = run(fused)
        outs.append((lp, ent, h.grad.clone(), W.grad.clone()))
        name = "fused" if fused else "torch"
        if dev != "cpu":
            res[f"head_{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        res[f"head_{name}_ms"] = timed(lambda: run(fused), reps=3)
    for i, what in enumerate(("logp", "entropy", "grad_hidden", "grad_weight")):
        res[f"head_rel_{what}"] = rel(outs[1][i].float(), outs[0][i].float())
    log("head", {k: v for k, v in res.items() if k.startswith("head")})


def ours_generate(eng: Engine, batch: int, new: int, reps: int = 2, after_warmup=None) -> float:
    toks = prompts(batch, eng.cfg.vocab_size, 3).tolist()
    reqs = [GenerateRequest(id=f"b{batch}-{i}", prompt_tokens=t,
                            sampling=Sampling(max_tokens=new, temperature=1.0, seed=i))
            for i, t in enumerate(toks)]
    return timed_generate(eng, reqs, new, reps, after_warmup)[0]


def timed_generate(eng: Engine, reqs, new: int, reps: int = 2, after_warmup=None):
    """(best tok/s of reps runs of reqs after a warm-up run, the last run's completions)."""
    eng.generate(reqs)  # warm-up: compiles and captures the shapes this batch goes through
    if after_warmup is not None:
        after_warmup()
    best, cs = 0.0, []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        cs = eng.generate(reqs)
        dt = time.perf_counter() - t
        assert all(len(c.tokens) == new for c in cs)
        best = max(best, len(cs) * new / dt)
    return best, cs


def sec_gen_group(a, res):
    group_section(a, res, "gen_group", "auto")


def sec_gen_group_fp8(a, res):
    group_section(a, res, "gen_group_fp8", "fp8")


def sec_gen_group_requests(a, res):
    group_section(a, res, "gen_group_requests", "auto", separate=True)


def group_section(a, res, prefix: str, kv_cache_dtype: str, separate: bool = False) -> None:
    """GRPO's shape at batch 256: 32 prompts × 8 samples, 128 + new tokens, with the samples of a
    prompt reading its keys and values once as a group (the default) and each reading its own
    (--no-shared-prompts), on one engine, three runs (shared, own, shared); how far the two
    agree on the same seeded requests (bf16: the shared pass sums in another order); and the
    shared run's log-probs against Score's for its first 16 samples (two groups). separate: the
    8 samples of a prompt as 8 requests (slime's n_samples_per_prompt), not one with n = 8."""
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new,
                                  kv_cache_dtype=kv_cache_dtype))
    toks = prompts(32, eng.cfg.vocab_size, 5).tolist()
    if separate:
        reqs = [GenerateRequest(id=f"g{i}-{j}", prompt_tokens=t,
                                sampling=Sampling(max_tokens=a.new, temperature=1.0,
                                                  seed=8 * i + j))
                for i, t in enumerate(toks) for j in range(8)]
    else:
        reqs = [GenerateRequest(id=f"g{i}", prompt_tokens=t, n=8,
                                sampling=Sampling(max_tokens=a.new, temperature=1.0, seed=i))
                for i, t in enumerate(toks)]
    outs = {}
    try:
        for run, share in enumerate((True, False, True)):
            eng.gen.share = share
            eng.gen.graphs.clear()
            name = "shared" if share else "own"
            tps, outs[name] = timed_generate(eng, reqs, a.new)
            res[f"{prefix}_{name}_b256_run{run}"] = tps
            log(prefix, name, tps)
        res[f"{prefix}_shared_b256"] = max(res[f"{prefix}_shared_b256_run0"],
                                           res[f"{prefix}_shared_b256_run2"])
        res[f"{prefix}_own_b256"] = res[f"{prefix}_own_b256_run1"]
        same = total = 0
        lp = 0.0
        for x, y in zip(outs["shared"], outs["own"]):
            n = next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                     len(x.tokens))
            same += n
            total += len(x.tokens)
            if n:
                lp = max(lp, max(abs(p - q) for p, q in zip(x.logprobs[:n], y.logprobs[:n])))
        res[f"{prefix}_tokens_before_divergence"] = same / total
        res[f"{prefix}_logprob_maxdiff"] = lp
        worst = 0.0
        for c in outs["shared"][:16]:
            sc = eng.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
            worst = max(worst, (torch.tensor(c.logprobs) - torch.tensor(sc)).abs().max().item())
        res[f"{prefix}_vs_score"] = worst
        log(prefix, {k: v for k, v in res.items() if k.startswith(prefix)})
    finally:
        eng.gen.share = True
        eng.close()


def step_times(eng: Engine, res: dict, prefix: str) -> None:
    """GPU time of one captured decode step at the longest bucket, without the scheduler: with
    every row at its last position (all keys read: _step_ms) and at position 0 (_step0_ms; the
    Triton attention then reads one key)."""
    if not torch.cuda.is_available():
        return
    gen = eng.gen
    for (B, L, top, *_), g in sorted(gen.graphs.items()):
        if B not in (1, 256) or L != gen.L or top:
            continue
        # All rows are idle after the benchmark, so replays do not advance them.
        for name, p in (("step0", 0), ("step", L - 1)):
            gen.pos[:B] = p
            g.replay()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                g.replay()
            end.record()
            sync()
            res[f"{prefix}_{name}_ms_b{B}"] = start.elapsed_time(end) / 50
        gen.pos[:B] = 0
    log("step times", {k: v for k, v in res.items() if "step_ms" in k})


def decode_vs_score(eng: Engine, res: dict, prefix: str, ns=(1, 4)) -> None:
    """Generation log-probs (KV cache, kernels, graphs) against Score (the full forward pass), at
    batch 1 and with four rows; and the greedy tokens, for comparison across sections."""
    toks = prompts(4, eng.cfg.vocab_size, 1).tolist()
    for n in ns:
        reqs = [GenerateRequest(id=f"p{n}-{i}", prompt_tokens=toks[i],
                                sampling=Sampling(max_tokens=64, seed=i)) for i in range(n)]
        cs = eng.generate(reqs)
        worst = 0.0
        for c in cs:
            s = eng.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
            worst = max(worst, (torch.tensor(c.logprobs) - torch.tensor(s)).abs().max().item())
        res[f"{prefix}_decode_vs_score_b{n}"] = worst
    g = eng.generate([GenerateRequest(id="greedy", prompt_tokens=toks[0],
                                      sampling=Sampling(max_tokens=32, temperature=0.0))])[0]
    res[f"{prefix}_greedy"] = g.tokens
    log(prefix, "decode vs score", {k: v for k, v in res.items() if "decode_vs" in k})


def parity(a, eng: Engine, res: dict) -> None:
    from transformers import AutoModelForCausalLM
    dev = a.device
    toks = prompts(4, eng.cfg.vocab_size, 1).to(dev)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev).eval()
        ref = hf(toks).logits.float()
        del hf
        got = eng.model.logits(eng.model(toks)).float()
        hf32 = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(dev).eval()
        ref32 = hf32(toks).logits.float()
        del hf32
    res["parity_rel_vs_hf_bf16"] = rel(got, ref)
    res["parity_rel_vs_hf_fp32"] = rel(got, ref32)
    res["hf_bf16_rel_vs_hf_fp32"] = rel(ref, ref32)
    log("parity", {k: v for k, v in res.items() if k.startswith(("parity", "hf_bf16"))})


def gen_paths(gen, res: dict, prefix: str) -> None:
    """The generator's paths (Triton kernels, all-Triton batch-1 step, graphs) and the errors
    that made it fall back, into res."""
    res[f"{prefix}_compile_error"] = gen.compile_error[:3000]
    res[f"{prefix}_kernel_error"] = gen.kernel_error[:3000]
    res[f"{prefix}_prefill_error"] = gen.prefill_error[:3000]
    res[f"{prefix}_paths"] = dict(triton=gen.triton, fused_b1=gen.fused_b1,
                                  graphs=len(gen.graphs))


def gen_section(a, res, prefix, opts, b256=True, extra=True):
    eng = Engine(a.model, Options(device=a.device, slots=256 if b256 else 8,
                                  max_seq_len=PROMPT + a.new, **opts))
    try:
        res[f"{prefix}_b1"] = ours_generate(eng, 1, a.new)
        log(prefix, "b1", res[f"{prefix}_b1"])
        if b256:
            res[f"{prefix}_b256"] = ours_generate(eng, 256, a.new)
            log(prefix, "b256", res[f"{prefix}_b256"])
            if prefix == "gen" and torch.cuda.is_available():
                # The same engine with the prefill's layer eager (--no-compile-prefill; before).
                default, eng.gen.prefill_fn = eng.gen.prefill_fn, block_forward
                res[f"{prefix}_prefill_eager_b256"] = ours_generate(eng, 256, a.new)
                eng.gen.prefill_fn = default
                log(prefix, "b256 with the prefill layer eager",
                    res[f"{prefix}_prefill_eager_b256"])
        step_times(eng, res, prefix)
        gen_paths(eng.gen, res, prefix)
        if extra:
            decode_vs_score(eng, res, prefix)
        if prefix == "gen":
            parity(a, eng, res)
    finally:
        eng.close()


def admit_timer(gen) -> dict:
    """Wraps gen._admit: wall time of the admissions that admitted something (each ends by
    reading the first tokens back, so the prefill's GPU time is included)."""
    acc = {"s": 0.0, "n": 0}
    orig = gen._admit

    def timed_admit():
        busy = bool(gen.waiting)
        t = time.perf_counter()
        orig()
        if busy:
            acc["s"] += time.perf_counter() - t
            acc["n"] += 1
    gen._admit = timed_admit
    return acc


def prefill_check(eng: Engine, res: dict, prefix: str) -> None:
    """The bucketed (graph) prefill against the eager one on the same prompts, in the model's
    dtype: ‖Δ‖/‖·‖ of the last token's logits and of the keys and values written, and whether
    the arg-max agrees; 128 tokens (bucket = prompt length) and 100 (padded to 128)."""
    gen = eng.gen
    dev = gen.device
    for T in (128, 100):
        toks = prompts(1, eng.cfg.vocab_size, 5, length=T)[0].tolist()

        def run():
            gen._ensure_cache()
            a, b = gen.S - 1, gen.S - 2  # rows no benchmark request uses
            got = gen._prefill_bucketed(toks, a)
            if got is None:
                return None
            got = got.float().clone()
            want = gen._prefill_eager([toks], torch.tensor([0], device=dev),
                                      torch.tensor([b], device=dev)).float()
            kerr = max(rel(kc[a, :, :T].float(), kc[b, :, :T].float()) for kc in gen.k)
            verr = max(rel(vc[a, :, :T].float(), vc[b, :, :T].float()) for vc in gen.v)
            return rel(got, want), kerr, verr, bool(got.argmax() == want.argmax())

        out = eng._call(run)
        if out is None:
            res[f"{prefix}_prefill_check_T{T}"] = "the bucketed prefill did not run"
            continue
        lg, kerr, verr, agree = out
        res[f"{prefix}_prefill_logits_rel_T{T}"] = lg
        res[f"{prefix}_prefill_kv_rel_T{T}"] = max(kerr, verr)
        res[f"{prefix}_prefill_argmax_agree_T{T}"] = agree
    log(prefix, "prefill check", {k: v for k, v in res.items() if "prefill_" in k})


def sec_gen_b1(a, res):
    prefix, opts = "gen_b1", {}
    if a.device == "cpu":  # a dry run: the GPU defaults' paths, without graphs
        opts = dict(prefill_graph_max=512, kernels=True, fused_b1=True)
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new, **opts))
    try:
        gen = eng.gen
        acc = admit_timer(gen)
        runs = [("", {}),
                ("_eager_prefill", dict(prefill_graph_max=0, prefill_fn=block_forward)),
                ("_before", dict(prefill_graph_max=0, first_token_triton=False,
                                 prefill_fn=block_forward)),
                ("_prefill_layer_eager", dict(prefill_fn=block_forward))]
        keep = dict(prefill_graph_max=gen.prefill_graph_max, first_token_triton=True,
                    prefill_fn=gen.prefill_fn)
        for suffix, attrs in runs:
            for k, v in {**keep, **attrs}.items():
                setattr(gen, k, v)
            gen.pf_graphs.clear()  # captured again with this run's prefill layer

            def reset():  # admissions timed after the warm-up
                acc["s"] = acc["n"] = 0
            res[f"{prefix}{suffix}_b1"] = ours_generate(eng, 1, a.new, after_warmup=reset)
            res[f"{prefix}{suffix}_admit_ms"] = 1e3 * acc["s"] / max(1, acc["n"])
            log(prefix + suffix, "b1", res[f"{prefix}{suffix}_b1"], "tok/s; admission",
                res[f"{prefix}{suffix}_admit_ms"], "ms")
        for k, v in keep.items():
            setattr(gen, k, v)
        gen.pf_graphs.clear()  # the last run's were captured with its prefill layer
        if torch.cuda.is_available():
            # The same engine without programmatic dependent launch (kernels._pdl): each kernel
            # of the step starts only when the previous one has finished, as before.
            os.environ["SLIMEN_PDL"] = "0"
            K._PDL.clear()
            gen.graphs.clear()
            res[f"{prefix}_no_pdl_b1"] = ours_generate(eng, 1, a.new)
            step_times(eng, res, prefix + "_no_pdl")
            log(prefix, "without PDL: b1", res[f"{prefix}_no_pdl_b1"], "tok/s")
            os.environ["SLIMEN_PDL"] = "1"
            K._PDL.clear()
            gen.graphs.clear()
            ours_generate(eng, 1, a.new)  # capture again with PDL for the checks below
        res[f"{prefix}_prefill_graphs"] = sorted(gen.pf_graphs)
        gen_paths(gen, res, prefix)
        step_times(eng, res, prefix)
        prefill_check(eng, res, prefix)
        decode_vs_score(eng, res, prefix, ns=(1,))
    finally:
        eng.close()


def sec_gen(a, res):
    gen_section(a, res, "gen", {})


def sec_gen_before(a, res):
    gen_section(a, res, "gen_before", dict(kernels=False))


def attention_inputs(eng: Engine, B: int, L: int):
    """Random inputs of the decode attention at the engine's shape (seeded): q [B, heads, D], the
    new key and value [B, kv_heads, D], and {"bf16": (keys, values), "fp8": the same values in
    float8_e4m3fn} caches [B, kv_heads, L, D] (the model's dtype for "bf16")."""
    cfg, dev, dt = eng.cfg, eng.gen.device, eng.model.embed.dtype
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    q, kn, vn = rand(B, cfg.heads, cfg.head_dim), *(rand(B, cfg.kv_heads, cfg.head_dim)
                                                     for _ in range(2))
    k16, v16 = (rand(B, cfg.kv_heads, L, cfg.head_dim) for _ in range(2))
    return q, kn, vn, {"bf16": (k16, v16),
                       "fp8": (k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn))}


def fp8_attention_alone(eng: Engine, a, res: dict, prefix: str) -> None:
    """The Triton decode attention alone at batch 256, every row at position 192 and at the last
    position, over a bf16 cache and over the same values in fp8: GPU ms (graph_timed), GB/s of
    keys and values read, and the outputs' relative difference at the last position."""
    cfg, dev = eng.cfg, eng.gen.device
    B, L = 256, PROMPT + a.new
    q, kn, vn, caches = attention_inputs(eng, B, L)
    scale = cfg.head_dim ** -0.5
    outs = {}
    for pos in (L // 2, L - 1):
        p = torch.full((B,), pos, dtype=eng.gen.pos.dtype, device=dev)
        for name, (kc, vc) in caches.items():
            def call(kc=kc, vc=vc):
                return K.decode_attention(q, kn, vn, kc, vc, p, L, scale)
            outs[name] = call().float()
            ms = graph_timed(call)
            res[f"{prefix}_attn_ms_{name}_pos{pos}"] = ms
            res[f"{prefix}_attn_gbps_{name}_pos{pos}"] = \
                2 * B * cfg.kv_heads * (pos + 1) * cfg.head_dim * kc.element_size() / ms / 1e6
    res[f"{prefix}_attn_rel_fp8_vs_bf16"] = rel(outs["fp8"], outs["bf16"])
    log(prefix, "attention alone", {k: v for k, v in res.items() if "_attn_" in k})


def sec_gen_fp8kv(a, res):
    """gen_section's measurements with kv_cache_dtype fp8, then the same seeded requests on a
    generator of the same model with the bf16 cache: sampled-token agreement."""
    prefix = "gen_fp8kv"
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new,
                                  kv_cache_dtype="fp8"))
    try:
        if torch.cuda.is_available():
            fp8_attention_alone(eng, a, res, prefix)
        gen = eng.gen
        gen._ensure_cache()
        res[f"{prefix}_cache_dtype"] = str(gen.k[0].dtype)
        res[f"{prefix}_cache_gib"] = sum(t.nbytes for t in gen.k + gen.v) / 2 ** 30
        res[f"{prefix}_b1"] = ours_generate(eng, 1, a.new)
        log(prefix, "b1", res[f"{prefix}_b1"])
        res[f"{prefix}_b256"] = ours_generate(eng, 256, a.new)
        log(prefix, "b256", res[f"{prefix}_b256"])
        step_times(eng, res, prefix)
        gen_paths(gen, res, prefix)
        decode_vs_score(eng, res, prefix)
        # The same requests from an fp8 generator and one of the model's dtype (bf16 on a GPU;
        # 8 rows each: batch 1 and 4).
        toks = prompts(4, eng.cfg.vocab_size, 11).tolist()
        reqs = [GenerateRequest(id=f"agree-{i}", prompt_tokens=toks[i],
                                sampling=Sampling(max_tokens=64, seed=i,
                                                  temperature=0.0 if i == 3 else 1.0))
                for i in range(4)]

        def outputs():
            return [c for n in (1, 4) for c in eng.generate(reqs[:n])]

        eng.opts.slots = 8
        eng.gen = eng.new_generator(eng.model)  # fp8, 8 rows
        eng.gen.bank = eng.bank
        f8 = outputs()
        eng.kv_dtype = eng.dtype
        eng.gen = eng.new_generator(eng.model)  # the model's dtype, 8 rows
        eng.gen.bank = eng.bank
        bf = outputs()
        same, total, first, lp = 0, 0, [], 0.0
        for x, y in zip(f8, bf):
            n = next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                     len(x.tokens))
            first.append(n)
            same += sum(p == q for p, q in zip(x.tokens, y.tokens))
            total += len(x.tokens)
            if n:  # log-probs of the common prefix: the same tokens in the same contexts
                lp = max(lp, max(abs(p - q) for p, q in zip(x.logprobs[:n], y.logprobs[:n])))
        res[f"{prefix}_agree_identical"] = \
            f"{sum(n == len(x.tokens) for n, x in zip(first, f8))} of {len(first)}"
        res[f"{prefix}_agree_first_divergence"] = first
        res[f"{prefix}_agree_tokens"] = same / total
        res[f"{prefix}_agree_logprob_maxdiff"] = lp
        log(prefix, "vs the bf16 cache", {k: v for k, v in res.items() if "_agree" in k})
        # The PyTorch decode path over the fp8 cache (--no-kernels: the compiled decode_layer
        # in CUDA graphs), 8 rows: that it runs compiled, and its log-probs against Score.
        eng.kv_dtype, eng.opts.kernels = torch.float8_e4m3fn, False
        eng.gen = eng.new_generator(eng.model)
        eng.gen.bank = eng.bank
        decode_vs_score(eng, res, prefix + "_torch")
        res[f"{prefix}_torch_compile_error"] = eng.gen.compile_error[:3000]
        res[f"{prefix}_torch_paths"] = dict(triton=eng.gen.triton, graphs=len(eng.gen.graphs),
                                            compiled=eng.gen.layer_fn is not decode_layer)
    finally:
        eng.close()


def sec_sweep_b1(a, res):
    """The batch-1 step's tunables on this GPU, one engine: the products' tile (kernels.GEMV_TILE
    elements) and warps (GEMV_WARPS), the attention's split length (ATTN_MIN_SPLIT) and its split
    launch (ATTN_LAUNCH[(True, False)]: positions a tile, warps, stages); for each, tok/s at
    batch 1 and the captured step's GPU time at the last position (sweep_b1 in bench.json, the
    defaults first)."""
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new))
    launch = K.ATTN_LAUNCH[(True, False)]
    default = (K.GEMV_TILE, K.GEMV_WARPS, K.ATTN_MIN_SPLIT, launch)
    configs = [default] + [(t, w, default[2], launch) for t in (4096, 8192, 16384)
                           for w in (4, 8) if (t, w) != default[:2]] + \
        [(default[0], default[1], s, launch) for s in (32, 128)] + \
        [(default[0], default[1], default[2], lc) for lc in
         ((64, 4, 0), (32, 2, 0), (32, 4, 0), (64, 2, 0), (16, 1, 0), (64, 4, 2)) if lc != launch]
    rows = []
    try:
        for tile, warps, split, lc in configs:
            K.GEMV_TILE, K.GEMV_WARPS, K.ATTN_MIN_SPLIT = tile, warps, split
            K.ATTN_LAUNCH[(True, False)] = lc
            eng.gen.graphs.clear()
            row = {"tile": tile, "warps": warps, "min_split": split, "attn_launch": lc}
            try:
                row["b1"] = ours_generate(eng, 1, a.new)
                got: dict = {}
                step_times(eng, got, "s")
                row["step_ms"] = got.get("s_step_ms_b1")
            except Exception as e:
                row["error"] = repr(e)[:300]
            rows.append(row)
            log("sweep_b1", row)
    finally:
        K.GEMV_TILE, K.GEMV_WARPS, K.ATTN_MIN_SPLIT = default[:3]
        K.ATTN_LAUNCH[(True, False)] = launch
        eng.close()
    res["sweep_b1"] = rows


def sec_gen_attn_launch(a, res):
    """Batch 256 with the batched attention's launch of before 2026-11-26's sixth session (64
    positions a tile, 4 warps) beside the default, over a bf16 and an fp8 cache, each pair on one
    engine: tok/s and the captured step's GPU time at positions 0 and the last."""
    for kv in ("bf16", "fp8"):
        eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new,
                                      kv_cache_dtype="fp8" if kv == "fp8" else "auto"))
        key = (False, kv == "fp8")
        default = K.ATTN_LAUNCH[key]
        try:
            for name, lc in (("default", default), ("before", (64, 4, 0))):
                K.ATTN_LAUNCH[key] = lc
                eng.gen.graphs.clear()
                res[f"attn_launch_{kv}_{name}_b256"] = ours_generate(eng, 256, a.new)
                step_times(eng, res, f"attn_launch_{kv}_{name}")
        finally:
            K.ATTN_LAUNCH[key] = default
            eng.close()
    log("gen_attn_launch", {k: v for k, v in res.items() if k.startswith("attn_launch")})


def sec_sweep_attn(a, res):
    """The batched decode attention's launch on this GPU (kernels.ATTN_LAUNCH's unsplit entries:
    positions a tile, warps, pipeline stages) over a bf16 and an fp8 cache: the kernel alone at
    batch 256 (GPU µs, graph_timed) with every row at positions from 0 to the last, their mean
    over the positions a 128 + new run decodes at, and the share of the bytes-per-second of a
    device copy it reaches at the last; then bf16 tok/s at batch 256 for the default and the
    fastest two (sweep_attn in bench.json)."""
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new))
    cfg, dev = eng.cfg, eng.gen.device
    B, L = 256, PROMPT + a.new
    q, kn, vn, caches = attention_inputs(eng, B, L)
    big = torch.empty(1 << 28, dtype=torch.uint8, device=dev)  # 256 MiB, read and written
    copy_bw = 2 * big.numel() / (graph_timed(lambda: big.clone(), 5) / 1e3)
    del big
    positions = sorted({0, PROMPT, (PROMPT + L) // 2, L - 1})
    decoded = [p for p in positions if p >= PROMPT]
    default = dict(K.ATTN_LAUNCH)
    rows = []
    try:
        for kv, (kc, vc) in caches.items():
            configs = [default[(False, kv == "fp8")]] + [
                (bl, w, st) for bl in (16, 32, 64) for w in (1, 2, 4) for st in (0, 2, 4)]
            for bl, w, st in configs:
                K.ATTN_LAUNCH[(False, kv == "fp8")] = (bl, w, st)
                row = {"kv": kv, "bl": bl, "warps": w, "stages": st}
                try:
                    for pos in positions:
                        p = torch.full((B,), pos, dtype=eng.gen.pos.dtype, device=dev)
                        row[f"us_{pos}"] = 1e3 * graph_timed(
                            lambda: K.decode_attention(q, kn, vn, kc, vc, p, L,
                                                       cfg.head_dim ** -0.5))
                    row["us_mean"] = sum(row[f"us_{p}"] for p in decoded) / len(decoded)
                    kv_bytes = 2 * B * cfg.kv_heads * L * cfg.head_dim * kc.element_size()
                    row["bw_share_last"] = kv_bytes / (row[f"us_{L - 1}"] / 1e6) / copy_bw
                except Exception as e:
                    row["error"] = repr(e)[:300]
                rows.append(row)
                log("sweep_attn", row)
            K.ATTN_LAUNCH.update(default)
        bf = [r for r in rows if r["kv"] == "bf16" and "us_mean" in r]
        for r in [bf[0]] + sorted(bf[1:], key=lambda r: r["us_mean"])[:2]:
            K.ATTN_LAUNCH[(False, False)] = (r["bl"], r["warps"], r["stages"])
            eng.gen.graphs.clear()
            r["b256"] = ours_generate(eng, 256, a.new)
            log("sweep_attn b256", r)
    finally:
        K.ATTN_LAUNCH.update(default)
        eng.close()
    res["sweep_attn"] = rows
    res["sweep_attn_copy_gbps"] = copy_bw / 1e9


def sec_gen_layer_b1(a, res):
    gen_section(a, res, "gen_layer_b1", dict(fused_b1=False), b256=False, extra=False)


def train_batch(cfg, samples: int, length: int) -> Batch:
    """samples random sequences of length tokens (64 prompt, the rest trained), advantages ±1."""
    g = torch.Generator().manual_seed(4)
    p = min(64, length // 4)
    batch = []
    for i in range(samples):
        seq = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
        r = length - p
        batch.append(Sample(seq[:p], seq[p:], [1.0] * r, [-5.0] * r,
                            [1.0 if i % 2 else -1.0] * r, group=f"g{i // 4}"))
    return Batch(samples=batch, loss=LossConfig(lr=1e-6, max_grad_norm=1.0))


def per_parameter(tr) -> None:
    """Gives the trainer tr the optimizer step's casts as they were before the multi-tensor ones
    (a cast into the masters' gradients and a copy back launched per parameter); `del
    tr._master_grads, tr._stepped` undoes it. The one-pass step (tr.fused_step), which has
    neither, is turned off. Also the reference of tests/test_train.py."""
    tr.fused_step = False

    def master_grads():
        for p, m in zip(tr.params, tr.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def stepped():
        with torch.no_grad():
            for p, m in zip(tr.params, tr.masters):
                p.copy_(m)
    tr._master_grads, tr._stepped = master_grads, stepped


def per_parameter_steps(eng: Engine, b: Batch, steps: int) -> float:
    """The median step with per_parameter's optimizer step (as before), on the same engine."""
    tr = eng.trainer
    fused = tr.fused_step
    per_parameter(tr)
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            eng.train(b)
            sync()
            times.append(time.perf_counter() - t)
    finally:
        del tr._master_grads, tr._stepped
        tr.fused_step = fused
    return sorted(times)[len(times) // 2]


def step_syncs(trainer, batch) -> list[str]:
    """Where one training step (trainer.step, run on this thread) waited for the GPU: for each
    synchronisation PyTorch reports (torch.cuda.set_sync_debug_mode) while the step runs, the
    Python frames it came from, innermost first ("train.py:519 < train.py:351 < ..."). (Turning
    the mode on reports one of its own, attributed to that call: not the step's.)"""
    import traceback
    import warnings
    got, stepping = [], []

    def show(message, category, filename, lineno, file=None, line=None):
        if stepping and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if not f.filename.endswith("warnings.py")][::-1][:4]
            got.append(" < ".join(f"{pathlib.Path(f.filename).name}:{f.lineno}" for f in frames))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        stepping.append(True)
        try:
            trainer.step(batch)
        finally:
            stepping.clear()
            torch.cuda.set_sync_debug_mode(0)
    return got


def train_bench(a, res, prefix, opts, samples=8, steps=3, micro=0, setup=None):
    length = a.train_len
    eng = Engine(a.model, Options(device=a.device, slots=1, micro_batch_tokens=micro, **opts))
    try:
        if setup is not None:
            setup(eng)
        cfg = eng.cfg
        b = train_batch(cfg, samples, length)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        eng.train(b)  # warm-up (compiles)
        res[f"{prefix}_first_step_s"] = time.perf_counter() - t
        sync()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            st = eng.train(b)
            sync()
            times.append(time.perf_counter() - t)
        dt = sorted(times)[len(times) // 2]
        if torch.cuda.is_available():
            res[f"{prefix}_syncs"] = step_syncs(eng.trainer, b)
        if prefix == "train" and eng.trainer.mixed:
            # The same engine with the fp32 gradients cast and the weights copied back one
            # parameter at a time from Python (as before), for a before/after of the same run.
            res["train_per_param_step_s"] = per_parameter_steps(eng, b, steps)
        tokens = samples * length
        # Model FLOPs: 6 per parameter per token for the matrices (the tied embedding counts
        # once, as the output head; the lookup is free) + causal attention
        # 6·2·layers·T/2·q_dim per token.
        matrix_params = cfg.params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)
        flops = tokens * (6 * matrix_params + 6 * 2 * cfg.layers * (length / 2) * cfg.q_dim)
        res[f"{prefix}_tokens_per_s"] = tokens / dt
        res[f"{prefix}_mfu"] = flops / dt / PEAK_BF16
        res[f"{prefix}_step_s"] = dt
        res[f"{prefix}_loss"] = st.loss
        res[f"{prefix}_mode"] = eng.trainer.mode
        res[f"{prefix}_fused_step"] = eng.trainer.fused_step  # the one-pass optimizer step
        res[f"{prefix}_compile_error"] = eng.trainer.compile_error[-20000:]
        if torch.cuda.is_available():
            res[f"{prefix}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        log(prefix, {k: v for k, v in res.items()
                     if k.startswith(prefix) and k != f"{prefix}_compile_error"})
        if res[f"{prefix}_compile_error"]:
            log(prefix, "compile error:\n", res[f"{prefix}_compile_error"][-6000:])
    finally:
        eng.close()


KINDS = (("attention", ("flash", "fmha", "attn", "attention", "sdpa")),  # before gemm: cuDNN's
         ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "gemv", "splitk")),
         ("optimizer", ("adam", "foreach", "multi_tensor")),
         ("sampler", ("sample",)),
         ("copy", ("copy", "memcpy", "memset", "fill", "cat", "index")),
         ("compiled/triton", ("triton",)))


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other"


def profiled(fn, out: pathlib.Path, name: str, res: dict, reps: int = 1) -> None:
    """Runs fn reps times under torch.profiler: the GPU kernels by total time (a table in
    out/profile_<name>.txt), their sum by kind, the kernel count, and the GPU-busy share of the
    wall time (kernel time / wall: below 1 the GPU waited for the host)."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        wall = time.perf_counter() - t
    kern = {}
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kern.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
            count += 1
    total = sum(v[1] for v in kern.values()) / 1e3 / reps  # ms
    # Where the GPU sat idle: the gaps between one kernel's end and the next one's start (a
    # long gap names the kernels around it; the host launched too late there).
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end, before = [], None, ""
    for st, en, n in spans:
        if end is not None and st > end:
            gaps.append((st - end, before, n))
        if end is None or en > end:
            end, before = en, n
    by_kind: dict = {}
    for n, (c, us) in kern.items():
        by_kind[kind_of(n)] = by_kind.get(kind_of(n), 0.0) + us / 1e3 / reps
    rows = [f"{name}: wall {wall * 1e3 / reps:.3f} ms, kernels {total:.3f} ms "
            f"({count / reps:.0f} a run), GPU busy {total / (wall * 1e3 / reps):.2f}",
            "by kind (ms a run): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                sorted(by_kind.items(), key=lambda x: -x[1])),
            f"{'ms a run':>10} {'calls':>6}  kernel"]
    for n, (c, us) in sorted(kern.items(), key=lambda x: -x[1][1])[:40]:
        rows.append(f"{us / 1e3 / reps:10.4f} {c / reps:6.0f}  {n[:150]}")
    idle = sum(g[0] for g in gaps) / 1e3 / reps
    rows.append(f"GPU idle between kernels: {idle:.3f} ms a run in {len(gaps) / reps:.0f} gaps; "
                "the longest (µs, the kernel before → the one after):")
    for us, a_, b_ in sorted(gaps, reverse=True)[:15]:
        rows.append(f"{us:10.1f}  {a_[:70]} → {b_[:70]}")
    res[f"profile_{name}_idle_ms"] = idle
    text = "\n".join(rows)
    (out / f"profile_{name}.txt").write_text(text + "\n")
    log(text)
    res[f"profile_{name}_wall_ms"] = wall * 1e3 / reps
    res[f"profile_{name}_kernel_ms"] = total
    res[f"profile_{name}_kernels"] = count / reps
    res[f"profile_{name}_by_kind_ms"] = by_kind


def host_profile(eng: Engine, b: Batch, out: pathlib.Path, res: dict) -> None:
    """The Python of one training step on the engine's thread under cProfile (the GPU-busy share
    above says how much of the step waits for it): out/profile_train_host.txt, the functions by
    their own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    def run():
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        eng._train(b)
        sync()
        pr.disable()
        return pr, time.perf_counter() - t

    pr, wall = eng._call(run)
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    (out / "profile_train_host.txt").write_text(f"one training step under cProfile: {wall:.3f} s\n"
                                                + buf.getvalue())
    res["profile_train_host_s"] = wall
    log("train step under cProfile", f"{wall:.3f} s; top by own time:")
    log("\n".join(buf.getvalue().splitlines()[:45]))


def sec_profile(a, res):
    """Where the GPU time goes: kernel tables of a batch-1 and a batch-256 generation (the
    whole request: prefill, decode steps, scheduling), of single captured decode steps, and of
    one training step (8 × train_len tokens), each with the GPU-busy share of its wall time."""
    out = pathlib.Path(a.out)
    eng = Engine(a.model, Options(device=a.device, slots=256, max_seq_len=PROMPT + a.new))
    try:
        for batch in (1, 256):
            toks = prompts(batch, eng.cfg.vocab_size, 3).tolist()
            reqs = [GenerateRequest(id=f"p{batch}-{i}", prompt_tokens=t,
                                    sampling=Sampling(max_tokens=a.new, temperature=1.0, seed=i))
                    for i, t in enumerate(toks)]
            eng.generate(reqs)  # compiles and captures
            profiled(lambda: eng.generate(reqs), out, f"generate_b{batch}", res)
        gen = eng.gen
        for (B, L, top, *_), g in sorted(gen.graphs.items()):
            if B not in (1, 256) or L != gen.L or top:
                continue
            gen.pos[:B] = L // 2  # idle rows: replays do not advance them
            profiled(g.replay, out, f"step_b{B}_pos{L // 2}", res, reps=20)
            gen.pos[:B] = 0
    finally:
        eng.close()
    profile_train(a, out, res, "train_8x", host=True)
    # The same step with the graph broken around the attention (section train_split).
    profile_train(a, out, res, "train_split_8x", setup=split_layer)


def profile_train(a, out: pathlib.Path, res: dict, name: str, setup=None,
                  host: bool = False) -> None:
    """The kernel table of one training step (8 × train_len tokens) on a fresh engine, after two
    warm-up steps; setup(eng) first when given; host: also the step's Python (host_profile)."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    eng = Engine(a.model, Options(device=a.device, slots=1))
    try:
        if setup is not None:
            setup(eng)
        b = train_batch(eng.cfg, 8, a.train_len)
        eng.train(b)  # compiles
        eng.train(b)
        profiled(lambda: eng.train(b), out, name, res)
        if host:
            res["profile_train_mode"] = eng.trainer.mode
            host_profile(eng, b, out, res)
    finally:
        eng.close()


def sec_train(a, res):
    import torch._dynamo
    torch._dynamo.config.verbose = True  # a compiler failure is recorded with its whole stack
    train_bench(a, res, "train", {})
    train_bench(a, res, "train_16x", {}, samples=16, micro=16 * a.train_len)


def sec_train_old_opt(a, res):
    """The default step with the optimizer step before the one-pass kernel (Trainer.fused_step
    off): the masters' fp32 gradients, their norm, the clip, torch's fused AdamW and the copy
    back; for a before/after with train in the same call."""
    def unfused(eng):
        eng.trainer.fused_step = False
    train_bench(a, res, "train_old_opt", {}, setup=unfused)


def sec_train_split(a, res):
    """The default step as it was before its layer was traced whole (split_layer)."""
    train_bench(a, res, "train_split", {}, setup=split_layer)


def split_layer(eng) -> None:
    """Compiles eng's training layer with SDPA's grouping left to the config's (symbolic) head
    counts: Dynamo breaks the graph around the attention (the default before whole_block)."""
    from slimen_torch.train import compile_options
    eng.trainer.model.train_block_fn = torch.compile(
        block_forward, dynamic=True,
        options=compile_options() if torch.cuda.is_available() else None)


def sec_train_eager(a, res):
    train_bench(a, res, "train_eager", dict(compile_train="off"))


def sec_train_static(a, res):
    train_bench(a, res, "train_static", dict(compile_train="block-static"))


def sec_train_regional(a, res):
    train_bench(a, res, "train_regional", dict(compile_train="regional"))


def sec_train_before(a, res):
    train_bench(a, res, "train_before", dict(fused_head=False, fused_norm=False,
                                             compile_train="off"))


def sec_first_step_run(a, res):
    """One fresh worker process's first steps (run by sec_first_step)."""
    import logging
    from slimen_torch import compile_cache
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s slimen_torch %(levelname)s %(message)s")
    t = time.perf_counter()
    eng = Engine(a.model, Options(device=a.device, compile_prefill=not a.no_compile_prefill))
    res["build_s"] = time.perf_counter() - t
    try:
        st = eng.compile_cache
        res["cache"] = st.line() if st else "none"
        res["cache_warm"] = bool(st and st.warm)
        cfg = eng.cfg
        t = time.perf_counter()
        eng.generate([GenerateRequest(id=f"p{i}", prompt_tokens=p.tolist(),
                                      sampling=Sampling(max_tokens=32, temperature=1.0, seed=i))
                      for i, p in enumerate(prompts(8, cfg.vocab_size, 1))])
        res["gen_s"] = time.perf_counter() - t
        res["after_gen"] = compile_cache.counts()
        g = torch.Generator().manual_seed(4)
        length, p = a.train_len, min(64, a.train_len // 4)
        batch = []
        for i in range(8):
            seq = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
            r = length - p
            batch.append(Sample(seq[:p], seq[p:], [1.0] * r, [-5.0] * r,
                                [1.0 if i % 2 else -1.0] * r, group=f"g{i // 4}"))
        b = Batch(samples=batch, loss=LossConfig(lr=1e-6, max_grad_norm=1.0))
        for k in ("train_s", "train2_s"):
            t = time.perf_counter()
            eng.train(b)
            sync()
            res[k] = time.perf_counter() - t
        res["counts"] = compile_cache.counts()
        from torch._dynamo.utils import compile_times
        res["compile_times"] = compile_times(repr="str", aggregate=True)[-6000:]
        res["mode"] = eng.trainer.mode
        res["gen_compile_error"] = eng.gen.compile_error[-3000:]
        res["train_compile_error"] = eng.trainer.compile_error[-6000:]
    finally:
        eng.close()
    log("first_step_run", json.dumps(res))


def sec_first_step(a, res):
    import tempfile
    root = pathlib.Path(tempfile.mkdtemp(prefix="slimen-first-step-"))
    fresh = root / "user"
    runs = (("cold", {"SLIMEN_COMPILE_CACHE": str(root / "ours")}),
            ("warm", {"SLIMEN_COMPILE_CACHE": str(root / "ours")}),
            ("before", {"TORCHINDUCTOR_CACHE_DIR": str(fresh),
                        "TRITON_CACHE_DIR": str(fresh / "triton")}))
    for label, extra in runs:
        env = {k: v for k, v in os.environ.items()
               if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                            "SLIMEN_COMPILE_CACHE", "SLIMEN_COMPILE_CACHE_IN_USE")}
        env.update(extra, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, __file__, "--section", "first_step_run", "--model", str(a.model),
               "--out", str(a.out), "--device", a.device, "--train-len", str(a.train_len)] + \
            (["--no-compile-prefill"] if a.no_compile_prefill else [])
        t = time.perf_counter()
        try:
            subprocess.run(cmd, env=env, timeout=SECTIONS["first_step_run"] * 2, check=False)
        except subprocess.TimeoutExpired:
            res[f"error_first_step_{label}"] = "timed out"
            continue
        res[f"first_step_{label}_process_s"] = time.perf_counter() - t
        f = pathlib.Path(a.out) / "first_step_run.json"
        if not f.exists():
            res[f"error_first_step_{label}"] = "the process died (no results)"
            continue
        for k, v in json.loads(f.read_text()).items():
            res[f"first_step_{label}_{k}"] = v
        f.unlink()
    shutil.rmtree(root, ignore_errors=True)


def sec_hf(a, res):
    from transformers import AutoModelForCausalLM
    dev = a.device
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev).eval()
    for batch, new in ((1, 32), (256, 64)):
        if dev == "cpu" and batch > 1:
            continue
        toks = prompts(batch, hf.config.vocab_size, 2).to(dev)
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
                  min_new_tokens=new, pad_token_id=0, attention_mask=torch.ones_like(toks))
        with torch.no_grad():
            hf.generate(toks[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            sync()
            t = time.perf_counter()
            out = hf.generate(toks, **kw)
            sync()
            dt = time.perf_counter() - t
        assert out.shape[1] == PROMPT + new
        res[f"hf_b{batch}"] = batch * new / dt
        log("hf", batch, res[f"hf_b{batch}"])


# ---- the driver ------------------------------------------------------------------------------

def table(res: dict) -> str:
    def num(k, digits=0):
        return "—" if k not in res else f"{res[k]:,.{digits}f}"

    def pct(k):
        return "—" if k not in res else f"{100 * res[k]:.1f}%"

    def mode(k):
        m = res.get(f"{k}_mode")
        return "" if m is None else f" (ran: {m or 'eager'})"

    rows = [
        "| Qwen3-0.6B shape, bf16, 128 prompt + 256 sampled tokens | batch 1 tok/s | "
        "batch 256 tok/s |",
        "|---|---:|---:|",
        f"| HF generate, same run (32 / 64 new tokens) | {num('hf_b1')} | {num('hf_b256')} |",
        f"| before: compiled layer, PyTorch attention and sampler, CUDA graphs | "
        f"{num('gen_before_b1')} | {num('gen_before_b256')} |",
        f"| Triton attention + sampler, compiled layer halves (batch 1 without the all-Triton "
        f"step) | {num('gen_layer_b1_b1')} | |",
        f"| **now** (default): + all-Triton batch-1 step | **{num('gen_b1')}** | "
        f"**{num('gen_b256')}** |",
        f"| the same with the prefill's layer eager (--no-compile-prefill; before) | | "
        f"{num('gen_prefill_eager_b256')} |",
        "| target | 1,000 | 50,000 |",
        f"| GPU time of one decode step, every row at position 383, ms (now / before) | "
        f"{num('gen_step_ms_b1', 3)} / {num('gen_before_step_ms_b1', 3)} | "
        f"{num('gen_step_ms_b256', 3)} / {num('gen_before_step_ms_b256', 3)} |",
        f"| the same, rows at position 0, ms (now / before) | "
        f"{num('gen_step0_ms_b1', 3)} / {num('gen_before_step0_ms_b1', 3)} | "
        f"{num('gen_step0_ms_b256', 3)} / {num('gen_before_step0_ms_b256', 3)} |",
        f"| sampling alone, launched eagerly (host launch time included), ms (Triton / PyTorch) | "
        f"{num('sample_ms_b1', 3)} / "
        f"{num('sample_torch_ms_b1', 3)} | {num('sample_ms_b256', 3)} / "
        f"{num('sample_torch_ms_b256', 3)} |",
        "",
        "| training, one AdamW step, 8 × 2,048 tokens unless said | tokens/s | "
        "MFU (989 TFLOP/s) | step s | peak GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, name in (
            ("train_before", "before: whole fp32 logits, unfused RMSNorm, eager"),
            ("train_eager", "chunked log-prob head + fused RMSNorm, eager"),
            ("train", "**now** (default): + whole layer compiled (dynamic shapes)"),
            ("train_old_opt", "now, the optimizer step unfused (before: fp32 gradients, torch's "
             "fused AdamW, copy back)"),
            ("train_16x", "now, 16 × 2,048 in one micro-batch"),
            ("train_static", "whole layer compiled for static shapes"),
            ("train_regional", "q/k/v and MLP compiled around eager attention")):
        rows.append(f"| {name}{mode(key)} | {num(key + '_tokens_per_s')} | {pct(key + '_mfu')} "
                    f"| {num(key + '_step_s', 3)} | {num(key + '_peak_mem_gib', 1)} |")
    rows.append("| target | | 40% | | |")
    rows += [
        "",
        f"parity (‖a − b‖/‖b‖ of logits): ours bf16 vs HF bf16 "
        f"{res.get('parity_rel_vs_hf_bf16', float('nan')):.2e}, ours bf16 vs HF fp32 "
        f"{res.get('parity_rel_vs_hf_fp32', float('nan')):.2e}, HF bf16 vs HF fp32 "
        f"{res.get('hf_bf16_rel_vs_hf_fp32', float('nan')):.2e}; generation vs Score log-probs, "
        f"max |Δ|: now b1 {num('gen_decode_vs_score_b1', 3)}, b4 "
        f"{num('gen_decode_vs_score_b4', 3)}; before b1 {num('gen_before_decode_vs_score_b1', 3)}"
        f", b4 {num('gen_before_decode_vs_score_b4', 3)}",
    ]
    if not any(k.startswith(("gen_", "hf_", "train", "sample_", "parity", "attn_")) and
               not k.startswith(("gen_b1", "gen_fp8kv")) for k in res):
        rows = []  # only the batch-1 or fp8 sections ran
    if any(k.startswith("gen_b1") for k in res):
        rows += [
            "",
            "| batch 1, 128 prompt + 256 sampled tokens | tok/s | one admission (prefill + first "
            "token), ms |",
            "|---|---:|---:|"]
        for key, name in (
                ("gen_b1_before", "eager prefill, first token by the PyTorch sampler (before)"),
                ("gen_b1_eager_prefill", "eager prefill, first token by the Triton sampler"),
                ("gen_b1_no_pdl", "prefill from a CUDA graph + Triton sampler, no programmatic "
                 "dependent launch (before)"),
                ("gen_b1_prefill_layer_eager", "prefill from a CUDA graph of the eager layer "
                 "(--no-compile-prefill; before)"),
                ("gen_b1", "**now** (default): prefill from a CUDA graph of the compiled layer + "
                 "Triton sampler, kernels launched programmatically dependent")):
            if key + "_b1" in res:
                rows.append(f"| {name} | {num(key + '_b1')} | {num(key + '_admit_ms', 2)} |")
        rows.append("| target | 1,000 | |")
        p = "gen_b1"
        if p + "_b1" in res:
            rows.append(
                f"{p}: step {num(p + '_step_ms_b1', 3)} ms at position 383 "
                f"({num(p + '_no_pdl_step_ms_b1', 3)} without PDL); prefill graph vs "
                f"eager (‖Δ‖/‖·‖, 128 / 100 tokens): logits "
                f"{res.get(p + '_prefill_logits_rel_T128', float('nan')):.2e} / "
                f"{res.get(p + '_prefill_logits_rel_T100', float('nan')):.2e}, keys and values "
                f"{res.get(p + '_prefill_kv_rel_T128', float('nan')):.2e} / "
                f"{res.get(p + '_prefill_kv_rel_T100', float('nan')):.2e}, arg-max agrees "
                f"{res.get(p + '_prefill_argmax_agree_T128')} / "
                f"{res.get(p + '_prefill_argmax_agree_T100')}; generation vs Score max |Δ| "
                f"{num(p + '_decode_vs_score_b1', 3)}; graphs {res.get(p + '_prefill_graphs')}")
    if any(k.startswith("first_step_") for k in res):
        rows += [
            "",
            "| first steps of a new worker (Qwen3-0.6B shape) | build s | first generate s | "
            "first train step s | second step s | whole process s | fx graph hit / miss | "
            "AOTAutograd hit / miss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for key, name in (("first_step_cold", "empty compile cache (cold)"),
                          ("first_step_warm", "**warm** compile cache (a second run)"),
                          ("first_step_before", "the caches in a fresh folder of the user's")):
            c = res.get(key + "_counts", {})
            rows.append(
                f"| {name} | {num(key + '_build_s', 1)} | {num(key + '_gen_s', 1)} | "
                f"{num(key + '_train_s', 1)} | {num(key + '_train2_s', 2)} | "
                f"{num(key + '_process_s', 1)} | {c.get('fx graph hit', '—')} / "
                f"{c.get('fx graph miss', '—')} | {c.get('AOTAutograd hit', '—')} / "
                f"{c.get('AOTAutograd miss', '—')} |")
        rows.append("| target (warm first train step) | | | 20 | | | | |")
        for key in ("first_step_cold", "first_step_warm", "first_step_before"):
            if key + "_cache" in res:
                rows.append(f"{key}: {res[key + '_cache']}")
    if "gen_fp8kv_b1" in res:
        p = "gen_fp8kv"
        rows += [
            "",
            "| KV cache, 128 prompt + 256 sampled tokens | batch 1 tok/s | batch 256 tok/s | "
            "step ms b1 / b256 (position 383) | generation vs Score max abs Δ b1 / b4 |",
            "|---|---:|---:|---:|---:|"]
        for key, name in (("gen", "the model's dtype, bf16 (default: `gen`)"),
                          (p, "fp8 (--kv-cache-dtype fp8)")):
            rows.append(f"| {name} | {num(key + '_b1')} | {num(key + '_b256')} | "
                        f"{num(key + '_step_ms_b1', 3)} / {num(key + '_step_ms_b256', 3)} | "
                        f"{num(key + '_decode_vs_score_b1', 3)} / "
                        f"{num(key + '_decode_vs_score_b4', 3)} |")
        g8, g16 = res.get(p + "_greedy"), res.get("gen_greedy")
        same = "—" if not (g8 and g16) else sum(x == y for x, y in zip(g8, g16))
        rows.append(
            f"{p}: cache {res.get(p + '_cache_dtype')} {num(p + '_cache_gib', 2)} GiB; the same "
            f"seeded requests (3 sampled, 1 greedy, 64 tokens, at batch 1 and 4) with the model's "
            f"dtype's cache: identical {res.get(p + '_agree_identical')}, first divergence at "
            f"{res.get(p + '_agree_first_divergence')}, tokens equal {pct(p + '_agree_tokens')}, "
            f"log-probs of the common prefix max abs Δ {num(p + '_agree_logprob_maxdiff', 4)}; "
            f"greedy tokens equal to gen's: {same} of {len(g8 or [])}; --no-kernels (compiled "
            f"decode_layer) over fp8: {res.get(p + '_torch_paths')}, generation vs Score max abs "
            f"Δ b1 / b4 {num(p + '_torch_decode_vs_score_b1', 3)} / "
            f"{num(p + '_torch_decode_vs_score_b4', 3)}")
        for pos in sorted({int(k.rsplit("pos", 1)[1]) for k in res
                           if k.startswith(p + "_attn_ms_bf16_pos")}):
            rows.append(
                f"{p}: the decode attention alone, batch 256 at position {pos}: bf16 "
                f"{num(f'{p}_attn_ms_bf16_pos{pos}', 3)} ms "
                f"({num(f'{p}_attn_gbps_bf16_pos{pos}')} GB/s), fp8 "
                f"{num(f'{p}_attn_ms_fp8_pos{pos}', 3)} ms "
                f"({num(f'{p}_attn_gbps_fp8_pos{pos}')} GB/s)")
        rows.append(f"{p}: attention outputs fp8 against bf16 ‖Δ‖/‖·‖ "
                    f"{res.get(p + '_attn_rel_fp8_vs_bf16', float('nan')):.2e}")
    for p in ("gen_group", "gen_group_fp8", "gen_group_requests"):
        if p + "_shared_b256" in res:
            rows.append(
                f"{p} (32 prompts × 8 samples, batch 256): {num(p + '_shared_b256')} tok/s with "
                f"a prompt read once a group, {num(p + '_own_b256')} with each row reading its "
                f"own; tokens before the first divergence {pct(p + '_tokens_before_divergence')}, "
                f"log-probs there max abs Δ {num(p + '_logprob_maxdiff', 4)}; the shared run "
                f"against Score max abs Δ {num(p + '_vs_score', 3)}")
    sweep = [r for r in res.get("sweep_attn", []) if "us_mean" in r]
    for kv in ("bf16", "fp8"):
        rs = [r for r in sweep if r["kv"] == kv]
        if rs:
            best = min(rs, key=lambda r: r["us_mean"])
            rows.append(f"sweep_attn {kv}: default {rs[0]['bl']}/{rs[0]['warps']}/"
                        f"{rs[0]['stages']} {rs[0]['us_mean']:.1f} µs mean, fastest "
                        f"{best['bl']}/{best['warps']}/{best['stages']} {best['us_mean']:.1f} µs "
                        f"(tile/warps/stages; the kernel alone at batch 256)")
    errs = [k for k in res if k.startswith("error_") or (k.endswith("_error") and res[k])]
    if errs:
        rows.append("errors (bench.json): " + ", ".join(errs))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--train-len", type=int, default=2048)
    ap.add_argument("--no-compile-prefill", action="store_true",
                    help="section first_step: the worker's --no-compile-prefill (as before)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all sections")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help="comma-separated, from: " + ", ".join(SECTIONS))
    ap.add_argument("--section", default="", help=argparse.SUPPRESS)  # run one, in this process
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.section:
        res: dict = {}
        try:
            globals()["sec_" + a.section](a, res)
        except Exception:
            res[f"error_{a.section}"] = traceback.format_exc()[-4000:]
            log(f"{a.section} FAILED:\n{res[f'error_{a.section}']}")
        (out / f"{a.section}.json").write_text(json.dumps(res))
        return
    t0 = time.time()
    model_dir = pathlib.Path(a.model or f"/tmp/bench-{a.shape}")
    if not (model_dir / "config.json").exists():
        make_model(a.shape, model_dir, seed=0, dtype="bfloat16" if a.device != "cpu" else "")
        no_eos(model_dir)
    log(f"model ready in {time.time() - t0:.0f}s")
    res = {"device": torch.cuda.get_device_name() if a.device != "cpu" else "cpu",
           "torch": torch.__version__}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:
        pass
    for name in a.sections.split(","):
        left = a.budget - (time.time() - t0)
        if left < 0.6 * SECTIONS[name]:
            log(f"[{name}: skipped, {left:.0f}s left]")
            res[f"skipped_{name}"] = True
            continue
        t = time.time()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if name == "train":
            env["TORCHDYNAMO_VERBOSE"] = "1"
        cmd = [sys.executable, __file__, "--section", name, "--model", str(model_dir),
               "--out", str(out), "--device", a.device, "--new", str(a.new),
               "--train-len", str(a.train_len)]
        try:
            subprocess.run(cmd, env=env, timeout=max(10, left - 5), check=False)
        except subprocess.TimeoutExpired:
            res[f"error_{name}"] = f"timed out after {left - 5:.0f}s"
        f = out / f"{name}.json"
        if f.exists():
            res.update(json.loads(f.read_text()))
            f.unlink()
        elif f"error_{name}" not in res:
            res[f"error_{name}"] = "the section's process died (no results)"
        log(f"[{name}: {time.time() - t:.0f}s, total {time.time() - t0:.0f}s]")
        (out / "bench.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "bench.md").write_text(md + "\n")
    log(f"total {time.time() - t0:.0f}s")
    log(md)


if __name__ == "__main__":
    main()
