"""One policy over two ranks on the CPU (gloo): FSDP2 training data-parallel over the ranks gives
the step one rank gives on the same global batch, generation dealt out to the ranks gives the
completions one rank gives, and the save is the folder (and optimizer state) one rank writes and
loads. The ranks run as two processes (torch.multiprocessing) through dist.Group, rank 0's side of
the gRPC service, and dist.follow, the other ranks'."""

import os
import pathlib
import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp

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


def collect(submit, reqs):
    import threading
    cv = threading.Condition()
    got = {}

    def on(c):
        with cv:
            got[(c.request_id, c.index)] = c.tokens
            cv.notify()

    def fail(code, msg):
        raise AssertionError(f"{code}: {msg}")

    for r in reqs:
        submit(r, on, fail)
    want = sum(r.n for r in reqs)
    with cv:
        assert cv.wait_for(lambda: len(got) == want, timeout=60)
    return got


def _rank(rank, size, port, model, bs, out, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from slimen_torch import dist
    rank, _, _, ctrl = dist.init("cpu")
    engine = dist.RankEngine(model, Options(**OPTS), rank)
    if rank != 0:
        dist.follow(engine, ctrl, rank)
        engine.close()
        torch.distributed.destroy_process_group()
        return
    group = dist.Group(engine, ctrl, ["cpu"] * size)
    stats = [group.train(b) for b in bs]
    group.save(out)
    gen = collect(group.submit, REQUESTS)
    devices = group.info()["devices"]
    group.close()
    torch.distributed.destroy_process_group()
    with open(result, "wb") as f:
        pickle.dump({"stats": stats, "gen": gen, "devices": devices,
                     "gather_s": engine.trainer.gather_seconds,
                     "gather_bytes": engine.trainer.gathered_bytes}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one(model_dirs, tmp_path):
    model = str(model_dirs["tiny-qwen3"])
    one = Engine(model, Options(**OPTS))
    try:
        bs = batches(one)
        one_stats = [one.train(b) for b in bs]
        one.save(str(tmp_path / "one"))
        gen1 = collect(one.submit, REQUESTS)  # after the steps, as the group generates
    finally:
        one.close()
    out, result = str(tmp_path / "two"), str(tmp_path / "result.pkl")
    mp.start_processes(_rank, args=(2, free_port(), model, bs, out, result), nprocs=2,
                       start_method="spawn", join=True)
    with open(result, "rb") as f:
        got = pickle.load(f)

    for a, b in zip(got["stats"], one_stats):
        assert not a.skipped and not b.skipped
        assert a.tokens == b.tokens and a.clip_frac == b.clip_frac
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert getattr(a, k) == pytest.approx(getattr(b, k), rel=1e-4, abs=1e-6), k
    assert got["stats"][1].grad_norm > STEPS[1].max_grad_norm  # the clip was applied
    assert got["devices"] == ["cpu", "cpu"] and got["gather_bytes"] > 0

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
    # Generation after the steps, from the gathered weights, on both ranks.
    assert gen1 == got["gen"]


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


def test_close_with_the_followers_gone(monkeypatch):
    """At the end of a run the host stops torchrun, which stops every rank: rank 0's close finds
    the followers gone. The close still ends the group thread and rank 0's engine, without the
    thread's traceback in the worker's log."""
    import threading

    from slimen_torch import dist

    class Local:
        closed = False
        device = torch.device("cpu")

        def close(self):
            self.closed = True

    def gone(objs, src, group):
        raise RuntimeError("Connection reset by peer")

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda a: raised.append(a.exc_value))
    monkeypatch.setattr(dist.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist.dist, "broadcast_object_list", gone)
    local = Local()
    group = dist.Group(local, object(), ["cpu", "cpu"])
    assert group.close(timeout=10)
    assert local.closed and not raised


def test_a_round_takes_the_whole_burst(monkeypatch):
    """Requests that come close together (the host's burst at a step's start) are generated in
    one round: a round started on the first of them kept the others waiting for all of it."""
    import threading
    import time

    from slimen_torch import dist

    class Local:
        device = torch.device("cpu")

        def request(self, req):
            pass

        def close(self):
            pass

    rounds = []

    def run_call(engine, call, ctrl, rank):
        if call[0] != "generate":
            return None
        rounds.append(sum(len(s) for s in call[1]))
        time.sleep(0.05)  # a round's generation
        return [[([f"done {q.id}"], None) for q in share] for share in call[1]]

    monkeypatch.setattr(dist.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist.dist, "broadcast_object_list", lambda objs, src, group: None)
    monkeypatch.setattr(dist, "run_call", run_call)
    monkeypatch.setattr(dist, "ROUND_QUIET_S", 0.2)  # far above the gaps below, on a busy machine
    monkeypatch.setattr(dist, "ROUND_WAIT_S", 5.0)
    group = dist.Group(Local(), object(), ["cpu", "cpu"])
    got, done = [], threading.Event()

    def ok(c):
        got.append(c)
        if len(got) == 20:
            done.set()

    try:
        for i in range(20):
            group.submit(GenerateRequest(id=str(i)), ok)
            time.sleep(0.002)
        assert done.wait(30)
    finally:
        group.close(timeout=10)
    assert sorted(got) == sorted(f"done {i}" for i in range(20))
    assert rounds == [20]


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
