"""The command line: serve, make-model, sft (`python -m slimen_torch COMMAND --help`)."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m slimen_torch",
                                description="slimen's PyTorch policy engine")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over the slimen engine protocol (gRPC)")
    s.add_argument("--model", required=True, help="Hugging Face model folder")
    s.add_argument("--listen", default="127.0.0.1:7777",
                   help="host:port (default 127.0.0.1:7777; port 0 picks a free one)")
    s.add_argument("--device", default="", help="cuda:0, cpu, … (default: cuda:0 if available)")
    s.add_argument("--dtype", default="", help="bfloat16 or float32 (default: bf16 on GPU)")
    s.add_argument("--token-env", default="",
                   help="environment variable holding the bearer token every call must carry")
    s.add_argument("--root", action="append", default=[],
                   help="folder that clients' Save and Load may use (repeatable; relative paths "
                   "are taken from the first; default: the current directory)")
    s.add_argument("--address-file", default="",
                   help="write host:port here once listening (for supervisors using port 0)")
    s.add_argument("--slots", type=int, default=0, help="concurrent samples (KV cache rows)")
    s.add_argument("--max-seq-len", type=int, default=0, help="KV cache positions per row")
    s.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="padded tokens per training micro-batch")
    s.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (less memory)")
    s.add_argument("--ref-model", default="",
                   help="folder of the frozen KL reference (default: --model)")
    s.add_argument("--no-cuda-graphs", action="store_true")
    s.add_argument("--no-versions", action="store_true",
                   help="keep no weights versions in the worker (rollout.max_staleness > 0 then "
                   "samples from rollout replicas: other worker processes)")
    s.add_argument("--no-push", action="store_true",
                   help="join no push group (rollout replicas then take the weights through a "
                   "folder the trainer saves, not a broadcast)")
    s.add_argument("--no-compile", action="store_true", help="do not torch.compile the decode step")
    s.add_argument("--compile-train", nargs="?", const="block", default="block",
                   choices=["block", "block-static", "regional", "off"],
                   help="torch.compile of the training layer on a GPU: block (default), "
                   "block-static, regional, off; a failure falls back block → regional → eager")
    s.add_argument("--no-kernels", action="store_true",
                   help="no Triton decode attention and sampler (GPU)")
    s.add_argument("--no-fused-b1", action="store_true",
                   help="no all-Triton decode step at batch 1 (GPU)")
    s.add_argument("--prefill-graph-max", type=int, default=None,
                   help="longest prompt prefilled alone by a CUDA graph (default 512 on a GPU; "
                        "0: always eagerly)")
    s.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the prefill's layer too (GPU; default on): faster "
                   "admissions (batch 256 +10%%, a lone prompt's 4.9 → 2.1 ms on the H200), one "
                   "or two more compiles per worker on first use (kept in the compile cache)")
    s.add_argument("--shared-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="the samples of one request read their shared prompt's keys and values "
                   "once as a group in the batched decode attention (GPU; default on)")
    s.add_argument("--prefix-cache", type=int, default=0, metavar="ROWS",
                   help="keep up to ROWS finished samples' KV cache rows and prefill a new prompt "
                   "that starts with one's tokens from there (a conversation's turns); 0: off "
                   "(default; see docs/torch.md)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache storage: auto (the model's dtype, default) or fp8 "
                   "(float8_e4m3fn, scale 1.0: half the cache bytes, keys and values rounded to "
                   "3 mantissa bits; see docs/torch.md)")
    s.add_argument("--prefix-min", type=int, default=16, metavar="TOKENS",
                   help="shortest cached prefix reused (default 16)")
    s.add_argument("--no-fused-head", action="store_true",
                   help="training log-probs from the whole fp32 logits, not in chunks")
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a sample does not depend on its batch and the "
                   "trainer's log-probs equal the rollout's bit for bit (see docs/torch.md)")

    m = sub.add_parser("make-model", help="write a randomly initialised model folder")
    m.add_argument("--shape", default="", help="tiny, tiny-qwen3, tiny-qwen2, qwen3-50m, "
                   "qwen3-0.6b (required unless --like)")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="", help="float32 or bfloat16 (default by size)")
    m.add_argument("--like", default="", help="a model folder whose tokenizer files (and, without "
                   "--shape, config.json) the new model takes, e.g. engines/tiny/builtin/tiny-chat")
    for flag in ("hidden", "intermediate", "layers", "heads", "kv-heads", "head-dim", "positions"):
        m.add_argument("--" + flag, type=int, default=None, help="with --like: the new " + flag)

    t = sub.add_parser("sft", help="supervised warm-up on a prompt/response JSONL file")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True, help='JSONL: {"prompt", "response"} or '
                   '{"prompt", "label"} per line, a prompt a string or messages, optional "tools" '
                   '(see docs/torch.md)')
    t.add_argument("--out", default="", help="output folder (default: overwrite --model)")
    t.add_argument("--steps", type=int, default=0, help="optimizer steps (default: from --epochs)")
    t.add_argument("--epochs", type=float, default=1)
    t.add_argument("--batch-size", type=int, default=32, help="examples per step")
    t.add_argument("--batch-tokens", type=int, default=0,
                   help="instead of --batch-size: examples up to this many tokens per step")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=-1,
                   help="linear warm-up steps (default: 5%% of the steps)")
    t.add_argument("--decay", default="constant", choices=["constant", "linear", "cosine"],
                   help="after the warm-up: keep --lr, or fall to --min-lr by the last step "
                   "(or by --max-seconds, whichever is first)")
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--eval-data", default="",
                   help="held-out JSONL of the same form: greedy exact match of its right lines, "
                   "per kind, every --eval-every steps and at the end")
    t.add_argument("--eval-every", type=int, default=0, help="0: only at the end")
    t.add_argument("--eval-n", type=int, default=0,
                   help="score the first N right lines of --eval-data (0: all)")
    t.add_argument("--eval-max-tokens", type=int, default=96)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="")
    t.add_argument("--dtype", default="")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--max-seconds", type=float, default=0,
                   help="stop (and save) once this much time has passed (0: no limit)")
    t.add_argument("--compile-train", default="block",
                   choices=["block", "block-static", "regional", "off"],
                   help="torch.compile of the training layer on a GPU (as serve); compiling "
                   "takes about a minute, so short warm-ups may prefer off")

    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s slimen_torch %(levelname)s %(message)s")
    if args.command == "serve":
        # Before the imports (torch's take seconds): the worker's log says when its process
        # began, so a group's start splits into torchrun's part and the ranks' own.
        import os
        logging.getLogger("slimen_torch").info(
            "serve: process %d began (rank %s of %s)", os.getpid(), os.environ.get("RANK", "0"),
            os.environ.get("WORLD_SIZE", "1"))
    if getattr(args, "device", None) == "":
        import torch
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.command == "serve":
        from .server import serve
        serve(args)
    elif args.command == "make-model":
        from .make_model import SIZE_FIELDS, make_like, make_model
        sizes = {k: getattr(args, k) for k in SIZE_FIELDS if getattr(args, k) is not None}
        if args.like:
            try:
                out = make_like(args.like, args.out, args.shape, seed=args.seed, dtype=args.dtype,
                                **sizes)
            except ValueError as e:
                p.error(f"make-model: {e}")
        elif not args.shape or sizes:
            p.error("make-model: give --shape, or --like DIR (the size options go with --like)")
        else:
            out = make_model(args.shape, args.out, seed=args.seed, dtype=args.dtype)
        print(out)
    elif args.command == "sft":
        from .sft import run
        run(args)


if __name__ == "__main__":
    main()
