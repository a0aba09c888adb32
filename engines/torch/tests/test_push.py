"""Pushing weights through a push group (push.py; JoinPushGroup and PushWeights): a trainer (this
process's engine, rank 0) and a replica (a worker process, rank 1, over gRPC) join a gloo group;
after a training step the trainer's weights, pushed, equal the replica's bit for bit, and the
replica then samples what the trainer samples."""

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

from slimen_torch.engine import Engine, Options
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


def serve(model, tmp_path, *args):
    """A worker process serving model on the CPU; returns (process, address)."""
    addr_file = tmp_path / "addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimen_torch", "serve", "--model", str(model), "--listen",
         "127.0.0.1:0", "--device", "cpu", "--root", str(tmp_path), "--address-file",
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
    links, resp = both(
        lambda: trainer.join_push("g1", init, 0, 2, 60),
        lambda: stub.JoinPushGroup(pb.PushGroupRequest(init_method=init, rank=1, world=2,
                                                       group="g1", timeout_s=60)))
    assert list(links) == ["", "gloo"] and list(resp.links) == ["gloo", ""]
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
    assert remote_generate(stub, reqs()) == want

    # A second step, a second push through the same group.
    trainer.train(fixed_batch(trainer, LossConfig(lr=5e-2), seed=1))
    both(lambda: trainer.push_weights("g1", 1, 2),
         lambda: stub.PushWeights(pb.PushWeightsRequest(group="g1", peer=1, version=2)))
    assert remote_generate(stub, [r for r in reqs()]) == \
        [(c.tokens, c.logprobs) for c in trainer.generate(reqs())]

    # A sender that cannot send tells the receiver, which fails at once instead of waiting.
    def refused():
        with pytest.raises(ValueError, match="no weights today"):
            trainer._push_group.send(trainer.model, 1, refuse="no weights today")

    _, err = both(refused, lambda: pytest.raises(
        grpc.RpcError, stub.PushWeights, pb.PushWeightsRequest(group="g1", peer=1, version=3)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sent no weights" in err.value.details()
    now = [(c.tokens, c.logprobs) for c in trainer.generate(reqs())]
    assert remote_generate(stub, reqs()) == now

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
            both(lambda: trainer.join_push("g2", init, 0, 2, 60),
                 lambda: stub.JoinPushGroup(pb.PushGroupRequest(init_method=init, rank=1, world=2,
                                                                group="g2", timeout_s=60)))

            def send():
                with pytest.raises(RequestError, match="rank 1's parameters differ"):
                    trainer.push_weights("g2", 1, 1)

            req = pb.PushWeightsRequest(group="g2", peer=1, version=1)
            _, err = both(send, lambda: pytest.raises(grpc.RpcError, stub.PushWeights, req))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "the trainer's parameters differ" in err.value.details()
            assert remote_generate(stub, reqs()) == before
    finally:
        trainer.close()
        stop(proc)

