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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           u: torch.Tensor, use_top_p: bool):
    """Draws one token per row.

    logits: [B, V] fp32; temperature, top_p, u: [B]. temperature 0 is greedy. use_top_p is a
    Python bool so that the sort nucleus sampling needs is not paid (or captured) when no row
    asks for it. Returns (tokens [B] int64, logprobs [B] fp32 under the temperature-1 logits).
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    if use_top_p:
        probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: a token
        # stays while the mass before it is below top_p (so the first always stays).
        before = probs.cumsum(dim=-1) - probs
        probs = probs * (before < top_p[:, None])
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None].contiguous()
    idx = torch.searchsorted(cdf, target).clamp_(max=logits.shape[-1] - 1)
    tokens = (order.gather(1, idx) if use_top_p else idx).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs
