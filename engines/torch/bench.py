"""GPU numbers of issue 6 in one run: parity, generation and training throughput, one table.

    python engines/torch/bench.py [--out DIR] [--skip-hf]

On a random Qwen3-0.6B-shaped model (make-model, bf16):
  1. logit parity with transformers in bf16 (relative error ‖ours − hf‖/‖hf‖ on 4×128 tokens),
     and generation log-probs against Score (the decode path against the full forward pass);
  2. generation, 128 prompt + 256 sampled tokens (temperature 1, top_p 1, no EOS so every
     response is 256 tokens), batch 1 and 256: HF generate (measured here, the baseline; on fewer
     new tokens because it is slow, which flatters it: its step time grows with the context) and
     ours with and without torch.compile (always CUDA graphs); tok/s = sampled tokens / wall time
     from submission to the last completion, prefill included;
  3. training: one optimizer step (policy loss, AdamW) on 8 samples of 2,048 tokens, tokens/s and
     model-FLOPs utilisation against the H100/H200 dense bf16 peak of 989 TFLOP/s.
The table is printed last and written to DIR/bench.md with the raw numbers in DIR/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling, ScoreRequest  # noqa: E402

PEAK_BF16 = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (datasheet)
PROMPT, NEW = 128, 256


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


def prompts(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT), generator=g)


def parity(model_dir, eng: Engine, res: dict, dev: str) -> None:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    toks = prompts(4, eng.cfg.vocab_size, 1).to(dev)
    with torch.no_grad():
        ref = hf(toks).logits.float()
        got = eng.model.logits(eng.model(toks)).float()
        hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
        ref32 = hf32(toks).logits.float()
    res["parity_rel_vs_hf_bf16"] = ((got - ref).norm() / ref.norm()).item()
    res["parity_rel_vs_hf_fp32"] = ((got - ref32).norm() / ref32.norm()).item()
    res["hf_bf16_rel_vs_hf_fp32"] = ((ref - ref32).norm() / ref32.norm()).item()
    del hf, hf32
    # The decode path (KV cache, graphs) against the full forward pass, on generated tokens.
    c = eng.generate([GenerateRequest(id="p", prompt_tokens=toks[0].tolist(),
                                      sampling=Sampling(max_tokens=64, seed=1))])[0]
    s = eng.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
    a, b = torch.tensor(c.logprobs), torch.tensor(s)
    res["decode_vs_score_max_abs_logprob"] = (a - b).abs().max().item()
    log("parity", {k: v for k, v in res.items() if "rel" in k or "logprob" in k})


def hf_generate(model_dir, batch: int, new: int) -> float:
    from transformers import AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    toks = prompts(batch, hf.config.vocab_size, 2).to(dev)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
              min_new_tokens=new, pad_token_id=0, attention_mask=torch.ones_like(toks))
    with torch.no_grad():
        hf.generate(toks[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
        sync()
        t = time.perf_counter()
        out = hf.generate(toks, **kw)
        sync()
        dt = time.perf_counter() - t
    assert out.shape[1] == PROMPT + new
    del hf
    return batch * new / dt


def ours_generate(eng: Engine, batch: int, reps: int = 2) -> float:
    toks = prompts(batch, eng.cfg.vocab_size, 3).tolist()
    reqs = [GenerateRequest(id=f"b{batch}-{i}", prompt_tokens=t,
                            sampling=Sampling(max_tokens=NEW, temperature=1.0, seed=i))
            for i, t in enumerate(toks)]
    eng.generate(reqs)  # warm-up: compiles and captures the shapes this batch goes through
    best = 0.0
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        cs = eng.generate(reqs)
        dt = time.perf_counter() - t
        assert all(len(c.tokens) == NEW for c in cs)
        best = max(best, batch * NEW / dt)
    return best


def step_times(eng: Engine, res: dict, prefix: str) -> None:
    """GPU time of one captured decode step, and of sampling alone, without the scheduler."""
    from slimen_torch import sampling
    if not torch.cuda.is_available():
        return
    gen = eng.gen
    for (B, L, top), g in sorted(gen.graphs.items()):
        if B not in (1, 256) or L != gen.L or top:
            continue
        # All rows are idle after the benchmark: replays rewrite position 0 of free rows only.
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            g.replay()
        end.record()
        sync()
        res[f"{prefix}_step_ms_b{B}"] = start.elapsed_time(end) / 50
    for B in (1, 256):
        logits = torch.randn(B, eng.cfg.vocab_size, device="cuda") * 3
        ones = torch.ones(B, device="cuda")
        u = torch.rand(B, device="cuda")
        sampling.sample(logits, ones, ones, u, False)
        sg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sg):
            sampling.sample(logits, ones, ones, u, False)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            sg.replay()
        end.record()
        sync()
        res[f"sample_ms_b{B}"] = start.elapsed_time(end) / 50
    log("step times", {k: v for k, v in res.items() if k.endswith(("_b1", "_b256")) and "ms" in k})


def train_bench(eng: Engine, res: dict, samples=8, length=2048, steps=3, prefix="train") -> None:
    cfg = eng.cfg
    g = torch.Generator().manual_seed(4)
    p = min(64, length // 4)
    batch = []
    for i in range(samples):
        seq = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
        r = length - p
        batch.append(Sample(seq[:p], seq[p:], [1.0] * r, [-5.0] * r, [1.0 if i % 2 else -1.0] * r,
                            group=f"g{i // 4}"))
    b = Batch(samples=batch, loss=LossConfig(lr=1e-6, max_grad_norm=1.0))
    eng.train(b)  # warm-up
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        st = eng.train(b)
        sync()
        times.append(time.perf_counter() - t)
    dt = sorted(times)[len(times) // 2]
    tokens = samples * length
    # Model FLOPs: 6 per parameter per token for the matrices (the tied embedding counts once,
    # as the output head; the lookup is free) + causal attention 6·2·layers·T/2·q_dim per token.
    matrix_params = cfg.params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)
    flops = tokens * (6 * matrix_params + 6 * 2 * cfg.layers * (length / 2) * cfg.q_dim)
    res[f"{prefix}_tokens_per_s"] = tokens / dt
    res[f"{prefix}_mfu"] = flops / dt / PEAK_BF16
    res[f"{prefix}_step_s"] = dt
    res[f"{prefix}_loss"] = st.loss
    res[f"{prefix}_compile_error"] = eng.trainer.compile_error[:500]
    if torch.cuda.is_available():
        res[f"{prefix}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    log(prefix, {k: v for k, v in res.items() if k.startswith(prefix)})


def main():
    global NEW
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", default="")
    # A dry run of the script itself on the CPU: --device cpu --shape tiny --new 8 --train-len 64
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--new", type=int, default=NEW)
    ap.add_argument("--train-len", type=int, default=2048)
    args = ap.parse_args()
    NEW = args.new
    dev = args.device
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                 "torch": torch.__version__}
    t0 = time.time()
    model_dir = pathlib.Path(args.model or f"/tmp/bench-{args.shape}")
    if not (model_dir / "config.json").exists():
        make_model(args.shape, model_dir, seed=0, dtype="bfloat16" if dev == "cuda" else "")
        no_eos(model_dir)
    log(f"model ready in {time.time() - t0:.0f}s")
    def section(name, fn):
        t = time.time()
        try:
            fn()
        except Exception:
            res[f"error_{name}"] = traceback.format_exc()[-2000:]
            log(f"{name} FAILED:\n{res[f'error_{name}']}")
        log(f"[{name}: {time.time() - t:.0f}s, total {time.time() - t0:.0f}s]")

    # Ours first (compiled): the headline numbers must come back even if a later part fails.
    eng = None

    def ours_compiled():
        nonlocal eng
        eng = Engine(str(model_dir), Options(device=dev, slots=256, max_seq_len=PROMPT + NEW,
                                             compile_train=True))
        res["ours_compiled_b1"] = ours_generate(eng, 1)
        log("ours compiled b1", res["ours_compiled_b1"])
        res["ours_compiled_b256"] = ours_generate(eng, 256)
        log("ours compiled b256", res["ours_compiled_b256"])
        res["compile_error"] = eng.gen.compile_error
        res["graphs"] = sorted(str(k) for k in eng.gen.graphs)
        step_times(eng, res, "compiled")

    section("ours_compiled", ours_compiled)
    if eng is not None:
        section("parity", lambda: parity(model_dir, eng, res, dev))
        section("train", lambda: train_bench(eng, res, length=args.train_len))
        eng.close()
        del eng

    def ours_eager():
        e = Engine(str(model_dir), Options(device=dev, slots=256, max_seq_len=PROMPT + NEW,
                                           compile=False))
        res["ours_graphs_b1"] = ours_generate(e, 1, reps=1)
        res["ours_graphs_b256"] = ours_generate(e, 256, reps=1)
        log("ours graphs-only", res["ours_graphs_b1"], res["ours_graphs_b256"])
        step_times(e, res, "graphs")
        train_bench(e, res, length=args.train_len, prefix="train_eager")
        e.close()

    section("ours_eager", ours_eager)
    if not args.skip_hf:
        def hf():
            res["hf_b1"] = hf_generate(model_dir, 1, 32)
            log("hf b1", res["hf_b1"])
            res["hf_b256"] = hf_generate(model_dir, 256, 64)
            log("hf b256", res["hf_b256"])
        section("hf", hf)

    def num(k, digits=0):
        return "failed" if k not in res else f"{res[k]:,.{digits}f}"

    def sci(k):
        return "failed" if k not in res else f"{res[k]:.2e}"

    def pct(k):
        return "failed" if k not in res else f"{100 * res[k]:.1f}%"

    rows = [
        "| Qwen3-0.6B shape, bf16, 128 prompt + 256 sampled tokens | batch 1 tok/s | batch 256 tok/s |",
        "|---|---:|---:|",
        f"| HF generate, same run (32 / 64 new tokens) | {num('hf_b1')} | {num('hf_b256')} |",
        f"| ours, CUDA graphs | {num('ours_graphs_b1')} | {num('ours_graphs_b256')} |",
        f"| ours, compiled layer + CUDA graphs | {num('ours_compiled_b1')} | "
        f"{num('ours_compiled_b256')} |",
        "| target | 1,000 | 50,000 |",
        f"| GPU time of one decode step at 384 positions, ms (graph replay; compiled / not) | "
        f"{num('compiled_step_ms_b1', 3)} / {num('graphs_step_ms_b1', 3)} | "
        f"{num('compiled_step_ms_b256', 3)} / {num('graphs_step_ms_b256', 3)} |",
        f"| of which sampling (graph replay), ms | {num('sample_ms_b1', 3)} | "
        f"{num('sample_ms_b256', 3)} |",
        "",
        "| training, 8 × 2,048 tokens, one AdamW step | tokens/s | MFU (989 TFLOP/s) | step s | peak GiB |",
        "|---|---:|---:|---:|---:|",
        f"| ours, compiled layer and loss head"
        f"{' (compile failed: ran eagerly)' if res.get('train_compile_error') else ''} | "
        f"{num('train_tokens_per_s')} | {pct('train_mfu')} | "
        f"{num('train_step_s', 2)} | {num('train_peak_mem_gib', 1)} |",
        f"| ours, eager | {num('train_eager_tokens_per_s')} | {pct('train_eager_mfu')} | "
        f"{num('train_eager_step_s', 2)} | {num('train_eager_peak_mem_gib', 1)} |",
        "",
        f"parity (‖a − b‖/‖b‖ of logits): ours bf16 vs HF bf16 {sci('parity_rel_vs_hf_bf16')}, "
        f"ours bf16 vs HF fp32 {sci('parity_rel_vs_hf_fp32')}, HF bf16 vs HF fp32 "
        f"{sci('hf_bf16_rel_vs_hf_fp32')}; generation vs Score log-probs: max |Δ| "
        f"{num('decode_vs_score_max_abs_logprob', 3)}",
    ]
    table = "\n".join(rows)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "bench.md").write_text(table + "\n")
    log(f"total {time.time() - t0:.0f}s")
    log(table)


if __name__ == "__main__":
    main()
