"""The gRPC server over real loopback connections: the Generate stream (continuous batching,
early finishers first, resent ids answered from memory, cancels, per-request errors), Train
step-id idempotency, Score, Tokenize, Save/Load, Info/Health and the bearer token."""

import concurrent.futures
import os
import queue
import threading

import pathlib

import grpc
import pytest

from slimen_torch.engine import Engine
from slimen_torch.proto import engine_pb2 as pb
from slimen_torch.proto import engine_pb2_grpc as pb_grpc
from slimen_torch.server import Roots, is_loopback, make_server
from slimen_torch.types import GenerateRequest, Sampling, ScoreRequest


class Spy:
    """The engine, counting the generate requests that reach it."""

    def __init__(self, engine):
        self.engine = engine
        self.submitted = []

    def submit(self, req, *a, **kw):
        self.submitted.append(req.id)
        return self.engine.submit(req, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def served(noeos_dir, tmp_path_factory):
    engine = Engine(str(noeos_dir))
    # Save and Load may use the session's temporary folders (tmp_path).
    server, service, port = make_server("127.0.0.1:0", roots=[str(tmp_path_factory.getbasetemp())])
    spy = Spy(engine)
    service.engine = spy
    service.loading = False
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.EngineStub(channel), service, spy
    channel.close()
    server.stop(0).wait()
    engine.close()


class Stream:
    """A Generate stream: send messages whenever, read responses with a timeout."""

    def __init__(self, stub, metadata=None):
        self.out: queue.Queue = queue.Queue()
        self.got: queue.Queue = queue.Queue()

        def requests():
            while (m := self.out.get()) is not None:
                yield m

        self.call = stub.Generate(requests(), metadata=metadata)

        def read():
            try:
                for r in self.call:
                    self.got.put(r)
            except grpc.RpcError as e:
                self.got.put(e)
            self.got.put(None)

        threading.Thread(target=read, daemon=True).start()

    def send(self, *reqs, cancel=()):
        self.out.put(pb.GenerateStreamRequest(requests=list(reqs), cancel=list(cancel)))

    def close(self):
        self.out.put(None)

    def events(self, n, timeout=60):
        """The next n completions or errors, in arrival order."""
        out = []
        while len(out) < n:
            r = self.got.get(timeout=timeout)
            if r is None or isinstance(r, grpc.RpcError):
                raise AssertionError(f"stream ended after {out}: {r}")
            out += list(r.completions) + list(r.errors)
        return out

    def ended(self, timeout=30):
        r = self.got.get(timeout=timeout)
        return r is None


def gen_req(rid, max_tokens, n=1, seed=1, **kw):
    return pb.GenerateRequest(id=rid, n=n, messages=[pb.Message(role="user", content="Bo has 3 eggs.")],
                              sampling=pb.Sampling(max_tokens=max_tokens, seed=seed, temperature=1.0,
                                                   **kw))


def test_info_health_tokenize(served):
    stub, service, spy = served
    info = stub.Info(pb.InfoRequest(protocol_version=1))
    health = stub.Health(pb.HealthRequest())
    assert info.protocol_version == health.protocol_version == 1
    assert info.instance == health.instance != ""
    assert health.status == pb.HealthResponse.SERVING
    assert info.info.architecture == "Qwen3ForCausalLM"
    assert info.info.vocab_size == spy.cfg.vocab_size
    assert info.info.max_seq_len == spy.gen.L
    assert "<|im_start|>" in info.info.chat_template
    assert set(info.info.capabilities) >= {"generate", "score", "train"}
    with pytest.raises(grpc.RpcError) as e:
        stub.Info(pb.InfoRequest(protocol_version=2))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    texts = ["Ann has 12 pens.", ""]
    got = stub.Tokenize(pb.TokenizeRequest(texts=texts))
    assert [list(t.ids) for t in got.tokens] == spy.tokenize(texts)


def test_early_finishers_come_back_first(served):
    """A long request does not hold back short ones sent after it: they join the running batch
    and stream back as soon as they are done."""
    stub, _, _ = served
    s = Stream(stub)
    s.send(gen_req("long", 300))
    s.send(gen_req("short1", 3), gen_req("short2", 6))
    first = s.events(2)
    assert {c.request_id for c in first} == {"short1", "short2"}
    s.send(gen_req("short3", 4))  # sent while "long" is still running
    nxt = s.events(1)
    assert nxt[0].request_id == "short3"
    last = s.events(1)[0]
    assert last.request_id == "long" and len(last.tokens) == 300 and last.finish_reason == "length"
    s.close()
    assert s.ended()


def test_stream_equals_the_engine(served):
    stub, _, spy = served
    s = Stream(stub)
    s.send(gen_req("same", 12, n=3, seed=42))
    got = sorted(s.events(3), key=lambda c: c.index)
    s.close()
    want = spy.generate([GenerateRequest(id="direct", messages=[{"role": "user", "content": "Bo has 3 eggs."}],
                                         n=3, sampling=Sampling(max_tokens=12, seed=42))])
    for g, w in zip(got, want):
        assert list(g.tokens) == w.tokens and list(g.prompt_tokens) == w.prompt_tokens
        assert g.text == w.text and g.finish_reason == w.finish_reason
        assert list(g.logprobs) == pytest.approx(w.logprobs, abs=1e-6)


def test_resent_id_is_answered_from_memory(served):
    stub, _, spy = served
    s = Stream(stub)
    s.send(gen_req("once", 8, n=2, seed=5))
    first = sorted(s.events(2), key=lambda c: c.index)
    s.close()
    assert s.ended()
    # Another stream (a reconnected client) resends the same request: same answer, not sampled.
    before = spy.submitted.count("once")
    s2 = Stream(stub)
    s2.send(gen_req("once", 8, n=2, seed=5))
    again = sorted(s2.events(2), key=lambda c: c.index)
    assert again == first
    assert spy.submitted.count("once") == before == 1
    # The same id for a different request is a client bug.
    s2.send(gen_req("once", 9, n=2, seed=5))
    err = s2.events(1)[0]
    assert isinstance(err, pb.RequestError) and err.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    s2.close()


def test_bad_request_fails_alone(served):
    stub, _, _ = served
    s = Stream(stub)
    bad = pb.GenerateRequest(id="bad", prompt_tokens=[1, 2], messages=[pb.Message(role="user", content="x")])
    s.send(bad, gen_req("good", 4))
    events = s.events(2)
    err = next(e for e in events if isinstance(e, pb.RequestError))
    assert err.request_id == "bad" and err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "exactly one" in err.message
    assert any(isinstance(e, pb.Completion) and e.request_id == "good" for e in events)
    s.close()


def test_cancel_stops_a_request(served):
    stub, _, spy = served
    s = Stream(stub)
    s.send(gen_req("cancelled", 400))
    s.send(gen_req("kept", 3))
    assert s.events(1)[0].request_id == "kept"
    s.send(cancel=["cancelled"])
    s.close()
    # Nothing more comes for the cancelled request and the stream ends with nothing pending.
    assert s.ended()
    for _ in range(100):
        if not spy.gen.busy():
            break
        threading.Event().wait(0.05)
    assert not spy.gen.busy(), "the cancelled request still occupies the engine"


def batch_pb(bid, spy):
    prompt = spy.tokenize(["Ann has 3 pens."])[0]
    response = spy.tokenize([" 5 pens"])[0]
    n = len(response)
    return pb.Batch(id=bid, samples=[pb.Sample(prompt=prompt, response=response, loss_mask=[1.0] * n,
                                               old_logprobs=[-6.0] * n, advantages=[1.0] * n)],
                    loss=pb.LossConfig(lr=1e-2, eps_clip=0.2))


def score(stub, spy):
    b = batch_pb("x", spy).samples[0]
    r = stub.Score(pb.ScoreBatchRequest(requests=[pb.ScoreRequest(prompt_tokens=b.prompt, tokens=b.response)]))
    return list(r.scores[0].logprobs)


def test_train_step_id_applies_once(served, tmp_path):
    stub, _, spy = served
    stub.Save(pb.SaveRequest(dir=str(tmp_path / "before")))
    start = score(stub, spy)
    b = batch_pb("step-1", spy)
    # Two concurrent sends of one step (a retry racing the original): applied once.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        r1, r2 = pool.map(lambda _: stub.Train(pb.TrainRequest(batch=b)), range(2))
    assert sorted([r1.duplicate, r2.duplicate]) == [False, True]
    assert r1.stats == r2.stats and r1.stats.tokens == len(b.samples[0].response)
    after = score(stub, spy)
    assert after != start
    r3 = stub.Train(pb.TrainRequest(batch=b))
    assert r3.duplicate and r3.stats == r1.stats
    assert score(stub, spy) == after
    # Score over gRPC is the engine's Score.
    direct = ScoreRequest(tokens=list(b.samples[0].response), prompt_tokens=list(b.samples[0].prompt))
    assert after == pytest.approx(spy.score([direct])[0], abs=1e-6)
    # Load goes back in time and forgets step ids: the same step applies again.
    stub.Load(pb.LoadRequest(dir=str(tmp_path / "before")))
    assert score(stub, spy) == pytest.approx(start, abs=1e-6)
    r4 = stub.Train(pb.TrainRequest(batch=b))
    assert not r4.duplicate
    assert score(stub, spy) == pytest.approx(after, abs=1e-5)


def test_bad_train_request_is_an_error(served):
    stub, _, _ = served
    bad = pb.Batch(id="bad", samples=[pb.Sample(prompt=[1], response=[2, 3], loss_mask=[1.0])])
    with pytest.raises(grpc.RpcError) as e:
        stub.Train(pb.TrainRequest(batch=bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "loss_mask" in e.value.details()


def test_values_over_grpc(served):
    stub, _, spy = served
    prompt, tokens = spy.tokenize(["Ann has 3 pens."])[0], spy.tokenize([" 5"])[0]
    r = stub.Values(pb.ScoreBatchRequest(requests=[pb.ScoreRequest(prompt_tokens=prompt, tokens=tokens)]))
    want = spy.values([ScoreRequest(tokens=tokens, prompt_tokens=prompt)])[0]
    assert list(r.values[0].logprobs) == pytest.approx(want) and len(want) == len(tokens)


def test_bearer_token(served):
    _, _, spy = served
    server, service, port = make_server("127.0.0.1:0", token="s3cret")
    service.engine, service.loading = spy, False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            for md in (None, [("authorization", "Bearer wrong")]):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Health(pb.HealthRequest(), metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            s = Stream(stub)
            s.send(gen_req("t", 2))
            r = s.got.get(timeout=30)
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = [("authorization", "Bearer s3cret")]
            assert stub.Health(pb.HealthRequest(), metadata=ok).status == pb.HealthResponse.SERVING
            s = Stream(stub, metadata=ok)
            s.send(gen_req("t", 2))
            assert s.events(1)[0].request_id == "t"
            s.close()
    finally:
        server.stop(0).wait()


def test_loading_server_is_not_serving():
    server, service, port = make_server("127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(pb.InfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0).wait()


def instance_header(call):
    return dict(call.initial_metadata() or ()).get("slimen-instance")


def stream_header(stub, timeout=10):
    """Opens a Generate stream that sends nothing and reads its header: it must come at once.
    Returns (instance header, close function)."""
    out: queue.Queue = queue.Queue()
    call = stub.Generate(iter(out.get, None))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(call.initial_metadata)
        try:
            md = fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            call.cancel()
            raise AssertionError("the Generate stream sent no header before any completion")
    out.put(None)  # close the sending side: the stream ends, nothing was asked
    assert list(call) == []
    return dict(md).get("slimen-instance")


def test_answers_name_the_instance(served):
    """As the Go server: every answer's header names the server process (the instance of Health
    and Info), errors included, and a Generate stream's header comes before anything is sent, so
    that a client notices a restarted engine without a Health call."""
    stub, service, spy = served
    inst = service.instance
    h, call = stub.Health.with_call(pb.HealthRequest())
    assert instance_header(call) == h.instance == inst != ""
    info, call = stub.Info.with_call(pb.InfoRequest(protocol_version=1))
    assert instance_header(call) == info.instance == inst
    _, call = stub.Tokenize.with_call(pb.TokenizeRequest(texts=["Ann"]))
    assert instance_header(call) == inst
    with pytest.raises(grpc.RpcError) as e:
        stub.Info(pb.InfoRequest(protocol_version=2))
    assert instance_header(e.value) == inst
    assert stream_header(stub) == inst
    # A stream that is used gets the same header, then its completions.
    s = Stream(stub)
    assert instance_header(s.call) == inst
    s.send(gen_req("named", 2))
    assert s.events(1)[0].request_id == "named"
    s.close()
    # One process keeps its id across calls; another process (a restarted engine) has another.
    server2, service2, port2 = make_server("127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port2}") as ch:
            stub2 = pb_grpc.EngineStub(ch)
            # While loading it names itself in Health; the stream is not up yet (UNAVAILABLE).
            h2, call = stub2.Health.with_call(pb.HealthRequest())
            assert h2.status == pb.HealthResponse.NOT_SERVING
            other = instance_header(call)
            assert other == h2.instance == service2.instance and other != inst
            service2.engine, service2.loading = spy, False
            assert stream_header(stub2) == other
            _, call = stub2.Health.with_call(pb.HealthRequest())
            assert instance_header(call) == other
    finally:
        server2.stop(0).wait()
    _, call = stub.Health.with_call(pb.HealthRequest())
    assert instance_header(call) == inst


# ---- Save and Load stay inside the root; the network needs a token ----

class Folders:
    """The engine, recording the folders that reach its save and load."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def save(self, d):
        self.calls.append(("save", d))
        return self.engine.save(d)

    def load(self, d):
        self.calls.append(("load", d))
        return self.engine.load(d)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_save_and_load_stay_inside_the_root(noeos_dir, tmp_path):
    """Hostile folders (parent references, absolute paths elsewhere, symbolic links out of the
    root, one that points nowhere outside it, a load of a real model folder outside) are refused
    before they reach the engine, with an error naming the root; folders inside reach it with
    their links resolved."""
    spy = Engine(str(noeos_dir))
    base = pathlib.Path(os.path.realpath(tmp_path))
    root, outside = base / "root", base / "outside"
    root.mkdir()
    spy.save(str(outside / "model"))  # a real model folder a load must not reach
    before = sorted(p.name for p in outside.iterdir())
    (root / "escape").symlink_to(outside)
    (root / "dangling").symlink_to(base / "nowhere")
    (root / "later").symlink_to("made")  # points nowhere yet, inside the root
    (base / "alias").symlink_to(root)  # the server is given its root through a link
    eng = Folders(spy)
    server, service, port = make_server("127.0.0.1:0", roots=[str(base / "alias")])
    service.engine, service.loading = eng, False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)

            def call(what, d):
                if what == "save":
                    return stub.Save(pb.SaveRequest(dir=d))
                return stub.Load(pb.LoadRequest(dir=d))

            for d in ["../outside/model", str(outside / "model"), "/etc", "/", "escape",
                      "escape/model", "escape/new", "dangling", "dangling/x",
                      "ckpt/../../outside/model", str(root / ".." / "outside" / "model")]:
                for what in ("save", "load"):
                    with pytest.raises(grpc.RpcError) as e:
                        call(what, d)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (what, d)
                    assert f"outside this server's root {root}:" in e.value.details(), (what, d)
            for what in ("save", "load"):
                with pytest.raises(grpc.RpcError) as e:
                    call(what, "")
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(root) in e.value.details()
            assert eng.calls == []
            assert sorted(p.name for p in outside.iterdir()) == before
            assert not os.path.lexists(base / "nowhere")

            # Inside: relative to the root, and absolute through the link it was given as.
            call("save", "ckpt/step_1")
            call("load", str(base / "alias" / "ckpt" / "x" / ".." / "step_1"))
            call("save", "later/x")
            assert (root / "ckpt" / "step_1" / "config.json").exists()
            want = str(root / "ckpt" / "step_1")
            assert eng.calls == [("save", want), ("load", want), ("save", str(root / "made" / "x"))]
    finally:
        server.stop(0).wait()
        spy.close()


def test_roots(tmp_path, monkeypatch):
    base = os.path.realpath(tmp_path)
    r = Roots([os.path.join(base, "run"), os.path.join(base, "models")])  # need not exist yet
    assert r.resolve("save", "checkpoints/step_1") == os.path.join(base, "run", "checkpoints", "step_1")
    assert r.resolve("save", os.path.join(base, "models", "m")) == os.path.join(base, "models", "m")
    with pytest.raises(Exception, match=f"outside this server's roots {base}/run, {base}/models"):
        r.resolve("load", base)
    with pytest.raises(ValueError, match="is a file"):
        (tmp_path / "f").write_text("x")
        Roots([str(tmp_path / "f")])
    # The default is the working directory, but not the file system's root.
    monkeypatch.chdir(tmp_path)
    assert Roots().dirs == [base]
    monkeypatch.chdir("/")
    with pytest.raises(ValueError, match="--root DIR"):
        Roots()
    assert Roots(["/"]).dirs == ["/"]


def test_off_loopback_needs_a_token():
    for host in ("127.0.0.1", "127.3.2.1", "[::1]", "::1", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "", "10.0.0.5", "gpu-node", "[::]"):
        assert not is_loopback(host), host
    for listen in ("0.0.0.0:0", "[::]:0"):
        with pytest.raises(ValueError, match=r"must authenticate its clients.*--token-env VAR"):
            make_server(listen)
    server, _, port = make_server("0.0.0.0:0", token="s3cret")
    try:
        assert port > 0
    finally:
        server.stop(0).wait()


def test_batch_of_carries_the_off_policy_fields():
    from slimen_torch.server import batch_of
    b = batch_of(pb.Batch(id="x", samples=[pb.Sample(prompt=[1], response=[2, 3], loss_mask=[1, 1],
                                                     old_logprobs=[-1, -2], advantages=[1, 1],
                                                     train_logprobs=[-0.5, -1.5])],
                          loss=pb.LossConfig(use_tis=True, tis_mode="icepop", tis_clip=1.5,
                                             tis_clip_low=0.5)))
    assert b.samples[0].train_logprobs == [-0.5, -1.5]
    lc = b.loss
    assert (lc.use_tis, lc.tis_mode, lc.tis_clip, lc.tis_clip_low) == (True, "icepop", 1.5, 0.5)


def test_save_probe_writes_nothing(noeos_dir, tmp_path):
    """The host's start-up question (engines/remote CheckSaveFolder: a Save of an adapter no
    server holds) is refused for a folder outside the root with PERMISSION_DENIED, and inside it
    with NOT_FOUND for the adapter; neither writes anything."""
    eng = Engine(str(noeos_dir))
    root = pathlib.Path(os.path.realpath(tmp_path)) / "root"
    root.mkdir()
    server, service, port = make_server("127.0.0.1:0", roots=[str(root)])
    service.engine, service.loading = eng, False
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            probe = "/slimen-save-probe"
            with pytest.raises(grpc.RpcError) as e:
                stub.Save(pb.SaveRequest(dir=str(tmp_path / "elsewhere" / "checkpoints"), adapter=probe))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"outside this server's root {root}" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.Save(pb.SaveRequest(dir=str(root / "run" / "checkpoints"), adapter=probe))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
            assert list(root.iterdir()) == [] and not (tmp_path / "elsewhere").exists()
    finally:
        server.stop(0).wait()
        eng.close()
