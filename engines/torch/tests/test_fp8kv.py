"""The fp8 KV cache (Options.kv_cache_dtype "fp8", --kv-cache-dtype fp8): the cache tensors are
float8_e4m3fn, every writer saturates at ±448 instead of making NaN, every reader converts back,
and generation's log-probs stay within fp8's rounding of Score's (the forward pass, which never
reads the cache).

The tolerance: e4m3 keeps 3 mantissa bits where bf16 keeps 7, so rounding a key or value to fp8
costs up to 2⁻⁴ of it against bf16's 2⁻⁸: 16× the error. The tests check that ratio (between 4×
and 64×, measured 13–25× on the tiny models) against a generator whose cache is bf16, and
an absolute bound of 0.02 nats (measured ≤ 0.0026 on the tiny models). Without the feature
the error would be fp32 noise (~1e-6), which the lower bound catches."""

import argparse

import pytest
import torch

from slimen_torch import kernels as K
from slimen_torch import server
from slimen_torch.__main__ import main
from slimen_torch.engine import Engine, Options
from slimen_torch.model import (FP8_MAX, apply_rope, kv_bytes, kv_read, kv_store, kv_write,
                                rms_norm)
from slimen_torch.types import GenerateRequest, Sampling, ScoreRequest

F8 = torch.float8_e4m3fn
triton_only = pytest.mark.skipif(not K.available("cpu"),
                                 reason="Triton (interpreter) not available on this machine")
quiet = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def requests(max_tokens=12):
    user = [{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many pens?"}]
    return [GenerateRequest(id="one", messages=user, n=2,
                            sampling=Sampling(seed=5, max_tokens=max_tokens)),
            GenerateRequest(id="greedy", messages=user, n=1,
                            sampling=Sampling(seed=1, max_tokens=max_tokens, temperature=0.0))]


def vs_score(e, completions):
    """The largest |generation log-prob − Score log-prob| over the completions' tokens."""
    worst = 0.0
    for c in completions:
        s = e.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
        worst = max(worst, max(abs(p - q) for p, q in zip(s, c.logprobs)))
    return worst


def test_kv_store_saturates():
    x = torch.tensor([1e4, -1e4, 500.0, 0.1, float("inf")])
    assert torch.isnan(x.to(F8).float()).any()  # why: a plain cast makes NaN of an outlier
    y = kv_store(x, F8)
    assert y.dtype == F8
    assert y.float().tolist()[:3] == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert not torch.isnan(y.float()).any()
    cache = torch.zeros(2, 1, 4, 3, dtype=F8)
    kv_write(cache, (torch.tensor([1]), slice(None), torch.tensor([2])),
             torch.tensor([[[1000.0, -0.3, 2.0]]]))
    got = kv_read(cache, (slice(None), slice(None), slice(None)), torch.float32)
    assert got[1, 0, 2].tolist() == [448.0, -0.3125, 2.0] and got.abs().sum() == 450.3125
    assert kv_store(x, torch.float32) is x  # "auto": untouched


def test_engine_cache_is_fp8_and_close_to_score(noeos_dir):
    """The cache holds float8_e4m3fn (a quarter of fp32's bytes here, half of bf16's on a GPU);
    generation's log-probs differ from Score's by fp8's rounding: ~16× what a bf16 cache costs."""
    e = Engine(str(noeos_dir), Options(device="cpu", kv_cache_dtype="fp8"))
    ref = Engine(str(noeos_dir), Options(device="cpu"))
    try:
        got = e.generate(requests())
        assert all(t.dtype == F8 for t in e.gen.k + e.gen.v)
        nbytes = sum(t.nbytes for t in e.gen.k + e.gen.v)
        ref.generate(requests()[:1])
        assert sum(t.nbytes for t in ref.gen.k + ref.gen.v) == 4 * nbytes
        err8 = vs_score(e, got)
        # The same engine with a bf16 cache (the compute stays fp32).
        e.gen = e.new_generator(e.model)
        e.gen.kv_dtype, e.gen.bank = torch.bfloat16, e.bank
        err16 = vs_score(e, e.generate(requests()))
        assert e.gen.k[0].dtype == torch.bfloat16 and err16 > 0
        assert 4 * err16 < err8 < min(64 * err16, 0.02), (err8, err16)
        assert vs_score(ref, ref.generate(requests())) < 1e-4  # fp32 cache: no rounding
    finally:
        e.close()
        ref.close()


@triton_only
@quiet
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("nsplit", [1, 3])
def test_decode_attention_fp8_cache(rope, nsplit):
    """The Triton kernel over an fp8 cache: stores the new key and value as PyTorch's saturating
    cast does (an outlier → 448, not NaN) and attends over the dequantized cache as the PyTorch
    reference does (fp32 compute)."""
    g = torch.Generator().manual_seed(3 * nsplit + rope)
    B, H, KV, D, L, slots = 2, 4, 2, 16, 300, 3
    kc = torch.randn(slots, KV, L, D, generator=g).to(F8)
    vc = torch.randn(slots, KV, L, D, generator=g).to(F8)
    kc2, vc2 = kc.clone(), vc.clone()
    q = torch.randn(B, H, D, generator=g)
    kn, vn = torch.randn(B, KV, D, generator=g), torch.randn(B, KV, D, generator=g)
    vn[0, 1, 3], vn[1, 0, 0] = 1000.0, -5000.0  # saturate
    pos = torch.tensor([L - 1, 40])
    if rope:
        ang = torch.arange(float(L))[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
        ang = torch.cat((ang, ang), -1)
        qn, knw = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
        o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5, nsplit=nsplit,
                               rope=(qn, knw, ang.cos(), ang.sin(), 1e-6))
        # The new q and key as the kernel computes them from the raw projections.
        c, s_ = ang.cos()[pos], ang.sin()[pos]
        q = apply_rope(rms_norm(q, qn, 1e-6), c, s_)
        kn = apply_rope(rms_norm(kn, knw, 1e-6), c, s_)
    else:
        o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5, nsplit=nsplit)
    want = K.decode_attention_reference(q, kn, vn, kc2, vc2, pos, L, D ** -0.5)
    assert o.dtype == torch.float32 and kc.dtype == F8
    assert not torch.isnan(o).any()
    assert vc[0, 1, L - 1, 3].item() == 448.0 and vc[1, 0, 40, 0].item() == -448.0
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert ((o - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("B", [1, 256])
def test_decode_attention_fp8_cache_in_fp16_on_the_gpu(B):
    """On a GPU the kernel's products over an fp8 cache run in fp16 (the interpreter's in fp32):
    bf16 queries, e4m3 keys and values converted exactly. Batch 1 takes the split launch, batch
    256 the unsplit one (kernels.ATTN_LAUNCH). Against the fp32 reference over the same fp8
    values it stays within bf16's rounding (measured 2.5e-3 on the H200; bf16 products over the
    same cache: 2.8e-3), and the new key and value are stored as PyTorch's saturating cast."""
    g = torch.Generator(device="cuda").manual_seed(B)
    H, KV, D, L = 16, 8, 128, 384
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, kn, vn = r(B, H, D).bfloat16(), r(B, KV, D).bfloat16(), r(B, KV, D).bfloat16()
    kc, vc = r(B, KV, L, D).to(F8), r(B, KV, L, D).to(F8)
    pos = torch.randint(0, L, (B,), generator=g, device="cuda")
    # The reference attends over the new key and value as the cache stores them.
    want = K.decode_attention_reference(q.float(), kv_store(kn, F8).float(),
                                        kv_store(vn, F8).float(), kc.float(), vc.float(), pos, L,
                                        D ** -0.5)
    o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5)
    assert o.dtype == torch.bfloat16
    assert ((o.float() - want).norm() / want.norm()).item() < 6e-3
    rows = torch.arange(B, device="cuda")
    assert torch.equal(kc[rows, :, pos].view(torch.uint8), kv_store(kn, F8).view(torch.uint8))
    assert torch.equal(vc[rows, :, pos].view(torch.uint8), kv_store(vn, F8).view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_shared_prefix_attention_on_the_gpu(fp8):
    """On a GPU (bf16 queries; the interpreter's tests are in fp32, test_kernels.py): 256 rows in
    32 groups of 8 that hold the same 128-token prompt read it once from each group's lead, and
    give the attention each row computes over its own copy, within bf16's rounding; the
    followers' own copies of the prompt are not read (zeroed here)."""
    g = torch.Generator(device="cuda").manual_seed(int(fp8))
    B, H, KV, D, L, P = 256, 16, 8, 128, 384, 128
    dt = F8 if fp8 else torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, kn, vn = r(B, H, D).bfloat16(), r(B, KV, D).bfloat16(), r(B, KV, D).bfloat16()
    kc, vc = r(B, KV, L, D).to(dt), r(B, KV, L, D).to(dt)
    leads = torch.arange(0, B, 8, device="cuda")
    kb, vb = kv_bytes(kc), kv_bytes(vc)  # (indexed copies of fp8 go through its bytes)
    for j in range(1, 8):  # every member holds its lead's prompt
        kb[leads + j, :, :P], vb[leads + j, :, :P] = kb[leads, :, :P], vb[leads, :, :P]
    pos = torch.randint(P, L, (B,), generator=g, device="cuda")
    own = K.decode_attention(q, kn, vn, kc.clone(), vc.clone(), pos, L, D ** -0.5)
    grp = torch.full((B, 8), -1, dtype=torch.long, device="cuda")
    grp[leads] = leads[:, None] + torch.arange(8, device="cuda")
    plen = torch.full((B,), P, dtype=torch.long, device="cuda")
    for j in range(1, 8):
        kb[leads + j, :, :P] = 0
        vb[leads + j, :, :P] = 0
    shared = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5, shared=(grp, plen))
    assert ((shared.float() - own.float()).norm() / own.float().norm()).item() < 1e-2


@triton_only
@quiet
def test_fp8_paths_agree(noeos_dir):
    """With an fp8 cache the Triton paths (batch-1 all-Triton step, Triton attention between the
    layer halves, the bucketed prefill) write and read the cache as the PyTorch paths do (eager
    prefill, decode_layer): same tokens, log-probs within 1e-5; and with prefix reuse the later
    turn's offset prefill reads the fp8 prefix. (Six tokens a request: five interpreted decode
    steps, each writing its token to the fp8 cache the next reads.)"""
    plain = Engine(str(noeos_dir), Options(device="cpu", kv_cache_dtype="fp8",
                                           prefill_graph_max=0))
    fast = Engine(str(noeos_dir), Options(device="cpu", kv_cache_dtype="fp8", kernels=True,
                                          fused_b1=True, prefill_graph_max=128))
    reuse = Engine(str(noeos_dir), Options(device="cpu", kv_cache_dtype="fp8", kernels=True,
                                           prefix_cache=4, prefix_min=4))
    try:
        assert fast.gen.triton and fast.gen.fused_b1 and not plain.gen.triton
        for reqs in (requests(6)[1:], requests(6)):
            a, b = plain.generate(reqs), fast.generate(reqs)
            assert [c.tokens for c in a] == [c.tokens for c in b]
            for x, y in zip(a, b):
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 1e-5
        assert fast.gen.prefill_error == "" and fast.gen.kernel_error == ""
        # A later turn of the greedy conversation: its prompt starts with the kept row's tokens.
        first = reuse.generate(requests(6)[1:])[0]
        assert first.tokens == a[-1].tokens
        later = [GenerateRequest(id="later", prompt_tokens=first.prompt_tokens + first.tokens +
                                 [5, 6, 7, 8], n=1, sampling=Sampling(seed=2, max_tokens=4))]
        reuse.gen.take_prefix_stats()
        got = reuse.generate(later)
        st = reuse.gen.take_prefix_stats()
        assert st["hits"] == 1 and st["reused_tokens"] == len(first.prompt_tokens) + 5
        assert vs_score(reuse, got) < 0.02
    finally:
        plain.close()
        fast.close()
        reuse.close()


def test_bad_kv_cache_dtype(noeos_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8' \(--kv-cache-dtype\)"):
        Engine(str(noeos_dir), Options(device="cpu", kv_cache_dtype="int8"))
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(noeos_dir), "--kv-cache-dtype", "int8"])
    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    main(["serve", "--model", str(noeos_dir), "--device", "cpu", "--kv-cache-dtype", "fp8"])
    assert isinstance(seen[0], argparse.Namespace)
    assert server._options(seen[0]).kv_cache_dtype == "fp8"
