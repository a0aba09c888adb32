"""One policy over several ranks: the worker started under torchrun (`torchrun --nproc-per-node N
-m slimen_torch serve …`), on one machine or across several (torchrun's rendezvous).

* Training shards the model with FSDP2 (`fully_shard`, each layer a group of its own or runs of
  consecutive layers one, GROUP_MB_ENV; the embeddings, final norm and heads the root's) and is
  data-parallel: every rank gets the whole batch (rank 0 broadcasts it), computes the loss weights
  over all of it (loss.token_weights: the reduction of docs/architecture.md "The policy loss"; with
  OWN_WEIGHTS_ENV those of its own samples only, the reductions still over all), runs its share of
  the samples and the gradients are summed over the ranks (not averaged), so a step equals one
  rank's on the same batch. The optimizer steps the fp32 shards: the DTensors, or with
  LOCAL_OPT_ENV their local tensors, with torch's fused AdamW.
  Ranks with fewer micro-batches than another run passes of weight 0, so that every rank makes the
  same collective calls.
* Generation needs no collectives: every rank keeps the full weights in the model it generates
  with, gathered from the shards after each optimizer step in the generating dtype (bf16 on GPUs)
  through flat buffers, one all-gather a bucket of at most GATHER_BUCKET_BYTES (the time per GB
  is logged). Generation is continuous on every rank, as on one: rank 0 deals each generate
  request out as soon as it comes, whole, to the rank with the fewest samples in flight; there it
  joins the engine's running batch at the next decode step, and each completion goes back to rank
  0 as it finishes. Completions depend on (seed, prompt, sample index) only, so they are the ones
  one rank gives.
* Rank 0 streams every rank's requests and completions through one interpreter, so it does per
  request of a follower as little as it can: it makes at once only the checks that need no
  prompt tokens (Engine.check), and the rank a request is dealt to renders its chat template and
  makes the rest (a failure there reaches the request's error callback); each follower's share
  of a broadcast is pickled on its own, as tuples, and each completion comes back as its protocol
  message's bytes, made on the follower, which rank 0 passes on to the stream unparsed
  (Received).
* Rank 0 speaks the gRPC protocol (server.py). Every call that needs the other ranks (train,
  values, save, load) and every generate request and cancel for a follower is broadcast on a gloo
  group of its own (Links.calls), so all ranks see them in one order; each follower sends its
  completions to rank 0 on a gloo group of the two (Links.back: the rendezvous the ranks already
  made, on one machine or several, and a rank gone fails it at once). score, tokenize, render and
  info are rank 0's alone.
* A call of every rank interleaves with generation as on one rank: each rank's engine runs it on
  its own thread between two decode steps, its requests in flight paused (kept in their cache
  rows) across it and going on after it with the new weights, as the engine of one rank does
  (engine.py). Generation makes no collective, so the calls' collectives (FSDP's, the gather's)
  are the only ones, made by every rank in rank 0's order: rank 0 broadcasts the next call only
  once its own engine has run the last. A request in flight across a train step gets tokens of
  both weights, as on one rank; completions equal one rank's for requests that do not overlap a
  call that changes the weights.
* Save writes, from rank 0, the full weights and the full optimizer state (with fp32 master
  weights) in the format of one rank, so any rank count loads it.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import logging
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from .engine import OPTIMIZER_FILE, Engine
from .launch import exit_now
from .model import Transformer, bind_thread, copy_tensors
from .proto import engine_pb2 as pb
from .server import Serialized, completion_pb
from .train import Trainer, import_compiler_later, micro_batches
from .types import GenerateRequest, RequestError, Sampling

log = logging.getLogger("slimen_torch")

IDLE_PING_S = 60  # rank 0 sends an empty call this often when idle, so followers see it alive
# A follower's link to rank 0 that breaks while the worker is not stopping ends the group after
# this many seconds (Group._receive).
LOST_GRACE_S = 3.0
# The gather of the full weights after an optimizer step joins the ranks' shards this many bytes
# of full weights (in the generating dtype) at a time: one all-gather for a small model, a few
# for a large one, whose flat buffers would otherwise double the weights' memory.
GATHER_BUCKET_BYTES = 1 << 30
# A rank not in its group this many seconds after it started (the model loaded, every rank met)
# writes its threads' stacks to its log, once (stacks_later): a start that hangs in a collective
# some rank never joins then says where each rank waits.
START_STACKS_S = 120.0


def world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; (0, 0, 1) outside it."""
    e = os.environ
    return int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)), int(e.get("WORLD_SIZE", 1))


def restart_count() -> int:
    """How many times torchrun has started this worker group again (0 for its first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def relisten(listen: str, address_file: str) -> str:
    """The address rank 0 listens on: listen, or, in a group that torchrun started again after a
    rank of it failed (its --max-restarts: the launcher lives on and the host does not see the
    group go), the port of the address file its predecessor wrote where listen asks for a free
    one, so that the host's client, which reconnects to the address it knows, finds the new
    group there."""
    if restart_count() == 0 or not address_file:
        return listen
    host, _, port = listen.rpartition(":")
    try:
        with open(address_file) as f:
            old = f.read().strip().rpartition(":")[2]
    except OSError:
        return listen
    return f"{host}:{old}" if port == "0" and old.isdigit() else listen


def die_with_parent() -> None:
    """A rank ends when its torchrun does (Linux): torchrun starts each rank in a session of its
    own, so a supervisor that kills torchrun (a hung worker) would otherwise leave the ranks
    holding their GPUs and rank 0 its port."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # torchrun died before the call
        os._exit(1)


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: a GPU worker's ranks take one GPU each (cuda:LOCAL_RANK of the GPUs
    it sees); the CPU stays the CPU."""
    if torch.device(device).type == "cuda":
        return f"cuda:{local_rank}"
    return device


class Links:
    """The worker group's own channels, on gloo with no practical timeout (a follower waits for
    rank 0's next call as long as the worker lives): calls, rank 0's broadcasts to every rank, so
    that all see them in one order; and back[r], the group of rank 0 and follower r, on which r
    sends rank 0 its completions as they finish."""

    def __init__(self, calls, back: dict):
        self.calls, self.back = calls, back


def init(device: str, backend: str = "") -> tuple[int, int, int, Links]:
    """Joins the process group (NCCL on GPUs, gloo on the CPU; backend names another, e.g. gloo
    for ranks sharing one GPU, which NCCL refuses) and makes the group's links (Links).
    Returns (rank, local rank, world size, links)."""
    rank, local, size = world()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    # No device_id: NCCL then starts its communicator at the first collective (on the device of
    # its tensors: this rank's) instead of at once. A default group bound to a device makes every
    # new_group of a rank outside the new group an ncclCommSplit of the default group, a
    # collective of all ranks that the new group's own ranks, making a gloo group, never join: from
    # 3 ranks on, the ranks outside a pair below waited there for ever and the worker never
    # started.
    restart = restart_count()
    if restart:
        # torchrun's store outlives the groups it restarts (its --max-restarts), holding the keys
        # every earlier group wrote, the addresses of its ranks' gloo pairs among them: a group
        # of the same key names read those and failed to connect. Each group its own prefix.
        store, _, _ = next(dist.rendezvous("env://"))
        dist.init_process_group(backend, store=dist.PrefixStore(f"slimen-group-{restart}/", store),
                                rank=rank, world_size=size)
    else:
        dist.init_process_group(backend)
    forever = datetime.timedelta(days=365)
    calls = dist.new_group(backend="gloo", timeout=forever)
    # Every rank makes every pair's group (new_group is a collective of all ranks).
    back = {r: dist.new_group([0, r], backend="gloo", timeout=forever) for r in range(1, size)}
    return rank, local, size, Links(calls, back)


class _Whole(nn.Module):
    """The root FSDP module: its call runs a training pass (fn(model)) with the root's weights
    (embeddings, final norm, heads) gathered; each layer gathers its own in its call."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.m = model

    def forward(self, fn):
        return fn(self.m)


def _local(p) -> torch.Tensor:
    """A DTensor's local shard: its _local_tensor, which to_local returns through an autograd
    function (about 40 µs a parameter on the CPU, milliseconds a gather over a few hundred
    parameters, against 3 µs); to_local where a torch names it otherwise; a plain tensor itself."""
    t = getattr(p, "_local_tensor", None)
    if isinstance(t, torch.Tensor):
        return t
    return p.to_local() if hasattr(p, "to_local") else p


def _rows(t: torch.Tensor, p) -> torch.Tensor:
    """The rows of full tensor t that this rank holds of parameter p (a DTensor sharded on dim 0
    by FSDP2, which cuts it as torch.chunk does: ceil(rows / ranks) a rank, the last ranks fewer
    or none): a view of t, so that a rank reads and moves only its own shard's bytes."""
    size, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    rows = t.shape[0]
    chunk = -(-rows // size)
    mine = t[min(rank * chunk, rows):min((rank + 1) * chunk, rows)]
    if mine.shape != _local(p).shape:
        raise ValueError(f"a tensor of shape {tuple(t.shape)}: rank {rank} holds "
                         f"{tuple(_local(p).shape)} of it, not rows of {size} ranks' chunks")
    return mine


class _Bucket:
    """One all-gather of ShardedTrainer.gather: some parameters' pieces in flat buffers of numel
    elements a rank, rank after rank in the gathered buffer. bind makes, once, the views the
    gather copies through, so that a gather spends no Python on slicing: the generating model's
    parameters stay the same tensors for a trainer's life (a load or a new value head makes a new
    plan), while FSDP2's shards are read through to_local at each gather."""

    def __init__(self, pairs: list, rank: int, size: int):
        g0 = pairs[0][1]
        self.dtype, self.device = g0.dtype, g0.device
        self.shards = [p for p, _ in pairs]
        self.gens = [g for _, g in pairs]
        self.full_bytes = sum(g.numel() for g in self.gens) * g0.element_size()
        offsets = [0] * size
        self.mine = []  # (offset, count) of this rank's shard of each parameter in its buffer
        self.pieces = []  # (offset in the gathered buffer, count, parameter index, first element)
        for i, (p, g) in enumerate(pairs):
            if g.dim() == 0 or not g.is_contiguous():
                raise ValueError(f"parameter {i} {tuple(g.shape)} of the generating model: the "
                                 "gather copies dim-0 row ranges of a contiguous tensor")
            rows = g.shape[0]
            inner, chunk = g.numel() // rows, -(-rows // size)
            for r in range(size):
                a, b = min(r * chunk, rows), min((r + 1) * chunk, rows)
                k = (b - a) * inner
                if r == rank:
                    if p.to_local().numel() != k:
                        raise ValueError(f"parameter {i} {tuple(g.shape)}: rank {rank} holds "
                                         f"{p.to_local().numel()} elements of it, the gather's "
                                         f"plan {k} (rows {a}:{b} of {size} ranks' chunks)")
                    self.mine.append((offsets[r], k))
                if k:
                    self.pieces.append((r, offsets[r], k, i, a * inner))
                offsets[r] += k
        self.numel = max(offsets)
        self.size = size

    def bind(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """Takes its buffers from the start of the shared ones (inp: this rank's, out: every
        rank's; buckets run one after another, on one stream) and makes its views: this rank's
        shards' places in inp, the pieces' places in out and in the generating parameters."""
        self.inp, self.out = inp[:self.numel], out[:self.size * self.numel]
        self.mine_views = [self.inp[o:o + k] for o, k in self.mine]
        self.src_views = [self.out[r * self.numel + o:r * self.numel + o + k]
                          for r, o, k, _, _ in self.pieces]
        self.dst_views = [self.gens[i].view(-1)[s:s + k] for _, _, k, i, s in self.pieces]


# The share of a GPU's memory that a step may hold beyond the shards (holds_step).
HOLD_SHARE = 0.25

# Switches of the sharded step, read from the environment when a ShardedTrainer is made, so that
# engines/torch/multi_gpu.sh runs one setting beside another in one call (its ALT knob); unset,
# each keeps the way the step was made before it.
# GROUP_MB_ENV: consecutive layers share an FSDP group of at most this many MB of full weights in
# the passes' dtype (layer_groups; 0: each layer a group of its own): fewer hooks, copy-ins and
# collectives a step, each a larger one.
GROUP_MB_ENV = "SLIMEN_TORCH_FSDP_GROUP_MB"
# OWN_WEIGHTS_ENV=1: a rank computes the loss weights of its own samples only (their reductions
# still count the whole batch), not of every sample of the batch (ShardedTrainer._own).
OWN_WEIGHTS_ENV = "SLIMEN_TORCH_FSDP_OWN_WEIGHTS"
# LOCAL_OPT_ENV=1: the optimizer steps the shards' local tensors (torch's fused AdamW, launched
# before the step's read-back) instead of a foreach AdamW over the DTensors. (The gradient norm
# and the clip are on the local shards either way: one foreach_norm and one all-reduce.)
LOCAL_OPT_ENV = "SLIMEN_TORCH_FSDP_LOCAL_OPT"
# GATHER_ONCE_ENV=1, where a step holds the model (holds_step): the layers' weights, gathered by
# the step's first forward, stay gathered until its last backward (one all-gather a group a
# step), instead of being resharded after each forward and gathered again by its backward (on 2
# H200s, 3 micro-batches a rank: 84 of a step's 113 all-gathers, each some copies and a
# collective launched from the backward's thread, which bounds the backward there).
GATHER_ONCE_ENV = "SLIMEN_TORCH_FSDP_GATHER_ONCE"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def layer_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """The layers' FSDP groups: runs of consecutive layers (sizes: each one's bytes of full
    weights) of at most budget bytes, a layer larger than budget alone; budget 0: a layer a
    group."""
    out, cur, n = [], [], 0
    for i, b in enumerate(sizes):
        if cur and (budget <= 0 or n + b > budget):
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += b
    if cur:
        out.append(cur)
    return out


def holds_step(m: Transformer, dtype: torch.dtype, dev: torch.device) -> bool:
    """Whether a sharded step holds the whole model between its micro-batches: its fp32
    gradients, reduced once after the last, and its weights in the generating dtype, kept
    gathered from one micro-batch's backward to the next's forward (ShardedTrainer._backward).
    Yes when they take at most HOLD_SHARE of the device's memory (0.6B: 3.6 GB; 8B: 48 GB, a
    third of an H200); else each micro-batch reduces its gradients, as FSDP does by default.
    Measured on 4 H200s (0.6B, 3 micro-batches a rank): holding halves the training call,
    1.3 s to 0.65 s, where the per-micro-batch collectives had waited on the slowest rank."""
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = sum(p.numel() for p in m.parameters())
    need = n * (dtype.itemsize + 4)
    return need <= HOLD_SHARE * total


class ShardedTrainer(Trainer):
    """A Trainer whose parameters are FSDP2 shards (fp32, the optimizer's masters) of a copy of
    the generating model, data-parallel over the process group."""

    def __init__(self, gen_model: Transformer, **kw):
        self.gen_model = gen_model
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.gathered_bytes = 0
        self.gather_seconds = 0.0
        self.passes_left = 0  # the step's passes whose backward is still to run (_plan)
        self.unreduced = False  # a pass's gradients are held, not yet reduced (_backward)
        self.group_bytes = int(float(os.environ.get(GROUP_MB_ENV) or 0) * 1e6)
        self.own_weights = _env_flag(OWN_WEIGHTS_ENV)
        self.local_opt = _env_flag(LOCAL_OPT_ENV)
        self.gather_once = _env_flag(GATHER_ONCE_ENV)
        self._shard(gen_model)
        super().__init__(self.whole.m, **kw)
        # The shards are fp32 and the optimizer steps them: no separate master copies.
        self.mixed = False

    def _shard(self, gen: Transformer) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._plan_cache = None  # the gather's buckets: of these shards
        dev = gen.embed.device
        m = Transformer(gen.cfg, device=dev, dtype=torch.float32)
        if gen.score is not None:
            m.add_value_head()
        with torch.no_grad():
            for p, g in zip(m.parameters(), gen.parameters(), strict=True):
                p.copy_(g)
        m.call_layers = True
        m.grad_checkpointing = gen.grad_checkpointing
        m.train_norm = gen.train_norm
        m.train_block_fn = gen.train_block_fn
        # bf16 weights for the passes where the generating model is bf16 (as one rank's bf16
        # parameters with fp32 masters), gradients reduced in fp32. The layers' inputs are not
        # cast: the hidden states are already in the weights' dtype, and the fp32 rope tables
        # reach the layer as on one rank (which casts them where it applies them); FSDP's cast
        # walked each layer call's arguments and cast both tables again, 84 times a step at 3
        # micro-batches (12 ms of the host's time on an H200 at 0.6B).
        mp = MixedPrecisionPolicy(param_dtype=gen.embed.dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
        self.hold = holds_step(m, gen.embed.dtype, dev)
        item = gen.embed.dtype.itemsize
        groups = layer_groups([sum(p.numel() for p in layer.parameters()) * item
                               for layer in m.layers], self.group_bytes)
        # Gathered once a step (GATHER_ONCE_ENV): the backward passes find the weights the
        # forwards left (the last backward reshards them, _backward).
        keep = self.hold and self.gather_once
        for g in groups:
            # A list: the layers share one group (one all-gather, one reduce-scatter).
            fully_shard([m.layers[i] for i in g] if len(g) > 1 else m.layers[g[0]], mp_policy=mp,
                        reshard_after_forward=not keep)
        whole = _Whole(m)
        fully_shard(whole, mp_policy=mp)
        self.whole = whole
        self.fsdp_groups = len(groups) + 1
        if self.rank == 0:
            log.info("FSDP groups: %d of the %d layers (%s) and the root; own loss weights %s; "
                     "optimizer on %s", len(groups), len(m.layers),
                     f"up to {self.group_bytes / 1e6:g} MB" if self.group_bytes else "a layer each",
                     "on" if self.own_weights else "off",
                     "the local shards" if self.local_opt else "the DTensors")
            log.info("FSDP over %d ranks: %s", self.size,
                     "a step's gradients are held and reduced once, after its last micro-batch"
                     + ("; its weights gathered once, by its first forward" if keep else "")
                     if self.hold else "each micro-batch reduces its gradients (the whole "
                     "model's would take more than %.0f%% of the device's memory)"
                     % (100 * HOLD_SHARE))

    def reset(self) -> None:
        """Starts over from the generating model's weights (Trainer.reset) without sharding
        again: each rank copies its rows of them into its fp32 shards (a load then puts the
        saved masters there). A value head the generating model gained since (a critic's
        checkpoint) shards the model again, with it."""
        if self.unreduced:
            self._drop_unreduced()
        self.whole.reshard()
        for p in self.params:
            p.grad = None
        self.opt = self.masters = None
        self.step_ahead = False
        self.steps = 0
        if self.gen_model.score is not None and self.model.score is None:
            self.add_params([])
            return
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), self.gen_model.parameters(), strict=True):
                _local(p).copy_(_rows(g, p))

    def add_params(self, params: list) -> None:
        # A critic's value head created on the generating model: shard the model again with it,
        # which is only possible before the optimizer holds state for the old parameters.
        if self.opt is not None:
            raise RequestError("FAILED_PRECONDITION", "a value head cannot be added to a sharded "
                               "model that has trained: start the critic from a checkpoint with "
                               "one, or train it on one rank")
        mode = self.mode
        self._shard(self.gen_model)
        self.model = self.whole.m
        named = list(self.model.named_parameters())
        self.params = [p for n, p in named if not n.startswith("score")] + \
            [p for n, p in named if n.startswith("score")]
        self._set_mode(mode)

    # ---- the hooks of Trainer ----

    def _fwd(self, fn):
        return self.whole(fn)

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """This rank's micro-batches; samples are dealt round-robin to the ranks, and every rank
        gets as many passes as the rank with the most (empty ones train nothing)."""
        if not lengths:
            return []
        plans = []
        for r in range(self.size):
            mine = list(range(r, len(lengths), self.size))
            plans.append([[mine[j] for j in mb] for mb in
                          micro_batches([lengths[i] for i in mine], self.micro_batch_tokens)]
                         if mine else [])
        n = max(len(p) for p in plans)
        self.passes_left = n
        if self.unreduced:  # an attempt that failed after a pass's backward (a retry, _retrying)
            self._drop_unreduced()
        self.whole.reshard()  # nothing held from a step that failed midway
        return plans[self.rank] + [[] for _ in range(n - len(plans[self.rank]))]

    def _own(self, plan: list[list[int]], n: int) -> list[int]:
        if not self.own_weights:
            return super()._own(plan, n)
        own = {i for mb in plan for i in mb}
        if any(not mb for mb in plan):
            own.add(0)  # a pass of weight 0 runs sample 0 (Trainer._step)
        return sorted(own)

    def _backward(self, loss: torch.Tensor) -> None:
        # Holding (holds_step): the gradients add up unreduced over a step's passes (in fp32,
        # FSDP's reduce dtype) and are reduce-scattered once, after the last; the weights stay
        # gathered from a pass's backward to the next pass's forward.
        self.passes_left -= 1
        last = self.passes_left <= 0 or not self.hold
        self.whole.set_requires_gradient_sync(last)
        self.whole.set_reshard_after_backward(last)
        # The loss is a weighted sum whose weights count the whole batch: the ranks' gradients
        # add up to the batch's gradient. FSDP averages them (gloo has no pre-scaled sum, so
        # set_gradient_divide_factor(1) is not open to it): the loss is scaled by the rank count.
        (loss * self.size).backward()
        self.unreduced = not last

    def _drop_unreduced(self) -> None:
        """Drops the gradients a failed attempt left unreduced in FSDP's unsharded buffers, so
        that its retry trains on its own gradients alone. FSDP2 has no public call for it: its
        parameters' accumulated gradients are set to None, as its reduction does."""
        for m in self.whole.modules():
            state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None)
            for fp in getattr(group, "fsdp_params", ()):
                fp.unsharded_accumulated_grad = None
                if getattr(fp, "_unsharded_param", None) is not None:
                    fp._unsharded_param.grad = None
        self.unreduced = False

    def _reduce(self, sums: dict) -> dict:
        keys = sorted(sums)
        t = torch.stack([sums[k] for k in keys])
        dist.all_reduce(t)
        return {k: t[i] for i, k in enumerate(keys)}

    def _grad_norm(self, grads) -> torch.Tensor:
        # One multi-tensor norm over the local shards, in fp32 as the one-rank step's, their
        # squares summed in fp64 and over the ranks: a Python loop of four DTensor operations a
        # gradient (226 of them for 0.6B) took milliseconds of the step's host time. grads are
        # DTensors, or the local shards' own (LOCAL_OPT_ENV, _local_grads).
        local = [_local(g) for g in grads]
        sq = torch.stack(torch._foreach_norm(local, 2.0)).double().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt().float()

    def _clip(self, grads, max_norm: float, norm: float) -> None:
        # On the local shards, as the norm: one multi-tensor product, no DTensor dispatch.
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([_local(g) for g in grads], coef)

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.opt is None:
            if self.local_opt:
                self.masters = [_local(p) for p in self.params]
                self.opt = self._local_adamw(self.masters)
            else:
                self.masters = self.params
                self.opt = torch.optim.AdamW(self.params, lr=0.0, foreach=True)
        return self.opt

    def _local_adamw(self, params) -> torch.optim.Optimizer:
        """AdamW over the shards' local tensors (LOCAL_OPT_ENV): plain tensors, so torch's fused
        kernel takes them, stepped before the read-back (found_inf, Trainer._apply); fused on the
        CPU too, so that the gloo ranks of the tests take the GPU's path."""
        self.step_ahead = True
        return torch.optim.AdamW(params, lr=0.0, fused=True)

    def _apply(self, lc, sums, diff_max=None):
        if self.local_opt:
            self._local_grads()
        return super()._apply(lc, sums, diff_max)

    def _local_grads(self) -> None:
        """The gradients FSDP reduced into the shards (DTensors) onto the local tensors the
        optimizer steps, the DTensors' dropped: the next step's backward then makes new ones
        instead of adding to these. A local tensor FSDP has replaced (it re-pads a parameter
        whose shard changed) takes the old one's place and state in the optimizer."""
        for k, p in enumerate(self.params):
            t, m = _local(p), self.masters[k]
            if t is not m:
                for g in self.opt.param_groups:
                    g["params"] = [t if q is m else q for q in g["params"]]
                if m in self.opt.state:
                    self.opt.state[t] = self.opt.state.pop(m)
                self.masters[k] = t
            t.grad = None if p.grad is None else _local(p.grad)
            p.grad = None

    def _stepped(self) -> None:
        self.gather()

    @torch.no_grad()
    def gather(self) -> None:
        """The full weights into the generating model (every rank), in its dtype, timed: each
        rank casts its shards into one flat buffer (a bucket of at most GATHER_BUCKET_BYTES of
        full weights at a time), one all-gather joins the ranks' buffers, and the pieces are
        copied into the generating model's parameters (two multi-tensor copies a bucket)."""
        sync = torch.cuda.synchronize if self.params[0].device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        n = 0
        for b in self._gather_plan():
            copy_tensors(b.mine_views, [_local(p).reshape(-1) for p in b.shards])
            dist.all_gather_into_tensor(b.out, b.inp)
            copy_tensors(b.dst_views, b.src_views)
            n += b.full_bytes
        sync()
        dt = time.perf_counter() - t
        self.gathered_bytes += n
        self.gather_seconds += dt
        if self.rank == 0:
            log.info("gathered the full weights (%.3f GB %s) from %d ranks in %.3f s: "
                     "%.3f s per GB", n / 1e9, str(self._gather_plan()[0].dtype).removeprefix(
                         "torch."), self.size, dt, dt / max(n / 1e9, 1e-12))

    def _gather_plan(self) -> list["_Bucket"]:
        """The buckets of the gather, made once per sharding: which rows of which parameter each
        rank holds (FSDP2 shards dim 0 as torch.chunk does: ceil(rows / ranks) a rank, the last
        ranks fewer or none), and where they lie in the flat buffers, which the buckets share:
        the largest bucket's size for every rank's pieces and 1/N of it for this rank's, kept for
        the trainer's life (the caching allocator would keep them reserved anyway)."""
        if self._plan_cache is not None:
            return self._plan_cache
        pairs = list(zip(self.model.parameters(), self.gen_model.parameters(), strict=True))
        dtypes = {g.dtype for _, g in pairs}
        if len(dtypes) != 1:
            raise ValueError(f"the generating model's parameters have several dtypes {dtypes}: "
                             "the gather casts to one")
        buckets, cur, size = [], [], 0
        for p, g in pairs:
            nb = g.numel() * g.element_size()
            if cur and size + nb > GATHER_BUCKET_BYTES:
                buckets.append(cur)
                cur, size = [], 0
            cur.append((p, g))
            size += nb
        if cur:
            buckets.append(cur)
        plan = [_Bucket(b, self.rank, self.size) for b in buckets]
        most, g0 = max(b.numel for b in plan), pairs[0][1]
        inp = torch.empty(most, dtype=g0.dtype, device=g0.device)
        out = torch.empty(self.size * most, dtype=g0.dtype, device=g0.device)
        for b in plan:
            b.bind(inp, out)
        self._plan_cache = plan
        return plan

    # ---- optimizer state: full tensors, the format of one rank ----

    def state_dict(self) -> dict | None:
        if self.opt is None:
            return None
        from torch.distributed.tensor import DTensor

        sd = self.opt.state_dict()

        def full(v, p):
            if torch.is_tensor(v) and not isinstance(v, DTensor) and v.ndim > 0:  # a local shard
                v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            return v.full_tensor().cpu() if hasattr(v, "full_tensor") else v

        sd["state"] = {k: {n: full(v, self.params[k]) for n, v in s.items()}
                       for k, s in sd["state"].items()}
        masters = [full(p.detach(), p) for p in self.params]
        return {"optimizer": sd, "steps": self.steps, "masters": masters}

    def load_state_dict(self, state: dict) -> None:
        """Loads a state of the format of one rank (full tensors; on the CPU, mapped: RankEngine's
        _load_optimizer): each rank copies only its rows of each tensor to its device, with no
        collective (every rank reads the same file)."""
        from torch.distributed.tensor import DTensor

        opt = self._optimizer()
        sd = state["optimizer"]
        n = sum(len(g["params"]) for g in sd["param_groups"])
        if n != len(self.params):
            raise ValueError(f"the optimizer state holds {n} parameters, the model "
                             f"{len(self.params)}: it belongs to another model")
        if len(sd["param_groups"]) != len(opt.param_groups):
            groups, k = [], 0
            mine = self.masters if self.local_opt else self.params
            for g in sd["param_groups"]:
                groups.append({"params": mine[k:k + len(g["params"])]})
                k += len(g["params"])
            self.opt = opt = self._local_adamw(groups) if self.local_opt else \
                torch.optim.AdamW(groups, lr=0.0, foreach=True)

        def state_shard(t, p):  # a DTensor as p, or its local tensor for the local optimizer
            local = _rows(t, p).to(p.device, p.dtype, copy=True)
            if self.local_opt:
                return local
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())

        with torch.no_grad():
            for p, m in zip(self.params, state.get("masters") or [], strict=False):
                _local(p).copy_(_rows(m, p))
        flat = [p for g in sd["param_groups"] for p in g["params"]]
        params = dict(zip(flat, self.params))
        sd = dict(sd)
        sd["state"] = {k: {n: state_shard(v, params[k]) if torch.is_tensor(v) and v.ndim > 0
                           else v for n, v in s.items()} for k, s in sd["state"].items()}
        if self.local_opt:
            # The saved groups' options replace the optimizer's: keep its own kind of step (one
            # saved by a foreach AdamW would otherwise ignore found_inf, _apply's skip).
            sd["param_groups"] = [dict(g, fused=opt.param_groups[0]["fused"],
                                       foreach=opt.param_groups[0]["foreach"])
                                  for g in sd["param_groups"]]
        opt.load_state_dict(sd)
        self.steps = state.get("steps", 0)
        if state.get("masters"):
            self.gather()


class RankEngine(Engine):
    """The engine of one rank: full weights for generation and scoring, a ShardedTrainer for
    training; only rank 0 writes a save."""

    keeps_versions = False  # its trainer's weights are shards: no in-worker rollout copies
    pushes_weights = False  # its default process group is the worker group's (push.py)

    def __init__(self, model_dir: str, options, rank: int):
        self.rank = rank
        super().__init__(model_dir, options)

    def _new_trainer(self, model: Transformer, **kw) -> Trainer:
        return ShardedTrainer(model, **kw)

    def _load_optimizer(self, model_dir) -> None:
        # Mapped on the CPU, not read whole onto the device: each rank copies its shard's rows
        # only (ShardedTrainer.load_state_dict), a 1/N of the state's bytes.
        path = model_dir / OPTIMIZER_FILE
        if path.exists():
            self.trainer.load_state_dict(torch.load(path, map_location="cpu", mmap=True))

    def _save(self, out) -> None:
        state = self.trainer.state_dict()  # collective: every rank
        if self.rank == 0:
            self._write(out, state)


def run_request(engine: Engine, key: int, req, put) -> None:
    """Submits req to this rank's engine; what comes of it goes to put, on the engine's thread:
    ("done", key, completion) for each sample, ("failed", key, code, message) once if it fails."""
    try:
        engine.submit(req, lambda c: put(("done", key, c)),
                      lambda code, msg: put(("failed", key, code, msg)))
    except RequestError as e:
        put(("failed", key, e.code, str(e)))
    except Exception as e:
        put(("failed", key, "UNKNOWN", str(e)))


def run_call(engine: RankEngine, call: tuple):
    """Runs one call of every rank on this rank's engine; rank 0 gets its result."""
    name, arg = call
    if name == "train":
        return engine.train(arg)
    if name == "values":
        return engine.values(arg)
    if name == "save":
        return engine.save(arg)
    if name == "load":
        return engine.load(arg)
    if name == "ping":
        return None
    raise ValueError(f"unknown call {name!r}")


def broken(rank: int, what: str, err: BaseException) -> None:
    """Ends this rank after a failure that is not a bad request: a rank gone (its collectives fail)
    or one rank's own error, after which the ranks no longer run the same calls. torchrun then
    stops the group, and whoever started it starts it again (the host's supervisor, docs/gpus.md;
    a cluster manager, docs/cluster.md); the host's client sees the worker gone, not an answer, and
    puts the policy's state back into the new group."""
    log.error("rank %d: %s failed (%s: %s); the worker group cannot go on: exiting", rank, what,
              type(err).__name__, err)
    exit_now(1)


class Received(Serialized):
    """A follower's completion as it reached rank 0: its protocol message's bytes, made by the
    follower (_Outbox), which rank 0, streaming every rank's completions from one interpreter,
    passes on to the Generate stream unparsed (server.stream_response); in the process it reads
    as a types.Completion, parsed at the first read."""

    __slots__ = ("_message",)

    def __init__(self, index: int, data: bytes):
        super().__init__(index, data)
        self._message = None

    @property
    def message(self) -> pb.Completion:
        if self._message is None:
            self._message = pb.Completion.FromString(self.data)
        return self._message

    request_id = property(lambda self: self.message.request_id)
    prompt_tokens = property(lambda self: list(self.message.prompt_tokens))
    tokens = property(lambda self: list(self.message.tokens))
    logprobs = property(lambda self: list(self.message.logprobs))
    text = property(lambda self: self.message.text)
    finish_reason = property(lambda self: self.message.finish_reason)


def _wire(msg: tuple) -> tuple:
    """A follower's message for rank 0 as it is sent: a completion as its index and its
    serialized protocol message (Received)."""
    if msg[0] == "done":
        c = msg[2]
        return ("done", msg[1], c.index, completion_pb(c).SerializeToString())
    return msg


def _unwire(msg: tuple) -> tuple:
    if msg[0] == "done":
        return ("done", msg[1], Received(msg[2], msg[3]))
    return msg


def _pack(reqs: list) -> bytes:
    """A follower's share of a broadcast of generate requests, [(key, request)], pickled on its
    own as plain tuples: every follower receives the broadcast, and unpickles its share only."""
    out = []
    for key, r in reqs:
        s = r.sampling
        out.append((key, r.id, r.messages, r.prompt_tokens, r.n, s.max_tokens, s.temperature,
                    s.top_p, s.stop, s.seed, s.constraint, r.adapter))
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(share: bytes) -> list:
    """The [(key, request)] of a share _pack made."""
    return [(key, GenerateRequest(id=rid, messages=ms, prompt_tokens=toks, n=n, adapter=ad,
                                  sampling=Sampling(max_tokens=mt, temperature=t, top_p=p,
                                                    stop=stop, seed=seed, constraint=c)))
            for key, rid, ms, toks, n, mt, t, p, stop, seed, c, ad in pickle.loads(share)]


class _Outbox:
    """A follower's completions on their way to rank 0: its engine thread's callbacks queue them
    and a thread of their own makes their messages (_wire) and sends what has queued (one message
    for all that came together) on the follower's group with rank 0, so that the engine thread
    never waits on the network."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.cv = threading.Condition()
        self.msgs: list = []
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="slimen-torch-outbox", daemon=True)
        self.thread.start()

    def put(self, msg) -> None:
        with self.cv:
            self.msgs.append(msg)
            self.cv.notify()

    def close(self) -> None:
        """Sends what has queued and then the last message ("bye",); waits for the thread."""
        with self.cv:
            self.closing = True
            self.cv.notify()
        self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.msgs or self.closing)
                msgs, self.msgs = self.msgs, []
                last = self.closing
            if last:
                msgs.append(("bye",))
            try:
                dist.send_object_list([[_wire(m) for m in msgs]], dst=0, group=self.group)
            except Exception as e:
                broken(self.rank, "sending completions to rank 0", e)
            if last:
                return


def follow(engine: RankEngine, links: Links, rank: int) -> None:
    """A follower's life: runs rank 0's broadcasts until it says close. Its generate requests go
    to this rank's engine as they come (joining its running batch) and their completions to rank
    0 as they finish; the calls of every rank run on the engine as on one rank, between two
    decode steps (module docstring)."""
    out = _Outbox(links.back[rank], rank)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=links.calls)
        call = box[0]
        if call[0] == "close":
            out.close()
            return
        if call[0] == "generate":
            shares, cancels = call[1]
            if rank in shares:
                for key, req in unpack(shares[rank]):
                    run_request(engine, key, req, out.put)
            for r, rid in cancels:
                if r == rank:
                    engine.cancel(rid)
            continue
        try:
            run_call(engine, call)
        except (RequestError, ValueError):
            pass  # rank 0 meets the same error (every rank checks the same input) and reports it
        except Exception as e:
            broken(rank, f"call {call[0]}", e)


class _Sent:
    """A generate request dealt out to a rank, with the samples it has still to give."""

    __slots__ = ("id", "rank", "left", "ok", "fail")

    def __init__(self, rid: str, rank: int, left: int, ok, fail):
        self.id, self.rank, self.left, self.ok, self.fail = rid, rank, left, ok, fail


class Group:
    """Rank 0's engine over the group: the methods server.Service calls. One thread takes, in the
    order they came, the calls of every rank (broadcast, then run here, one at a time) and the
    generate requests, each dealt out as soon as it comes to the rank with the fewest samples in
    flight: rank 0's to its own engine, the others' in one broadcast for all that came together.
    A thread per follower receives its completions and hands them to their callbacks."""

    def __init__(self, engine: RankEngine, links: Links, devices: list[str]):
        self.local, self.links, self.devices = engine, links, devices
        self.size = dist.get_world_size(links.calls)
        self.cv = threading.Condition()
        # ("call", (name, arg), future) and ("gen", key, request, on_completion, on_error), in
        # the order they came.
        self.queue: list = []
        self.cancels: list = []  # (rank, request id), for the next broadcast
        self.sent: dict[int, _Sent] = {}  # by key: the requests dealt out and not done
        self.in_flight = [0] * self.size  # samples in flight on each rank (not "load": a method)
        self.keys = itertools.count()
        self.closed = False
        self.stop = False  # stopping() was called
        self.lost: list[int] = []  # the followers whose link to rank 0 broke (_receive)
        self.thread = threading.Thread(target=self._loop, name="slimen-torch-group", daemon=True)
        self.receivers = [threading.Thread(target=self._receive, args=(r,), daemon=True,
                                           name=f"slimen-torch-from-rank-{r}")
                          for r in range(1, self.size)]
        for t in [self.thread] + self.receivers:
            t.start()

    # -- rank 0 alone --

    def info(self) -> dict:
        i = self.local.info()
        i["devices"] = list(self.devices)
        return i

    def tokenize(self, texts):
        return self.local.tokenize(texts)

    def render(self, reqs):
        return self.local.render(reqs)

    def score(self, reqs):
        return self.local.score(reqs)

    # -- every rank --

    def _call(self, name: str, arg):
        fut = concurrent.futures.Future()
        with self.cv:
            if self.closed:
                raise RuntimeError("engine closed")
            self.queue.append(("call", (name, arg), fut))
            self.cv.notify_all()
        return fut.result()

    def train(self, batch):
        return self._call("train", batch)

    def values(self, reqs):
        return self._call("values", reqs)

    def save(self, folder):
        return self._call("save", folder)

    def load(self, folder):
        return self._call("load", folder)

    def submit(self, req, on_completion, on_error=None) -> None:
        # What can be checked without the prompt's tokens is, here: such a bad request fails at
        # once, as on one rank. The chat template and the rest of the checks are the engine's of
        # the rank it is dealt to (a failure there reaches on_error): rank 0 would otherwise
        # render every rank's prompts on its one interpreter, before any could be dealt out.
        self.local.check(req)
        with self.cv:
            if self.closed:
                raise RuntimeError("engine closed")
            self.queue.append(("gen", next(self.keys), req, on_completion, on_error))
            self.cv.notify_all()

    def cancel(self, request_id: str) -> None:
        here = False
        with self.cv:
            self.queue = [q for q in self.queue if q[0] != "gen" or q[2].id != request_id]
            for key, s in list(self.sent.items()):
                if s.id != request_id:
                    continue
                del self.sent[key]
                self.in_flight[s.rank] -= s.left
                if s.rank == 0:
                    here = True
                else:
                    self.cancels.append((s.rank, request_id))
            self.cv.notify_all()
        if here:
            self.local.cancel(request_id)

    def stopping(self) -> None:
        """Says that the worker is stopping (torchrun stops every rank at once): a follower's
        link that breaks from now on is no rank lost mid-run."""
        with self.cv:
            self.stop = True
            self.cv.notify_all()

    def close(self, timeout: float = 60) -> bool:
        """Tells the followers to stop and closes rank 0's engine; False when the group thread
        or a follower's receiver did not finish within timeout (a follower gone: its collectives
        never return)."""
        end = time.monotonic() + timeout
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        for t in [self.thread] + self.receivers:
            t.join(timeout=max(0.0, end - time.monotonic()))
            if t.is_alive():
                return False
        self.local.close()
        return True

    # -- the threads --

    def _broadcast(self, call) -> None:
        dist.broadcast_object_list([call], src=0, group=self.links.calls)

    def _deal(self) -> tuple[dict, list]:
        """Takes the generate requests at the head of the queue (holding the lock): each to the
        rank with the fewest samples in flight (the lowest such rank). Returns ({rank: [(key,
        request)]}, cancels to send)."""
        shares: dict[int, list] = {}
        while self.queue and self.queue[0][0] == "gen":
            _, key, req, ok, fail = self.queue.pop(0)
            r = min(range(self.size), key=lambda i: self.in_flight[i])
            n = req.n or 1
            self.in_flight[r] += n
            self.sent[key] = _Sent(req.id, r, n, ok, fail)
            shares.setdefault(r, []).append((key, req))
        cancels, self.cancels = self.cancels, []
        return shares, cancels

    def _loop(self) -> None:
        bind_thread(self.local.device)
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.closed or self.queue or self.cancels,
                                 timeout=IDLE_PING_S)
                if self.closed:
                    left, self.queue = self.queue, []
                    for q in left:
                        if q[0] == "call":
                            q[2].set_exception(RuntimeError("engine closed"))
                    break
                if self.queue and self.queue[0][0] == "call":
                    _, call, fut = self.queue.pop(0)
                    gen = None
                elif self.queue or self.cancels:
                    gen = self._deal()
                    call = fut = None
                else:
                    call, fut, gen = ("ping", None), None, None
            if gen is not None:
                self._send(*gen)
                continue
            try:
                self._broadcast(call)
                res = run_call(self.local, call)
            except (RequestError, ValueError) as e:  # a bad request: every rank refused it alike
                if fut is not None:
                    fut.set_exception(e)
                continue
            except Exception as e:
                broken(0, f"call {call[0]}", e)
            if fut is not None:
                fut.set_result(res)
        try:
            self._broadcast(("close", None))
        except Exception as e:
            # The followers are gone already: at the end of a run torchrun, stopped by the host,
            # stops them too (and they die with it), so the close finds no one to tell.
            log.info("closing the group: the other ranks are gone already (%s)", e)

    def _send(self, shares: dict, cancels: list) -> None:
        """Hands dealt requests to their ranks: the followers' (and cancels) in one broadcast,
        rank 0's to its engine."""
        others = {r: _pack(s) for r, s in shares.items() if r != 0}
        if others or cancels:
            try:
                self._broadcast(("generate", (others, cancels)))
            except Exception as e:
                broken(0, "sending generate requests", e)
        for key, req in shares.get(0, ()):
            run_request(self.local, key, req, self._deliver)

    def _deliver(self, msg) -> None:
        """A completion or a failure of a dealt request (run_request's messages), to its
        callbacks; one of a cancelled request is dropped."""
        self._deliver_all([msg])

    def _deliver_all(self, msgs: list) -> None:
        """_deliver of each of msgs, in order, taking the lock once."""
        calls = []
        with self.cv:
            for msg in msgs:
                kind, key = msg[0], msg[1]
                s = self.sent.get(key)
                if s is None:
                    continue
                n = 1 if kind == "done" else s.left
                s.left -= n
                self.in_flight[s.rank] -= n
                if s.left <= 0:
                    del self.sent[key]
                calls.append((s, msg))
        for s, msg in calls:
            if msg[0] == "done":
                s.ok(msg[2])
            elif s.fail is not None:
                s.fail(msg[2], msg[3])

    def _receive(self, rank: int) -> None:
        """Follower rank's completions, until its last message. A link that breaks while the
        worker is not stopping ends the group, after LOST_GRACE_S: at the end of a run torchrun
        stops every rank at once, and a follower may go before rank 0 has taken its signal."""
        try:
            while True:
                box = [None]
                dist.recv_object_list(box, src=rank, group=self.links.back[rank])
                msgs = box[0]
                bye = bool(msgs) and msgs[-1][0] == "bye"  # the last message, and last in it
                self._deliver_all([_unwire(m) for m in (msgs[:-1] if bye else msgs)])
                if bye:
                    return
        except Exception as e:
            with self.cv:
                self.lost.append(rank)
                closing = self.cv.wait_for(lambda: self.closed or self.stop, timeout=LOST_GRACE_S)
            if not closing:
                broken(0, f"receiving rank {rank}'s completions", e)
            log.info("rank %d's completions: its link closed as the worker stops (%s)", rank, e)


def stacks_later(rank: int, seconds: float) -> threading.Timer:
    """Writes this rank's threads' stacks to stderr (the worker's log) seconds from now, under a
    line that says why, unless the returned timer is cancelled first."""
    import faulthandler
    import sys

    def dump():
        log.warning("rank %d: not in its group %.0f s after it started: its threads' stacks "
                    "follow", rank, seconds)
        for h in logging.getLogger().handlers + log.handlers:
            h.flush()
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    t = threading.Timer(seconds, dump)
    t.name, t.daemon = "slimen-torch-start-stacks", True
    t.start()
    return t


def serve_rank(args, opts, service, on_fault=None) -> None:
    """The worker of one rank under torchrun: rank 0 serves (service is its server's), the
    others follow. Returns when rank 0 closes the group. on_fault: the rank's Engine.on_fault (a
    rank whose device failed exits, and torchrun starts the group again)."""
    starting = stacks_later(world()[0], START_STACKS_S)
    # Dynamo, which FSDP's sharded parameters (DTensor) import on every rank, GPU or CPU, and
    # the compiler of a GPU's compiled layers: while the ranks meet.
    importing = import_compiler_later()
    rank, local, size, links = init(opts.device)
    log.info("rank %d of %d (local rank %d) on %s", rank, size, local, opts.device)
    importing.join()  # before the engine's FSDP and compiles import the same modules
    engine = RankEngine(args.model, opts, rank)
    engine.on_fault = on_fault
    devices = [None] * size
    dist.all_gather_object(devices, f"{os.uname().nodename}/{opts.device}", group=links.calls)
    starting.cancel()
    if rank != 0:
        follow(engine, links, rank)
        engine.close()
        dist.destroy_process_group()
        return
    return Group(engine, links, devices)
