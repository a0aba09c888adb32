"""Pushing weights from a trainer worker to its rollout replicas through a process group
(JoinPushGroup and PushWeights of the engine protocol; host/replica.go, docs/async.md).

The trainer (rank 0) and its replicas (ranks 1 … world − 1), each a worker process of its own,
join a torch.distributed group of their own: the default group of these processes, gloo (CPU),
made at init_method (tcp://host:port, which the host picks). Every pair (0, i) gets a subgroup
and a link (_link): NCCL when both members are on GPUs and on two different ones, CUDA IPC when
both are on the same GPU (NCCL refuses two ranks on one GPU), gloo otherwise (CPU workers). A
push from the trainer to replica i goes through the pair's subgroup, so the other replicas,
which may be generating from the versions they hold, take no part: first a header (a hash of
the parameters' names, shapes and dtypes, and the element count per dtype), which the replica
answers (its parameters match, or not: then both fail at once), then the weights.

NCCL (and gloo between GPU workers, the fallback): the parameters flattened into one buffer per
dtype, broadcast (gloo stages them through the CPU); the replica receives into buffers of the
same sizes and copies them into its model's parameters in place (its captured CUDA graphs keep
pointing at them). gloo between CPU workers: each parameter as it is (flattening would only add
two copies).

CUDA IPC: at the first push to a replica the trainer allocates one flat GPU buffer per dtype and
sends the replica their IPC handles (torch.multiprocessing's reduce_tensor, carried by the pair's
gloo group); the replica maps them into its process and keeps them. Each push then is two device
copies: the trainer copies its parameters into the buffers and synchronizes, signals the replica
(a one-word gloo broadcast), the replica copies from the buffers into its parameters in place,
synchronizes and acknowledges, so the trainer never overwrites a buffer being read. A pair whose
buffers cannot be shared or mapped (an error on either side) falls back to the gloo path for
good, and both members log why. close() drops the buffers (the caching allocator frees the
trainer's once the replica has dropped its mapping).

A worker that is an FSDP group (dist.py: its default group is the trainer's, its weights shards)
cannot join: the host keeps the folder push for it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import logging
import pickle
import threading
import time

import torch

from .model import copy_tensors

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


def _link(mine: tuple[str, str], theirs: tuple[str, str], nccl: bool) -> str:
    """How rank 0 and a replica, each (device type, _device_id), are linked: "nccl" between two
    GPUs (when NCCL is there: nccl), "cuda-ipc" on one GPU, "gloo" otherwise."""
    if mine[0] == "cuda" and theirs[0] == "cuda" and mine[1] and theirs[1]:
        if mine[1] == theirs[1]:
            return "cuda-ipc"
        return "nccl" if nccl else "gloo"
    return "gloo"


def _on(device: torch.device):
    """device as the calling thread's current CUDA device while in the block (an IPC handle is
    opened on the current device; model.py's bind_thread sets it for the engine's thread only)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _export(t: torch.Tensor) -> bytes:
    """A handle to t's memory that another process on this machine can map (_import): CUDA IPC
    for a GPU tensor (torch.multiprocessing's reduce_tensor; this process must keep t alive while
    the other uses it), shared memory for a CPU tensor."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type == "cpu":
        t.share_memory_()
    return bytes(ForkingPickler.dumps(reduce_tensor(t)))


def _import(handle: bytes, device: torch.device) -> torch.Tensor:
    """The tensor _export shared, mapped into this process on device (the same GPU as the
    sender's: Group checks the GPUs' UUIDs). The sender's device index is its own numbering of
    the GPUs (CUDA_VISIBLE_DEVICES may differ between the two processes): this process's index of
    the same GPU replaces it."""
    fn, args = pickle.loads(handle)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        names = list(inspect.signature(fn).parameters)
        if "storage_device" in names:
            args = list(args)
            args[names.index("storage_device")] = index
        with _on(device):
            t = fn(*args)
        if t.device != torch.device("cuda", index):
            raise RuntimeError(f"the buffer was mapped on {t.device}, not on {device}")
        return t
    t = fn(*args)
    if t.device.type != device.type:
        raise RuntimeError(f"the buffer was mapped on {t.device}, not on {device}")
    return t


def _nbytes(bufs: dict) -> int:
    """Bytes of a pair's flat buffers (by dtype)."""
    return sum(b.numel() * b.element_size() for b in bufs.values())


def _broadcast_each(ps: list[torch.Tensor], g) -> int:
    """Rank 0's tensors ps into every member's, one broadcast each, in place; the bytes sent."""
    import torch.distributed as dist

    for p in ps:
        dist.broadcast(p.detach(), src=0, group=g)
    return sum(p.numel() * p.element_size() for p in ps)


def _views(buf: torch.Tensor, ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """buf (a flat buffer of the parameters ps, in order) as one view per parameter."""
    return [s.view(p.shape) for s, p in zip(buf.split([p.numel() for p in ps]), ps)]


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
        # A CUDA IPC pair's flat buffers by dtype (rank 0: its own; a replica: rank 0's, mapped),
        # by the pair's key in pairs; shared at the first push (_buffers).
        self._bufs: dict[int, dict[torch.dtype, torch.Tensor]] = {}
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
                link = _link(tuple(ids[0]), tuple(ids[i]), dist.is_nccl_available())
                g = dist.new_group([0, i], backend="nccl" if link == "nccl" else "gloo",
                                   timeout=self.timeout)
                if rank in (0, i):
                    self.pairs[i] = (g, link)
            self.links = [""] * world
            if rank == 0:
                for i, (_, link) in self.pairs.items():
                    self.links[i] = link
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

        if self._bufs:
            self._bufs.clear()
            if self.device.type == "cuda" and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()  # rank 0's buffers the replica has let go of
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

    def _direct(self, link: str) -> bool:
        """Whether parameters go as they are, one broadcast each (gloo between CPU workers: no
        staging, and flattening would only add two copies), rather than flattened per dtype."""
        return link == "gloo" and self.device.type == "cpu"

    def _buffers(self, key: int, g, counts: list[int]) -> dict | None:
        """A CUDA IPC pair's flat buffers (key: the pair's key in pairs), shared at the first push
        (and again should the element counts per dtype change): rank 0 allocates them and sends
        their handles, the replica maps them and answers "" or why it could not. Both members
        take the same counts (the header both agreed on) and the same answer, so both keep the
        buffers or both fall back to gloo (None)."""
        import torch.distributed as dist

        bufs = self._bufs.get(key)
        want = {dt: n for dt, n in zip(DTYPES, counts) if n}
        if bufs is not None and {dt: b.numel() for dt, b in bufs.items()} == want:
            return bufs
        self._bufs.pop(key, None)
        bufs, why = None, ""
        peer = key if self.rank == 0 else 0
        if self.rank == 0:
            try:
                with _on(self.device):
                    bufs = {dt: torch.empty(n, dtype=dt, device=self.device)
                            for dt, n in want.items()}
                    sent = {dt: _export(b) for dt, b in bufs.items()}
            except Exception as e:  # any failure means the gloo path
                bufs, sent, why = None, None, f"sharing its buffers failed: {type(e).__name__}: {e}"
            obj = [why or sent]
            dist.broadcast_object_list(obj, src=0, group=g)
            answer = [None]
            dist.broadcast_object_list(answer, src=key, group=g)
            why = why or answer[0]
        else:
            obj = [None]
            dist.broadcast_object_list(obj, src=0, group=g)
            got = obj[0]
            if isinstance(got, str):
                why = f"rank 0: {got}"
            else:
                try:
                    bufs = {dt: _import(h, self.device) for dt, h in got.items()}
                    for dt, b in bufs.items():
                        if b.dtype != dt or b.numel() != want.get(dt):
                            raise RuntimeError(f"rank 0's {dt} buffer holds {b.numel()} {b.dtype} "
                                               f"elements, not {want.get(dt)}")
                except Exception as e:  # any failure means the gloo path
                    bufs, why = None, (f"mapping rank 0's buffers failed: {type(e).__name__}: "
                                       f"{e}")
            dist.broadcast_object_list([why], src=self.rank, group=g)
        if why:
            bufs = None
            self.pairs[key] = (g, "gloo")
            self.links[peer] = "gloo"
            log.warning("push group %s: rank %d's link to rank %d falls back from CUDA IPC to gloo "
                        "(through the CPU): %s", self.name, self.rank, peer, why)
            return None
        self._bufs[key] = bufs
        log.info("push group %s: rank %d %s %.6g GB of flat buffers (%s) %s rank %d by CUDA IPC",
                 self.name, self.rank, "shares" if self.rank == 0 else "mapped",
                 _nbytes(bufs) / 1e9,
                 ", ".join(str(dt).removeprefix("torch.") for dt in bufs),
                 "with" if self.rank == 0 else "of", peer)
        return bufs

    @torch.no_grad()
    def send(self, model, peer: int, refuse: str = "") -> dict:
        """Rank 0: pushes model's parameters to peer. Returns bytes, seconds and the link.
        With refuse (a reason), or parameters it cannot send, it sends a header that tells the
        receiver so (which then fails at once instead of waiting) and raises; so does a receiver
        whose parameters differ (its answer to the header)."""
        import torch.distributed as dist

        if self.rank != 0:
            raise ValueError(f"push group {self.name!r}: rank {self.rank} sends nothing (only "
                             "rank 0, the trainer, does)")
        g, link = self._pair(peer)
        dev = self.device if link == "nccl" else torch.device("cpu")
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
        if link == "cuda-ipc":
            bufs = self._buffers(peer, g, header[4:-1])
            if bufs is not None:
                nbytes = self._send_shared(g, peer, groups, bufs)
                return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=link)
            link = "gloo"  # _buffers said why
        nbytes = 0
        for dt, ps in groups:
            if not ps:
                continue
            if self._direct(link):
                nbytes += _broadcast_each(ps, g)
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in ps]).to(dev)
            dist.broadcast(flat, src=0, group=g)
            nbytes += flat.numel() * flat.element_size()
        self._sync(dev)
        return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=link)

    def _copy_and_tell(self, g, pairs) -> None:
        """One side of a CUDA IPC push: copy_tensors(dst, src) for each (dst, src) of pairs on
        this member's GPU, waited for (the other process must see finished data), then this
        member's word to the pair: 1, or 0 when the copies failed (then raised here)."""
        import torch.distributed as dist

        err = None
        try:
            with _on(self.device):
                for dst, src in pairs:
                    copy_tensors(dst, src)
                self._sync(self.device)
        except Exception as e:  # the other member is told, then it is raised
            err = e
        dist.broadcast(torch.tensor([0 if err else 1], dtype=torch.int64), src=self.rank, group=g)
        if err is not None:
            raise err

    @staticmethod
    def _word(g, src: int) -> int:
        """The pair member src's word of _copy_and_tell."""
        import torch.distributed as dist

        w = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(w, src=src, group=g)
        return int(w.item())

    def _send_shared(self, g, peer: int, groups, bufs: dict) -> int:
        """Rank 0's half of a CUDA IPC push: copies the parameters into the shared buffers, tells
        the replica, waits for the replica's answer (the buffers are free again only after it)."""
        self._copy_and_tell(g, [(_views(bufs[dt], ps), [p.detach() for p in ps])
                                for dt, ps in groups if ps])
        if self._word(g, peer) != 1:
            raise RuntimeError(f"push group {self.name!r}: rank {peer} could not copy the weights "
                               "from the shared buffers (its log says why)")
        return _nbytes(bufs)

    @torch.no_grad()
    def receive(self, model) -> dict:
        """A replica: takes rank 0's parameters into model's, in place."""
        import torch.distributed as dist

        g, link = self._pair(self.rank)
        dev = self.device if link == "nccl" else torch.device("cpu")
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
        if link == "cuda-ipc":
            bufs = self._buffers(self.rank, g, mine[4:-1])
            if bufs is not None:
                nbytes = self._receive_shared(g, groups, bufs)
                return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=link)
            link = "gloo"  # _buffers said why
        nbytes = 0
        for dt, ps in groups:
            if not ps:
                continue
            if self._direct(link):
                nbytes += _broadcast_each(ps, g)
                continue
            buf = torch.empty(sum(p.numel() for p in ps), dtype=dt, device=dev)
            dist.broadcast(buf, src=0, group=g)
            nbytes += buf.numel() * buf.element_size()
            if buf.device != self.device:
                buf = buf.to(self.device)
            copy_tensors(ps, _views(buf, ps))
        self._sync(self.device)
        return dict(bytes=nbytes, seconds=time.perf_counter() - t, link=link)

    def _receive_shared(self, g, groups, bufs: dict) -> int:
        """The replica's half of a CUDA IPC push: waits for rank 0's word, copies the shared
        buffers into the parameters in place and answers (rank 0 may write the buffers again
        after it)."""
        if self._word(g, 0) != 1:
            raise RuntimeError(f"push group {self.name!r}: the trainer could not copy its weights "
                               "into the shared buffers (its log says why)")
        self._copy_and_tell(g, [(ps, _views(bufs[dt], ps)) for dt, ps in groups if ps])
        return _nbytes(bufs)

    @staticmethod
    def _sync(dev: torch.device) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


__all__ = ["Group", "layout"]
