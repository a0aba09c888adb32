"""The gather of full weights after an optimizer step of a worker over several ranks (dist.py):
seconds per GB, under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node R engines/torch/bench_gather.py \\
        --model M [--device cuda|cpu] [--backend nccl|gloo] [--same-gpu] [--repeat 5]

Each rank builds the worker's engine (full weights for generation, FSDP2 shards for training),
then times ShardedTrainer.gather (the shards cast to the generating dtype in flat buffers,
all-gathered and copied into the generating model) --repeat times and rank 0 prints one JSON line:
ranks, backend, device, GB gathered and their dtype (the generating model's), seconds (median),
s/GB. --same-gpu puts every rank on cuda:0 (a one-GPU machine: NCCL refuses two
ranks on one GPU, gloo may take them).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from slimen_torch import dist  # noqa: E402
from slimen_torch.engine import Options  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="")
    p.add_argument("--same-gpu", action="store_true")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    rank, local, size = dist.world()
    device = "cuda:0" if a.same_gpu else dist.rank_device(a.device, local)
    rank, local, size, links = dist.init(device, a.backend)
    backend = torch.distributed.get_backend()
    eng = dist.RankEngine(a.model, Options(device=device, compile=False, cuda_graphs=False,
                                           compile_train="off"), rank)
    tr = eng.trainer
    times = []
    for _ in range(a.repeat + 1):  # the first warms up the collectives
        torch.distributed.barrier(group=links.calls)
        t = time.perf_counter()
        tr.gather()
        times.append(time.perf_counter() - t)
    gen = list(tr.gen_model.parameters())
    gb = sum(p.numel() * p.element_size() for p in gen) / 1e9
    med = statistics.median(times[1:])
    if rank == 0:
        print(json.dumps({"ranks": size, "backend": backend, "device": device, "gb": round(gb, 4),
                          "dtype": str(gen[0].dtype).removeprefix("torch."),
                          "gather_s": round(med, 5), "s_per_gb": round(med / gb, 4)}), flush=True)
    eng.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
