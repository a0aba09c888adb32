"""Seeded sampling that does not depend on how requests were batched.

Every sampled token is drawn by inverting the cumulative distribution at one uniform number
u = hash(row key, step), where the row key is a hash of (request seed, sample index) and step is
the token's index in the response. So a response is a function of (seed, prompt, sample index)
alone, whatever else shares its batch, and the draw costs one number per row instead of one per
vocabulary entry (a Gumbel draw would need 150k random numbers a row per token). The hash is
integer arithmetic that runs identically on the CPU and on the GPU, inside a CUDA graph too.
"""

from __future__ import annotations

import torch

from . import batch_invariant

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor | int, c: int):
    # (x·c) mod 2³² without overflowing int64: split c into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """A 32-bit integer finaliser (lowbias32): every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: int, index: int) -> int:
    """The key of one sample: a 32-bit hash of the 64-bit seed and the sample index."""
    h = mix32((seed & _M32) ^ 0x5EED)
    h = mix32(h ^ ((seed >> 32) & _M32))
    return mix32(h ^ (index & _M32))


def uniform(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """u in (0, 1) for each row: key, step are int64 tensors; 24 bits, exact in fp32."""
    h = mix32(mix32(key ^ (step & _M32)) ^ 0x9E3779B9)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of non-negative weights w [B, V], the first index whose running sum reaches
    u·(row sum), never an index of weight 0.

    Two levels, because a running sum along one row of 150k entries is one long sequential scan
    on a GPU: sums of chunks first (a parallel reduction), the running sum over the chunk sums,
    then the running sum inside the one chunk that holds the target.
    """
    B, V = w.shape
    C = 1024
    while C >= 64 and V % C:
        C //= 2
    if C < 64 or V // C < 2:
        c = w.cumsum(-1)
        target = torch.minimum(u * c[:, -1], c[:, -1])[:, None].contiguous()
        return torch.searchsorted(c, target).squeeze(1).clamp(max=V - 1)
    blocks = w.view(B, V // C, C)
    cmass = blocks.sum(-1).cumsum(-1)  # [B, chunks]
    target = (u * cmass[:, -1])[:, None].contiguous()
    j = torch.searchsorted(cmass, target).clamp(max=V // C - 1)  # [B, 1]
    before = torch.where(j > 0, cmass.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, j[:, :, None].expand(B, 1, C)).squeeze(1).cumsum(-1)  # [B, C]
    # Rounding can leave the rest of the target just above the chunk's own total; the last
    # entry with weight then takes it (searchsorted finds the first index reaching the total).
    rest = torch.minimum(target - before, inner[:, -1:]).contiguous()
    k = torch.searchsorted(inner, rest).clamp(max=C - 1)
    return (j * C + k).squeeze(1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           u: torch.Tensor, use_top_p: bool):
    """Draws one token per row.

    logits: [B, V] fp32; temperature, top_p, u: [B]. temperature 0 is greedy. use_top_p is a
    Python bool so that the sort nucleus sampling needs is not paid (or captured) when no row
    asks for it. Returns (tokens [B] int64, logprobs [B] fp32 under the temperature-1 logits).
    In the deterministic mode the same draws with sums in a fixed order (batch_invariant.sample).
    """
    if batch_invariant.enabled():
        return batch_invariant.sample(logits, temperature, top_p, u, use_top_p)
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    # Unnormalised probabilities (the largest is 1): sampling needs no division by the total.
    w = torch.exp((logits - logits.amax(-1, keepdim=True)) / t[:, None])
    tokens = _inverse_cdf(w, u)
    if use_top_p:
        ws, order = w.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: a token
        # stays while the mass before it is below top_p (so the first always stays).
        before = ws.cumsum(dim=-1) - ws
        ws = ws * (before < top_p[:, None] * ws.sum(-1, keepdim=True))
        nucleus = order.gather(1, _inverse_cdf(ws, u)[:, None]).squeeze(1)
        # Rows without top-p keep the unsorted draw: a row's token must not depend on whether
        # another row of its batch asked for top-p.
        tokens = torch.where(top_p < 1, nucleus, tokens)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs
