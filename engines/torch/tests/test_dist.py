"""One policy over two ranks on the CPU (gloo): FSDP2 training data-parallel over the ranks gives
the step one rank gives on the same global batch, the gather leaves every rank the generating
weights of one rank, generation dealt out to the ranks as requests come (no rounds) gives the
completions one rank gives, and the save is the folder (and optimizer state) one rank writes and
loads. The ranks run as two processes (torch.multiprocessing) through dist.Group, rank 0's side of
the gRPC service, and dist.follow, the other ranks'."""

import os
import pathlib
import pickle
import socket

import pytest
import torch

from torch.distributed.tensor import DTensor

import ranks
from slimen_torch.engine import Engine, Options
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling, ScoreRequest

STEPS = [
    # the default reduction with a KL term; a second step with the token mean and a clipped norm
    LossConfig(lr=1e-2, eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.1, adam_eps=1e-5),
    LossConfig(lr=1e-2, eps_clip=0.2, eps_clip_high=0.28, aggregation="token_mean",
               max_grad_norm=0.05, entropy_coef=0.01, adam_eps=1e-5),
]
OPTS = dict(device="cpu", micro_batch_tokens=24)  # one sample a micro-batch: ranks run 3 and 2


def batches(e: Engine) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    V = e.cfg.vocab_size
    samples = []
    for i in range(5):  # odd: the ranks get 3 and 2 samples, rank 1 runs a pass of weight 0
        prompt = torch.randint(0, V, (4 + i,), generator=g).tolist()
        response = torch.randint(0, V, (5 + 2 * i,), generator=g).tolist()
        old = e.score([ScoreRequest(tokens=response, prompt_tokens=prompt)])[0]
        mask = [1.0] * len(response)
        mask[0] = 0.0
        adv = [1.0 if i % 2 == 0 else -0.5] * len(response)
        samples.append(Sample(prompt, response, mask, old, adv, group=f"g{i // 2}"))
    return [Batch(samples=samples, loss=lc, id=f"s{k}") for k, lc in enumerate(STEPS)]


REQUESTS = [GenerateRequest(id=f"r{i}", prompt_tokens=[5 + i, 9, 11 + 2 * i], n=1 + i % 2,
                            sampling=Sampling(max_tokens=6, temperature=1.0, top_p=0.9, seed=i))
            for i in range(5)]


def start(submit, reqs):
    """Submits reqs; returns got, {(request id, index): tokens}, and when, {request id: the time
    its last sample finished}, both filled as completions come."""
    import threading
    import time
    cv = threading.Condition()
    got, when, left = {}, {}, {r.id: r.n or 1 for r in reqs}

    def on(c):
        with cv:
            got[(c.request_id, c.index)] = c.tokens
            left[c.request_id] -= 1
            if left[c.request_id] == 0:
                when[c.request_id] = time.monotonic()
            cv.notify_all()

    def fail(code, msg):
        raise AssertionError(f"{code}: {msg}")

    for r in reqs:
        submit(r, on, fail)
    return got, when, cv


def wait(got, cv, reqs, timeout=60):
    want = sum(r.n or 1 for r in reqs)
    with cv:
        assert cv.wait_for(lambda: len(got) == want, timeout=timeout), sorted(got)
    return got


def collect(submit, reqs):
    got, _, cv = start(submit, reqs)
    return wait(got, cv, reqs)


def long_req(rid: str, seed: int) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt_tokens=[3 + seed, 4, 5],
                           sampling=Sampling(max_tokens=LONG, temperature=1.0, seed=seed))


def short_req(rid: str, seed: int) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt_tokens=[7, 8 + seed], n=2,
                           sampling=Sampling(max_tokens=4, temperature=1.0, seed=seed))


LONG = 480  # new tokens of a long request (the test model has 512 positions and no EOS)
LONGS = [long_req("long0", 1), long_req("long1", 2)]  # one a rank
LATE = [short_req("late0", 3), short_req("late1", 4)]  # after LONGS started: one a rank


def steps_and_generation(engine, bs, out):
    """The calls both tests make, on one rank's engine or on rank 0's Group: a step; generation;
    a second step while long requests generate on every rank (on two ranks) and, once they run,
    short ones that join their batches; the save and a load of it; generation again; a third
    step, from the loaded weights and optimizer state. Returns what the test compares."""
    import time

    stats = [engine.train(bs[0])]
    gen_a = collect(engine.submit, REQUESTS)
    longs, when, cv = start(engine.submit, LONGS)
    stats.append(engine.train(bs[1]))  # the long requests paused across it, as on one rank
    with cv:
        longs_during_train = len(longs)
    trainer = getattr(engine, "local", engine).trainer  # (a Group's is its rank 0 engine's)
    mode, compile_error = trainer.mode, trainer.compile_error
    time.sleep(0.3)  # the long requests run
    late, late_when, late_cv = start(engine.submit, LATE)
    wait(late, late_cv, LATE)
    wait(longs, cv, LONGS)
    engine.save(out)
    engine.load(out)  # what a restarted group does with the last checkpoint
    gen_b = collect(engine.submit, REQUESTS)
    stats.append(engine.train(bs[0]))  # the step a restarted group takes first
    return {"stats": stats, "gen_a": gen_a, "gen_b": gen_b, "late": late,
            "longs_during_train": longs_during_train, "mode": mode,
            "compile_error": compile_error,
            "late_first": max(late_when.values()) < min(when.values())}


class _SplitOfAllRanks:
    """The ncclCommSplit a rank outside a new group makes when the default group is NCCL bound to
    a device (torch's new_group then splits the default communicator, NCCL_SPLIT_NOCOLOR): a
    collective of all the default group's ranks, here on its store. The k-th split returns once
    every rank has made k; after SPLIT_WAIT_S it fails, where NCCL waits for ever."""

    supports_splitting = True
    SPLIT_WAIT_S = 20

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size, self.k = store, rank, size, 0

    def perform_nocolor_split(self, device):
        import time
        self.k += 1
        key = f"test-split-{self.k}"
        self.store.add(key, 1)
        end = time.monotonic() + self.SPLIT_WAIT_S
        while self.store.add(key, 0) < self.size:
            if time.monotonic() > end:
                raise RuntimeError(f"rank {self.rank}: split {self.k} of the default group: the "
                                   "other ranks never joined it (NCCL waits there for ever)")
            time.sleep(0.02)


def _nccl_on_gloo(rank: int) -> None:
    """Makes init_process_group("nccl", …) a gloo group on the CPU that, given a device_id,
    behaves as NCCL's eagerly started one does where groups are made: bound to the device, its
    new_group of a rank outside the group is a split of every rank (_SplitOfAllRanks)."""
    c10d = torch.distributed.distributed_c10d
    real = torch.distributed.init_process_group

    def init_process_group(backend=None, *args, device_id=None, **kw):
        real("gloo" if backend == "nccl" else backend, *args, **kw)
        if device_id is not None:
            pg = c10d._get_default_group()
            pg.bound_device_id = torch.device("cuda", rank)
            split = _SplitOfAllRanks(c10d._world.pg_map[pg][1], rank, pg.size())
            c10d._get_split_source = lambda group: split

    torch.distributed.init_process_group = init_process_group


def _count_reduce_scatters() -> list:
    """Counts FSDP's reduce-scatters of gradients: returns a list that gets one entry a call."""
    calls, real = [], torch.distributed.reduce_scatter_tensor

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    torch.distributed.reduce_scatter_tensor = counted
    return calls


def _count_all_gathers() -> list:
    """Counts all-gathers into a tensor (FSDP's of weights, and the gather for generation):
    returns a list that gets one entry a call."""
    calls, real = [], torch.distributed.all_gather_into_tensor

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    torch.distributed.all_gather_into_tensor = counted
    return calls


def _count_builds(dist) -> list:
    """Counts the ShardedTrainers a rank builds (FSDP's wrapping of an fp32 copy of the model):
    a list that gets one entry a build."""
    calls, real = [], dist.ShardedTrainer.__init__

    def counted(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)

    dist.ShardedTrainer.__init__ = counted
    return calls


def _count_weights() -> list:
    """Counts the samples whose loss weights a rank computes: a list that gets one entry a call
    of loss.token_weights, the number of its arrays."""
    from slimen_torch import loss
    calls, real = [], loss.token_weights

    def counted(*args, **kw):
        out = real(*args, **kw)
        calls.append(len(out))
        return out

    loss.token_weights = counted
    return calls


def _rank(rank, size, port, model, opts, bs, out, result, bucket, nccl=False, hold_share=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from slimen_torch import dist
    dist.GATHER_BUCKET_BYTES = bucket or dist.GATHER_BUCKET_BYTES
    if hold_share is not None:
        dist.HOLD_SHARE = hold_share
    opts = dict(opts, device=dist.rank_device(opts["device"], rank))
    if nccl:
        _nccl_on_gloo(rank)
    rank, _, _, links = dist.init(opts["device"], backend="nccl" if nccl else "")
    reduce_scatters = _count_reduce_scatters()
    all_gathers = _count_all_gathers()
    weighed = _count_weights()
    built = _count_builds(dist)
    engine = dist.RankEngine(model, Options(**opts), rank)
    if rank != 0:
        dist.follow(engine, links, rank)
        weights = {n: p.detach().cpu() for n, p in engine.model.named_parameters()}
        engine.close()
        torch.distributed.destroy_process_group()
        torch.save(weights, f"{result}.w{rank}")
        return
    group = dist.Group(engine, links, [opts["device"].split(":")[0]] * size)
    if len(bs) > 1:
        got = steps_and_generation(group, bs, out)
    elif out:
        got = {"stats": [group.train(b) for b in bs]}
        group.save(out)
    else:  # a step, then generation dealt out to every rank
        got = {"stats": [group.train(b) for b in bs], "gen_a": collect(group.submit, REQUESTS)}
    got["devices"] = group.info()["devices"]
    weights = {n: p.detach().cpu() for n, p in engine.model.named_parameters()}
    group.close()
    torch.distributed.destroy_process_group()
    torch.save(weights, f"{result}.w0")
    t = engine.trainer
    got.update(gather_s=t.gather_seconds, gather_bytes=t.gathered_bytes, built=built,
               reduce_scatters=reduce_scatters, all_gathers=all_gathers, weighed=weighed,
               fsdp_groups=t.fsdp_groups,
               opt_dtensors=sum(isinstance(q, DTensor) for g in t.opt.param_groups
                                for q in g["params"]),
               opt_fused=t.opt.param_groups[0]["fused"])
    with open(result, "wb") as f:
        pickle.dump(got, f)


def run_two(model, opts, bs, out, result, bucket=0, size=2, nccl=False, hold_share=None):
    """Runs the calls on two ranks (size: as many; bucket: the gather's bytes a bucket, 0 the
    default; nccl: init's NCCL path, _nccl_on_gloo; hold_share: dist.HOLD_SHARE); returns what rank 0 got and each rank's
    generating weights at the end."""
    ranks.start_processes(_rank, (size, free_port(), model, opts, bs, out, result, bucket, nccl,
                                  hold_share), size)
    with open(result, "rb") as f:
        got = pickle.load(f)
    return got, [torch.load(f"{result}.w{r}") for r in range(size)]


def w0_layers(weights: dict) -> set:
    """The layer indices of a model's parameter names (layers.I.…)."""
    return {n.split(".")[1] for n in weights if n.startswith("layers.")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The sharded step's switches (dist.py): unset, and all on (both layers of the tiny model in one
# FSDP group, each rank's own loss weights, the optimizer on the local shards, the weights
# gathered once a step).
SWITCHES = {"": {}, "switched": {"SLIMEN_TORCH_FSDP_GROUP_MB": "1",
                                 "SLIMEN_TORCH_FSDP_OWN_WEIGHTS": "1",
                                 "SLIMEN_TORCH_FSDP_LOCAL_OPT": "1",
                                 "SLIMEN_TORCH_FSDP_GATHER_ONCE": "1"}}


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_two_ranks_equal_one(noeos_dir, tmp_path, monkeypatch, switches):
    for k, v in SWITCHES[switches].items():
        monkeypatch.setenv(k, v)  # the ranks get the environment (ranks.py)
    model = str(noeos_dir)
    one = Engine(model, Options(**OPTS))
    try:
        bs = batches(one)
        want = steps_and_generation(one, bs, str(tmp_path / "one"))
        one_weights = {n: p.detach().clone() for n, p in one.model.named_parameters()}
    finally:
        one.close()
    out, result = str(tmp_path / "two"), str(tmp_path / "result.pkl")
    got, (w0, w1) = run_two(model, OPTS, bs, out, str(result))

    for a, b in zip(got["stats"], want["stats"]):
        assert not a.skipped and not b.skipped
        assert a.tokens == b.tokens and a.clip_frac == b.clip_frac
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert getattr(a, k) == pytest.approx(getattr(b, k), rel=1e-4, abs=1e-6), k
    assert len(got["stats"]) == len(want["stats"]) == 3
    assert got["stats"][1].grad_norm > STEPS[1].max_grad_norm  # the clip was applied
    # The gradients are reduced once a step, not once a micro-batch (rank 0 runs 3 a step): a
    # reduce-scatter for each FSDP group (the layers, or both in one, and the root) a step, for 3
    # steps.
    assert got["fsdp_groups"] == (2 if switches else len(w0_layers(w0)) + 1)
    assert len(got["reduce_scatters"]) == 3 * got["fsdp_groups"]
    # The weights' all-gathers: each group's at the step's first forward and, unless gathered
    # once a step, each layer group's again at each pass's backward (resharded after its
    # forward); and the 4 gathers for generation below.
    layer_groups = got["fsdp_groups"] - 1
    per_step = got["fsdp_groups"] + (0 if switches else 3 * layer_groups)
    assert len(got["all_gathers"]) == 3 * per_step + 4
    # Rank 0 computes the loss weights of its 3 samples of the 5, or of all 5, in each step.
    assert got["weighed"] == [3 if switches else 5] * 3
    # One sharded trainer for the rank's life: the load starts it over in place (a second build
    # took seconds of a restarted group's return on the GPUs).
    assert got["built"] == [1]
    # The optimizer steps the DTensors, or their local shards with torch's fused AdamW (on the
    # CPU too: the GPU's path, launched before the read-back).
    assert got["opt_dtensors"] == (0 if switches else len(w0))
    assert bool(got["opt_fused"]) == bool(switches)
    assert got["devices"] == ["cpu", "cpu"]
    # A gather after each of the 3 steps and one after the load (from the loaded masters), each
    # of the generating model's bytes (fp32 on the CPU); every rank's generating weights are the
    # same, and one rank's.
    assert got["gather_bytes"] == 4 * sum(p.numel() * 4 for p in w0.values())
    for n, p in w0.items():
        assert torch.equal(w1[n], p), n
        torch.testing.assert_close(p, one_weights[n], rtol=1e-4, atol=1e-5, msg=n)

    # The save is one rank's folder: the same files, weights and optimizer state; one rank loads it.
    two, ref = pathlib.Path(out), tmp_path / "one"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in ref.iterdir())
    e2, e1 = Engine(str(two), Options(**OPTS)), Engine(str(ref), Options(**OPTS))
    try:
        for (n, p), q in zip(e1.model.named_parameters(), e2.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=n)
        o1, o2 = (torch.load(d / "optimizer.pt") for d in (ref, two))
        assert o1["steps"] == o2["steps"] == 2
        for k, s in o1["optimizer"]["state"].items():
            for n, v in s.items():
                torch.testing.assert_close(o2["optimizer"]["state"][k][n], v, rtol=1e-4,
                                           atol=1e-6)
        # and they train on alike from it
        a, b = e1.train(bs[0]), e2.train(bs[0])
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
    finally:
        e1.close()
        e2.close()
    # Generation from the gathered weights, on both ranks, after each step: one rank's.
    assert got["gen_a"] == want["gen_a"] and got["gen_b"] == want["gen_b"]
    assert got["late"] == want["late"]
    # No rounds: the long requests were still generating when the second step returned (they
    # were paused across it), and the short ones that came while they ran finished first.
    assert got["longs_during_train"] == 0 and got["late_first"]


def test_layer_groups():
    """Consecutive layers share an FSDP group up to the budget; one larger alone; 0: a layer a
    group. The 0.6B shape's 28 layers (31.5 MB of bf16 weights each) at 96 MB: 3 a group."""
    from slimen_torch.dist import layer_groups
    assert layer_groups([10] * 5, 0) == [[0], [1], [2], [3], [4]]
    assert layer_groups([10] * 5, 25) == [[0, 1], [2, 3], [4]]
    assert layer_groups([10, 30, 10, 10], 25) == [[0], [1], [2, 3]]
    assert layer_groups([], 25) == []
    g = layer_groups([31_457_280] * 28, 96_000_000)
    assert [len(x) for x in g] == [3] * 9 + [1] and sum(g, []) == list(range(28))


def test_four_ranks_start_on_nccl(noeos_dir, tmp_path):
    """Four ranks start through init's NCCL path (issue 37: with NCCL bound to a device, each
    rank outside a pair's group made an ncclCommSplit that the pair never joined, and a worker
    of 3 ranks or more never started; here NCCL's groups are gloo's, _nccl_on_gloo), then train a
    step equal to one rank's and generate, dealt out to all four, what one rank generates."""
    model = str(noeos_dir)
    one = Engine(model, Options(**OPTS))
    try:
        bs = batches(one)[:1]
        want = one.train(bs[0])
        want_gen = collect(one.submit, REQUESTS)
    finally:
        one.close()
    got, ws = run_two(model, OPTS, bs, "", str(tmp_path / "result.pkl"), size=4, nccl=True)
    a = got["stats"][0]
    assert a.tokens == want.tokens
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert getattr(a, k) == pytest.approx(getattr(want, k), rel=1e-4, abs=1e-6), k
    assert got["devices"] == ["cpu"] * 4
    for w in ws[1:]:
        for n, p in ws[0].items():
            assert torch.equal(w[n], p), n
    assert got["gen_a"] == want_gen


def test_a_retried_step_drops_what_its_failed_attempt_held(noeos_dir, monkeypatch):
    """A sharded step that fails after a pass's backward (its gradients held unreduced) and is
    tried again (a compile mode dropped, Trainer._retrying) trains on the retry's gradients
    alone: the same step as one that never failed (one gloo rank, in this process)."""
    from slimen_torch import dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = str(noeos_dir)
        bs = batches(Engine(model, Options(**OPTS)))[:1]
        ok = dist.RankEngine(model, Options(**OPTS), 0)
        want = ok.train(bs[0])
        retried = dist.RankEngine(model, Options(**OPTS), 0)
        t = retried.trainer
        assert t.hold
        calls, backwards, real, real_backward = [], [], t._logprobs, t._backward

        def failing_once(*a, **kw):
            if backwards and not calls:  # a pass after the first pass's backward, once
                calls.append(1)
                raise RuntimeError("a compiled pass failed")
            return real(*a, **kw)

        def counted_backward(loss):
            backwards.append(1)
            real_backward(loss)

        monkeypatch.setattr(t, "_logprobs", failing_once)
        monkeypatch.setattr(t, "_backward", counted_backward)
        monkeypatch.setattr(t, "_uncompile", lambda err: True)  # as a dropped compile mode does
        got = retried.train(bs[0])
        assert calls and len(backwards) > 2  # it failed once, then ran every pass again
        # (Adam's first step moves a weight by about lr whatever its gradient's size: the
        # gradient's norm is what shows gradients counted twice.)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
        for (n, p), q in zip(ok.model.named_parameters(), retried.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
        ok.close()
        retried.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_a_model_too_large_to_hold_reduces_each_micro_batch(noeos_dir, tmp_path, monkeypatch,
                                                             switches):
    """When the whole model's weights and gradients would pass dist.HOLD_SHARE of the device's
    memory, each micro-batch gathers and reduces as FSDP does by default: the same step, one
    reduce-scatter a group a micro-batch (rank 0 runs 3); with the switches, the gradients that
    FSDP adds up over the micro-batches are the local optimizer's."""
    for k, v in SWITCHES[switches].items():
        monkeypatch.setenv(k, v)
    model = str(noeos_dir)
    one = Engine(model, Options(**OPTS))
    try:
        bs = batches(one)[:1]
        want = one.train(bs[0])
    finally:
        one.close()
    got, (w0, _) = run_two(model, OPTS, bs, "", str(tmp_path / "result.pkl"), hold_share=0.0)
    for k in ("loss", "pg_loss", "grad_norm"):
        assert getattr(got["stats"][0], k) == pytest.approx(getattr(want, k), rel=1e-4), k
    assert got["fsdp_groups"] == (2 if switches else len(w0_layers(w0)) + 1)
    assert len(got["reduce_scatters"]) == 3 * got["fsdp_groups"]


def test_gather_in_the_generating_dtype(model_dirs, tmp_path):
    """A bf16 generating model gets the full weights in bf16 (half of fp32's bytes through the
    flat buffers; buckets smaller than some parameters here, so several all-gathers and one
    parameter alone in some), the same on every rank, and one rank's after the same step."""
    opts = dict(OPTS, dtype="bfloat16")
    model = str(model_dirs["tiny-qwen3"])
    one = Engine(model, Options(**opts))
    try:
        bs = batches(one)[:1]
        before = {n: p.detach().float().clone() for n, p in one.model.named_parameters()}
        want = one.train(bs[0])
        one_weights = {n: p.detach().clone() for n, p in one.model.named_parameters()}
    finally:
        one.close()
    out = tmp_path / "two"
    got, (w0, w1) = run_two(model, opts, bs, str(out), str(tmp_path / "result.pkl"), bucket=4096)
    assert got["stats"][0].loss == pytest.approx(want.loss, rel=1e-2)
    assert got["gather_bytes"] == sum(p.numel() * 2 for p in w0.values())
    # Every rank's generating weights are the fp32 masters (the save's) cast to bf16, bit for bit.
    masters = torch.load(out / "optimizer.pt")["masters"]
    assert len(masters) == len(w0)
    for (n, p), m in zip(w0.items(), masters):
        assert p.dtype == torch.bfloat16 and torch.equal(w1[n], p), n
        assert torch.equal(p, m.to(torch.bfloat16)), n
        # One rank's step, to bf16 training's rounding (its passes and gradients are bf16, the
        # group's gradients are reduced in fp32, and Adam's first step moves a weight by about lr
        # whatever its gradient's size, so weights of tiny gradients move differently).
        step1, step2 = one_weights[n].float() - before[n], p.float() - before[n]
        assert (step2 - step1).norm() <= 0.1 * step1.norm(), n


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_compiled_layer_under_fsdp_on_two_gpus(noeos_dir, tmp_path):
    """The compiled training layer (compile_train block) under FSDP2 over two GPUs (NCCL): it
    compiles and trains without falling back to eager, its steps are one GPU's compiled steps (to
    bf16 rounding), every rank generates from the same bf16 weights, and a step runs while
    generation is in flight. (On the CPU with gloo, FSDP2 around the compiled layer gives one rank's loss and
    gradient norm to 1e-6, but inductor takes 95 s there to compile it: too long for the suite.)"""
    opts = dict(OPTS, device="cuda", compile_train="block")
    model = str(noeos_dir)
    one = Engine(model, Options(**dict(opts, device="cuda:0")))
    try:
        bs = batches(one)
        want = [one.train(b) for b in bs]
        assert one.trainer.mode == "block", one.trainer.compile_error
    finally:
        one.close()
    got, (w0, w1) = run_two(model, opts, bs, str(tmp_path / "two"), str(tmp_path / "result.pkl"))
    assert got["mode"] == "block", got["compile_error"]
    assert got["devices"] == ["cuda", "cuda"]
    a, b = got["stats"][0], want[0]
    assert a.tokens == b.tokens
    assert a.loss == pytest.approx(b.loss, rel=2e-2) and \
        a.grad_norm == pytest.approx(b.grad_norm, rel=2e-2)
    assert all(torch.isfinite(torch.tensor([s.loss, s.grad_norm])).all() for s in got["stats"])
    assert got["gather_bytes"] == sum(p.numel() * 2 for p in w0.values())  # the load's trainer
    for n, p in w0.items():
        assert p.dtype == torch.bfloat16 and torch.equal(w1[n], p), n
    # The second step ran while the long requests generated (paused across it). Whether the late
    # requests finish first is timing on a GPU, where a long request of the tiny model may end
    # within the wait before them: the CPU test and test_requests_go_out_as_they_come pin it.
    assert got["longs_during_train"] == 0


def _pb_batch(b: Batch):
    from slimen_torch.proto import engine_pb2 as pb
    lc = b.loss
    return pb.Batch(id=b.id, loss=pb.LossConfig(**{f: getattr(lc, f) for f in
                                                   type(lc).__dataclass_fields__}),
                    samples=[pb.Sample(prompt=s.prompt, response=s.response, loss_mask=s.loss_mask,
                                       old_logprobs=s.old_logprobs, advantages=s.advantages,
                                       group=s.group) for s in b.samples])


def test_two_nodes_over_rendezvous(model_dirs, tmp_path):
    """Two torchrun "nodes" of one rank each on loopback (c10d rendezvous, gloo): the group's
    rank 0 serves over gRPC and a client trains a step through it, equal to one rank's step, and
    generates from both ranks."""
    import subprocess
    import sys
    import time

    import grpc

    from slimen_torch.proto import engine_pb2 as pb
    from slimen_torch.proto import engine_pb2_grpc as pb_grpc

    model = str(model_dirs["tiny-qwen3"])
    one = Engine(model, Options(**OPTS))
    try:
        b = batches(one)[0]
        want = one.train(b)
    finally:
        one.close()
    pkg = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=pkg, OMP_NUM_THREADS="1")
    port = free_port()
    addr_files = [tmp_path / f"addr{n}" for n in (0, 1)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "slimen-test", "-m", "slimen_torch", "serve", "--model", model,
         "--device", "cpu", "--listen", "127.0.0.1:0", "--address-file", str(addr_files[n]),
         "--micro-batch-tokens", str(OPTS["micro_batch_tokens"]), "--root", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    try:
        deadline = time.time() + 120
        # The rendezvous, not --node-rank, orders the nodes: rank 0 is on either.
        while not any(f.exists() for f in addr_files):
            assert all(p.poll() is None for p in procs), [p.stdout.read() for p in procs]
            assert time.time() < deadline, "no address file"
            time.sleep(0.2)
        addr = next(f for f in addr_files if f.exists()).read_text().strip()
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.EngineStub(ch)
            while stub.Health(pb.HealthRequest()).status != pb.HealthResponse.SERVING:
                assert all(p.poll() is None for p in procs), [p.stdout.read() for p in procs]
                assert time.time() < deadline, "never serving"
                time.sleep(0.2)
            info = stub.Info(pb.InfoRequest()).info
            assert len(info.devices) == 2
            got = stub.Train(pb.TrainRequest(batch=_pb_batch(b))).stats
            assert got.loss == pytest.approx(want.loss, rel=1e-4)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
            reqs = [pb.GenerateRequest(id=f"g{i}", prompt_tokens=[5 + i, 6, 7],
                                       sampling=pb.Sampling(max_tokens=4, seed=i))
                    for i in range(4)]
            comps = [c for r in stub.Generate(iter([pb.GenerateStreamRequest(requests=reqs)]))
                     for c in r.completions]
            assert sorted(c.request_id for c in comps) == ["g0", "g1", "g2", "g3"]
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


class FakeLocal:
    """Rank 0's engine in the Group tests: requests it is given run until the test ends them."""
    device = torch.device("cpu")

    def __init__(self):
        self.running, self.cancelled, self.closed = [], [], False

    def check(self, req):
        pass

    def submit(self, req, ok, fail):
        self.running.append((req, ok))

    def cancel(self, rid):
        self.cancelled.append(rid)

    def close(self):
        self.closed = True


def fake_links(monkeypatch, recv):
    """Two ranks whose broadcasts land in the returned queue and whose follower's messages come
    from recv (objs, src, group)."""
    import queue

    from slimen_torch import dist

    sent = queue.Queue()
    monkeypatch.setattr(dist.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist.dist, "broadcast_object_list",
                        lambda objs, src, group: sent.put(objs[0]))
    monkeypatch.setattr(dist.dist, "recv_object_list", recv)
    return dist.Links(object(), {1: object()}), sent


def test_close_with_the_followers_gone(monkeypatch):
    """At the end of a run the host stops torchrun, which stops every rank: a follower's link
    breaks once rank 0 has taken its signal (Group.stopping), and rank 0's close finds the
    followers gone (its broadcast fails). The close still ends the group's threads and rank 0's
    engine, without a thread's traceback in the worker's log and without taking the broken link
    for a rank lost mid-run."""
    import threading
    import time

    from slimen_torch import dist

    def gone(*a, **k):
        raise RuntimeError("Connection reset by peer")

    cut = threading.Event()

    def recv(objs, src, group):
        cut.wait()
        gone()

    raised, broke = [], []
    monkeypatch.setattr(threading, "excepthook", lambda a: raised.append(a.exc_value))
    monkeypatch.setattr(dist, "broken", lambda *a: broke.append(a))
    monkeypatch.setattr(dist, "LOST_GRACE_S", 0.1)
    links, _ = fake_links(monkeypatch, recv)
    monkeypatch.setattr(dist.dist, "broadcast_object_list", gone)
    local = FakeLocal()
    group = dist.Group(local, links, ["cpu", "cpu"])
    group.stopping()
    cut.set()
    time.sleep(0.5)  # past the grace: the server's stop may take seconds before the close
    assert group.close(timeout=10)
    assert local.closed and not raised and not broke
    assert group.lost == [1]


class _FakeServer:
    """A gRPC server's stop, recorded."""

    def __init__(self):
        self.graces = []

    def stop(self, grace):
        self.graces.append(grace)
        return self

    def wait(self):
        pass


class _FakeGroup:
    def __init__(self, lost):
        self.lost, self.stopped, self.closes = lost, False, []

    def stopping(self):
        self.stopped = True

    def close(self, timeout):
        self.closes.append(timeout)
        return False


@pytest.mark.parametrize("lost", [[], [1]])
def test_rank_0_stops_at_once_with_a_follower_gone(monkeypatch, lost):
    """torchrun stops rank 0 because a follower died: rank 0 saw the follower's link break, so
    it exits at once, waiting neither for the server's calls in flight (a generate stream of
    requests the dead rank held kept it the grace's 5 s) nor for the group's close (5 s more);
    torchrun starts the group again only once every rank has exited. With every follower's link
    whole, the stop is the graceful one."""
    from slimen_torch import server

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(server.os, "_exit", exit_)
    srv, group = _FakeServer(), _FakeGroup(lost)
    with pytest.raises(SystemExit):
        server.shut_down(srv, group, 2)
    assert group.stopped
    assert (srv.graces, group.closes) == (([None], []) if lost else ([5], [5]))


def test_a_follower_lost_mid_run_ends_the_group(monkeypatch):
    """A follower's link that breaks while rank 0 is not closing (the rank SIGKILLed) ends the
    group (dist.broken: torchrun then restarts it) instead of leaving its requests waiting."""
    import threading

    from slimen_torch import dist

    def gone(objs, src, group):
        raise RuntimeError("Connection reset by peer")

    broke = threading.Event()
    monkeypatch.setattr(dist, "LOST_GRACE_S", 0.05)
    monkeypatch.setattr(dist, "broken", lambda rank, what, err: broke.set())
    links, _ = fake_links(monkeypatch, gone)
    group = dist.Group(FakeLocal(), links, ["cpu", "cpu"])
    try:
        assert broke.wait(10)
    finally:
        group.close(timeout=10)


def test_requests_go_out_as_they_come(monkeypatch):
    """No rounds: each generate request is dealt out when it comes, while the earlier ones still
    run, to the rank with the fewest samples in flight (rank 0's to its engine, rank 1's in a
    broadcast); rank 1's completions reach their callbacks as it sends them; a cancel goes to the
    rank that has the request, and what it sends for it afterwards is dropped."""
    import queue
    import time

    from slimen_torch import dist

    from slimen_torch.proto import engine_pb2 as pb

    inbox = queue.Queue()

    def recv(objs, src, group):
        objs[0] = inbox.get()

    def done(key, rid):
        """Rank 1's message of a completion of request rid: its protocol message (dist._wire)."""
        return ("done", key, 0, pb.Completion(request_id=rid, text="done").SerializeToString())

    def text(c):
        return c if isinstance(c, str) else f"{c.request_id} {c.text}"

    links, sent = fake_links(monkeypatch, recv)
    local = FakeLocal()
    group = dist.Group(local, links, ["cpu", "cpu"])
    got = queue.Queue()

    def req(i, n=1):
        return GenerateRequest(id=f"q{i}", prompt_tokens=[1], n=n)

    def generate_call():
        call = sent.get(timeout=10)
        assert call[0] == "generate", call
        shares, cancels = call[1]
        return {r: dist.unpack(b) for r, b in shares.items()}, cancels

    def wait_running(k):
        for _ in range(1000):
            if len(local.running) == k:
                return
            time.sleep(0.01)
        raise AssertionError(f"rank 0 runs {len(local.running)} requests, want {k}")

    try:
        group.submit(req(0, n=2), got.put)  # loads 0, 0: rank 0
        wait_running(1)
        group.submit(req(1), got.put)  # loads 2, 0: rank 1, while q0 runs
        shares, cancels = generate_call()
        assert [r.id for _, r in shares[1]] == ["q1"] and not cancels and 0 not in shares
        key1 = shares[1][0][0]
        group.submit(req(2), got.put)  # loads 2, 1: rank 1
        shares, _ = generate_call()
        key2 = shares[1][0][0]
        assert [r.id for _, r in shares[1]] == ["q2"]
        group.submit(req(3), got.put)  # loads 2, 2: rank 0
        wait_running(2)
        assert [r.id for r, _ in local.running] == ["q0", "q3"] and got.empty()
        # rank 1 finishes q1 before anything on rank 0 is done
        inbox.put([done(key1, "q1")])
        assert text(got.get(timeout=10)) == "q1 done"
        local.running[0][1]("q0 #0")
        assert text(got.get(timeout=10)) == "q0 #0"
        # loads 1, 1 and q2 cancelled on rank 1: rank 1 is the least loaded after it
        group.cancel("q2")
        inbox.put([done(key2, "q2")])  # sent before the cancel arrived: dropped
        shares, cancels = generate_call()
        assert cancels == [(1, "q2")] and not shares
        group.submit(req(4), got.put, lambda code, msg: got.put(f"q4 {code}: {msg}"))
        shares, _ = generate_call()
        assert [r.id for _, r in shares[1]] == ["q4"]
        key4 = shares[1][0][0]
        local.running[0][1]("q0 #1")
        local.running[1][1]("q3 done")
        assert [text(got.get(timeout=10)) for _ in range(2)] == ["q0 #1", "q3 done"]
        assert group.in_flight == [0, 1]
        # a request that fails on rank 1 reaches its error callback (after q2's dropped sample:
        # the follower's messages come in order)
        inbox.put([("failed", key4, "INTERNAL", "rank 1 failed it")])
        assert text(got.get(timeout=10)) == "q4 INTERNAL: rank 1 failed it"
        assert got.empty() and group.in_flight == [0, 0] and not group.sent
    finally:
        inbox.put([("bye",)])
        assert group.close(timeout=10)


def test_rank_0_renders_only_its_own_requests(monkeypatch, model_dirs):
    """Rank 0 streams every rank's requests through one interpreter: it makes at once the checks
    that need no prompt tokens (a request they refuse fails in submit, as on one rank) and
    renders the chat template of the requests it runs itself only; a follower's go out with
    their messages, and a failure of the rest of the checks there reaches the request's
    on_error. Rank 0 rendered every request before it could deal any out, and its own twice."""
    import queue

    from slimen_torch import dist
    from slimen_torch.types import RequestError

    sent_back = queue.Queue()

    def recv(objs, src, group):
        objs[0] = sent_back.get()

    links, sent = fake_links(monkeypatch, recv)
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu"))
    renders = []
    real = e.tokenizer.encode_chat
    monkeypatch.setattr(e.tokenizer, "encode_chat", lambda ms, *a: renders.append(ms) or
                        real(ms, *a))
    group = dist.Group(e, links, ["cpu", "cpu"])
    got = queue.Queue()

    def req(i, **kw):
        return GenerateRequest(id=f"m{i}", messages=[{"role": "user", "content": f"hi {i}"}],
                               sampling=Sampling(max_tokens=2, seed=i, **kw))

    try:
        with pytest.raises(RequestError, match="temperature"):
            group.submit(req(9, temperature=-1.0), got.put)
        group.submit(req(0), got.put, lambda code, msg: got.put((code, msg)))  # rank 0
        group.submit(req(1), got.put, lambda code, msg: got.put((code, msg)))  # rank 1
        c = got.get(timeout=60)
        assert c.request_id == "m0" and len(c.tokens) == 2
        call = sent.get(timeout=10)
        assert call[0] == "generate"
        (key, r1), = dist.unpack(call[1][0][1])
        assert r1 == req(1)  # the request as it came, messages and all
        assert [ms[0]["content"] for ms in renders] == ["hi 0"]
        # rank 1's engine refuses what rank 0 did not check: the error reaches on_error
        sent_back.put([("failed", key, "INVALID_ARGUMENT", "request 'm1': chat template: no")])
        assert got.get(timeout=10) == ("INVALID_ARGUMENT", "request 'm1': chat template: no")
        assert group.in_flight == [0, 0]
    finally:
        sent_back.put([("bye",)])
        assert group.close(timeout=30)


def test_a_followers_completion_crosses_as_its_message():
    """A follower sends each completion as its serialized protocol message (made there, not on
    rank 0): rank 0 puts the bytes into the Generate stream's answer as they are, which reads as
    the answer of the completion's own message, and in the process it reads as the completion the
    follower's engine gave."""
    import pickle

    from slimen_torch import dist, server
    from slimen_torch.proto import engine_pb2 as pb
    from slimen_torch.types import Completion

    c = Completion(request_id="r7", index=2, prompt_tokens=[5, 6, 7], tokens=[9, 10, 3],
                   logprobs=[-0.5, -1.25, -0.0625], text="a b", finish_reason="stop")
    own = Completion(request_id="r8", index=0, prompt_tokens=[1], tokens=[300] * 200,
                     logprobs=[-1.0] * 200, text="x" * 300, finish_reason="length")
    wire = pickle.loads(pickle.dumps([dist._wire(("done", 4, c)), ("failed", 5, "X", "y")]))
    assert isinstance(wire[0][3], bytes) and wire[1] == ("failed", 5, "X", "y")
    kind, key, got = dist._unwire(wire[0])
    assert (kind, key, got.index) == ("done", 4, 2)
    assert server.completion_pb(got) is got
    err = pb.RequestError(request_id="r9", code=3, message="no")
    want = pb.GenerateStreamResponse(
        completions=[server.completion_pb(c), server.completion_pb(own)], errors=[err])
    data = server.stream_response([got, server.completion_pb(own)], [err])
    assert pb.GenerateStreamResponse.FromString(data) == want
    for f in ("request_id", "index", "prompt_tokens", "tokens", "logprobs", "text",
              "finish_reason"):
        assert getattr(got, f) == getattr(c, f), f


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_threads_use_its_gpu(model_dirs):
    """An engine on the second GPU (a multi-GPU worker's rank 1) runs its threads there: the
    current CUDA device is per thread, and a thread left on cuda:0 captured empty CUDA graphs and
    failed Triton launches ("cannot be accessed from Triton") on the first 2-GPU run."""
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cuda:1"))
    try:
        assert e._call(torch.cuda.current_device) == 1
        out = e.generate([GenerateRequest(id="a", prompt_tokens=[3, 4, 5], n=4,
                                          sampling=Sampling(max_tokens=24, seed=1))])
        assert len(out) == 4 and all(len(c.tokens) > 0 for c in out)
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_engine_on_cuda_without_an_index(model_dirs):
    """device "cuda" (no index, bench.py's default) is the building thread's current GPU; binding
    the engine thread to it by that name raised in the thread and left every call waiting."""
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cuda"))
    try:
        assert e.device == torch.device("cuda", torch.cuda.current_device())
        out = e.generate([GenerateRequest(id="a", prompt_tokens=[3, 4, 5],
                                          sampling=Sampling(max_tokens=8, seed=1))], timeout=120)
        assert len(out[0].tokens) > 0
    finally:
        e.close()


def test_a_rank_that_never_starts_logs_its_stacks(capfd, caplog):
    """A rank still starting START_STACKS_S after it began (a collective some rank never joins:
    issue 37's hang) writes its threads' stacks to its log, once; one that started in time
    (the timer cancelled) writes nothing."""
    import threading

    from slimen_torch import dist

    waiting = threading.Event()

    def waits_in_a_collective():
        waiting.wait(10)

    t = threading.Thread(target=waits_in_a_collective, name="stuck")
    t.start()
    try:
        dist.stacks_later(3, 0.05).join(5)
    finally:
        waiting.set()
        t.join()
    err = capfd.readouterr().err
    assert "rank 3: not in its group 0 s after it started" in caplog.text
    assert "in waits_in_a_collective" in err and "in test_a_rank_that_never_starts" in err, err
    caplog.clear()
    timer = dist.stacks_later(1, 0.2)
    timer.cancel()
    timer.join(5)
    assert "not in its group" not in caplog.text and "Thread" not in capfd.readouterr().err
