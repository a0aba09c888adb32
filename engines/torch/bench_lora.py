"""Issue 19 on one GPU: how many LoRA agents of one base train in one worker against how many full
copies fit, and generation of a batch spread over adapters against one model.

    python engines/torch/bench_lora.py [--out DIR] [--shape qwen3-0.6b] [--budget SECONDS]
    python engines/torch/bench_lora.py --device cpu --shape tiny --quick     # a dry run on the CPU

On a random model of --shape (make-model; bf16 on a GPU), these sections:

  memory     the memory model: bytes per full-weight agent (bf16 weights, fp32 master copy, AdamW
             moments, gradient; a frozen KL reference copy besides) and per LoRA agent (the same
             for its A and B only, plus its rows in the stacks the mixed-batch path gathers from),
             and how many of each the free memory holds after the shared parts (one base, the
             KV cache, a training step's activations)
  full       the allocation test of full copies: worker engines on the model, one after another,
             each taking one AdamW step (so its optimizer state exists), until the next does not
             fit (out of memory), --max-full or the time budget; all kept alive. Eager (no
             compilation, no CUDA graphs) with --slots cache rows: memory is what it measures
  lora       the same for LoRA agents in one worker: adapters (rank --rank on every projection)
             added to one engine, each taking one AdamW step, in rounds that double, until out of
             memory, --max-adapters or the time budget; then one mixed generate over the first 8
             shows the worker still serves them all
  gen        generation throughput: --rows rows (128-token prompts, --new sampled tokens,
             temperature 1) of one model with the engine's defaults (CUDA graphs, Triton), the
             same rows spread over 8 adapters in one batch through the adapter table (the decode
             step captured in the same graphs; the shrink folded into the base's product and
             lora_kernels' fused expand; the prefill in the compiled prefill layer), the same
             with the prefill in the eager layer (lora.PREFILL_COMPILED off), the same captured
             with the shrink a product of its own (the generator's lora_fold off) and without
             the fused expand (lora.Packed: lora_fused off), the same on the eager per-row path
             (lora.Rows, the generator's lora_table off), one adapter, and the rows of one model
             on the eager path; the ratio of 8 captured adapters to the one captured model (the
             target is >= 0.7, docs/performance.md); and a token check (greedy, min(--new, 32)
             tokens; the adapters' B drawn, so that they change the base's outputs): each row of the
             mixed batch against the same batch all of its row's adapter (the same shapes: equal
             unless a row's result depended on the other rows' adapters), against the eager Rows
             path and the captured table not fused, and the first 8 rows each alone (batch 1:
             other kernels, so bf16 may round differently: reported, not required)
  proj       the decode step's fused products alone (every layer's four, --rows rows, random
             weights of --shape) in one CUDA graph: without adapters, and with a table of 8
             slots of rank --rank as Packed, Fused unfolded and Fused folded; device µs a step
             and the µs each adds a projection
  host       the host's work a decode step, with --rows rows spread over 8 adapters (the table
             folded, as with the Triton kernels) against one model: the µs of Decode._lora_step
             (the table's place and the rows' slots) in the steady state (the same rows, the same
             adapters), the tensor operations it dispatches and, on a GPU, the stream
             synchronisations it causes (torch.cuda's sync debug mode), and the µs of the whole
             host side of a generation's decode steps (a step less the model's work: the graph
             replay's launch on a GPU, the eager step on the CPU; less the wait for the step
             before and the admissions)
  diff       the steady decode step, variant against variant, in one process on one engine and
             the same rows (--rows rows over 8 adapters, all at position --pos): the one model
             (the adapters placed, not applied); the default (folded, fused expand); without the
             expand kernel (the folded product's base columns); the base's own product and the
             expand; the table's copy of the base alone; the table selected with the layers'
             own weights; unfolded; Packed; each of the one model and the default with the
             layers not compiled and without programmatic dependent launch; the expand kernel's
             other tiles (lora_kernels' switches: 64 rows, the old default, 32 rows, 2 warps,
             128 rows on 8 warps); the table's tensors static for torch.compile; the one model
             again. Each captured as the generator captures it and replayed --steps times at
             the same length, timed by CUDA events around the replay: µs a step (median) and
             the graph's kernels; and the step's sampled tokens and log-probs against the
             default's (a tile of the expand keeps them bit for bit). So each part of the step's
             growth with adapters is a difference of two rows of one table.
             --variants picks some; each variant's result is written to
             OUT/bench_lora_diff.json as it comes

Prints a table and writes DIR/bench_lora.json and DIR/bench_lora.md. Each section runs in its own
process, so an out-of-memory error or a crash costs that section only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from slimen_torch import lora  # noqa: E402
from slimen_torch.config import read_config  # noqa: E402
from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402
from slimen_torch.profiling import OpCount  # noqa: E402
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling  # noqa: E402

SECTIONS = ("memory", "full", "lora", "gen", "proj", "host", "diff", "steps")


def opts(a, **kw) -> Options:
    o = dict(device=a.device, slots=a.slots, max_seq_len=a.max_len)
    if a.device == "cpu":
        o.update(cuda_graphs=False, compile=False, kernels=False)
    o.update(kw)
    return Options(**o)


# The allocation tests run eagerly: compiling each copy's step would take the time budget, and
# memory is what they measure.
NO_COMPILE = dict(cuda_graphs=False, compile=False, compile_train="off")


def batch(a, adapter="") -> Batch:
    g = torch.Generator().manual_seed(1)
    n = a.train_len
    samples = []
    for _ in range(a.train_rows):
        p = torch.randint(10, 200, (n // 2,), generator=g).tolist()
        r = torch.randint(10, 200, (n - n // 2,), generator=g).tolist()
        samples.append(Sample(prompt=p, response=r, loss_mask=[1.0] * len(r),
                              old_logprobs=[-5.0] * len(r), advantages=[1.0] * len(r)))
    return Batch(samples=samples, loss=LossConfig(lr=1e-5), adapter=adapter)


def cuda() -> bool:
    return torch.cuda.is_available()


def mem() -> dict:
    if not cuda():
        return {}
    free, total = torch.cuda.mem_get_info()
    return dict(allocated_gb=torch.cuda.memory_allocated() / 2**30, free_gb=free / 2**30,
                total_gb=total / 2**30)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# ---- sections ----

def sec_memory(a, model_dir):
    cfg, _ = read_config(model_dir)
    P = cfg.params()
    bf = 2 if a.device != "cpu" else 4
    mixed = bf == 2
    # A trained parameter: the weight, its gradient, AdamW's two fp32 moments, and on a GPU the
    # fp32 master copy (engine: bf16 weights, fp32 masters).
    per_trained = bf + bf + 8 + (4 if mixed else 0)
    full = P * per_trained + P * bf  # + the frozen KL reference copy of a full-weight policy
    ad = lora.Adapter("m", lora.LoRAConfig(rank=a.rank, alpha=2 * a.rank, targets=lora.TARGETS),
                      cfg, "meta", torch.float32)
    r_params = ad.numel()
    per_adapter = r_params * per_trained + r_params * bf  # + its rows in the gather stacks
    kv = 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * a.max_len * a.slots * bf
    out = dict(params=P, adapter_params=r_params, bytes_per_full_agent=full,
               bytes_per_lora_agent=per_adapter, base_bytes=P * bf, kv_cache_bytes=kv)
    if cuda():
        free, total = torch.cuda.mem_get_info()
        act = 2 * 1024**3  # a training step's activations, taken as 2 GiB (measured in `full`)
        out.update(free_bytes=free, total_bytes=total,
                   predicted_full=int((free - act) // (full + kv)),
                   predicted_lora=int((free - act - kv - P * bf) // per_adapter))
    return out


def sec_full(a, model_dir):
    engines, rows, t0 = [], [], time.perf_counter()
    try:
        while len(engines) < a.max_full and time.perf_counter() - t0 < a.budget:
            try:
                e = Engine(str(model_dir), opts(a, **NO_COMPILE))
                engines.append(e)
                st = e.train(batch(a))
                rows.append(dict(n=len(engines), loss=st.loss, **mem()))
                print(f"full copies: {len(engines)} {mem()}", flush=True)
            except Exception as e:
                if not is_oom(e):
                    raise
                if engines:
                    engines.pop().close()
                return dict(fits=len(engines), stopped="out of memory", steps=rows)
        return dict(fits=len(engines), stopped="cap" if len(engines) >= a.max_full else "time budget",
                    steps=rows)
    finally:
        for e in engines:
            e.close()


def sec_lora(a, model_dir):
    e = Engine(str(model_dir), opts(a, **NO_COMPILE))
    cfgl = lora.LoRAConfig(rank=a.rank, alpha=2 * a.rank, targets=lora.TARGETS)
    rows, n, t0, stopped = [], 0, time.perf_counter(), "cap"
    # One short sample per step: the step allocates the adapter's gradients and AdamW state, which
    # stay; activations are transient and shared (the memory model budgets them once).
    b = batch(a)
    b.samples = b.samples[:1]
    target = 8
    try:
        while n < a.max_adapters:
            if time.perf_counter() - t0 > a.budget:
                stopped = "time budget"
                break
            try:
                while n < min(target, a.max_adapters):
                    name = f"agent_{n}"
                    e.add_adapter(name, cfgl, n)
                    e.train(Batch(samples=b.samples, loss=b.loss, adapter=name))
                    n += 1
                    if time.perf_counter() - t0 > a.budget:
                        break
            except Exception as ex:
                if not is_oom(ex):
                    raise
                e.remove_adapter(f"agent_{n}")
                stopped = "out of memory"
                break
            rows.append(dict(n=n, **mem()))
            print(f"LoRA agents: {n} {mem()}", flush=True)
            target *= 2
        if stopped == "out of memory":
            # Headroom for the generate below (its cache and activations): 2% of the adapters go.
            for name in e.adapter_names()[-max(1, n // 50):]:
                e.remove_adapter(name)
            if cuda():
                torch.cuda.empty_cache()
        # The worker still serves them: one batch over the first 8 adapters.
        names = e.adapter_names()[:8]
        reqs = [GenerateRequest(id=f"m{i}", prompt_tokens=list(range(10, 42)), adapter=names[i % len(names)],
                                sampling=Sampling(max_tokens=8, temperature=1.0, seed=i))
                for i in range(16)]
        ok = len(e.generate(reqs)) == 16
        return dict(fits=n, stopped=stopped, steps=rows, mixed_generate_ok=ok,
                    adapter_params=e.bank.adapters[names[0]].numel())
    finally:
        e.close()


def prompt(i: int, repeat: bool = False, n: int = 128) -> list[int]:
    """Row i's n-token prompt (n ≥ 2), each row's its own; repeat: gen's form before, 128
    tokens that repeat every 190 rows (rows i and i + 190 the same prompt: the one model groups
    them and reads their prompt once, which rows under different adapters cannot do)."""
    if repeat:
        return [10 + (i + j) % 190 for j in range(128)]
    return [10 + i % 190, 10 + i // 190 % 190] + [10 + (i + j) % 190 for j in range(n - 2)]


def gen_run(e, a, adapters, new=None, warm=True, repeat=False) -> float:
    """tok/s of a.rows rows of new (default a.new) tokens, row i by adapters[i % len] ("" base),
    after a warm-up run (warm); repeat: prompt()'s repeating form."""
    def reqs(tag):
        return [GenerateRequest(id=f"{tag}{i}", prompt_tokens=prompt(i, repeat),
                                adapter=adapters[i % len(adapters)],
                                sampling=Sampling(max_tokens=new or a.new, temperature=1.0, seed=i))
                for i in range(a.rows)]
    if warm:
        e.generate(reqs("w"))
    best = 0.0
    for k in range(1):
        t = time.perf_counter()
        out = e.generate(reqs(f"r{k}"))
        if cuda():
            torch.cuda.synchronize()
        best = max(best, sum(len(c.tokens) for c in out) / (time.perf_counter() - t))
    return best


def greedy(e, a, adapters, rows=None) -> list[tuple[list[int], list[float]]]:
    """The greedy (tokens, log-probs) of rows (default all) of prompt()'s 128-token prompts, each
    its own (a repeated prompt of one adapter would be prefilled once and grouped, another
    computation), row i by adapters[i % len], in one batch."""
    rows = range(a.rows) if rows is None else rows
    reqs = [GenerateRequest(id=f"c{i}", prompt_tokens=prompt(i),
                            adapter=adapters[i % len(adapters)],
                            sampling=Sampling(max_tokens=min(a.new, 32), temperature=0.0))
            for i in rows]
    return [(c.tokens, c.logprobs) for c in e.generate(reqs)]


def lp_diff(x, y) -> float:
    """The largest |log-prob difference| of two generations' common tokens."""
    return max((abs(p - q) for p, q in zip(x[1], y[1])), default=0.0)


def token_check(e, a, names) -> dict:
    """The mixed batch's greedy tokens against the same rows generated otherwise (see gen)."""
    k = len(names)
    mixed = greedy(e, a, names)
    same_shape, shape_lp = 0, 0.0
    for j, name in enumerate(names):
        one = greedy(e, a, [name])
        for i in range(j, a.rows, k):
            same_shape += mixed[i][0] == one[i][0]
            shape_lp = max(shape_lp, lp_diff(mixed[i], one[i]))
    base = greedy(e, a, [""])
    e.gen.lora_table = False
    try:
        rows = greedy(e, a, names)
    finally:
        e.gen.lora_table = True
    e.gen.lora_fused = False
    e.gen.graphs.clear()
    try:
        packed = greedy(e, a, names)
    finally:
        e.gen.lora_fused = True
        e.gen.graphs.clear()
    alone = sum(greedy(e, a, names, [i])[0][0] == mixed[i][0] for i in range(min(k, a.rows)))
    return dict(rows=a.rows, same_shape_equal=same_shape, same_shape_max_lp_diff=shape_lp,
                rows_path_equal=sum(x[0] == y[0] for x, y in zip(mixed, rows)),
                rows_path_max_lp_diff=max(lp_diff(x, y) for x, y in zip(mixed, rows)),
                packed_equal=sum(x[0] == y[0] for x, y in zip(mixed, packed)),
                packed_max_lp_diff=max(lp_diff(x, y) for x, y in zip(mixed, packed)),
                alone_equal=alone, alone_checked=min(k, a.rows),
                differ_from_base=sum(x[0] != y[0] or lp_diff(x, y) > 1e-3
                                     for x, y in zip(mixed, base)))


def profiled(e, a, adapters) -> str:
    """The kernels of one gen_run of adapters (warm), top 30 by device time (CPU on the CPU);
    the profiler runs on the engine's thread, where the model's work runs."""
    from torch.profiler import ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    key = "self_device_time_total" if cuda() else "self_cpu_time_total"
    prof = torch.profiler.profile(activities=acts)
    e._call(prof.start)
    gen_run(e, a, adapters, warm=False)
    e._call(lambda: (torch.cuda.synchronize() if cuda() else None, prof.stop()))
    return prof.key_averages().table(sort_by=key, row_limit=30)


def _adapters(e, a, names):
    """Adds the 8 adapters of gen and host (rank --rank on every projection, B drawn too: a new
    adapter's B is 0, which would compute the base's tokens)."""
    g = torch.Generator().manual_seed(3)
    for i, name in enumerate(names):
        e.add_adapter(name, lora.LoRAConfig(rank=a.rank, alpha=2 * a.rank, targets=lora.TARGETS), i)
        with torch.no_grad():
            for n, p in e.bank.adapters[name].named():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    e.bank.changed()


def sec_gen(a, model_dir):
    res = {}
    slots = max(a.rows, a.slots)
    e = Engine(str(model_dir), opts(a, slots=slots))
    prof = []
    try:
        res["one_model_defaults_tok_s"] = gen_run(e, a, [""])
        # The prompts as they were before 2026-11-29 (256 rows: 66 pairs of twins 190 rows apart):
        # the one model groups the twins (the shared-prompt pass), adapters cannot.
        res["one_model_repeated_prompts_tok_s"] = gen_run(e, a, [""], repeat=True)
        if a.profile:
            prof.append("== one model\n" + profiled(e, a, [""]))
        names = [f"g{i}" for i in range(8)]
        _adapters(e, a, names)
        res["eight_adapters_tok_s"] = gen_run(e, a, names)
        res["eight_adapters_repeated_prompts_tok_s"] = gen_run(e, a, names, repeat=True)
        # The prefill under the table in the eager layer (lora.PREFILL_COMPILED off), where by
        # default it runs the compiled prefill layer, as the one model's does.
        lora.PREFILL_COMPILED = False
        try:
            res["eight_adapters_prefill_eager_tok_s"] = gen_run(e, a, names)
        finally:
            lora.PREFILL_COMPILED = True
        if a.profile:
            prof.append("== 8 adapters\n" + profiled(e, a, names))
            (pathlib.Path(a.out) / "profile-gen.txt").write_text("\n".join(prof))
        # Where the difference lies: the prefill (a run of one new token a row: its 128-token
        # prompt prefilled, one token sampled) and the decode steps after it, for the one model
        # and the eight adapters.
        for k, ads in (("one_model", [""]), ("eight_adapters", names)):
            pre = a.rows / gen_run(e, a, ads, new=1)
            full = a.rows * a.new / res[k + ("_defaults" if k == "one_model" else "") + "_tok_s"]
            res[k + "_prefill_s"] = pre
            res[k + "_decode_step_ms"] = (full - pre) / max(1, a.new - 1) * 1e3
        gen = e.gen
        res["decode_graphs"] = len(gen.graphs) if gen.use_graphs else 0
        res["table"] = dict(version=e.bank.table.version, slots=e.bank.table.cap, rank=e.bank.table.r)
        res["one_adapter_tok_s"] = gen_run(e, a, ["g0"])
        # The table captured with the shrink a product of its own (not folded into the base's),
        # and with lora.Packed's arithmetic (before the fused expand); the graphs are captured
        # again each way, as they hold the step's kernels.
        for k, attr in (("eight_adapters_unfolded_tok_s", "lora_fold"),
                        ("eight_adapters_packed_tok_s", "lora_fused")):
            setattr(gen, attr, False)
            gen.graphs.clear()
            try:
                res[k] = gen_run(e, a, names)
            finally:
                setattr(gen, attr, True)
                gen.graphs.clear()
        res["table"]["folded"] = e.bank.table.folded
        gen.lora_table = False
        try:
            res["eight_adapters_eager_tok_s"] = gen_run(e, a, names)
        finally:
            gen.lora_table = True
        base = res["one_model_defaults_tok_s"]
        res["ratio_eight_captured_to_one_model"] = res["eight_adapters_tok_s"] / base
        res["ratio_eight_eager_to_one_model"] = res["eight_adapters_eager_tok_s"] / base
        res["ratio_eight_packed_to_one_model"] = res["eight_adapters_packed_tok_s"] / base
        res["ratio_eight_unfolded_to_one_model"] = res["eight_adapters_unfolded_tok_s"] / base
        res["tokens"] = token_check(e, a, names)
    finally:
        e.close()
    e = Engine(str(model_dir), opts(a, slots=slots, cuda_graphs=False, compile=False, kernels=False))
    try:
        res["one_model_eager_tok_s"] = gen_run(e, a, [""])
    finally:
        e.close()
    return res


def sec_proj(a, model_dir):
    """The decode step's projections alone: for every layer its four fused products over --rows
    rows (bf16 on a GPU; the q/k/v, o, gate/up and down matrices of --shape, random) without
    adapters and with a table of 8 slots of rank --rank on all seven targets (rows spread over
    slots 0-8), three ways: Packed, Fused with the shrink its own product, Fused folded. Each way
    one CUDA graph of all the layers' products, replayed; device µs a step and a projection."""
    from slimen_torch import lora_kernels
    cfg, _ = read_config(model_dir)
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    cap, r, M = 8, a.rank, a.rows
    outs = {f: sum(lora.proj_shape(cfg, t)[0] for t in ts) for f, ts in lora.FUSED.items()}
    ins = {f: lora.proj_shape(cfg, ts[0])[1] for f, ts in lora.FUSED.items()}
    gcd = math.gcd(*(lora.proj_shape(cfg, t)[0] for t in lora.TARGETS))
    bn = min(lora_kernels.BN_MAX, gcd & -gcd)  # Table.bn
    idx = torch.randint(0, cap + 1, (M,), generator=g, device=dev)
    scale = torch.full((cap,), 2.0, device=dev)
    xs = {f: torch.randn(M, ins[f], generator=g, device=dev).to(dt) for f in lora.FUSED}
    layers = []
    for _ in range(cfg.layers):
        lay = {}
        for f, ts in lora.FUSED.items():
            n, k, cr = outs[f], ins[f], cap * r
            wa = (torch.randn(n + len(ts) * cr, k, generator=g, device=dev) * 0.02).to(dt)
            bm = torch.zeros(n, len(ts) * cr, device=dev, dtype=dt)
            part, o = [], 0
            for p, t in enumerate(ts):
                m = lora.proj_shape(cfg, t)[0]
                bm[o:o + m, p * cr:(p + 1) * cr] = torch.randn(m, cr, generator=g,
                                                               device=dev) * 0.02
                part += [p] * (m // bn)
                o += m
            part = torch.tensor(part, dtype=torch.int32, device=dev)
            on = (idx[:, None] == torch.arange(1, cap + 1, device=dev)).float() * scale
            mask = on[:, :, None].expand(-1, -1, r).reshape(M, cr).to(dt).repeat(1, len(ts))
            lay[f] = dict(w=wa[:n], wa=wa, a=wa[n:], b=bm, part=part, m=mask)
        layers.append(lay)

    def ways():
        def base():
            for lay in layers:
                for f, d in lay.items():
                    torch.nn.functional.linear(xs[f], d["w"])

        def packed():
            for lay in layers:
                for f, d in lay.items():
                    lora.linear(xs[f], lora.Packed(d["w"], d["a"], d["b"], d["m"]))

        def fused():
            for lay in layers:
                for f, d in lay.items():
                    lora.linear(xs[f], lora.Fused(d["w"], d["a"], d["b"], idx, scale, d["part"], r))

        def folded():
            for lay in layers:
                for f, d in lay.items():
                    lora.linear(xs[f], lora.Fused(d["wa"], None, d["b"], idx, scale, d["part"], r))
        return dict(base=base, packed=packed, fused=fused, folded=folded)

    res = dict(rows=M, rank=r, slots=cap, layers=cfg.layers)
    n_proj = cfg.layers * 4
    for name, fn in ways().items():
        fn()  # compiles the kernels
        if dev.type != "cuda":
            t = time.perf_counter()
            fn()
            res[name + "_us"] = (time.perf_counter() - t) * 1e6
            continue
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        res[name + "_us"] = start.elapsed_time(end) * 1e3 / 20
    for name in ("packed", "fused", "folded"):
        res[name + "_extra_us_per_projection"] = (res[name + "_us"] - res["base_us"]) / n_proj
    # Layer 0's results each way against Packed's, relative to its largest value.
    for name in ("fused", "folded"):
        worst = 0.0
        for f, d in layers[0].items():
            want = lora.linear(xs[f], lora.Packed(d["w"], d["a"], d["b"], d["m"])).float()
            w = lora.Fused(d["wa"] if name == "folded" else d["w"], None if name == "folded"
                           else d["a"], d["b"], idx, scale, d["part"], r)
            got = lora.linear(xs[f], w).float()
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        res[name + "_rel_diff_to_packed"] = worst
    return res


def _syncs(caught) -> int:
    """The warnings of torch.cuda's sync debug mode among caught ("called a synchronizing CUDA
    operation")."""
    return sum("synchroniz" in str(w.message) for w in caught)


def _lora_step_cost(e, a, names, steps=200) -> dict:
    """Decode._lora_step of a.rows rows (row i by adapter i % 8) in the steady state, on the
    engine's thread: µs a call, the operations a call dispatches and (on a GPU) the stream
    synchronisations; the table folded as with the Triton kernels (the generator's triton set
    for the calls: only the placement runs, no kernel)."""
    import types
    import warnings
    gen = e.gen
    ads = [e.bank.adapters[n] for n in names]
    rows = [(r, types.SimpleNamespace(req=types.SimpleNamespace(adapter=ads[r % len(ads)])))
            for r in range(min(a.rows, gen.S))]

    def run():
        triton = gen.triton
        gen.triton = True
        try:
            gen._lora_step(rows)  # places the adapters and writes the rows' slots
            gen._lora_step(rows)
            assert gen.lora_mode == "table" and e.bank.table.folded, (gen.lora_mode,)
            if cuda():
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                gen._lora_step(rows)
            us = (time.perf_counter() - t) / steps * 1e6
            with OpCount() as ops:
                gen._lora_step(rows)
            syncs = None
            if cuda():
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(10):
                            gen._lora_step(rows)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = _syncs(w) / 10
            # Every row's adapter changed (row i by adapter i + 1): each row's slot written.
            moved = [(r, types.SimpleNamespace(req=types.SimpleNamespace(
                adapter=ads[(r + 1) % len(ads)]))) for r in range(len(rows))]
            gen.row_changes = getattr(gen, "row_changes", 0) + 1
            moved_syncs = None
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                if cuda():
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    t = time.perf_counter()
                    gen._lora_step(moved)
                    moved_us = (time.perf_counter() - t) * 1e6
                finally:
                    if cuda():
                        torch.cuda.set_sync_debug_mode(0)
            if cuda():
                moved_syncs = _syncs(w)
            assert gen.lora_idx[:len(rows)].tolist() == [
                e.bank.table.slot_of(s.req.adapter) for _, s in moved]
            return dict(us=us, ops=ops.n, syncs=syncs, moved_us=moved_us,
                        moved_syncs=moved_syncs)
        finally:
            gen.triton = triton
    return e._call(run)


def _host_per_step(e, a, adapters) -> dict:
    """The host side of gen_run's decode steps (warm): the ms of a step() less _run (the model's
    work on the CPU, the replay's launch on a GPU: it runs in ms only where the step is eager),
    the wait for the step before (_process's event) and _admit (the prefills); and of
    _lora_step alone. Means over the steps, and medians (the steady state: admissions and
    finished rows make the others' work). On a GPU also the stream synchronisations of the whole
    run (torch.cuda's sync debug mode; graph captures, admissions and finished rows included,
    _process's event wait not: one model and 8 adapters run the same shapes)."""
    import statistics
    import warnings
    gen = e.gen
    cur = dict(run=0.0, wait=0.0, admit=0.0, lora=0.0, launched=0)
    host, lora_t = [], []
    orig = dict(step=gen.step, _run=gen._run, _process=gen._process, _admit=gen._admit,
                _lora_step=gen._lora_step)

    def timed(key, fn):
        def f(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                cur[key] += time.perf_counter() - t
        return f

    def step():
        for k in cur:
            cur[k] = 0
        t = time.perf_counter()
        orig["step"]()
        if cur["launched"]:
            host.append(time.perf_counter() - t - cur["run"] - cur["wait"] - cur["admit"])
            lora_t.append(cur["lora"])

    def process(rec):
        if rec[0] is not None:
            t = time.perf_counter()
            rec[0].synchronize()
            cur["wait"] += time.perf_counter() - t
        return orig["_process"](rec)

    def run(*args):
        cur["launched"] = 1
        return timed("run", orig["_run"])(*args)

    def install():
        gen.step, gen._run, gen._process = step, run, process
        gen._admit = timed("admit", orig["_admit"])
        gen._lora_step = timed("lora", orig["_lora_step"])

    caught = warnings.catch_warnings(record=True)
    syncs = []

    def remove():
        for k in orig:
            delattr(gen, k)
        if cuda():
            torch.cuda.set_sync_debug_mode(0)
            caught.__exit__(None, None, None)

    def install_all():
        install()
        if cuda():
            syncs.append(caught.__enter__())
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
    e._call(install_all)
    try:
        gen_run(e, a, adapters, warm=False)
    finally:
        e._call(remove)
    ms = dict(steps=len(host), syncs=_syncs(syncs[0]) if syncs else None)
    for k, xs in (("host", host), ("lora", lora_t)):
        ms[k + "_ms"] = statistics.fmean(xs) * 1e3 if xs else 0.0
        ms[k + "_median_ms"] = statistics.median(xs) * 1e3 if xs else 0.0
    return ms


def sec_host(a, model_dir):
    res = {}
    e = Engine(str(model_dir), opts(a, slots=max(a.rows, a.slots)))
    try:
        gen_run(e, a, [""], new=min(a.new, 8))  # warm: graphs captured, kernels compiled
        res["one_model"] = _host_per_step(e, a, [""])
        names = [f"g{i}" for i in range(8)]
        _adapters(e, a, names)
        res["lora_step"] = _lora_step_cost(e, a, names)
        gen_run(e, a, names, new=min(a.new, 8))
        res["eight_adapters"] = _host_per_step(e, a, names)
        res["table"] = dict(version=e.bank.table.version, slots=e.bank.table.cap,
                            folded=e.bank.table.folded, layers=e.cfg.layers)
    finally:
        e.close()
    return res


# ---- diff: the steady decode step, variant against variant ----

def _graph_nodes(graph) -> dict | None:
    """The nodes of a CUDA graph captured with keep_graph, by type (kernel, memcpy, memset,
    other), read through the CUDA runtime torch loaded; None where they cannot be read."""
    import ctypes
    try:
        path = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line)
        rt = ctypes.CDLL(path)
        g, n = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
        if rt.cudaGraphGetNodes(g, None, ctypes.byref(n)) != 0:
            return None
        nodes = (ctypes.c_void_p * n.value)()
        if rt.cudaGraphGetNodes(g, nodes, ctypes.byref(n)) != 0:
            return None
        out, kind = {}, ctypes.c_int(0)
        for node in nodes[:n.value]:
            if rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
                return None
            k = {0: "kernel", 1: "memcpy", 2: "memset"}.get(kind.value, "other")
            out[k] = out.get(k, 0) + 1
        return out
    except Exception:
        return None


def _diff_variants(e, gen) -> list:
    """The diff section's variants, in the order they run: (name, what, adapters applied,
    setup), setup() making the change and returning its undo. All run the same rows (row i by
    adapter i % 8, the table placed); "adapters applied" False runs the step as the one model
    (lora_mode None)."""
    from slimen_torch import kernels, lora_kernels
    from slimen_torch.model import decode_post, decode_pre
    F = torch.nn.functional
    linear = lora.linear

    def patched(obj, name, value):
        def setup():
            old = getattr(obj, name)
            setattr(obj, name, value)
            return lambda: setattr(obj, name, old)
        return setup

    def on_fused(fn):
        """lora.linear (which model.linear calls) with fn(x, w) for the step's Fused weights."""
        def f(x, w, b=None):
            return fn(x, w) if isinstance(w, lora.Fused) and w.a is None else linear(x, w, b)
        return patched(lora, "linear", f)

    def no_expand(x, w):  # the folded product, its base columns as a view
        return F.linear(x, w.w)[:, :w.b.shape[0]]

    def expand_only(x, w):  # the base's product (its own N), then the expand
        y = F.linear(x, w.w[:w.b.shape[0]])
        # The shrink read from y's first columns (the same kernel's work; its values unused)
        # where y is that wide.
        s = y if y.shape[1] >= w.b.shape[1] else y.new_zeros(y.shape[0], w.b.shape[1])
        return lora_kernels.expand(y, s, w.b, w.idx, w.scale, w.part, w.r, 0)

    def base_copy(x, w):  # the table's copy of the base weight: no shrink, no expand
        return F.linear(x, w.w[:w.b.shape[0]])

    def eager():
        old = gen.pre_fn, gen.post_fn
        gen.pre_fn, gen.post_fn = decode_pre, decode_post

        def undo():
            gen.pre_fn, gen.post_fn = old
        return undo

    def no_pdl():
        old = dict(kernels._PDL)
        for i in range(torch.cuda.device_count() if cuda() else 1):
            kernels._PDL[i] = False

        def undo():
            kernels._PDL.clear()
            kernels._PDL.update(old)
        return undo

    def static_table():
        # The table's tensors static for torch.compile, as the model's parameters are (Dynamo's
        # force_parameter_static_shapes): the compiled layers specialise on their sizes instead
        # of symbols. Dynamo's caches dropped, so that the layers compile again.
        t = e.bank.table
        for x in [*t.wa.values(), *t.a.values(), *t.b.values(), *t.part.values(), t.scale]:
            torch._dynamo.mark_static(x)
        torch._dynamo.reset()
        return lambda: None

    def expand_form(**kw):
        """lora_kernels' expand in another tile (its module-level switches)."""
        def setup():
            old = {k: getattr(lora_kernels, k) for k in kw}
            for k, v in kw.items():
                setattr(lora_kernels, k, v)
            return lambda: [setattr(lora_kernels, k, v) for k, v in old.items()]
        return setup

    def none():
        return lambda: None
    return [
        ("one_model", "one model (the rows' adapters not applied)", False, none),
        ("lora", "8 adapters: the table folded, the fused expand (the default)", True, none),
        ("lora_no_expand", "8 adapters, no expand kernel (the folded product's base columns)",
         True, on_fused(no_expand)),
        ("lora_expand_only", "8 adapters, the base's own product (not folded) and the expand",
         True, on_fused(expand_only)),
        ("lora_base_copy", "8 adapters, the product of the table's copy of the base alone",
         True, on_fused(base_copy)),
        ("lora_own_weights", "8 adapters selected (lora.Slots), the layers' own weights", True,
         patched(lora.Slots, "weights", lambda self, model, i, w: w)),
        ("lora_unfolded", "8 adapters, the shrink a product of its own (lora_fold off)", True,
         patched(gen, "lora_fold", False)),
        ("lora_packed", "8 adapters, lora.Packed (lora_fused off)", True,
         patched(gen, "lora_fused", False)),
        ("one_model_eager", "one model, the layers not compiled", False, eager),
        ("lora_eager", "8 adapters, the layers not compiled", True, eager),
        ("one_model_no_pdl", "one model, no programmatic dependent launch", False, no_pdl),
        ("lora_no_pdl", "8 adapters, no programmatic dependent launch", True, no_pdl),
        # The expand kernel's other tiles (lora_kernels.BM and WARPS; rows "as lora's" says
        # whether the step's tokens and log-probs stay the default's bit for bit).
        ("lora_bm64", "8 adapters, the expand's tiles of 64 rows (BM 64, the old default)", True,
         expand_form(BM=64)),
        ("lora_bm32", "8 adapters, the expand's tiles of 32 rows (BM 32)", True,
         expand_form(BM=32)),
        ("lora_w2", "8 adapters, the expand's tiles (16 rows) on 2 warps", True,
         expand_form(WARPS=2)),
        ("lora_bm128_w8", "8 adapters, the expand's tiles of 128 rows on 8 warps", True,
         expand_form(BM=128, WARPS=8)),
        ("lora_static", "8 adapters, the table's tensors static for torch.compile", True,
         static_table),
        ("one_model_again", "one model (compiled again after lora_static)", False, none),
    ]


def _timeline(e, a, adapters) -> dict:
    """gen_run's generation (after its warm-up) with every decode step (Decode._run) and every
    prefill (_prefill) timed on the device by CUDA events around it, and the host's wall time
    of the run: {"wall_s", "steps": {(B, L): [µs, …]}, "prefills": [(rows, µs)]} (GPU only)."""
    gen = e.gen
    ev: list = []
    run, prefill = gen._run, gen._prefill

    class Clock:  # the CPU's stand-in for a CUDA event (the section's dry run)
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    def event():
        return torch.cuda.Event(enable_timing=True) if cuda() else Clock()

    def timed(kind, fn, info):
        a0, b0 = event(), event()
        a0.record()
        out = fn()
        b0.record()
        ev.append((kind, info, a0, b0))
        return out

    gen._run = lambda B, L, top_p: timed("step", lambda: run(B, L, top_p), (B, L))
    gen._prefill = lambda placed: timed("prefill", lambda: prefill(placed), len(placed))
    try:
        gen_run(e, a, adapters, warm=True)  # the warm-up's events are dropped below
        ev.clear()
        t = time.perf_counter()
        gen_run(e, a, adapters, warm=False)
        if cuda():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        del gen._run, gen._prefill
    steps: dict = {}
    pre = []
    for kind, info, a0, b0 in ev:
        us = a0.elapsed_time(b0) * 1e3
        if kind == "step":
            steps.setdefault(info, []).append(us)
        else:
            pre.append((info, us))
    return {"wall_s": wall, "steps": steps, "prefills": pre,
            "first_to_last_ms": ev[0][2].elapsed_time(ev[-1][3]) if ev else 0.0}


def sec_steps(a, model_dir):
    """The generation of the gen section, one model and 8 adapters, as the device runs it: each
    decode step's device µs by its (rows, length) graph, each prefill's, and the run's wall time,
    so that the ratio of the runs splits into steps, their count and shapes, prefills and the
    gaps where the device waits for the host (wall time less the timed work). On the CPU the
    host's clock stands in for the events (a dry run)."""
    e = Engine(str(model_dir), opts(a, slots=max(a.rows, a.slots)))
    res = {}
    try:
        res["one_model"] = _timeline(e, a, [""])
        names = [f"g{i}" for i in range(8)]
        _adapters(e, a, names)
        res["eight_adapters"] = _timeline(e, a, names)
    finally:
        e.close()
    for r in res.values():
        r["steps"] = {f"{B}x{L}": v for (B, L), v in r["steps"].items()}
    return res


def sec_diff(a, model_dir):
    """The steady decode step, variant against variant (_diff_variants), in one process on one
    engine and the same rows: --rows rows of distinct prompts of min(128, --pos) tokens spread
    over 8 adapters (rank --rank on every projection), every row at position --pos (the
    positions past its prompt hold zeros). Each variant captures the
    step as the generator does (Decode._capture: compiled, warmed up, one CUDA graph) and
    replays it --steps times, the step state restored before each replay (the same length each
    time), timed by CUDA events around the replay alone: the median µs, and the graph's nodes by
    type. On the CPU the step runs eagerly: its median µs and the tensor operations it
    dispatches."""
    import statistics
    from slimen_torch.generate import _bucket
    from slimen_torch.sequence import Request
    kw = dict(slots=max(a.rows, a.slots))
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        kw["kernels"] = True  # the Fused path under Triton's interpreter (the tests)
    e = Engine(str(model_dir), opts(a, **kw))
    names = [f"g{i}" for i in range(8)]
    _adapters(e, a, names)
    gen = e.gen

    def admit():
        ads = [e.bank.adapters[n] for n in names]
        n = max(2, min(128, a.pos, gen.L - 2))  # the prompts' length
        for i in range(a.rows):
            r = Request(f"d{i}", prompt(i, n=n), 1,
                        Sampling(max_tokens=gen.L, temperature=1.0, seed=i), lambda c: None)
            r.adapter = ads[i % len(ads)]
            gen.add(r)
        while gen.waiting:
            gen._admit()
        return [(r, s) for r, s in enumerate(gen.slots) if s is not None]

    def measure(rows, B, L, grouped, state, saved, applied) -> dict:
        out = {}
        gen._lora_step(rows)
        if not applied:
            gen.lora_mode = None
        out["mode"] = gen.lora_mode
        graphs = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)

        def restore():
            for x, s in zip(state, saved):
                x.copy_(s)
        restore()
        times = []
        if gen.use_graphs:
            cls = torch.cuda.CUDAGraph
            torch.cuda.CUDAGraph = lambda: cls(keep_graph=True)  # (its nodes read below)
            try:
                g = gen._capture(B, L, False, grouped)
            finally:
                torch.cuda.CUDAGraph = cls
            g.instantiate()
            out["nodes"] = _graph_nodes(g)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(a.steps)]
            launch = []
            for i in range(-3, a.steps):  # (three replays to warm up)
                if i == 0:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                restore()
                if i >= 0:
                    ev[i][0].record()
                t = time.perf_counter()
                g.replay()
                launch.append(time.perf_counter() - t)
                if i >= 0:
                    ev[i][1].record()
            torch.cuda.synchronize()
            # The host's clock over the replays, one after another (the restores included):
            # above the events' µs where the GPU waits for the host's launches; and the host's
            # µs in replay() itself (the graph's launch), which bench_lora's host section leaves
            # out of the host's work a step.
            out["wall_us"] = (time.perf_counter() - t0) / a.steps * 1e6
            out["launch_us"] = statistics.median(launch[3:]) * 1e6
            times = [s.elapsed_time(t) * 1e3 for s, t in ev]
            restore()
            g.replay()
        else:
            gen._decode(B, L, False, grouped)  # (compiles what is compiled)
            for _ in range(a.steps):
                restore()
                t = time.perf_counter()
                gen._decode(B, L, False, grouped)
                times.append((time.perf_counter() - t) * 1e6)
            restore()
            with OpCount() as ops:
                gen._decode(B, L, False, grouped)
            out["ops"] = ops.n
        # The step's sampled tokens and their log-probs (from the state restored), which run()
        # compares with the default's.
        out["_rows"] = (gen.out_tok[:B].clone(), gen.out_lp[:B].clone())
        restore()
        out.update(us=statistics.median(times), us_min=min(times),
                   graphs_compiled=torch._dynamo.utils.counters["stats"].get(
                       "unique_graphs", 0) - graphs)
        return out

    def run():
        # Every variant's layers compile as their own entry of the compiled functions' caches.
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        rows = admit()
        B = _bucket(rows[-1][0] + 1, gen.S, gen.batch_sizes)
        pos = min(a.pos, gen.L - 2)
        gen.pos[torch.tensor([r for r, _ in rows], device=gen.device)] = pos
        L = min(-(-(pos + 1) // gen.length_bucket) * gen.length_bucket, gen.L)
        grouped = gen.groups.active()
        state = (gen.tok, gen.pos, gen.step_idx)
        saved = [x.clone() for x in state]
        res = dict(rows=len(rows), batch=B, length=L, pos=pos, steps=a.steps, variants={})
        keep = ("pre_fn", "post_fn", "layer_fn", "triton", "fused_b1", "compile_error",
                "kernel_error")
        only = [x for x in (getattr(a, "variants", "") or "").split(",") if x]
        partial = pathlib.Path(a.out) / "bench_lora_diff.json" if getattr(a, "out", "") else None
        ref = None  # the default's rows (out_tok, out_lp) after its step
        for name, what, applied, setup in _diff_variants(e, gen):
            if only and name not in only:
                continue
            kept = {k: getattr(gen, k) for k in keep}
            out = dict(what=what)
            undo = setup()
            try:
                out.update(measure(rows, B, L, grouped, state, saved, applied))
            except Exception as ex:
                out["error"] = f"{type(ex).__name__}: {ex}"
                out["traceback"] = traceback.format_exc()
            finally:
                undo()
                # A variant that failed to compile is reported, not inherited by the next.
                out.update(compile_error=gen.compile_error, kernel_error=gen.kernel_error)
                for k, v in kept.items():
                    setattr(gen, k, v)
            got = out.pop("_rows", None)
            if name == "lora":
                ref = got
            elif got is not None and ref is not None:
                # The rows as the default's: equal tokens, and the largest log-prob difference
                # (0: the same step bit for bit, as a form of the expand must give).
                out["as_lora"] = dict(tokens=int((got[0] == ref[0]).sum()), rows=len(got[0]),
                                      lp_max_diff=(got[1] - ref[1]).abs().max().item())
            res["variants"][name] = out
            if partial is not None:  # (what was measured survives a run cut short)
                partial.write_text(json.dumps(res, indent=2) + "\n")
            print(f"diff {name}: {out.get('us', 0):.1f} us, "
                  f"{out.get('nodes') or out.get('ops')} {out.get('as_lora', '')} "
                  f"{out.get('error', '')}", flush=True)
        t = e.bank.table
        res["table"] = dict(version=t.version, slots=t.cap, rank=t.r, folded=t.folded)
        res["dynamo"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                         if k in ("stats", "graph_break", "recompiles")}
        gen.fail_all("the diff section is done")
        return res
    try:
        return e._call(run)
    finally:
        e.close()


# ---- driver ----

def table(results: dict, a) -> str:
    L = [f"# LoRA agents on one {a.device} ({a.shape}, rank {a.rank} on all 7 projections)", ""]
    m = results.get("memory", {})
    if "params" in m:
        L.append(f"- base {m['params'] / 1e6:.1f} M parameters; adapter {m['adapter_params'] / 1e6:.2f} M")
        L.append(f"- memory model: {m['bytes_per_full_agent'] / 2**30:.2f} GiB per full agent, "
                 f"{m['bytes_per_lora_agent'] / 2**20:.1f} MiB per LoRA agent"
                 + (f"; predicted {m['predicted_full']} full / {m['predicted_lora']} LoRA"
                    if "predicted_full" in m else ""))
    L += ["", "| agents that train in one run | fit | stopped by |", "|---|---:|---|"]
    for k, what in (("full", "full copies (one worker each)"), ("lora", "LoRA adapters on one base")):
        r = results.get(k, {})
        L.append(f"| {what} | {r.get('fits', '—')} | {r.get('stopped', r.get('error', '—'))} |")
    g = results.get("gen", {})
    if g and "error" not in g:
        L += ["", f"| generation, {a.rows} rows × {a.new} tokens | tok/s |", "|---|---:|"]
        for k, what in (("one_model_defaults_tok_s", "one model, engine defaults (graphs, Triton)"),
                        ("eight_adapters_tok_s", "spread over 8 adapters, one batch (the table, captured)"),
                        ("one_model_repeated_prompts_tok_s",
                         "one model, the prompts before (66 pairs of twins: grouped)"),
                        ("eight_adapters_repeated_prompts_tok_s",
                         "spread over 8 adapters, the prompts before (twins on other adapters)"),
                        ("eight_adapters_prefill_eager_tok_s",
                         "spread over 8 adapters, the prefill in the eager layer"),
                        ("eight_adapters_unfolded_tok_s",
                         "spread over 8 adapters, one batch (captured, the shrink not folded)"),
                        ("eight_adapters_packed_tok_s",
                         "spread over 8 adapters, one batch (captured, the expand not fused)"),
                        ("eight_adapters_eager_tok_s", "spread over 8 adapters, one batch (Rows, eager)"),
                        ("one_adapter_tok_s", "one adapter"),
                        ("one_model_eager_tok_s", "one model, eager path")):
            L.append(f"| {what} | {g.get(k, 0):,.0f} |")
        if "eight_adapters_prefill_s" in g:
            L += ["", "- the run split (one model → 8 adapters): prefill with one sampled token "
                  f"{g['one_model_prefill_s']:.3f} → {g['eight_adapters_prefill_s']:.3f} s, "
                  f"a decode step after it {g['one_model_decode_step_ms']:.2f} → "
                  f"{g['eight_adapters_decode_step_ms']:.2f} ms"]
        if "ratio_eight_captured_to_one_model" in g:
            t = g["tokens"]
            L += ["", f"- 8 adapters captured / one captured model: "
                  f"{g['ratio_eight_captured_to_one_model']:.3f}x (not folded: "
                  f"{g['ratio_eight_unfolded_to_one_model']:.3f}x; not fused: "
                  f"{g['ratio_eight_packed_to_one_model']:.3f}x; eager Rows: "
                  f"{g['ratio_eight_eager_to_one_model']:.3f}x); {g['decode_graphs']} decode graphs, "
                  f"table {g['table']}",
                  f"- greedy tokens of the mixed batch: {t['same_shape_equal']}/{t['rows']} rows equal to "
                  f"the batch all of their adapter (log-probs within {t['same_shape_max_lp_diff']:.2g}), "
                  f"{t['rows_path_equal']}/{t['rows']} to the eager Rows path (within "
                  f"{t['rows_path_max_lp_diff']:.2g}), {t['packed_equal']}/{t['rows']} to the "
                  f"captured table not fused (within {t['packed_max_lp_diff']:.2g}), "
                  f"{t['alone_equal']}/{t['alone_checked']} to the row "
                  f"alone; {t['differ_from_base']}/{t['rows']} differ from the base's (tokens or "
                  f"log-probs by > 1e-3)"]
    elif g:
        L.append(f"\ngen: {g['error']}")
    p = results.get("proj", {})
    if p and "error" not in p:
        L += ["", f"| the step's projections alone, {p['rows']} rows, {p['layers']} layers × 4 "
              f"(8 slots of rank {p['rank']}; one graph) | µs a step | µs more a projection |",
              "|---|---:|---:|"]
        for k, what in (("base", "no adapters"), ("packed", "Packed (before)"),
                        ("fused", "Fused, the shrink its own product"),
                        ("folded", "Fused, folded (the default)")):
            extra = p.get(k + "_extra_us_per_projection")
            L.append(f"| {what} | {p.get(k + '_us', 0):,.0f} | "
                     f"{'—' if extra is None else f'{extra:.1f}'} |")
        L.append(f"- layer 0's results against Packed's (largest difference ÷ largest value): "
                 f"fused {p['fused_rel_diff_to_packed']:.2g}, folded "
                 f"{p['folded_rel_diff_to_packed']:.2g}")
    elif p:
        L.append(f"\nproj: {p['error']}")
    h = results.get("host", {})
    if h and "error" not in h:
        ls, t = h["lora_step"], h["table"]
        L += ["", f"| the host's work a decode step, {a.rows} rows ({t['layers']} layers; table "
              f"{t['slots']} slots, folded {t['folded']}) | ms a step (median) | of it "
              "_lora_step (median) |", "|---|---:|---:|"]
        for k, what in (("one_model", "one model"), ("eight_adapters", "spread over 8 adapters")):
            x = h[k]
            L.append(f"| {what} ({x['steps']} steps) | {x['host_ms']:.3f} "
                     f"({x['host_median_ms']:.3f}) | {x['lora_ms']:.3f} "
                     f"({x['lora_median_ms']:.3f}) |")
        if h["one_model"]["syncs"] is not None:
            L.append(f"- stream synchronisations in the run: one model "
                     f"{h['one_model']['syncs']}, 8 adapters {h['eight_adapters']['syncs']}")
        L.append(f"- _lora_step in the steady state: {ls['us']:.1f} µs a call, {ls['ops']} tensor "
                 f"operations, " + ("no GPU" if ls["syncs"] is None
                                    else f"{ls['syncs']:g} stream synchronisations")
                 + f"; with every row's adapter changed {ls['moved_us']:.0f} µs"
                 + ("" if ls["moved_syncs"] is None
                    else f", {ls['moved_syncs']} stream synchronisations"))
    elif h:
        L.append(f"\nhost: {h['error']}")
    st = results.get("steps", {})
    if st and "error" not in st:
        L += ["", "| the generation as the device runs it | wall s | decode steps | their device ms "
              "(rows×length: steps, µs median) | prefills (rows: ms) | first event → last, ms |",
              "|---|---:|---:|---|---|---:|"]
        for k in ("one_model", "eight_adapters"):
            r = st.get(k)
            if not r:
                continue
            n = sum(len(v) for v in r["steps"].values())
            tot = sum(sum(v) for v in r["steps"].values()) / 1e3
            shapes = "; ".join(f"{sh}: {len(v)}, {sorted(v)[len(v) // 2]:,.0f}"
                               for sh, v in sorted(r["steps"].items()))
            pre = ", ".join(f"{rows}: {us / 1e3:.1f}" for rows, us in r["prefills"])
            L.append(f"| {k} | {r['wall_s']:.3f} | {n} | {tot:.1f} ({shapes}) | {pre} | "
                     f"{r['first_to_last_ms']:.1f} |")
    elif st:
        L.append(f"\nsteps: {st['error']}")
    d = results.get("diff", {})
    if d and "error" not in d:
        vs = d["variants"]
        ref = vs.get("one_model", {}).get("us")
        where = "GPU: CUDA events around the graph's replay" if a.device != "cpu" else "CPU, eager"
        L += ["", f"| the steady decode step, {d['rows']} rows (batch {d['batch']}) at position "
              f"{d['pos']} (length {d['length']}), {d['steps']} steps ({where}) | µs a step "
              "(median) | µs more than one model | host's µs a step, replays back to back "
              "(of it in replay()) | kernels (graph nodes) or operations | rows' tokens as "
              "lora's (largest log-prob difference) |",
              "|---|---:|---:|---:|---:|---:|"]
        for name, v in vs.items():
            if "error" in v:
                L.append(f"| {name}: {v['what']} | error: {v['error'][:80]} | | | | |")
                continue
            same = v.get("as_lora")
            same = (f"{same['tokens']}/{same['rows']} ({same['lp_max_diff']:.2g})" if same
                    else "—")
            n = v.get("nodes")
            count = (f"{n.get('kernel', 0)} (+{sum(n.values()) - n.get('kernel', 0)} other)"
                     if n else str(v.get("ops", "—")))
            more = "—" if ref is None else f"{v['us'] - ref:+,.0f}"
            flags = "".join(f"; {k}: {v[k][:60]}" for k in ("compile_error", "kernel_error")
                            if v.get(k))
            wall = (f"{v['wall_us']:,.0f} ({v['launch_us']:,.0f})" if "wall_us" in v
                    else "—")
            L.append(f"| {name}: {v['what']}{flags} | {v['us']:,.0f} | {more} | {wall} | "
                     f"{count} | {same} |")
        L.append(f"- table {d['table']}; torch.compile {d['dynamo'].get('stats', {})}")
    elif d:
        L.append(f"\ndiff: {d['error']}")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_lora_out")
    ap.add_argument("--device", default="cuda" if cuda() else "cpu")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8, help="cache rows of the allocation tests' engines")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--train-rows", type=int, default=2, help="the allocation tests' training step")
    ap.add_argument("--train-len", type=int, default=256)
    ap.add_argument("--max-full", type=int, default=64)
    ap.add_argument("--max-adapters", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per allocation test")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--pos", type=int, default=192,
                    help="diff: the rows' position (attention over pos + 1 positions)")
    ap.add_argument("--steps", type=int, default=100, help="diff: timed steps a variant")
    ap.add_argument("--variants", default="",
                    help="diff: the variants to run, comma-separated (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="gen: the kernels of one run of the one model and one of the 8 adapters "
                    "(top 30 by device time) in OUT/profile-gen.txt")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU dry run)")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.rows, a.new, a.max_full, a.max_adapters = 16, 4, 3, 24
        a.train_rows, a.train_len, a.max_len, a.budget = 2, 32, 256, min(a.budget, 30)
        a.pos, a.steps = 24, 1
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.section:  # a child: one section, its result as JSON on the last line
        torch.manual_seed(0)
        try:
            r = globals()["sec_" + a.section](a, pathlib.Path(a.model))
        except Exception as e:
            r = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        print("RESULT " + json.dumps(r), flush=True)
        return
    model = out / f"model-{a.shape}"
    if not (model / "config.json").exists():
        make_model(a.shape, model, seed=7)
    results = {}
    # The arguments for the children, less --sections (as "--sections=X" or "--sections X").
    passthrough, skip = [], False
    for x in sys.argv[1:]:
        if not skip and not x.startswith("--sections"):
            passthrough.append(x)
        skip = x == "--sections"
    for s in a.sections.split(","):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, *passthrough, "--section", s, "--model", str(model)],
                           capture_output=True, text=True, env=os.environ)
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else dict(error=f"exit {p.returncode}: {p.stderr[-2000:]}")
        r["seconds"] = round(time.perf_counter() - t, 1)
        results[s] = r
        (out / "bench_lora.log").open("a").write(f"== {s}\n{p.stdout}\n{p.stderr}\n")
        print(f"{s}: {r.get('error') or 'done'} in {r['seconds']} s", flush=True)
    (out / "bench_lora.json").write_text(json.dumps(results, indent=2) + "\n")
    md = table(results, a)
    (out / "bench_lora.md").write_text(md)
    print(md)
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
