"""Issue 21's weight push between a trainer and a rollout replica (slimen_torch/push.py), one table.

    python engines/torch/bench_push.py --device cuda:0 --device2 cuda:1 [--shape qwen3-0.6b]
    python engines/torch/bench_push.py --device cuda:0 --device2 cuda:0   # one GPU: CUDA IPC
    python engines/torch/bench_push.py --quick            # the CPU check (tiny-qwen3, gloo)

Two processes, the trainer (rank 0, --device) and a replica (rank 1, --device2), join a push group
as the workers do (JoinPushGroup: gloo for the group; for the pair NCCL when they are on two GPUs,
CUDA IPC when on one) and push a random model of --shape (bf16 on a GPU) --pushes times after one
warm-up (which, over CUDA IPC, shares the buffers): the median seconds of a push (over NCCL:
flattening, the broadcast, the copy into the replica's parameters; over CUDA IPC: the copy into
the shared buffers, the copy out of them; the slower of the two processes) and its s/GB (the
issue's goal between GPUs of one host: ≤ 0.01 s/GB), then the same weights sent as one broadcast
per tensor (what the flat buffers save; on one GPU through gloo and the CPU, the path before CUDA
IPC), over CUDA IPC one device copy of the weights on the trainer (the bound: a push makes two),
and that the replica's weights equal the trainer's bit for bit after the push.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import socket
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def model_of(shape: str, device: str, seed: int):
    from slimen_torch.config import parse_config
    from slimen_torch.make_model import SHAPES, config_dict
    from slimen_torch.model import Transformer

    cfg = parse_config(config_dict(shape, SHAPES[shape][2], 1, 0, "bfloat16"))
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    m = Transformer(cfg, device=dev, dtype=dtype).requires_grad_(False)
    g = torch.Generator(device=dev).manual_seed(seed)
    for p in m.parameters():
        p.normal_(0, 0.02, generator=g)
    return m


def digest(model) -> str:
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def member(rank: int, a, init: str, out) -> None:
    import torch.distributed as dist

    from slimen_torch.push import Group

    device = a.device if rank == 0 else a.device2
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    model = model_of(a.shape, device, seed=1 if rank == 0 else 2)
    g = Group("bench", init, rank, 2, 120, torch.device(device))
    flat = []
    for i in range(a.pushes + 1):
        if rank == 0:
            with torch.no_grad():  # new weights each time, as after an optimizer step
                next(model.parameters()).add_(1e-3)
            got = g.send(model, 1)
        else:
            got = g.receive(model)
        if i:  # the first is a warm-up (NCCL makes its communicator then)
            flat.append(got["seconds"])
    link, nbytes = got["link"], got["bytes"]
    sha = digest(model)
    # One device copy of the weights into the trainer's shared buffers (a push makes two).
    copy = []
    if rank == 0 and link == "cuda-ipc":
        from slimen_torch.model import copy_tensors
        from slimen_torch.push import _views, layout

        groups, _ = layout(model)
        bufs = g._bufs[1]
        for i in range(a.pushes + 1):
            t = time.perf_counter()
            with torch.no_grad():
                for dt, ps in groups:
                    if ps:
                        copy_tensors(_views(bufs[dt], ps), ps)
            g._sync(torch.device(device))
            if i:
                copy.append(time.perf_counter() - t)
    # One broadcast per tensor, into the parameters directly (what the flat buffers replace).
    pair, _ = g.pairs[1]
    stage = link != "nccl"
    per = []
    for i in range(a.pushes + 1):
        t = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                buf = p.detach().cpu() if stage else p.data
                dist.broadcast(buf, src=0, group=pair)
                if stage and rank != 0:
                    p.copy_(buf)
        g._sync(torch.device(device))
        if i:
            per.append(time.perf_counter() - t)
    out.put((rank, dict(flat=flat, per=per, copy=copy, link=link, bytes=nbytes, sha=sha,
                        device=device, tensors=sum(1 for _ in model.parameters()))))
    g.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    two = torch.cuda.is_available() and torch.cuda.device_count() > 1
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--device2", default="cuda:1" if two else "")
    ap.add_argument("--shape", default="")
    ap.add_argument("--pushes", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    a.device2 = a.device2 or a.device
    a.shape = a.shape or ("tiny-qwen3" if a.quick else "qwen3-0.6b")
    a.pushes = a.pushes or (3 if a.quick else 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{port}"
    procs = [ctx.Process(target=member, args=(r, a, init, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        r, res = out.get(timeout=600)
        got[r] = res
    for p in procs:
        p.join(60)
    t, r = got[0], got[1]
    gb = t["bytes"] / 1e9
    flat = statistics.median(max(x, y) for x, y in zip(t["flat"], r["flat"]))
    per = statistics.median(max(x, y) for x, y in zip(t["per"], r["per"]))
    print(f"push of {a.shape} ({gb:.4g} GB, {t['tensors']} tensors) from {t['device']} to "
          f"{r['device']} over {t['link']}, median of {a.pushes} after a warm-up:\n")
    print("| push | seconds | s/GB |")
    print("|---|---|---|")
    if t["link"] == "cuda-ipc":
        how = "flat buffers per dtype shared by CUDA IPC (two device copies)"
    elif t["link"] == "gloo" and t["device"] == "cpu":
        how = "each parameter in place (gloo between CPU workers)"
    else:
        how = "one flat broadcast per dtype"
    print(f"| push.py: {how} | {flat:.6f} | {flat / gb:.6f} |")
    each = ("one gloo broadcast per tensor through the CPU (one GPU's path before CUDA IPC)"
            if t["link"] == "cuda-ipc" else "one broadcast per tensor")
    print(f"| {each} | {per:.6f} | {per / gb:.6f} |")
    if t["copy"]:
        c = statistics.median(t["copy"])
        print(f"| one device copy of the weights on the trainer (a push makes two) | {c:.6f} | "
              f"{c / gb:.6f} |")
    same = t["sha"] == r["sha"]
    if t["copy"]:  # the goal on one GPU: the device copy's speed
        goal = f"push.py / one device copy: {flat / statistics.median(t['copy']):.2f}×"
    else:
        goal = f"goal between GPUs ≤ 0.01 s/GB: {'met' if flat / gb <= 0.01 else 'not met'}"
    print(f"\nthe replica's weights equal the trainer's bit for bit: {'yes' if same else 'NO'}; "
          f"per tensor / push.py: {per / flat:.2f}×; {goal}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
