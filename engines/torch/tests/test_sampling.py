"""The seeded sampler: the two-level inverse CDF draws from the right distribution, never picks
a token of zero weight, and the per-row uniforms depend only on (seed, sample index, step)."""

import pytest
import torch

from slimen_torch import sampling as S


def test_two_level_equals_one_scan():
    g = torch.Generator().manual_seed(0)
    for V in (96, 1000, 4096, 151936):
        w = torch.exp(torch.randn(5, V, generator=g) * 3)
        u = torch.rand(5, generator=g)
        c = w.cumsum(-1)
        direct = torch.searchsorted(c, (u * c[:, -1])[:, None]).squeeze(1)
        assert S._inverse_cdf(w, u).tolist() == direct.tolist(), V


def test_frequencies_follow_the_distribution():
    # Four tokens with mass, spread over the two 1024-wide chunks of a 2048 vocabulary.
    where, values = [3, 700, 1100, 2040], torch.tensor([0.0, 1.0, 2.0, -1.0])
    logits = torch.full((1, 2048), float("-inf"))
    logits[0, where] = values
    n = 4096
    u = (torch.arange(n) + 0.5) / n  # evenly spread: frequencies are exact up to 1/n
    toks, _ = S.sample(logits.expand(n, -1).contiguous(), torch.ones(n), torch.ones(n), u, False)
    assert set(toks.tolist()) <= set(where)
    freq = torch.tensor([(toks == w).float().mean().item() for w in where])
    assert torch.allclose(freq, torch.softmax(values, 0), atol=2 / n)


def test_zero_weight_is_never_drawn():
    w = torch.zeros(3, 2048)
    w[:, 5] = 1.0
    w[:, 1500] = 1.0
    assert S._inverse_cdf(w, torch.tensor([0.1, 0.9, 1 - 2**-24])).tolist() == [5, 1500, 1500]


def test_top_p_and_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 1000
    u = (torch.arange(n) + 0.5) / n
    L = logits.expand(n, -1).contiguous()
    toks, lp = S.sample(L, torch.ones(n), torch.full((n,), 0.7), u, True)
    # top_p 0.7 keeps 0.5 and 0.3 (the mass before 0.15 is 0.8 ≥ 0.7), renormalised to 5/8, 3/8.
    assert set(toks.tolist()) == {0, 1}
    assert abs((toks == 0).float().mean().item() - 5 / 8) < 2 / n
    # Log-probs are under the temperature-1 distribution whatever the sampling settings.
    assert torch.allclose(lp, logits[0, toks])
    greedy, _ = S.sample(L[:3], torch.zeros(3), torch.ones(3), u[:3], False)
    assert greedy.tolist() == [0, 0, 0]


def test_uniforms_are_per_sample_and_step():
    k = torch.tensor([S.row_key(7, 0), S.row_key(7, 1), S.row_key(8, 0), S.row_key(7, 0)])
    u0 = S.uniform(k, torch.zeros(4, dtype=torch.long))
    u1 = S.uniform(k, torch.ones(4, dtype=torch.long))
    assert u0[0] == u0[3] and len(set(u0[:3].tolist())) == 3 and (u0 != u1).all()
    assert ((u0 > 0) & (u0 < 1)).all()
    # Seeds above 2^32 matter too.
    assert S.row_key(7 + 2**40, 0) != S.row_key(7, 0)


def test_rows_without_top_p_ignore_their_neighbours():
    # A row's draw must not depend on whether another row of its batch asks for top-p.
    g = torch.Generator().manual_seed(1)
    n, V = 64, 3000
    logits = torch.randn(n, V, generator=g) * 2
    u, t = torch.rand(n, generator=g), torch.full((n,), 0.9)
    top_p = torch.ones(n)
    top_p[::3] = 0.5
    mixed, lp_mixed = S.sample(logits, t, top_p, u, True)
    plain, lp_plain = S.sample(logits, t, torch.ones(n), u, False)
    keep = top_p == 1
    assert mixed[keep].tolist() == plain[keep].tolist()
    assert torch.equal(lp_mixed[keep], lp_plain[keep])
    nucleus, _ = S.sample(logits[~keep], t[~keep], top_p[~keep], u[~keep], True)
    assert mixed[~keep].tolist() == nucleus.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_triton_sampler_stays_in_the_vocabulary():
    """kernels.sample_and_advance on the GPU, where its sums of a chunk's weights (two tl.sum
    of other widths, a scan) round differently: at the top uniforms of (0, 1), over a vocabulary
    smaller than a chunk (qwen3-50m's 624 tokens in one of 2048), every draw is a token of the
    vocabulary (before the fix some were 2047, test_kernels' partial-vocabulary test), and a
    bf16 row's log-prob is its token's."""
    from slimen_torch import kernels as K
    g = torch.Generator(device="cuda").manual_seed(0)
    n, V = 1 << 16, 624
    logits = (torch.randn(n, V, device="cuda", generator=g) * 0.5).bfloat16()
    top = torch.arange(n, device="cuda") % 16
    u = ((2 ** 24 - 1 - top).double() + 0.5).div(2 ** 24).float()
    zeros = torch.zeros(n, dtype=torch.long, device="cuda")
    toks, lp = K.sample_and_advance(logits, torch.ones(n, device="cuda"), zeros, zeros, u=u)
    assert toks.max().item() < V
    want = torch.log_softmax(logits.float(), -1).gather(1, toks[:, None])[:, 0]
    assert torch.allclose(lp, want, atol=1e-4)
