"""Pushing weights through a push group (push.py; JoinPushGroup and PushWeights): a trainer (this
process's engine, rank 0) and a replica (a worker process, rank 1, over gRPC) join a gloo group;
after a training step the trainer's weights, pushed, equal the replica's bit for bit, and the
replica then samples what the trainer samples. Two members on one GPU are linked by CUDA IPC
(the GPU tests; on the CPU the same protocol runs through shared memory)."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from safetensors.torch import load_file

import ranks
from push_members import member
from slimen_torch.engine import Engine, Options
from slimen_torch.push import _link
from slimen_torch.proto import engine_pb2 as pb
from slimen_torch.proto import engine_pb2_grpc as pb_grpc
from slimen_torch.types import GenerateRequest, LossConfig, RequestError, Sampling
from slimen_torch.weights import hf_state_dict

from test_train import fixed_batch

PKG = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def serve(model, tmp_path, *args, device="cpu"):
    """A worker process serving model on device; returns (process, address)."""
    addr_file = tmp_path / "addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimen_torch", "serve", "--model", str(model), "--listen",
         "127.0.0.1:0", "--device", device, "--root", str(tmp_path), "--address-file",
         str(addr_file), *args],
        env=dict(os.environ, PYTHONPATH=str(PKG)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not addr_file.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no address file"
        time.sleep(0.1)
    return proc, addr_file.read_text().strip()


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def ready(stub):
    deadline = time.time() + 120
    while True:
        try:
            if stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert time.time() < deadline, "never serving"
        time.sleep(0.1)


def both(a, b):
    """Runs a() here and b() in a thread at once; returns both results (raising either's error)."""
    out, err = {}, {}

    def run_b():
        try:
            out["b"] = b()
        except BaseException as e:
            err["b"] = e

    t = threading.Thread(target=run_b)
    t.start()
    try:
        ra = a()
    finally:
        t.join(120)
    if "b" in err:
        raise err["b"]
    return ra, out["b"]


def join(trainer, stub, group, init):
    """The trainer (rank 0) and the replica behind stub (rank 1) join group at init at once;
    returns both members' links."""
    links, resp = both(
        lambda: trainer.join_push(group, init, 0, 2, 60),
        lambda: stub.JoinPushGroup(pb.PushGroupRequest(init_method=init, rank=1, world=2,
                                                       group=group, timeout_s=60)))
    return list(links), list(resp.links)


def reqs():
    return [GenerateRequest(id=f"p{i}", prompt_tokens=[3 + i, 5, 7], n=2,
                            sampling=Sampling(max_tokens=6, temperature=1.0, seed=21 + i))
            for i in range(3)]


def remote_generate(stub, rs):
    msg = pb.GenerateStreamRequest(requests=[pb.GenerateRequest(
        id=r.id, prompt_tokens=r.prompt_tokens, n=r.n,
        sampling=pb.Sampling(max_tokens=r.sampling.max_tokens,
                             temperature=r.sampling.temperature, seed=r.sampling.seed))
        for r in rs])
    got = {}
    for resp in stub.Generate(iter([msg])):
        assert not resp.errors, resp.errors
        for c in resp.completions:
            got[(c.request_id, c.index)] = (list(c.tokens), list(c.logprobs))
    return [got[k] for k in sorted(got)]


def assert_same_samples(got, want):
    """The same tokens, and log-probs equal to rounding: in the default (not deterministic) mode a
    row's numbers depend on the batch the worker's scheduler put it in, and the requests of a
    stream reach it one by one (a CI run once saw one log-prob 5e-7 apart)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.fixture
def pair(model_dirs, tmp_path):
    """The trainer engine (this process) and a replica worker's stub."""
    if torch.distributed.is_initialized():
        pytest.skip("this process is in a process group already")
    model = model_dirs["tiny-qwen3"]
    proc, addr = serve(model, tmp_path, "--no-versions")
    trainer = Engine(str(model), Options(device="cpu", versions=False))
    ch = grpc.insecure_channel(addr)
    try:
        stub = pb_grpc.EngineStub(ch)
        ready(stub)
        yield trainer, stub
    finally:
        ch.close()
        trainer.close()
        stop(proc)


def test_a_pushed_replica_holds_the_trainers_weights_and_samples_as_it_does(pair, tmp_path):
    trainer, stub = pair
    assert "push" in trainer.info()["capabilities"]
    assert "push" in stub.Info(pb.InfoRequest()).info.capabilities
    st = trainer.train(fixed_batch(trainer, LossConfig(lr=5e-2)))
    assert not st.skipped
    want = [(c.tokens, c.logprobs) for c in trainer.generate(reqs())]
    assert remote_generate(stub, reqs()) != want  # the replica has the weights before the step

    init = f"tcp://127.0.0.1:{free_port()}"
    links, theirs = join(trainer, stub, "g1", init)
    assert links == ["", "gloo"] and theirs == ["gloo", ""]
    # A resent join of the same group is answered from the group made.
    assert trainer.join_push("g1", init, 0, 2, 60) == links

    sent, got = both(
        lambda: trainer.push_weights("g1", 1, 1),
        lambda: stub.PushWeights(pb.PushWeightsRequest(group="g1", peer=1, version=1)))
    n = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert sent["bytes"] == got.bytes == n and got.link == "gloo"

    # Bit for bit: the replica's saved weights are the trainer's.
    stub.Save(pb.SaveRequest(dir="replica"))
    saved = load_file(str(tmp_path / "replica" / "model.safetensors"))
    mine = hf_state_dict(trainer.model)
    assert saved.keys() == mine.keys()
    for k, v in mine.items():
        assert torch.equal(saved[k], v), k
    # And it samples what the trainer samples (the same seeds).
    assert_same_samples(remote_generate(stub, reqs()), want)

    # A second step, a second push through the same group.
    trainer.train(fixed_batch(trainer, LossConfig(lr=5e-2), seed=1))
    both(lambda: trainer.push_weights("g1", 1, 2),
         lambda: stub.PushWeights(pb.PushWeightsRequest(group="g1", peer=1, version=2)))
    assert_same_samples(remote_generate(stub, reqs()),
                        [(c.tokens, c.logprobs) for c in trainer.generate(reqs())])

    # A sender that cannot send tells the receiver, which fails at once instead of waiting.
    def refused():
        with pytest.raises(ValueError, match="no weights today"):
            trainer._push_group.send(trainer.model, 1, refuse="no weights today")

    _, err = both(refused, lambda: pytest.raises(
        grpc.RpcError, stub.PushWeights, pb.PushWeightsRequest(group="g1", peer=1, version=3)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sent no weights" in err.value.details()
    now = [(c.tokens, c.logprobs) for c in trainer.generate(reqs())]
    assert_same_samples(remote_generate(stub, reqs()), now)

    # A push naming a group the worker is not in fails at once.
    with pytest.raises(grpc.RpcError) as e:
        stub.PushWeights(pb.PushWeightsRequest(group="other", peer=1, version=3))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_worker_without_push_refuses_to_join(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", versions=False, push=False))
    try:
        assert "push" not in e.info()["capabilities"]
        with pytest.raises(RequestError) as err:
            e.join_push("g", "tcp://127.0.0.1:1", 0, 2, 5)
        assert err.value.code == "FAILED_PRECONDITION" and "--no-push" in str(err.value)
    finally:
        e.close()


def test_a_replica_of_another_model_takes_no_weights(model_dirs, tmp_path):
    """The replica answers the header: parameters that differ fail both sides at once."""
    if torch.distributed.is_initialized():
        pytest.skip("this process is in a process group already")
    proc, addr = serve(model_dirs["tiny-qwen3"], tmp_path, "--no-versions")
    trainer = Engine(str(model_dirs["tiny"]), Options(device="cpu", versions=False))
    try:
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.EngineStub(ch)
            ready(stub)
            before = remote_generate(stub, reqs())
            init = f"tcp://127.0.0.1:{free_port()}"
            join(trainer, stub, "g2", init)

            def send():
                with pytest.raises(RequestError, match="rank 1's parameters differ"):
                    trainer.push_weights("g2", 1, 1)

            req = pb.PushWeightsRequest(group="g2", peer=1, version=1)
            _, err = both(send, lambda: pytest.raises(grpc.RpcError, stub.PushWeights, req))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "the trainer's parameters differ" in err.value.details()
            assert_same_samples(remote_generate(stub, reqs()), before)
    finally:
        trainer.close()
        stop(proc)



def test_the_link_of_a_pair_follows_the_devices():
    """NCCL between two GPUs, CUDA IPC on one GPU (NCCL refuses two ranks there), gloo for the
    rest (a CPU member, or no NCCL)."""
    assert _link(("cuda", "GPU-a"), ("cuda", "GPU-b"), True) == "nccl"
    assert _link(("cuda", "GPU-a"), ("cuda", "GPU-b"), False) == "gloo"
    assert _link(("cuda", "GPU-a"), ("cuda", "GPU-a"), True) == "cuda-ipc"
    assert _link(("cuda", "GPU-a"), ("cuda", "GPU-a"), False) == "cuda-ipc"
    assert _link(("cpu", ""), ("cpu", ""), True) == "gloo"
    assert _link(("cuda", "GPU-a"), ("cpu", ""), True) == "gloo"
    assert _link(("cpu", ""), ("cuda", "GPU-a"), True) == "gloo"


def run_pair(device: str, force_shared=False, fail_map=False):
    """Spawns push_members.member as rank 0 and rank 1 on device; returns their reports."""
    out = ranks.context().Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ranks.process(member, (r, device, init, force_shared, fail_map, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, res = out.get(timeout=180)
            got[r] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert "error" not in got[0] and "error" not in got[1], got
    return got[0], got[1]


def check_shared_pushes(t, r):
    """Pushes 1 and 2 and 4 went through the shared buffers (the same ones each time, on both
    sides), bit for bit; push 3, into parameters of another shape, failed on both sides."""
    assert t["links"] == ["", "cuda-ipc"] and r["links"] == ["cuda-ipc", ""]
    assert t["before"] != r["before"]
    tp, rp = t["pushes"], r["pushes"]
    for i in (0, 1, 3):
        assert tp[i]["link"] == rp[i]["link"] == "cuda-ipc", (i, tp[i], rp[i])
        assert tp[i]["bytes"] == rp[i]["bytes"] == t["bytes"], i
        assert tp[i]["digest"] == rp[i]["digest"], i
        assert tp[i]["ptrs"] and tp[i]["ptrs"] == tp[0]["ptrs"], i  # one set of buffers
        assert rp[i]["ptrs"] and rp[i]["ptrs"] == rp[0]["ptrs"], i
    assert set(tp[0]["ptrs"]) == {"torch.float32", "torch.bfloat16"}
    assert tp[0]["digest"] != tp[1]["digest"] != tp[3]["digest"]  # each push brought new weights
    assert "rank 1's parameters differ" in tp[2]["error"]
    assert "the trainer's parameters differ" in rp[2]["error"]
    assert rp[2]["digest"] == rp[1]["digest"]  # the replica's model kept what it had
    assert t["links_after"] == ["", "cuda-ipc"] and r["links_after"] == ["cuda-ipc", ""]
    assert t["closed_bufs"] == r["closed_bufs"] == 0


def check_fallback(t, r):
    """A replica that cannot map the buffers: both members fall back to gloo, and every push
    (the first included) still brings the weights bit for bit."""
    tp, rp = t["pushes"], r["pushes"]
    for i in (0, 1, 3):
        assert tp[i]["link"] == rp[i]["link"] == "gloo", (i, tp[i], rp[i])
        assert tp[i]["digest"] == rp[i]["digest"] and not tp[i]["ptrs"] and not rp[i]["ptrs"], i
    assert "rank 1's parameters differ" in tp[2]["error"]
    assert t["links_after"] == ["", "gloo"] and r["links_after"] == ["gloo", ""]


def test_the_shared_buffer_protocol_on_the_cpu():
    """push.py's CUDA IPC protocol (buffers shared once, copy, signal, copy, acknowledge), with
    the buffers in shared memory: the CPU pair linked as one GPU's pair would be."""
    check_shared_pushes(*run_pair("cpu", force_shared=True))


def test_a_pair_that_cannot_map_the_buffers_falls_back_to_gloo_on_the_cpu():
    check_fallback(*run_pair("cpu", force_shared=True, fail_map=True))


@GPU
def test_two_members_on_one_gpu_push_by_cuda_ipc():
    check_shared_pushes(*run_pair("cuda:0"))


@GPU
def test_two_members_on_one_gpu_fall_back_to_gloo_when_ipc_fails():
    check_fallback(*run_pair("cuda:0", fail_map=True))


@GPU
def test_a_replica_worker_on_the_trainers_gpu_takes_the_weights_by_cuda_ipc(model_dirs, tmp_path):
    """The engines: a trainer and a replica worker on cuda:0 join with a CUDA IPC link, and two
    pushes in a row leave the replica with the trainer's weights bit for bit."""
    if torch.distributed.is_initialized():
        pytest.skip("this process is in a process group already")
    model = model_dirs["tiny-qwen3"]
    proc, addr = serve(model, tmp_path, "--no-versions", device="cuda:0")
    trainer = Engine(str(model), Options(device="cuda:0", versions=False))
    try:
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.EngineStub(ch)
            ready(stub)
            init = f"tcp://127.0.0.1:{free_port()}"
            links, theirs = join(trainer, stub, "g3", init)
            assert links == ["", "cuda-ipc"] and theirs == ["cuda-ipc", ""]
            n = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            for v in (1, 2):
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.add_(0.01 * v)
                torch.cuda.synchronize()  # done before the engine's thread copies them
                sent, got = both(
                    lambda: trainer.push_weights("g3", 1, v),
                    lambda: stub.PushWeights(pb.PushWeightsRequest(group="g3", peer=1,
                                                                   version=v)))
                assert sent["link"] == got.link == "cuda-ipc"
                assert sent["bytes"] == got.bytes == n
                stub.Save(pb.SaveRequest(dir=f"replica{v}"))
                saved = load_file(str(tmp_path / f"replica{v}" / "model.safetensors"))
                mine = hf_state_dict(trainer.model)
                assert saved.keys() == mine.keys()
                for k, w in mine.items():
                    assert torch.equal(saved[k], w.cpu()), (v, k)
    finally:
        trainer.close()
        stop(proc)


def test_the_async_summary_reads_each_links_pushes(tmp_path):
    """async_summary.py's "replica push" column takes host/replica.go's events.log lines by link,
    cuda-ipc included."""
    sys.path.insert(0, str(PKG))
    from async_summary import push_rate

    line = ('policy "p": weights version {v} pushed to its rollout replica by broadcast in {s}s '
            '(1.19 GB: {r} s/GB; {link}, 0.001000s in the workers)\n')
    (tmp_path / "events.log").write_text(
        line.format(v=1, s="0.003000", r="0.002521", link="cuda-ipc")
        + line.format(v=2, s="0.005000", r="0.004202", link="cuda-ipc")
        + line.format(v=3, s="0.008000", r="0.006723", link="nccl"))
    got = push_rate(str(tmp_path / "metrics.jsonl"))
    assert set(got) == {"broadcast cuda-ipc", "broadcast nccl"}
    secs, rate, n = got["broadcast cuda-ipc"]
    assert n == 2 and abs(secs - 0.004) < 1e-9 and abs(rate - 0.0033615) < 1e-9
    assert got["broadcast nccl"][2] == 1
