"""The host's time in a sharded training step (dist.ShardedTrainer) against one rank's (Trainer),
by phase, on the CPU over gloo: a model of tiny widths with the 0.6B shape's 28 layers, so that
Python and the FSDP2 hooks weigh as they do beside an H200's kernels.

    python engines/torch/bench_fsdp.py [--ranks 1,2] [--samples 24] [--steps 6] [--layers 28] \
        [--settings "SETTING;SETTING…"] [--stat median|min]

Weak scaling, as multi_gpu.sh: each rank has --samples samples a step (N ranks: N × --samples in
the batch), dealt into micro-batches of --mbt tokens (3 a rank by default, as the GPU run's).
N = 1 is the one-rank worker's Trainer; N = 1s the ShardedTrainer over one rank (FSDP2 without
a second rank), N > 1 ShardedTrainer over N gloo ranks. Each rank times each phase of a step
(the method of the trainer that runs it, wrapped): wall and CPU ms of the calling thread (gloo's
own threads left out: on a GPU NCCL runs on the device), the medians
over the steps after the first two (--stat min: the least, what a shared machine's other load
adds to least), rank 0's and the slowest rank's. The phases: weights (the
loss weights and the plan), fwd (forward passes, with FSDP's pre-forward hooks and all-gathers),
bwd (backward passes, with the post-backward hooks and the reduce-scatter), sums (the all-reduce
of the step's statistics and their maximum), norm (the gradient norm), opt (clip and AdamW),
gather (the full weights into the generating model), rest (the rest of the call: the read-back,
the stats). --settings compares settings of the sharded step's switches (dist.py's
SLIMEN_TORCH_FSDP_*, e.g. ";SLIMEN_TORCH_FSDP_GATHER_ONCE=1": none, then that one): each rank
makes a trainer for each and runs their steps interleaved, so that a shared machine's changing
load (separate runs moved by a third on 2 shared cores) falls on all alike. On 2 shared cores
the wall times of N = 2 are those of two processes taking turns; the CPU figures are per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SWITCH = "SLIMEN_TORCH_FSDP_"
PHASES = ("weights", "fwd", "bwd", "sums", "norm", "opt", "gather", "rest")


def model(layers: int):
    from slimen_torch.config import parse_config
    from slimen_torch.make_model import config_dict
    from slimen_torch.model import Transformer

    raw = config_dict("tiny-qwen3", 512, 2, 0, "float32")
    raw["num_hidden_layers"] = layers
    m = Transformer(parse_config(raw), dtype=torch.float32)
    m.init_weights(torch.Generator().manual_seed(1))
    return m.eval()


def batch(n: int, seed: int, vocab: int):
    from slimen_torch.types import Batch, LossConfig, Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = torch.randint(0, vocab, (8 + i % 5,), generator=g).tolist()
        r = torch.randint(0, vocab, (12 + i % 7,), generator=g).tolist()
        samples.append(Sample(p, r, [1.0] * len(r), [-6.0] * len(r),
                              [1.0 if i % 2 else -1.0] * len(r), group=f"g{i // 4}"))
    return Batch(samples=samples, loss=LossConfig(lr=1e-4, max_grad_norm=1.0, adam_eps=1e-5))


class Timer:
    """Wall and CPU seconds of each phase of the current step."""

    def __init__(self):
        self.now: dict = {}

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                t = self.now.setdefault(phase, [0.0, 0.0])
                t[0] += time.perf_counter() - w
                t[1] += time.thread_time() - c
        setattr(obj, name, timed)


def _timed(a, sharded: bool):
    """(trainer, its Timer): a ShardedTrainer (or one rank's Trainer) of a new model, each phase's
    method wrapped."""
    from slimen_torch import dist
    from slimen_torch.train import Trainer

    gen = model(a.layers)
    kw = dict(micro_batch_tokens=a.mbt)
    tr = dist.ShardedTrainer(gen, **kw) if sharded else Trainer(gen, **kw)
    tm = Timer()
    for name, phase in (("_plan", "weights"), ("_own", "weights"), ("_fwd", "fwd"),
                        ("_backward", "bwd"), ("_reduce", "sums"), ("_reduce_max", "sums"),
                        ("_grad_norm", "norm"), ("_clip", "opt"), ("_stepped", "gather")):
        tm.wrap(tr, name, phase)
    make_opt = tr._optimizer

    def optimizer():
        opt = make_opt()
        if not getattr(opt, "_timed", False):
            tm.wrap(opt, "step", "opt")
            opt._timed = True
        return opt
    tr._optimizer = optimizer
    return tr, tm


def _rank(rank: int, size: int, port: int, a, out: str) -> None:
    torch.set_num_threads(1)
    sharded = size > 1 or a.sharded
    if sharded:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
        import torch.distributed as tdist
        tdist.init_process_group("gloo")

    # A trainer for each setting, its switches in the environment while it is made (where
    # ShardedTrainer reads them); their steps interleaved, so that a shared machine's load falls
    # on every setting alike.
    trainers = []
    for setting in a.settings:
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(SWITCH)}
        os.environ.update(setting)
        trainers.append(_timed(a, sharded))
        for k in setting:
            del os.environ[k]
        os.environ.update(saved)
    rows = [[] for _ in trainers]
    for s in range(a.steps):
        b = batch(a.samples * size, s, trainers[0][0].model.cfg.vocab_size)
        for j in [(s + k) % len(trainers) for k in range(len(trainers))]:
            tr, tm = trainers[j]
            tm.now = {}
            w, c = time.perf_counter(), time.thread_time()
            stats = tr.step(b)
            total = (time.perf_counter() - w, time.thread_time() - c)
            assert not stats.skipped, stats.reason
            known = [sum(v[i] for v in tm.now.values()) for i in (0, 1)]
            tm.now["rest"] = [total[i] - known[i] for i in (0, 1)]
            tm.now["total"] = list(total)
            tm.now["loss"] = [stats.loss, stats.grad_norm]
            rows[j].append(tm.now)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    if sharded:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: int, a, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"n{size}{'s' if a.sharded else ''}")
    mp.start_processes(_rank, args=(size, free_port(), a, out), nprocs=size,
                       start_method="spawn", join=True)
    res = []
    for r in range(size):
        with open(f"{out}.{r}") as f:
            res.append(json.load(f))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="1,2", help="rank counts; 1s: ShardedTrainer on one rank")
    p.add_argument("--samples", type=int, default=24, help="samples a rank a step")
    p.add_argument("--mbt", type=int, default=200, help="micro-batch tokens")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--stat", choices=("median", "min"), default="median")
    p.add_argument("--settings", default="",
                   help="settings of the sharded step's switches, ';' between settings, each "
                        "'VAR=VALUE …' ('' none): a trainer each, their steps interleaved")
    a = p.parse_args()
    stat = statistics.median if a.stat == "median" else min
    texts = [t.strip() for t in a.settings.split(";")] if a.settings else [""]
    a.settings = [dict(w.split("=", 1) for w in t.split()) for t in texts]
    base = {k: v for k, v in os.environ.items() if k.startswith(SWITCH)}
    print(f"environment: {base or 'no switches'}; {a.layers} layers, {a.samples} samples a "
          f"rank, micro-batches of {a.mbt} tokens; ms, {a.stat} of steps 3-{a.steps}")
    cols = ["N", "setting"] + [f"{p} wall/cpu" for p in PHASES + ("total",)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    with tempfile.TemporaryDirectory() as tmp:
        for spec in a.ranks.split(","):
            a.sharded = spec.endswith("s")
            n = int(spec.rstrip("s"))
            res = run(n, a, tmp)
            for j, text in enumerate(texts):
                for r, label in ((0, "rank 0"), (None, "slowest")):
                    if r is None and n == 1:
                        continue
                    cells = []
                    for ph in PHASES + ("total",):
                        per_rank = [[stat(row.get(ph, [0, 0])[i] for row in x[j][2:]) * 1e3
                                     for i in (0, 1)] for x in res]
                        w, c = per_rank[0] if r == 0 else max(per_rank, key=lambda v: v[1])
                        cells.append(f"{w:.1f}/{c:.1f}")
                    print(f"| {spec} {label} | {text or '-'} | " + " | ".join(cells) + " |")
                loss, norm = res[0][j][-1]["loss"]
                print(f"  (N={spec} {text or '-'}: last step's loss {loss:.6f}, "
                      f"grad norm {norm:.6f})", flush=True)


if __name__ == "__main__":
    main()
