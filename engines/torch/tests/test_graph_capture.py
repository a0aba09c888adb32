"""The CUDA graphs of decode steps and prefills are captured without emptying the allocator's
cache (decode.capture): torch.cuda.graph's empty_cache handed every cached block back to the
driver at each capture mid-run, and the next training call took its memory again from cudaMalloc.
The CUDA calls are faked, so the capture paths run on the CPU."""

import contextlib

import torch

from slimen_torch.decode import Decode
from slimen_torch.prefill import Prefill


class FakeGraph:
    def __init__(self):
        self.calls = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(("begin", pool, capture_error_mode))

    def capture_end(self):
        self.calls.append(("end",))


class FakeStream:
    def wait_stream(self, other):
        pass


def fake_cuda(monkeypatch) -> list:
    """Replaces the CUDA calls a capture makes; returns the list of what happened."""
    seen = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: seen.append("empty_cache"))
    return seen


class Gen:
    """What the capture paths use of a Generator: the step it captures and the graphs' pool."""

    def __init__(self, seen):
        self.seen, self.pool = seen, object()
        self.tok, self.pos, self.step_idx = (torch.zeros(2, dtype=torch.long) for _ in range(3))

    def _graph_pool(self):
        return self.pool

    def _decode(self, B, L, use_top_p, grouped):
        self.seen.append(("decode", B, L))

    def _prefill_static(self, Tb):
        self.seen.append(("prefill", Tb))


def test_decode_and_prefill_graphs_keep_the_cache(monkeypatch):
    seen = fake_cuda(monkeypatch)
    gen = Gen(seen)
    g = Decode._capture(gen, 4, 64, False, False)
    assert "empty_cache" not in seen
    # the warm-up step, then the captured one, into the generator's pool
    assert [s for s in seen if isinstance(s, tuple)] == [("decode", 4, 64)] * 2
    assert g.calls == [("begin", gen.pool, "thread_local"), ("end",)]
    seen.clear()
    g = Prefill._capture_prefill(gen, 128)
    assert "empty_cache" not in seen
    assert [s for s in seen if isinstance(s, tuple)] == [("prefill", 128)] * 2
    assert g.calls == [("begin", gen.pool, "thread_local"), ("end",)]


def test_a_failed_capture_ends_it(monkeypatch):
    seen = fake_cuda(monkeypatch)
    gen = Gen(seen)
    from slimen_torch.decode import capture
    g = FakeGraph()
    try:
        with capture(g, gen.pool):
            raise RuntimeError("the step failed")
    except RuntimeError:
        pass
    assert g.calls[-1] == ("end",)


def test_every_capture_runs_on_one_stream(monkeypatch):
    """The captures share torch.cuda.graph's capture stream: the allocator reuses a graph pool's
    blocks only on the stream they were taken on."""
    fake_cuda(monkeypatch)
    from slimen_torch.decode import capture
    streams = []
    monkeypatch.setattr(torch.cuda, "stream",
                        lambda s: streams.append(s) or contextlib.nullcontext())
    for _ in range(3):
        with capture(FakeGraph(), object()):
            pass
    assert len(streams) == 3 and all(s is streams[0] for s in streams)
    assert torch.cuda.graph.default_capture_stream is streams[0]

