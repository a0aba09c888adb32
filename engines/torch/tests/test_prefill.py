"""The bucketed prefill (one prompt padded to a multiple of 64 tokens, on a GPU replayed from a
CUDA graph per bucket; on the CPU the same code runs directly) against the eager prefill: the
same logits, the same keys and values in the cache row, the same generated tokens, and the
fallback to the eager path for long prompts and on failure."""

import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def bucketed(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]),
               Options(device="cpu", slots=6, max_seq_len=512, prefill_graph_max=128))
    yield e
    e.close()


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-qwen2"])
def test_logits_and_cache_equal_the_eager_prefill(shape, model_dirs, bucketed):
    e = bucketed if shape == "tiny-qwen3" else Engine(
        str(model_dirs[shape]), Options(device="cpu", slots=4, max_seq_len=256,
                                        prefill_graph_max=128))
    gen = e.gen
    g = torch.Generator().manual_seed(3)

    def run():
        gen._ensure_cache()
        out = []
        for T in (5, 64, 70, 128):  # buckets 64, 64, 128, 128
            prompt = torch.randint(0, e.cfg.vocab_size, (T,), generator=g).tolist()
            # Stale cache contents must not matter: fill both rows with noise first.
            for kc, vc in zip(gen.k, gen.v):
                kc[1:3].normal_()
                vc[1:3].normal_()
            got = gen._prefill_bucketed(prompt, 1).clone()
            want = gen._prefill_eager([prompt], torch.tensor([0]), torch.tensor([2]))
            kv = [(kc[1, :, :T].clone(), kc[2, :, :T].clone(), vc[1, :, :T].clone(),
                   vc[2, :, :T].clone()) for kc, vc in zip(gen.k, gen.v)]
            out.append((T, got, want, kv))
        # Longer than prefill_graph_max: not this path.
        assert gen._prefill_bucketed([1] * 129, 1) is None
        return out

    try:
        for T, got, want, kv in e._call(run):
            assert got.shape == want.shape == (1, e.cfg.vocab_size)
            assert rel(got, want) <= 1e-5, T
            assert got.argmax() == want.argmax()
            for k1, k2, v1, v2 in kv:
                assert rel(k1, k2) <= 1e-5 and rel(v1, v2) <= 1e-5, T
        assert gen.prefill_error == ""
    finally:
        if e is not bucketed:
            e.close()


def requests(vocab):
    user = [{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many pens?"}]
    long = torch.randint(0, vocab, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    return [
        GenerateRequest(id="one", messages=user, sampling=Sampling(seed=5, max_tokens=6)),
        # n samples of one prompt: the graph writes one row, the others are copies of it.
        GenerateRequest(id="three", messages=user, n=3,
                        sampling=Sampling(seed=6, max_tokens=5, temperature=0.8)),
        GenerateRequest(id="greedy", prompt_tokens=long[:70], n=1,
                        sampling=Sampling(seed=1, max_tokens=4, temperature=0.0)),
        GenerateRequest(id="top-p", prompt_tokens=long[:9], n=2,
                        sampling=Sampling(seed=2, max_tokens=4, top_p=0.7)),
        # Longer than prefill_graph_max (128): the eager prefill.
        GenerateRequest(id="long", prompt_tokens=long, n=2, sampling=Sampling(seed=3, max_tokens=4)),
    ]


def test_generation_equals_the_eager_prefill(engine, bucketed):
    reqs = requests(engine.cfg.vocab_size)
    # One request at a time (each prompt prefilled alone: the bucketed path), then together
    # (admitted together: the eager batched prefill). A top-p row in a batch changes how the
    # other rows draw (the PyTorch sampler then sorts every row), so top-p is tested alone.
    gen, calls = bucketed.gen, []
    static = gen._prefill_static
    gen._prefill_static = lambda Tb: calls.append(Tb) or static(Tb)
    try:
        alone = [c for r in reqs for c in bucketed.generate([r])]
    finally:
        del gen._prefill_static
    assert calls == [64, 64, 128, 64]  # "long" (150 tokens) was prefilled eagerly
    want = [c for r in reqs for c in engine.generate([r])]
    mixed = [r for r in reqs if r.sampling.top_p == 1]
    assert len(mixed) == 4
    together = bucketed.generate(mixed)
    want_together = engine.generate(mixed)
    assert bucketed.gen.prefill_error == "" and bucketed.gen.prefill_graph_max == 128
    for got, ref in ((alone, want), (together, want_together)):
        assert [c.tokens for c in got] == [c.tokens for c in ref]
        for x, y in zip(got, ref):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def test_failure_falls_back_to_the_eager_prefill(model_dirs, engine):
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", prefill_graph_max=128))
    try:
        def broken(*a, **kw):
            raise RuntimeError("no kernel for this")

        e.gen._prefill_static = broken
        r = requests(e.cfg.vocab_size)[1]
        got = e.generate([r])
        assert [c.tokens for c in got] == [c.tokens for c in engine.generate([r])]
        assert "no kernel for this" in e.gen.prefill_error and e.gen.prefill_graph_max == 0
    finally:
        e.close()


def test_a_compiled_prefill_layer_and_its_fallback(model_dirs, engine):
    """With --compile-prefill (on a GPU) the generator's prefill layer is a compiled copy of
    block_forward. Traced by Dynamo with dynamic shapes (here with the eager backend, which runs
    the traced operations as they are) it generates what the eager layer generates, through the
    bucketed and the batched prefill; a prefill layer that fails falls back to the eager layer,
    keeping the bucketed path."""
    from slimen_torch.model import block_forward

    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", prefill_graph_max=128,
                                                      compile_prefill=True))
    try:
        gen = e.gen
        assert gen.prefill_fn is block_forward  # --compile-prefill compiles on a GPU only
        gen.prefill_fn = torch.compile(block_forward, dynamic=True, backend="eager")
        reqs = [r for r in requests(e.cfg.vocab_size) if r.sampling.top_p == 1]
        for got, want in (([c for r in reqs for c in e.generate([r])],
                           [c for r in reqs for c in engine.generate([r])]),
                          (e.generate(reqs), engine.generate(reqs))):
            assert [c.tokens for c in got] == [c.tokens for c in want]
            for x, y in zip(got, want):
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs),
                                      atol=1e-5)
        assert gen.compile_error == "" and gen.prefill_fn is not block_forward

        def broken(*a, **kw):
            raise RuntimeError("inductor says no")

        gen.prefill_fn = broken
        alone, together = e.generate(reqs[:1]), e.generate(reqs[1:3])
        assert [c.tokens for c in alone + together] == \
            [c.tokens for c in engine.generate(reqs[:1]) + engine.generate(reqs[1:3])]
        assert "inductor says no" in gen.compile_error and gen.prefill_fn is block_forward
        assert gen.prefill_graph_max == 128 and gen.prefill_error == ""
        # A training step on the engine's thread, as a worker runs it after generating. (Torch
        # 2.11 on the CPU: after a compiled call from a thread that then ends without a backward
        # pass, the process's next backward pass crashes; a worker's engine thread lives on.)
        r = reqs[2]  # prompt tokens given
        c = e.generate([r])[0]
        st = e.train(Batch(samples=[Sample(r.prompt_tokens, c.tokens, [1.0] * len(c.tokens),
                                           c.logprobs, [1.0] * len(c.tokens))],
                           loss=LossConfig(lr=1e-3)))
        assert not st.skipped
    finally:
        e.close()
