"""Pushing weights from a trainer worker to its rollout replicas through a process group
(JoinPushGroup and PushWeights of the engine protocol; host/replica.go, docs/async.md).

The trainer (rank 0) and its replicas (ranks 1 … world − 1), each a worker process of its own,
join a torch.distributed group of their own: the default group of these processes, gloo (CPU),
made at init_method (tcp://host:port, which the host picks). Every pair (0, i) gets a subgroup,
NCCL when both members are on GPUs and on two different ones (NCCL refuses two ranks on one GPU),
gloo otherwise (tensors staged through the CPU). A push from the trainer to replica i is a
broadcast in the pair's subgroup, so the other replicas, which may be generating from the
versions they hold, take no part: first a header (a hash of the parameters' names, shapes and
dtypes, and the element count per dtype), then the parameters flattened into one buffer per
dtype (between CPU workers, where nothing is staged, each parameter as it is: flattening would
only add two copies). The replica answers the header (its parameters match, or not: then both
fail at once) and receives into buffers of the same sizes, which it copies into its model's
parameters in place (its captured CUDA graphs keep pointing at them).

A worker that is an FSDP group (dist.py: its default group is the trainer's, its weights shards)
cannot join: the host keeps the folder push for it.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
import time

import torch

log = logging.getLogger("slimen_torch")

# The dtypes a header counts, in the order their buffers are sent.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def layout(model) -> tuple[list[tuple[torch.dtype, list[torch.Tensor]]], list[int]]:
    """The model's parameters grouped by dtype in DTYPES order, and the header that describes
    them: 4 words of a hash of every parameter's name, shape and dtype, the element count per
    dtype, and a last word 0 (a sender that cannot send sets it: REFUSED)."""
    named = list(model.named_parameters())
    h = hashlib.sha256()
    for n, p in named:
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
    groups = []
    for dt in DTYPES:
        ps = [p for _, p in named if p.dtype == dt]
        groups.append((dt, ps))
    other = sorted({str(p.dtype) for _, p in named if p.dtype not in DTYPES})
    if other:
        raise ValueError(f"parameters of dtype {', '.join(other)} cannot be pushed")
    words = [int.from_bytes(h.digest()[8 * i:8 * i + 8], "little", signed=True) for i in range(4)]
    return groups, words + [sum(p.numel() for p in ps) for _, ps in groups] + [0]


HEADER_WORDS = 4 + len(DTYPES) + 1
REFUSED = 1  # the header's last word when the sender sends no weights after it


def _device_id(device: torch.device) -> str:
    """What tells two processes' GPUs apart: the GPU's UUID ("" on the CPU)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


class Group:
    """This process's membership of a push group."""

    def __init__(self, name: str, init_method: str, rank: int, world: int, timeout_s: float,
                 device: torch.device):
        import torch.distributed as dist

        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"push group {name!r}: rank {rank} of {world} members")
        if dist.is_initialized():
            raise RuntimeError("this process is in a process group already")
        self.name, self.rank, self.world, self.device = name, rank, world, device
        self.timeout = datetime.timedelta(seconds=timeout_s if timeout_s > 0 else 300)
        t = time.perf_counter()
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=self.timeout)
        try:
            ids: list = [None] * world
            dist.all_gather_object(ids, (device.type, _device_id(device)))
            self.pairs: dict[int, object] = {}
            for i in range(1, world):
                # Every member makes every pair's subgroup, in the same order (new_group's rule).
                nccl = (ids[0][0] == "cuda" and ids[i][0] == "cuda" and ids[0][1] != ids[i][1]
                        and dist.is_nccl_available())
                backend = "nccl" if nccl else "gloo"
                g = dist.new_group([0, i], backend=backend, timeout=self.timeout)
                if rank in (0, i):
                    self.pairs[i] = (g, backend)
            self.links = [""] * world
            if rank == 0:
                for i, (_, backend) in self.pairs.items():
                    self.links[i] = backend
            else:
                self.links[0] = self.pairs[rank][1]
        except BaseException:
            dist.destroy_process_group()
            raise
        log.info("push group %s: rank %d of %d joined in %.3f s at %s (links %s)", name, rank,
                 world, time.perf_counter() - t, init_method,
                 ", ".join(f"{i}: {b}" for i, b in enumerate(self.links) if b))

    def close(self, timeout: float = 10) -> None:
        """Leaves the group; gives up after timeout seconds (tearing down NCCL communicators may
        wait for a member that is gone: the process is usually exiting then)."""
        import torch.distributed as dist

        if dist.is_initialized():
            t = threading.Thread(target=dist.destroy_process_group, name="slimen-push-close",
                                 daemon=True)
            t.start()
            t.join(timeout)
            if t.is_alive():
                log.warning("push group %s: leaving it took over %.0f s; going on", self.name,
                            timeout)

    def _pair(self, peer: int):
        if peer == 0 or peer not in self.pairs:
            raise ValueError(f"push group {self.name!r}: rank {self.rank} is not linked to rank "
                             f"{peer} (the sender is rank 0, the receivers 1…{self.world - 1})")
        return self.pairs[peer]

    def _direct(self, backend: str) -> bool:
        """Whether parameters go as they are, one broadcast each (gloo between CPU workers: no
        staging, and flattening would only add two copies), rather than flattened per dtype."""
        return backend == "gloo" and self.device.type == "cpu"

    @torch.no_grad()
    def send(self, model, peer: int, refuse: str = "") -> dict:
        """Rank 0: broadcasts model's parameters to peer. Returns bytes, seconds and the link.
        With refuse (a reason), or parameters it cannot send, it sends a header that tells the
        receiver so (which then fails at once instead of waiting) and raises; so does a receiver
        whose parameters differ (its answer to the header)."""
        import torch.distributed as dist

        if self.rank != 0:
            raise ValueError(f"push group {self.name!r}: rank {self.rank} sends nothing (only "
                             "rank 0, the trainer, does)")
        g, backend = self._pair(peer)
        dev = self.device if backend == "nccl" else torch.device("cpu")
        t = time.perf_counter()
        try:
            if refuse:
                raise ValueError(refuse)
            groups, header = layout(model)
        except ValueError:
            header = [0] * HEADER_WORDS
            header[-1] = REFUSED
            dist.broadcast(torch.tensor(header, dtype=torch.int64, device=dev), src=0, group=g)
            raise
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=dev), src=0, group=g)
        ok = torch.zeros(1, dtype=torch.int64, device=dev)
        dist.broadcast(ok, src=peer, group=g)
        if ok.item() != 1:
            raise ValueError(f"push group {self.name!r}: rank {peer}'s parameters differ from the "
                             "trainer's (names, shapes or dtypes): it took no weights")
        nbytes = 0
        for dt, ps in groups:
            if not ps:
                continue
            if self._direct(backend):
                for p in ps:
                    dist.broadcast(p.detach(), src=0, group=g)
                    nbytes += p.numel() * p.element_size()
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in ps]).to(dev)
            dist.broadcast(flat, src=0, group=g)
            nbytes += flat.numel() * flat.element_size()
        self._sync(dev)
        return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=backend)

    @torch.no_grad()
    def receive(self, model) -> dict:
        """A replica: takes rank 0's parameters into model's, in place."""
        import torch.distributed as dist

        g, backend = self._pair(self.rank)
        dev = self.device if backend == "nccl" else torch.device("cpu")
        t = time.perf_counter()
        groups, mine = layout(model)
        header = torch.zeros(len(mine), dtype=torch.int64, device=dev)
        dist.broadcast(header, src=0, group=g)
        theirs = header.tolist()
        if theirs[-1] == REFUSED:
            raise ValueError(f"push group {self.name!r}: the trainer sent no weights (it says why)")
        ok = theirs == mine
        dist.broadcast(torch.tensor([int(ok)], dtype=torch.int64, device=dev), src=self.rank,
                       group=g)
        if not ok:
            raise ValueError(f"push group {self.name!r}: the trainer's parameters differ from "
                             f"this replica's (names, shapes, dtypes or sizes: {theirs[4:-1]} "
                             f"elements per dtype {[str(d) for d in DTYPES]}, here {mine[4:-1]})")
        nbytes = 0
        for dt, ps in groups:
            if not ps:
                continue
            if self._direct(backend):
                for p in ps:
                    dist.broadcast(p.data, src=0, group=g)
                    nbytes += p.numel() * p.element_size()
                continue
            buf = torch.empty(sum(p.numel() for p in ps), dtype=dt, device=dev)
            dist.broadcast(buf, src=0, group=g)
            nbytes += buf.numel() * buf.element_size()
            if buf.device != self.device:
                buf = buf.to(self.device)
            parts = buf.split([p.numel() for p in ps])
            dst, src = ps, [s.view(p.shape) for s, p in zip(parts, ps)]
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(dst, src)
            else:
                for d, s in zip(dst, src):
                    d.copy_(s)
        self._sync(self.device)
        return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=backend)

    @staticmethod
    def _sync(dev: torch.device) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


__all__ = ["Group", "layout"]
