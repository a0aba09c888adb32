"""Weights versions (versions.py): a kept version samples and scores as the weights did when it was
kept, while the current weights train on; drop frees; SaveVersion writes a folder that loads back
equal; the same over gRPC (KeepVersion, GenerateRequest.version, ScoreBatchRequest.version)."""

import threading

import grpc
import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.proto import engine_pb2 as pb
from slimen_torch.proto import engine_pb2_grpc as pb_grpc
from slimen_torch.server import make_server
from slimen_torch.types import GenerateRequest, LossConfig, RequestError, Sampling, ScoreRequest

from test_train import fixed_batch


def reqs(n=3):
    return [GenerateRequest(id=f"r{i}", prompt_tokens=[3 + i, 5, 7], n=2,
                            sampling=Sampling(max_tokens=6, temperature=1.0, seed=11 + i))
            for i in range(n)]


def collect(submit, rs):
    """All completions of rs through submit(req, on_completion, on_error), in order."""
    done = threading.Condition()
    got, errs = {}, []
    for i, r in enumerate(rs):
        submit(r, lambda c, i=i: (done.acquire(), got.__setitem__((i, c.index), c),
                                  done.notify(), done.release()),
               lambda code, msg: (done.acquire(), errs.append((code, msg)), done.notify(),
                                  done.release()))
    want = sum(r.n for r in rs)
    with done:
        assert done.wait_for(lambda: errs or len(got) == want, 60)
    if errs:
        raise RequestError(*errs[0])
    return [(got[k].tokens, got[k].logprobs) for k in sorted(got)]


@pytest.fixture
def eng(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu"))
    yield e
    e.close()


def test_a_kept_version_samples_the_weights_it_was_kept_with(eng, tmp_path):
    assert "versions" in eng.info()["capabilities"]
    before = [(c.tokens, c.logprobs) for c in eng.generate(reqs())]
    pairs = [ScoreRequest(prompt_tokens=[3, 5, 7], tokens=t) for t, _ in before[:2]]
    scored = eng.score(pairs)
    eng.keep_version(0)
    st = eng.train(fixed_batch(eng, LossConfig(lr=5e-2)))
    assert not st.skipped
    # The current weights moved; version 0 did not.
    after = [(c.tokens, c.logprobs) for c in eng.generate(reqs())]
    assert after != before
    assert collect(lambda r, *cb: eng.submit_version(0, r, *cb), reqs()) == before
    assert eng.score_version(0, pairs) == scored
    assert eng.score(pairs) != scored
    # The trainer and the rollout model share no storage.
    ro = eng.versions.rollout
    mine = {p.data_ptr() for p in eng.model.parameters()}
    assert not mine & {p.data_ptr() for p in ro.model.parameters()}
    assert not mine & {b.data_ptr() for b in eng.versions.tensors(0)}

    # Version 1 (the trained weights) next to 0: each request samples its own version, the rollout
    # model switching between them.
    eng.keep_version(1)
    assert collect(lambda r, *cb: eng.submit_version(1, r, *cb), reqs()) == after
    both = []
    threads = [threading.Thread(target=lambda v=v: both.append(
        (v, collect(lambda r, *cb: eng.submit_version(v, r, *cb), reqs())))) for v in (0, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v, got in both:
        assert got == (before if v == 0 else after)

    # SaveVersion writes version 0 as a model folder that loads back equal.
    eng.save_version(0, str(tmp_path / "v0"))
    assert not (tmp_path / "v0" / "optimizer.pt").exists()
    back = Engine(str(tmp_path / "v0"), Options(device="cpu"))
    try:
        assert [(c.tokens, c.logprobs) for c in back.generate(reqs())] == before
    finally:
        back.close()

    # Drop frees: version 0's tensors are gone, and asking for it is refused.
    size = eng.versions.kept_bytes()
    eng.drop_versions(1)
    assert eng.versions.held() == [1]
    assert eng.versions.kept_bytes() == size // 2
    with pytest.raises(RequestError, match="weights version 0 is not kept"):
        eng.submit_version(0, reqs()[0], lambda c: None)
    with pytest.raises(RequestError, match="not kept"):
        eng.score_version(0, pairs)


def test_generation_of_a_version_runs_while_training(eng):
    """A versioned round is not queued behind a training step: the two run on different threads."""
    eng.keep_version(0)
    batch = fixed_batch(eng, LossConfig(lr=1e-2))
    gate, release = threading.Event(), threading.Event()
    step = eng.trainer.step

    def slow_step(b):  # the training step waits until versioned generation is done
        gate.set()
        assert release.wait(60)
        return step(b)

    eng.trainer.step = slow_step
    t = threading.Thread(target=lambda: eng.train(batch))
    t.start()
    assert gate.wait(60)
    got = collect(lambda r, *cb: eng.submit_version(0, r, *cb), reqs(1))
    release.set()
    t.join()
    assert len(got) == 2


def test_versions_over_grpc(model_dirs, tmp_path):
    engine = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu"))
    server, service, port = make_server("127.0.0.1:0", roots=[str(tmp_path)])
    service.engine, service.loading = engine, False
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.EngineStub(channel)
    try:
        info = stub.Info(pb.InfoRequest()).info
        assert "versions" in info.capabilities

        def gen(version=None, tag=""):
            r = pb.GenerateRequest(id="g" + tag, prompt_tokens=[3, 5, 7], n=2,
                                   sampling=pb.Sampling(max_tokens=5, temperature=1.0, seed=3))
            if version is not None:
                r.version = version
            out = {}
            for msg in stub.Generate(iter([pb.GenerateStreamRequest(requests=[r])])):
                assert not msg.errors, msg.errors
                for c in msg.completions:
                    out[c.index] = (list(c.tokens), [round(x, 5) for x in c.logprobs])
            return [out[i] for i in sorted(out)]

        before = gen(tag="0")
        stub.KeepVersion(pb.VersionRequest(version=0))
        engine.train(fixed_batch(engine, LossConfig(lr=5e-2)))
        assert gen(tag="1") != before
        assert gen(0, tag="2") == before
        score = pb.ScoreBatchRequest(requests=[pb.ScoreRequest(prompt_tokens=[3, 5, 7],
                                                               tokens=before[0][0])], version=0)
        lp = [round(x, 5) for x in stub.Score(score).scores[0].logprobs]
        assert lp == before[0][1]
        stub.Save(pb.SaveRequest(dir=str(tmp_path / "v0"), version=0))
        assert (tmp_path / "v0" / "model.safetensors").exists()
        stub.DropVersions(pb.VersionRequest(version=1))
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(score)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        r = pb.GenerateRequest(id="gone", prompt_tokens=[3], n=1, version=0,
                               sampling=pb.Sampling(max_tokens=2, temperature=1.0))
        msgs = list(stub.Generate(iter([pb.GenerateStreamRequest(requests=[r])])))
        assert msgs[-1].errors[0].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "not kept" in msgs[-1].errors[0].message
    finally:
        channel.close()
        server.stop(0).wait()
        engine.close()


def test_keep_copies_in_the_generator_dtype(model_dirs):
    e = Engine(str(model_dirs["tiny"]), Options(device="cpu", dtype="bfloat16"))
    try:
        e.keep_version(3)
        bufs = e.versions.tensors(3)
        assert {b.dtype for b in bufs} == {torch.bfloat16}
        src = dict(e.model.named_parameters())
        assert all(torch.equal(b, src[n]) for b, n in zip(bufs, e.versions.names()))
    finally:
        e.close()


def test_a_switch_drops_the_rollout_models_kept_prefixes(model_dirs):
    """With the prefix cache on, the rows the rollout model kept under one version are not reused
    under another: version 1 samples a prompt that extends a version-0 conversation as the current
    weights (version 1) do."""
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", prefix_cache=8, prefix_min=4))
    try:
        first = GenerateRequest(id="t1", prompt_tokens=[3, 5, 7, 9, 11, 13], n=1,
                                sampling=Sampling(max_tokens=6, temperature=1.0, seed=5))
        e.keep_version(0)
        turn1 = collect(lambda r, *cb: e.submit_version(0, r, *cb), [first])[0][0]
        e.train(fixed_batch(e, LossConfig(lr=5e-2)))
        e.keep_version(1)
        nxt = [GenerateRequest(id=f"t2{tag}", prompt_tokens=[3, 5, 7, 9, 11, 13] + turn1 + [17, 19],
                               n=2, sampling=Sampling(max_tokens=6, temperature=1.0, seed=6))
               for tag in "ab"]
        got = collect(lambda r, *cb: e.submit_version(1, r, *cb), nxt[:1])
        want = [(c.tokens, c.logprobs) for c in e.generate(nxt[1:])]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) < 1e-5
    finally:
        e.close()


def test_a_dead_rollout_thread_fails_its_calls(model_dirs, monkeypatch):
    """Should the rollout model's thread stop (here its start raises), generation and scoring of
    a version fail with the reason instead of waiting for it."""
    import slimen_torch.versions as versions_mod

    def broken(device):
        raise ValueError("no such device")
    monkeypatch.setattr(versions_mod, "bind_thread", broken)
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu"))
    try:
        e.keep_version(0)
        # Refused at submission once the thread is gone, else by the thread's last act.
        with pytest.raises((RequestError, RuntimeError),
                           match="rollout thread stopped: ValueError: no such"):
            collect(lambda r, *cb: e.submit_version(0, r, *cb), reqs(1))
        with pytest.raises((RequestError, RuntimeError), match="rollout thread stopped"):
            e.score_version(0, [ScoreRequest(tokens=[3], prompt_tokens=[1, 2])])
    finally:
        e.close()
