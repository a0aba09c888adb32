"""One policy over several ranks: the worker started under torchrun (`torchrun --nproc-per-node N
-m slimen_torch serve …`), on one machine or across several (torchrun's rendezvous).

* Training shards the model with FSDP2 (`fully_shard`, each layer a group of its own, the
  embeddings, final norm and heads the root's) and is data-parallel: every rank gets the whole
  batch (rank 0 broadcasts it), computes the loss weights over all of it (loss.token_weights: the
  reduction of docs/architecture.md "The policy loss"), runs its share of the samples and the
  gradients are summed over the ranks (not averaged), so a step equals one rank's on the same batch.
  Ranks with fewer micro-batches than another run passes of weight 0, so that every rank makes the
  same collective calls.
* Generation needs no collectives: every rank keeps the full weights in the model it generates
  with, gathered from the shards after each optimizer step (the time per GB is logged), and
  generates its share of the requests (each request goes whole to the rank with the fewest samples
  so far). Completions depend on (seed, prompt, sample index) only, so they are the ones one rank
  gives.
* Rank 0 speaks the gRPC protocol (server.py). Every call that needs the other ranks (train,
  values, save, load, a round of generation) is broadcast to them on a gloo group of its own and
  run by all in the same order; score, tokenize, render and info are rank 0's alone.
* Save writes, from rank 0, the full weights and the full optimizer state (with fp32 master
  weights) in the format of one rank, so any rank count loads it.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from .engine import Engine
from .model import Transformer, bind_thread
from .train import Trainer, micro_batches
from .types import RequestError

log = logging.getLogger("slimen_torch")

IDLE_PING_S = 60  # rank 0 sends an empty call this often when idle, so followers see it alive
# A round of generation starts once no request has come for ROUND_QUIET_S (at most ROUND_WAIT_S
# after the first): the host's requests of a step come as a burst, and a round that starts on the
# burst's first requests keeps the rest waiting for the whole round (docs/performance.md).
ROUND_QUIET_S = 0.003
ROUND_WAIT_S = 0.05


def world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; (0, 0, 1) outside it."""
    e = os.environ
    return int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)), int(e.get("WORLD_SIZE", 1))


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


def init(device: str, backend: str = "") -> tuple[int, int, int, object]:
    """Joins the process group (NCCL on GPUs, gloo on the CPU; backend names another, e.g. gloo
    for ranks sharing one GPU, which NCCL refuses) and makes the control group (gloo, no practical
    timeout: a follower waits for rank 0's next call as long as the worker lives).
    Returns (rank, local rank, world size, control group)."""
    rank, local, size = world()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group(backend)
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return rank, local, size, ctrl


class _Whole(nn.Module):
    """The root FSDP module: its call runs a training pass (fn(model)) with the root's weights
    (embeddings, final norm, heads) gathered; each layer gathers its own in its call."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.m = model

    def forward(self, fn):
        return fn(self.m)


class ShardedTrainer(Trainer):
    """A Trainer whose parameters are FSDP2 shards (fp32, the optimizer's masters) of a copy of
    the generating model, data-parallel over the process group."""

    def __init__(self, gen_model: Transformer, **kw):
        self.gen_model = gen_model
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.gathered_bytes = 0
        self.gather_seconds = 0.0
        self._shard(gen_model)
        super().__init__(self.whole.m, **kw)
        # The shards are fp32 and the optimizer steps them: no separate master copies.
        self.mixed = False

    def _shard(self, gen: Transformer) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
        # parameters with fp32 masters), gradients reduced in fp32.
        mp = MixedPrecisionPolicy(param_dtype=gen.embed.dtype, reduce_dtype=torch.float32)
        for layer in m.layers:
            fully_shard(layer, mp_policy=mp)
        whole = _Whole(m)
        fully_shard(whole, mp_policy=mp)
        self.whole = whole

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
        return plans[self.rank] + [[] for _ in range(n - len(plans[self.rank]))]

    def _backward(self, loss: torch.Tensor) -> None:
        # The loss is a weighted sum whose weights count the whole batch: the ranks' gradients
        # add up to the batch's gradient. FSDP averages them (gloo has no pre-scaled sum, so
        # set_gradient_divide_factor(1) is not open to it): the loss is scaled by the rank count.
        (loss * self.size).backward()

    def _reduce(self, sums: dict) -> dict:
        keys = sorted(sums)
        t = torch.stack([sums[k] for k in keys])
        dist.all_reduce(t)
        return {k: t[i] for i, k in enumerate(keys)}

    def _grad_norm(self, grads) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for g in grads:
            sq += g.to_local().double().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt().float()

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.opt is None:
            self.masters = self.params
            self.opt = torch.optim.AdamW(self.params, lr=0.0, foreach=True)
        return self.opt

    def _stepped(self) -> None:
        self.gather()

    @torch.no_grad()
    def gather(self) -> None:
        """The full weights into the generating model (every rank), timed."""
        sync = torch.cuda.synchronize if self.params[0].device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        n = 0
        for p, g in zip(self.model.parameters(), self.gen_model.parameters(), strict=True):
            full = p.full_tensor()
            g.copy_(full)
            n += full.numel() * full.element_size()
        sync()
        dt = time.perf_counter() - t
        self.gathered_bytes += n
        self.gather_seconds += dt
        if self.rank == 0:
            log.info("gathered the full weights (%.3f GB fp32) from %d ranks in %.3f s: "
                     "%.3f s per GB", n / 1e9, self.size, dt, dt / max(n / 1e9, 1e-12))

    # ---- optimizer state: full tensors, the format of one rank ----

    def state_dict(self) -> dict | None:
        if self.opt is None:
            return None
        sd = self.opt.state_dict()

        def full(v):
            return v.full_tensor().cpu() if hasattr(v, "full_tensor") else v

        sd["state"] = {k: {n: full(v) for n, v in s.items()} for k, s in sd["state"].items()}
        masters = [full(p.detach()) for p in self.params]
        return {"optimizer": sd, "steps": self.steps, "masters": masters}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.tensor import distribute_tensor

        opt = self._optimizer()
        sd = state["optimizer"]
        n = sum(len(g["params"]) for g in sd["param_groups"])
        if n != len(self.params):
            raise ValueError(f"the optimizer state holds {n} parameters, the model "
                             f"{len(self.params)}: it belongs to another model")
        if len(sd["param_groups"]) != len(opt.param_groups):
            groups, k = [], 0
            for g in sd["param_groups"]:
                groups.append({"params": self.params[k:k + len(g["params"])]})
                k += len(g["params"])
            self.opt = opt = torch.optim.AdamW(groups, lr=0.0, foreach=True)

        def shard(t, p):
            return distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements)

        with torch.no_grad():
            for p, m in zip(self.params, state.get("masters") or [], strict=False):
                p.to_local().copy_(shard(m, p).to_local())
        flat = [p for g in sd["param_groups"] for p in g["params"]]
        params = dict(zip(flat, self.params))
        sd = dict(sd)
        sd["state"] = {k: {n: shard(v, params[k]) if torch.is_tensor(v) and v.ndim > 0 else v
                           for n, v in s.items()} for k, s in sd["state"].items()}
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

    def _save(self, out) -> None:
        state = self.trainer.state_dict()  # collective: every rank
        if self.rank == 0:
            self._write(out, state)


def generate_share(engine: Engine, reqs) -> list:
    """Runs reqs (GenerateRequests) on this rank's engine; [(completions, error)] per request,
    error None or (code, message)."""
    cv = threading.Condition()
    out = [([], None) for _ in reqs]
    left = [r.n or 1 for r in reqs]
    for i, r in enumerate(reqs):
        def done(c, i=i):
            with cv:
                out[i][0].append(c)
                left[i] -= 1
                cv.notify()

        def fail(code, msg, i=i):
            with cv:
                out[i] = (out[i][0], (code, msg))
                left[i] = 0
                cv.notify()
        try:
            engine.submit(r, done, fail)
        except RequestError as e:
            fail(e.code, str(e))
        except Exception as e:
            fail("UNKNOWN", str(e))
    with cv:
        cv.wait_for(lambda: all(n <= 0 for n in left))
    return [(sorted(c, key=lambda x: x.index), err) for c, err in out]


def run_call(engine: RankEngine, call: tuple, ctrl, rank: int):
    """Runs one broadcast call on this rank; rank 0 gets its result."""
    name, arg = call
    if name == "train":
        return engine.train(arg)
    if name == "values":
        return engine.values(arg)
    if name == "save":
        return engine.save(arg)
    if name == "load":
        return engine.load(arg)
    if name == "generate":
        mine = generate_share(engine, arg[rank])
        got = [None] * dist.get_world_size(ctrl) if rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=ctrl)
        return got
    if name in ("ping", "close"):
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
    logging.shutdown()
    os._exit(1)


def follow(engine: RankEngine, ctrl, rank: int) -> None:
    """A follower's life: run rank 0's calls until it says close."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        call = box[0]
        if call[0] == "close":
            return
        try:
            run_call(engine, call, ctrl, rank)
        except (RequestError, ValueError):
            pass  # rank 0 meets the same error (every rank checks the same input) and reports it
        except Exception as e:
            broken(rank, f"call {call[0]}", e)


class Group:
    """Rank 0's engine over the group: the methods server.Service calls. Calls that need the other
    ranks go through one thread, in order; generate requests wait for the next round of
    generation, which deals them out to the ranks."""

    def __init__(self, engine: RankEngine, ctrl, devices: list[str]):
        self.local, self.ctrl, self.devices = engine, ctrl, devices
        self.size = dist.get_world_size(ctrl)
        self.cv = threading.Condition()
        self.calls: list = []  # (call, future)
        self.pending: list = []  # (GenerateRequest, on_completion, on_error)
        self.closed = False
        self.rounds = 0
        self.thread = threading.Thread(target=self._loop, name="slimen-torch-group", daemon=True)
        self.thread.start()

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
            self.calls.append(((name, arg), fut))
            self.cv.notify()
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
        self.local.request(req)  # checked here: a bad request fails at once, as on one rank
        with self.cv:
            if self.closed:
                raise RuntimeError("engine closed")
            self.pending.append((req, on_completion, on_error))
            self.cv.notify()

    def cancel(self, request_id: str) -> None:
        with self.cv:
            self.pending = [p for p in self.pending if p[0].id != request_id]

    def close(self, timeout: float = 60) -> bool:
        """Tells the followers to stop and closes rank 0's engine; False when the group thread
        did not finish within timeout (a follower gone: its collectives never return)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            return False
        self.local.close()
        return True

    # -- the thread --

    def _broadcast(self, call) -> None:
        dist.broadcast_object_list([call], src=0, group=self.ctrl)

    def _loop(self) -> None:
        bind_thread(self.local.device)
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.closed or self.calls or self.pending,
                                 timeout=IDLE_PING_S)
                if self.closed:
                    calls, self.calls = self.calls, []
                    for _, fut in calls:
                        fut.set_exception(RuntimeError("engine closed"))
                    break
                if self.calls:
                    call, fut = self.calls.pop(0)
                    gen = None
                elif self.pending:
                    self._gather_burst()
                    gen, self.pending = self.pending, []
                    call = fut = None
                else:
                    call, fut, gen = ("ping", None), None, None
            if gen is not None:
                self._generate(gen)
                continue
            try:
                self._broadcast(call)
                res = run_call(self.local, call, self.ctrl, 0)
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

    def _gather_burst(self) -> None:
        """Waits (holding the condition's lock between waits) while requests keep coming, so that
        a round takes the host's whole burst; a call waiting ends the wait."""
        end = time.monotonic() + ROUND_WAIT_S
        n = len(self.pending)
        while not (self.closed or self.calls):
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cv.wait(timeout=min(ROUND_QUIET_S, left))
            if len(self.pending) == n:
                return
            n = len(self.pending)

    def _generate(self, gen: list) -> None:
        """One round: the requests dealt out to the ranks (each to the one with the fewest
        samples so far), generated, and the completions handed to their callbacks."""
        shares = [[] for _ in range(self.size)]
        owners = [[] for _ in range(self.size)]
        load = [0] * self.size
        for req, ok, fail in gen:
            r = min(range(self.size), key=lambda i: load[i])
            load[r] += req.n or 1
            shares[r].append(req)
            owners[r].append((ok, fail))
        self.rounds += 1
        try:
            self._broadcast(("generate", shares))
            got = run_call(self.local, ("generate", shares), self.ctrl, 0)
        except Exception as e:  # requests' own errors come back in got, not here
            broken(0, "a round of generation", e)
        for r in range(self.size):
            for (ok, fail), (comps, err) in zip(owners[r], got[r]):
                for c in comps:
                    ok(c)
                if err is not None and fail is not None:
                    fail(*err)


def serve_rank(args, opts, service) -> None:
    """The worker of one rank under torchrun: rank 0 serves (service is its server's), the
    others follow. Returns when rank 0 closes the group."""
    rank, local, size, ctrl = init(opts.device)
    log.info("rank %d of %d (local rank %d) on %s", rank, size, local, opts.device)
    engine = RankEngine(args.model, opts, rank)
    devices = [None] * size
    dist.all_gather_object(devices, f"{os.uname().nodename}/{opts.device}", group=ctrl)
    if rank != 0:
        follow(engine, ctrl, rank)
        engine.close()
        dist.destroy_process_group()
        return
    return Group(engine, ctrl, devices)
