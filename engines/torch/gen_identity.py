"""The identity of the worker's generation: a sha256 of the tokens and log-probs of a fixed set of
generations on a tiny random model, printed per case and in total, on whatever device it runs.

Run it at two commits on the same machine: equal hashes mean the generation paths give the same
tokens and the same log-probs, bit for bit (a refactoring changed nothing). The cases cover the
scheduler's paths: greedy and seeded sampling, top-p, a batch of mixed requests, n samples of one
prompt (prefilled once; a shared-prompt group when the Triton kernels run), a conversation over
the prefix cache, a constrained (JSON schema) request, an fp8 KV cache and a LoRA adapter.

    python engines/torch/gen_identity.py [--device cuda] [--kernels] [--dump out.json]
                                         [--package DIR]

--kernels runs the Triton kernels on the CPU too (set TRITON_INTERPRET=1 first; slow).
--package DIR imports the slimen_torch package in DIR instead of this script's (another commit's
copy, so that one device call can run both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import struct
import sys
import tempfile

import torch

# Set by main() once it knows which slimen_torch to import.
lora = Engine = Options = make_model = GenerateRequest = Sampling = None

USER = [{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many pens?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def req(rid, ids=None, n=1, adapter="", **kw) -> GenerateRequest:
    kw.setdefault("max_tokens", 16)
    kw.setdefault("seed", 1)
    return GenerateRequest(id=rid, messages=None if ids else USER, prompt_tokens=ids, n=n,
                           adapter=adapter, sampling=Sampling(**kw))


def conversation(e: Engine, seed: int, turns: int = 3) -> list:
    """Each turn's prompt: the previous one, its first sample's tokens and new tokens."""
    ids, out = prompt(seed, 40), []
    for t in range(turns):
        cs = e.generate([req(f"c{seed}-{t}", ids, n=2, seed=seed + t, max_tokens=8)])
        out += cs
        ids = ids + cs[0].tokens + prompt(seed * 10 + t, 9)
    return out


def cases(model_dir: str, opts: dict) -> dict[str, list]:
    """Case name → its completions, each engine made with opts plus the case's own options."""
    out = {}
    e = Engine(model_dir, Options(**opts))
    try:
        out["greedy"] = e.generate([req("g", temperature=0.0, max_tokens=24)])
        out["sampled"] = e.generate([req("s", seed=3, temperature=0.8, max_tokens=24)])
        out["top_p"] = e.generate([req("p", seed=5, top_p=0.7)])
        out["n_samples"] = e.generate([req("n", seed=9, n=6, max_tokens=20)])
        out["mixed_batch"] = e.generate([req("a", seed=2, n=3, max_tokens=5),
                                         req("b", prompt(1, 30), seed=4, n=2),
                                         req("c", [3, 4], n=5, max_tokens=30),
                                         req("d", prompt(2, 70), temperature=0.0)])
        out["constrained"] = e.generate([req(f"j{i}", seed=i, max_tokens=40, constraint=json.dumps(
            {"json_schema": SCHEMA})) for i in range(3)])
        e.add_adapter("ad", lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj")), 11)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():  # B drawn too: a new adapter computes what the base does
            for p in e.bank.adapters["ad"].params():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        e.bank.changed()
        out["lora"] = e.generate([req("l", seed=6, n=2, adapter="ad"), req("lb", seed=6, n=2)])
    finally:
        e.close()
    e = Engine(model_dir, Options(**opts, prefix_cache=6, prefix_min=4))
    try:
        out["prefix_cache"] = conversation(e, 1) + conversation(e, 2)
        st = e.gen.take_prefix_stats()
        if not st["hits"]:
            raise SystemExit(f"gen_identity: the prefix-cache case had no hit: {st}")
    finally:
        e.close()
    e = Engine(model_dir, Options(**opts, kv_cache_dtype="fp8"))
    try:
        out["fp8_cache"] = e.generate([req("f", seed=7, n=3, max_tokens=20)])
    finally:
        e.close()
    return out


def digest(cs: list) -> str:
    """sha256 of each completion's tokens and the bits of its float log-probs, in order."""
    h = hashlib.sha256()
    for c in cs:
        h.update(f"{c.request_id}/{c.index}:{c.finish_reason}:{c.tokens}".encode())
        h.update(b"".join(struct.pack("<d", x) for x in c.logprobs))
    return h.hexdigest()


def load(package_dir: pathlib.Path) -> None:
    """Imports the slimen_torch package found in package_dir."""
    global lora, Engine, Options, make_model, GenerateRequest, Sampling
    sys.path.insert(0, str(package_dir))
    import slimen_torch
    from slimen_torch import lora
    from slimen_torch.engine import Engine, Options
    from slimen_torch.make_model import make_model
    from slimen_torch.types import GenerateRequest, Sampling
    got = pathlib.Path(slimen_torch.__file__).resolve().parent.parent
    if got != package_dir:
        raise SystemExit(f"gen_identity: --package {package_dir}: imported slimen_torch from {got}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", action="store_true", help="the Triton kernels on the CPU too")
    ap.add_argument("--dump", help="write every completion's tokens and log-probs to this file")
    ap.add_argument("--package", default=str(pathlib.Path(__file__).resolve().parent),
                    help="the folder holding the slimen_torch package to run")
    a = ap.parse_args()
    package = pathlib.Path(a.package).resolve()
    if not (package / "slimen_torch" / "__init__.py").is_file():
        raise SystemExit(f"gen_identity: --package {a.package}: no slimen_torch package there")
    load(package)
    # A lone prompt of up to 128 tokens takes the bucketed prefill (CUDA graphs on a GPU).
    opts = dict(device=a.device, slots=16, max_seq_len=256, prefill_graph_max=128)
    if a.kernels:
        opts["kernels"] = True
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model("tiny-qwen3", pathlib.Path(tmp) / "m", seed=7))
        got = cases(model_dir, opts)
    total = hashlib.sha256()
    for name, cs in got.items():
        d = digest(cs)
        total.update(d.encode())
        print(f"{name:14s} {d}  ({len(cs)} completions, {sum(len(c.tokens) for c in cs)} tokens)")
    print(f"{'total':14s} {total.hexdigest()}  ({a.device}{', kernels' if a.kernels else ''})")
    print(f"(slimen_torch of {package})")
    if a.dump:
        pathlib.Path(a.dump).write_text(json.dumps(
            {k: [[c.request_id, c.index, c.tokens, c.logprobs, c.finish_reason] for c in cs]
             for k, cs in got.items()}))


if __name__ == "__main__":
    main()
