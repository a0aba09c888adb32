"""Generation on the CPU: seeded determinism, independence from batching, sampling settings, and
log-probs that equal the forward pass."""

import concurrent.futures

import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.types import GenerateRequest, Sampling, ScoreRequest

USER = [{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many pens?"}]


def req(rid, seed=1, n=1, **kw):
    kw.setdefault("max_tokens", 24)
    return GenerateRequest(id=rid, messages=USER, n=n, sampling=Sampling(seed=seed, **kw))


def tokens_of(cs):
    return [c.tokens for c in cs]


def test_same_seed_same_samples(engine):
    a = engine.generate([req("a", seed=3, n=4)])
    b = engine.generate([req("b", seed=3, n=4)])
    assert tokens_of(a) == tokens_of(b)
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    # The n samples of one request differ from each other, and another seed gives others.
    assert len({tuple(t) for t in tokens_of(a)}) > 1
    assert tokens_of(engine.generate([req("c", seed=4, n=4)])) != tokens_of(a)


def test_samples_do_not_depend_on_the_batch(engine):
    alone = engine.generate([req("x", seed=9, n=2)])
    crowd = engine.generate([req("y", seed=2, n=3, max_tokens=5), req("x2", seed=9, n=2),
                             GenerateRequest(id="z", prompt_tokens=[3, 4], n=5,
                                             sampling=Sampling(seed=1, max_tokens=40))])
    assert tokens_of(alone) == tokens_of(crowd[3:5])


def test_greedy_and_top_p(engine):
    g = engine.generate([req("g", temperature=0.0, seed=1), req("g2", temperature=0.0, seed=2)])
    assert g[0].tokens == g[1].tokens  # greedy ignores the seed
    # A nucleus smaller than the top token's mass keeps only the top token: greedy again.
    p = engine.generate([req("p", temperature=1.0, top_p=1e-6, seed=5)])
    assert p[0].tokens == g[0].tokens
    # Greedy picks the arg-max of the forward pass at every step.
    prompt = g[0].prompt_tokens
    seq = torch.tensor([prompt + g[0].tokens])
    with torch.no_grad():
        logits = engine.model.logits(engine.model(seq))[0]
    argmax = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert argmax == g[0].tokens


def test_logprobs_equal_the_forward_pass(engine):
    c = engine.generate([req("lp", seed=11, temperature=0.7, max_tokens=16)])[0]
    seq = torch.tensor([c.prompt_tokens + c.tokens])
    with torch.no_grad():
        lsm = torch.log_softmax(engine.model.logits(engine.model(seq))[0].float(), -1)
    want = lsm[len(c.prompt_tokens) - 1:-1].gather(1, torch.tensor(c.tokens)[:, None])[:, 0]
    # Sampled at temperature 0.7, reported under the temperature-1 distribution.
    assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-5)
    scores = engine.score([ScoreRequest(tokens=c.tokens, messages=USER),
                           ScoreRequest(tokens=c.tokens[:3], prompt_tokens=c.prompt_tokens),
                           ScoreRequest(tokens=[], prompt_tokens=[1, 2])])
    assert torch.allclose(torch.tensor(scores[0]), want, atol=1e-5)
    assert torch.allclose(torch.tensor(scores[1]), want[:3], atol=1e-5)
    assert scores[2] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_are_captured_again_after_all_were_dropped(model_dirs):
    """After every captured graph is dropped (the Triton kernels' fallback drops the decode
    graphs), the next generation captures new ones and samples what it sampled before. Reopening
    the memory pool of destroyed graphs failed in PyTorch's allocator ("use_count > 0")."""
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cuda:0", dtype="bfloat16"))
    try:
        a = e.generate([req("a", seed=3, n=4)])
        assert e.gen.graphs
        e.gen.graphs.clear()
        e.gen.pf_graphs.clear()
        b = e.generate([req("b", seed=3, n=4)])
        assert e.gen.graphs and tokens_of(b) == tokens_of(a)
    finally:
        e.close()


def test_length_and_stop_strings(noeos_dir):
    from slimen_torch.engine import Engine, Options
    e = Engine(str(noeos_dir))
    try:
        c = e.generate([req("len", seed=1, max_tokens=9)])[0]
        assert len(c.tokens) == 9 and c.finish_reason == "length"
        assert c.text == e.tokenizer.decode(c.tokens)
        # Stop at a piece of text the unconstrained sample contains.
        long = e.generate([req("long", seed=1, max_tokens=40)])[0]
        stop = long.text[10:12]
        assert stop and stop not in long.text[:10]
        s = e.generate([req("stop", seed=1, max_tokens=40, stop=[stop])])[0]
        assert s.finish_reason == "stop"
        assert s.text == long.text[:long.text.index(stop)]
        assert s.tokens == long.tokens[:len(s.tokens)] and len(s.tokens) < 40
    finally:
        e.close()


def test_eos_ends_a_response(engine):
    # Many samples of a random model: some end with the end-of-sequence token, which is kept in
    # the tokens and left out of the text.
    cs = engine.generate([req("eos", seed=1, n=64, max_tokens=48)])
    ended = [c for c in cs if c.finish_reason == "stop"]
    assert ended, "no sample ended with EOS"
    for c in ended:
        assert c.tokens[-1] in engine.eos
        assert c.text == engine.tokenizer.decode(c.tokens[:-1])
    for c in cs:
        assert len(c.tokens) == len(c.logprobs) <= 48


def test_a_token_outside_the_vocabulary_is_logged(engine, caplog):
    # On a GPU the next step's embedding of such a token is a device-side assertion that names
    # no sample (the 2048-row exam swarm's): the host logs the sample that drew it first, once.
    from slimen_torch.generate import Generator
    from slimen_torch.sequence import Request
    g = Generator(engine.model, engine.tokenizer, engine.eos, slots=2, max_len=64,
                  cuda_graphs=False, compile_layers=False, prefill_tokens=512)
    g.add(Request("oov", [1, 2, 3], 1, Sampling(max_tokens=4), lambda c: None))
    g._admit()
    s = g.slots[0]
    V = engine.cfg.vocab_size
    with caplog.at_level("ERROR", logger="slimen_torch"):
        g._append(s, V + 3, 0.0)
        g._append(s, V + 4, 0.0)
    lines = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert lines == [f"sample 0 of request 'oov' (row 0) drew token {V + 3}, outside the "
                     f"vocabulary of {V}, at response position 1"]


def test_bad_requests_are_refused(engine):
    import pytest

    from slimen_torch.types import RequestError
    with pytest.raises(RequestError, match="exactly one"):
        engine.submit(GenerateRequest(id="b"), print)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.submit(GenerateRequest(id="b", prompt_tokens=[10**6]), print)
    with pytest.raises(RequestError, match="no room"):
        engine.submit(GenerateRequest(id="b", prompt_tokens=[1] * engine.gen.L), print)
    # Sampling settings have no defaults in the engine: the host sets them from the run's config.
    with pytest.raises(RequestError, match="max_tokens = 0"):
        engine.submit(GenerateRequest(id="b", messages=USER, sampling=Sampling(max_tokens=0)), print)
    with pytest.raises(RequestError, match="temperature nan"):
        engine.submit(req("b", temperature=float("nan")), print)
    with pytest.raises(RequestError, match="top_p 1.5"):
        engine.submit(req("b", top_p=1.5), print)


def test_a_dead_engine_thread_fails_every_call(model_dirs, monkeypatch):
    """Should the engine's thread stop (here its start raises, as binding a GPU named without an
    index once did), calls fail with the reason at once instead of waiting forever."""
    import slimen_torch.engine as engine_mod

    def broken(device):
        raise ValueError("no such device")
    monkeypatch.setattr(engine_mod, "bind_thread", broken)
    e = Engine(str(model_dirs["tiny"]))
    try:
        e._thread.join(timeout=30)
        for call in (lambda: e.generate([GenerateRequest(id="a", prompt_tokens=[1, 2],
                                                         sampling=Sampling(max_tokens=4))],
                                        timeout=30),
                     lambda: e.score([ScoreRequest(tokens=[3], prompt_tokens=[1, 2])])):
            with pytest.raises(RuntimeError, match="engine's thread stopped: ValueError: no such"):
                call()
    finally:
        e.close()


def _fault(*_a, **_k):
    raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_a_device_fault_ends_the_worker(model_dirs, monkeypatch):
    """A CUDA error in the decode step (the device runs nothing more in this process) goes to
    on_fault, which `serve` makes end the process so that the host starts a new worker and
    resends the calls; and when freeing the failed rows raises too (the same sticky error),
    the waiting call still fails with the reason instead of waiting forever."""
    e = Engine(str(model_dirs["tiny"]))
    faults = []
    try:
        e.on_fault = faults.append
        monkeypatch.setattr(e.gen, "step", _fault)
        monkeypatch.setattr(e.gen, "_free", _fault)
        with pytest.raises(RuntimeError, match="thread stopped: AcceleratorError: CUDA error"):
            e.generate([req("a")], timeout=30)
        assert faults == ["AcceleratorError: CUDA error: device-side assert triggered"]
        with pytest.raises(RuntimeError, match="thread stopped"):
            e.score([ScoreRequest(tokens=[3], prompt_tokens=[1, 2])])
    finally:
        e.close()


def test_a_device_fault_in_a_call_fails_it_and_the_engine(model_dirs):
    """A call that meets a CUDA error gets it (no on_fault: an engine not served), and the
    engine stops: every later call fails with the reason."""
    e = Engine(str(model_dirs["tiny"]))
    try:
        assert e.score([ScoreRequest(tokens=[3], prompt_tokens=[1, 2])])
        with pytest.raises(torch.AcceleratorError, match="CUDA error"):
            e._call(_fault)
        e._thread.join(timeout=30)
        assert not e._thread.is_alive()
        with pytest.raises(RuntimeError, match="thread stopped: AcceleratorError"):
            e.generate([req("b")], timeout=30)
    finally:
        e.close()


def test_a_call_stopped_by_a_device_fault_is_answered_after_on_fault(model_dirs):
    """The call that met the fault is answered only after on_fault has run (served, the process
    has ended by then and the host resends it); an on_fault that returns does not leave it
    waiting."""
    e = Engine(str(model_dirs["tiny"]))
    seen = []
    try:
        e.on_fault = lambda why: seen.append((why, fut.done()))
        fut = concurrent.futures.Future()
        with e._cv:
            e._tasks.append((_fault, fut))
            e._cv.notify()
        with pytest.raises(torch.AcceleratorError, match="CUDA error"):
            fut.result(timeout=30)
        assert seen == [("AcceleratorError: CUDA error: device-side assert triggered", False)]
    finally:
        e.close()


def test_an_ordinary_error_in_a_call_leaves_the_engine_serving(model_dirs):
    """Only the device's failure stops the engine: a call's own error goes to its caller."""
    e = Engine(str(model_dirs["tiny"]))
    try:
        with pytest.raises(ValueError, match="bad"):
            e._call(lambda: (_ for _ in ()).throw(ValueError("bad")))
        assert e.generate([req("c")], timeout=30)
    finally:
        e.close()


def test_a_served_worker_exits_on_a_device_fault(model_dirs):
    """The served engine's on_fault (server._device_fault_exit) ends the process at once with
    DEVICE_FAULT_EXIT, for the host's supervisor to start a new worker; the call in flight gets
    no error (the host resends it to the new worker)."""
    import subprocess
    import sys

    from slimen_torch import server
    code = f"""
import torch
from slimen_torch import server
from slimen_torch.engine import Engine
from slimen_torch.types import GenerateRequest, Sampling
e = Engine({str(model_dirs["tiny"])!r})
e.on_fault = server._device_fault_exit
def fault():
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
e.gen.step = fault
try:
    e.generate([GenerateRequest(id="a", prompt_tokens=[1, 2], sampling=Sampling(max_tokens=4))],
               timeout=60)
except BaseException as err:
    print("the call failed:", err)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == server.DEVICE_FAULT_EXIT, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "the call failed" not in p.stdout
    assert "the device failed (AcceleratorError: CUDA error: an illegal memory" in p.stderr
