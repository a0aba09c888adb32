"""kernels.gemm, the batched decode step's products (model.decode_step_fused), against the
PyTorch code it replaces: in fp32 on the CPU under Triton's interpreter (conftest sets
TRITON_INTERPRET=1 when there is no GPU), in bf16 on a GPU. Whole engines with the batched step
are in test_kernels.py (test_engine_with_kernels_generates_the_same)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from slimen_torch import kernels as K
from slimen_torch.model import qkv_from_normed, rms_norm

triton_only = pytest.mark.skipif(not K.available("cpu"),
                                 reason="Triton (interpreter) not available on this machine")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@triton_only
@pytest.mark.parametrize("M,K_,N,split", [(5, 96, 70, 1), (33, 200, 64, 3), (16, 64, 16, 4)])
def test_gemm(M, K_, N, split, monkeypatch):
    """The batched products: norm in front, bias, SwiGLU or residual behind, K split over
    programs (the last to arrive sums the partials, and leaves the counters at zero), rows
    strided."""
    g = torch.Generator().manual_seed(M + N)
    xs = torch.randn(M, K_ + 8, generator=g)
    x = xs[:, :K_]  # strided rows
    w = torch.randn(N, K_, generator=g) * 0.1
    nw = 1 + 0.1 * torch.randn(K_, generator=g)
    bias, res = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    out = torch.empty(M, N)
    for role in ("qkv", "o"):
        monkeypatch.setitem(K.GEMM_LAUNCH, (role, 0), (16, 32, 32, split, 4, 2))
    K.gemm(x, w, out, bias=bias, norm_w=nw, eps=1e-6, role="qkv")
    assert rel(out, F.linear(rms_norm(x, nw, 1e-6), w, bias)) < 1e-6
    out.zero_()
    K.gemm(x, w, out, res=res, role="o")
    assert rel(out, res + F.linear(x, w)) < 1e-6
    assert not K._counters(out.device).any()
    K.gemm(x, w, out, res=res, role="o")  # the counters serve the next launch
    assert rel(out, res + F.linear(x, w)) < 1e-6
    w13 = torch.randn(2 * N, K_, generator=g) * 0.1
    K.gemm(x, w13, out, norm_w=nw, eps=1e-6, swiglu=True)
    gate, up = F.linear(rms_norm(x, nw, 1e-6), w13).chunk(2, -1)
    assert rel(out, F.silu(gate) * up) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [3, 256])
def test_gemm_on_the_gpu(M):
    """bf16 at the Qwen3-0.6B shape on a GPU: each role's default launch (split K for the o and
    down products) against PyTorch's bf16 products, and the split products deterministic."""
    g = torch.Generator(device="cuda").manual_seed(M)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()  # noqa: E731
    hidden, inter = 1024, 3072
    x, nw, res = r(M, hidden), 1 + 0.1 * r(hidden), r(M, hidden)
    w13, w2, wo = r(2 * inter, hidden) * 0.03, r(hidden, inter) * 0.02, r(hidden, 2048) * 0.02
    a = r(M, inter)
    out = torch.empty(M, inter, dtype=torch.bfloat16, device="cuda")
    K.gemm(x, w13, out, norm_w=nw, eps=1e-6, swiglu=True, role="gate_up")
    gate, up = F.linear(rms_norm(x, nw, 1e-6), w13).chunk(2, -1)
    assert rel(out, F.silu(gate) * up) < 1e-2
    for w, inp, role in ((w2, a, "down"), (wo, r(M, 2048), "o")):
        h = torch.empty(M, hidden, dtype=torch.bfloat16, device="cuda")
        K.gemm(inp, w, h, res=res, role=role)
        assert rel(h, res + F.linear(inp, w)) < 1e-2
        h2 = torch.empty_like(h)
        K.gemm(inp, w, h2, res=res, role=role)
        assert torch.equal(h, h2)


@triton_only
@pytest.mark.parametrize("qk_norm", [True, False])
def test_gemm_with_rope(qk_norm):
    """rope=…: the q/k/v product normalises and rotates its q and k heads at each row's position
    in its epilogue (the batched step), as model.qkv_from_normed does; v is left as it is."""
    g = torch.Generator().manual_seed(7 + qk_norm)
    B, H, KV, D, hidden, L = 6, 4, 2, 16, 48, 100
    cfg = SimpleNamespace(q_dim=H * D, kv_dim=KV * D, heads=H, kv_heads=KV, head_dim=D,
                          qk_norm=qk_norm, rms_eps=1e-6)
    h = torch.randn(B, hidden, generator=g)
    nw = 1 + 0.1 * torch.randn(hidden, generator=g)
    wqkv = torch.randn((H + 2 * KV) * D, hidden, generator=g) * 0.2
    bqkv = torch.randn((H + 2 * KV) * D, generator=g)
    qn, kn = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
    ang = torch.arange(float(L))[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(0, L, (B,), generator=g)
    out = torch.empty(B, (H + 2 * KV) * D)
    K.gemm(h, wqkv, out, bias=bqkv, norm_w=nw, eps=1e-6, role="qkv",
           rope=(qn if qk_norm else None, kn if qk_norm else None, cos, sin, pos, H * D, KV * D))
    w = (None, wqkv, bqkv, qn, kn)
    q, k, v = qkv_from_normed(cfg, w, rms_norm(h, nw, 1e-6), cos[pos], sin[pos])
    assert rel(out, torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), 1)) < 1e-6
