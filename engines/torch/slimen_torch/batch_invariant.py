"""Batch-invariant arithmetic: the worker's deterministic mode (Options.deterministic).

In the default mode a row's numbers depend on what else is computed with it: a matrix product
picks its tiling and its split of the reduction by the number of rows (a cuBLAS heuristic; on the
CPU a matrix-vector kernel for one row, a blocked one for many), a reduction over a row is split
across threads when there are few rows, the decode attention splits the cache by its length, and
training runs other kernels (compiled, fused) than generation. So the log-prob of a token differs
between the rollout that sampled it and the trainer that trains on it, and a sample's tokens can
depend on its batch (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

Here every reduction has an order fixed by the row alone:

* products (`matmul`, `linear`): on a GPU a Triton kernel with one tile shape for every size
  (the reduction runs along K in fixed steps, never split); elsewhere the products of each
  output element summed by `tree_sum`;
* sums over a row (`tree_sum`): a pairwise tree over the row padded with zeros to a power of two,
  elementwise adds only. Trailing zeros leave the sum unchanged, so a row's sum is the same
  whatever its padding: RMSNorm (`rms_norm`), the log-softmax (`logsumexp`, `token_logprobs`)
  and the sampler's sums (`sample`) use it;
* attention (`attention`): one query row at a time over its keys in chunks of `KV_SPLIT`
  positions counted from position 0, combined in order by the online softmax. A chunk past the
  query's position is an exact no-op, so the result is the same for any cache length, any
  batch, and for a token whether it is decoded, prefilled (with or without a cached prefix) or
  re-read by the trainer.

The model's functions (model.py) call these when the mode is on for the calling thread
(`enabled`): the engine turns it on for its own thread, where all of its model work runs. The
trainer then computes log-probs with the same functions and dtypes as generation, so they are
equal bit for bit. Gradients need not be batch-invariant, only repeatable: the products'
backward passes are plain PyTorch products (cuBLAS), and on a GPU the attention's, RMSNorm's
and the log-prob head's backward passes are Triton kernels without atomics (each sum in one
program's fixed order); elsewhere autograd of the functions above.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F

from . import lora

from .triton_env import HAVE_TRITON, INTERPRET, tl, triton  # noqa: F401

# The attention's split along the keys: positions [0, KV_SPLIT), [KV_SPLIT, 2·KV_SPLIT), …
KV_SPLIT = 64

_state = threading.local()


def enabled() -> bool:
    """Whether the calling thread computes in the batch-invariant mode."""
    return getattr(_state, "on", False)


def set_enabled(on: bool) -> None:
    """Turns the mode on or off for the calling thread (the engine's thread, for its life)."""
    _state.on = bool(on)


@contextlib.contextmanager
def mode(on: bool = True):
    """The mode on (or off) for the calling thread inside the block."""
    saved = enabled()
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(saved)


def use_triton(t: torch.Tensor) -> bool:
    """Whether t's products and attention run in the Triton kernels (CUDA tensors; or any under
    TRITON_INTERPRET=1 when tests ask for it through FORCE_TRITON)."""
    return HAVE_TRITON and (t.is_cuda or FORCE_TRITON)


FORCE_TRITON = False  # tests: the Triton kernels on the CPU under TRITON_INTERPRET=1


# ---- sums in a fixed order ----

def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension as a pairwise tree: zero-padded to a power of two, then
    halved by elementwise adds (x[:h] + x[h:]) until one entry is left. Every row is summed in the
    same order whatever the other rows, and zeros past a row's entries change nothing (the first
    levels add them to entries exactly), so a shorter row padded with zeros sums alike."""
    n = x.shape[-1]
    p = 1 if n <= 1 else 1 << (n - 1).bit_length()
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """The running sum along the last dimension in a fixed order (Hillis-Steele: log2(n) rounds of
    elementwise adds), the same for a row whatever its batch."""
    n, k = x.shape[-1], 1
    while k < n:
        x = torch.cat((x[..., :k], x[..., k:] + x[..., :-k]), dim=-1)
        k *= 2
    return x


# On a GPU the sums over a row run in Triton kernels (row_sum, the fused logsumexp): one program
# a row, its entries added into ROW_BLOCK fp32 lanes chunk by chunk, then the lanes summed by the
# one reduction tree of that block size. The order is fixed by the row's length alone, and zeros
# past a row's entries change nothing either (lanes + 0 are exact). tree_sum's many small
# kernels (a pad and log2(n) adds, each a launch and a pass over memory) cost more than the
# products at decode sizes. False: tree_sum everywhere (determinism.py --row-kernels off).
ROW_KERNELS = True
ROW_BLOCK = 1024

if HAVE_TRITON:
    @triton.jit
    def _row_sum_kernel(X, Y, N, sx, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            acc += tl.load(X + row * sx + i, mask=i < N, other=0.0).to(tl.float32)
        tl.store(Y + row, tl.sum(acc, axis=0))

    @triton.jit
    def _lse_part_kernel(X, PM, PS, N, sx, P, BLOCK: tl.constexpr):
        # Part p (entries [p·BLOCK, (p + 1)·BLOCK)) of a row's log Σ exp(x): its maximum
        # (order-free) and Σ exp(x − max) over the part, into PM and PS [rows, P]. A part with
        # no finite maximum is shifted by 0, as logsumexp does.
        row = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        i = p * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row * sx + i, mask=i < N, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        mr = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
        s = tl.sum(tl.where(i < N, tl.exp(x - mr), 0.0), axis=0)
        tl.store(PM + row * P + p, m)
        tl.store(PS + row * P + p, s)

    @triton.jit
    def _lse_combine_kernel(PM, PS, Y, P, BP: tl.constexpr):
        # A row's log Σ exp from its parts (_lse_part_kernel's): the parts' maximum M, then
        # M + log Σ_p s_p·exp(m_p − M) over the parts in one fixed order.
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BP)
        pm = tl.load(PM + row * P + j, mask=j < P, other=float("-inf"))
        ps = tl.load(PS + row * P + j, mask=j < P, other=0.0)
        m = tl.max(pm, axis=0)
        mr = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
        s = tl.sum(tl.where(j < P, ps * tl.exp(pm - mr), 0.0), axis=0)
        tl.store(Y + row, mr + tl.log(s))

    @triton.jit
    def _rms_kernel(X, W, Y, N, sx, sy, eps, BLOCK: tl.constexpr):
        # model.rms_norm of a row: its mean square summed as _row_sum_kernel sums, the row
        # normalised in fp32 and cast to X's dtype, then times the weight (in fp32, rounded to
        # Y's dtype as a product of tensors of those dtypes is).
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + i, mask=i < N, other=0.0).to(tl.float32)
            acc += x * x
        r = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            xr = tl.load(X + row * sx + i, mask=i < N, other=0.0)
            w = tl.load(W + i, mask=i < N, other=0.0).to(tl.float32)
            y = (xr.to(tl.float32) * r).to(xr.dtype).to(tl.float32)
            tl.store(Y + row * sy + i, (w * y).to(Y.dtype.element_ty), mask=i < N)


if HAVE_TRITON:
    @triton.jit
    def _rms_bwd_kernel(X, W, G, GX, GW, RES, M, N, sx, sg, sgx, sgh, HR, sres, eps, ROWS,
                        BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
        # The gradient of model.rms_norm (y = w·z, z = (x·r) rounded to x's dtype,
        # r = 1/√(mean x² + eps)) for ROWS rows: gx = r·(gz − x̂·mean(gz·x̂)) with gz = g·w and
        # x̂ = x·r in fp32 (the cast passes the gradient through), and the rows' part of gw =
        # Σ g·z in fp32, summed in row order into this program's row of GW (the caller adds
        # the programs' rows: no atomics, the same order every call). HAS_RES: gx plus the
        # row of RES (a residual's gradient), the two rounded and added as autograd adds them.
        # Row r's gx goes to GX + (r // HR)·sgx + (r % HR)·sgh: HR heads a row of GX (a layer's
        # q or k heads, written into their place in the q/k/v gradient).
        pid = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        im = i < N
        w = tl.load(W + i, mask=im, other=0.0).to(tl.float32)
        gw = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, ROWS):
            row = pid.to(tl.int64) * ROWS + k
            if row < M:
                xr = tl.load(X + row * sx + i, mask=im, other=0.0)
                x = xr.to(tl.float32)
                g = tl.load(G + row * sg + i, mask=im, other=0.0).to(tl.float32)
                r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
                xh = x * r
                gw += g * xh.to(xr.dtype).to(tl.float32)
                gz = g * w
                c = tl.sum(gz * xh, axis=0) / N
                gx = (r * (gz - xh * c)).to(GX.dtype.element_ty)
                if HAS_RES:
                    res = tl.load(RES + row * sres + i, mask=im, other=0.0).to(tl.float32)
                    gx = (gx.to(tl.float32) + res).to(GX.dtype.element_ty)
                tl.store(GX + (row // HR) * sgx + (row % HR) * sgh + i, gx, mask=im)
        tl.store(GW + pid.to(tl.int64) * N + i, gw, mask=im)


# The RMSNorm's backward pass on a GPU: _rms_bwd_kernel instead of autograd of its PyTorch
# form, about fifteen elementwise kernels a norm (determinism.py --norm-bwd torch). A program
# takes up to RMS_BWD_ROWS rows, fewer where that leaves under ~1,024 programs (a row's chain of
# loads and sums is latency-bound); rows of up to RMS_BWD_MAX entries (one block a row).
RMS_BWD_TRITON = True
RMS_BWD_ROWS = 32
RMS_BWD_PROGRAMS = 1024
RMS_BWD_MAX = 16384


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor,
                             eps: float, res: torch.Tensor | None = None,
                             out: torch.Tensor | None = None):
    """(gx, gw): the gradients of rms_norm(x, weight, eps) for its output's gradient g, in
    _rms_bwd_kernel; repeatable bit for bit (gw: the programs' partial sums added by one sum).
    res: a gradient of x's shape added to gx (another use of x: a residual), rounded as
    autograd's sum; out: gx written there ([..., heads, N] of x's shape, rows of heads
    contiguous along N, the leading dimensions one stride: a view into a wider gradient) and
    returned."""
    x2, g2 = _rows(x), _rows(g)
    M, N = x2.shape
    if out is None:
        gx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o3 = gx.view(M, 1, N)
    else:
        gx = out
        o3 = out.view(-1, out.shape[-2], N)
    r2 = _rows(res) if res is not None else x2
    rows = min(RMS_BWD_ROWS, max(1, M // RMS_BWD_PROGRAMS))
    P = max(1, triton.cdiv(M, rows))
    # Every program writes its row of part whatever its rows: zeros only with no launch.
    part = (torch.empty if M else torch.zeros)(P, N, dtype=torch.float32, device=x.device)
    if M:
        _rms_bwd_kernel[(P,)](x2, weight.contiguous(), g2, o3, part, r2, M, N, x2.stride(0),
                              g2.stride(0), o3.stride(0), o3.stride(1), o3.shape[1],
                              r2.stride(0), float(eps), rows,
                              BLOCK=max(16, triton.next_power_of_2(N)), HAS_RES=res is not None,
                              num_warps=4)
    return gx, part.sum(0).to(weight.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _reduce_rows(kernel, x: torch.Tensor) -> torch.Tensor:
    """kernel's fp32 reduction of each row over the last dimension, one program a row."""
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), BLOCK=ROW_BLOCK, num_warps=4)
    return y.view(x.shape[:-1])


def row_sum_triton(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension in _row_sum_kernel (fp32, no gradient)."""
    return _reduce_rows(_row_sum_kernel, x)


# The log-softmax's normaliser and the sampler over a vocabulary take a row in parts of
# VOCAB_PART entries, a program a part (then a program a row over the parts' numbers): a decode
# step's 256 rows of 151,936 logits are ~19,000 programs instead of 256 that each walk a whole
# row. The parts are fixed by the row's length alone, so a row's numbers are those of the row
# alone in any batch, and the trainer, Score and the sampler run the same two kernels on the
# logits as they are (their dtype, unconverted) for the same log-sum-exp.
VOCAB_PART = 2048


def _vocab_parts(n: int) -> int:
    return max(1, triton.cdiv(n, VOCAB_PART))


def _lse_parts(x2: torch.Tensor):
    """(PM, PS) [rows, parts] of _lse_part_kernel for the rows of x2 (stride 1 along a row)."""
    R, N = x2.shape
    P = _vocab_parts(N)
    pm = torch.empty(R, P, dtype=torch.float32, device=x2.device)
    ps = torch.empty(R, P, dtype=torch.float32, device=x2.device)
    if R:
        _lse_part_kernel[(R, P)](x2, pm, ps, N, x2.stride(0), P, BLOCK=VOCAB_PART, num_warps=4)
    return pm, ps


def logsumexp_triton(x: torch.Tensor) -> torch.Tensor:
    """log Σ exp over the last dimension (x of any float dtype, read in fp32) in
    _lse_part_kernel and _lse_combine_kernel (fp32, no gradient)."""
    x2 = _rows(x)
    pm, ps = _lse_parts(x2)
    y = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        P = pm.shape[1]
        _lse_combine_kernel[(x2.shape[0],)](pm, ps, y, P, BP=max(16, triton.next_power_of_2(P)),
                                            num_warps=4)
    return y.view(x.shape[:-1])


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in _rms_kernel, one program a row (no gradient)."""
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _rms_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.shape[1], x2.stride(0),
                                    y.stride(0), float(eps), BLOCK=ROW_BLOCK, num_warps=4)
    return y.view(x.shape)


class _RMSNorm(torch.autograd.Function):
    """rms_norm_triton; the backward pass the gradient of model.rms_norm: in
    rms_norm_backward_triton, or by autograd of its PyTorch form recomputed."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_triton(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        if RMS_BWD_TRITON and x.shape[-1] <= RMS_BWD_MAX:
            gx, gw = rms_norm_backward_triton(x, weight, g, ctx.eps)
            return gx, gw, None
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            x32 = x_.float()
            y = w_ * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            gx, gw = torch.autograd.grad(y, (x_, w_), g)
        return gx, gw, None


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return row_sum_triton(x)

    @staticmethod
    def backward(ctx, g):
        return g[..., None].expand(ctx.shape)


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = logsumexp_triton(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return (g[..., None] * torch.exp(x.float() - y[..., None])).to(x.dtype)


def row_kernels(x: torch.Tensor) -> bool:
    """Whether x's sums over a row run in the Triton row kernels (use_triton and ROW_KERNELS)."""
    return ROW_KERNELS and use_triton(x)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension (fp32 x) in a fixed order: the Triton row kernel where
    row_kernels says so, tree_sum elsewhere."""
    if row_kernels(x):
        return _RowSum.apply(x)
    return tree_sum(x)


# ---- products ----

# Elements of the products a CPU chunk materialises (rows × N × K): bounds the memory.
_CHUNK = 1 << 22


def matmul_tree(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ → [M, N] in fp32: each element the tree_sum of its K products (fp32
    products of fp32 or bf16 inputs, exact for bf16). Rows are computed in chunks, each element
    alike in any chunk."""
    M, K = x.shape
    N = w.shape[0]
    wf = w.float()
    rows = max(1, _CHUNK // max(1, N * K))
    out = [tree_sum(x[i:i + rows, None, :].float() * wf[None]) for i in range(0, M, rows)]
    return torch.cat(out) if out else x.new_zeros(0, N, dtype=torch.float32)


# The kernels are compiled alike for every row count and length (Triton would otherwise compile
# a variant for a count of 1 or a multiple of 16): one code path for every batch.
if HAVE_TRITON:
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(X, W, Y, M, N, K, sxm, sxk, swn, swk, sym, syn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       IEEE: tl.constexpr):
        # One BM × BN tile of Y = X·Wᵀ; the reduction along K in steps of BK, always whole (no
        # split-K) and in the same order, with the same tile shape for every M: a row's result
        # does not depend on the others.
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(X + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(W + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        # The output's offsets in 64 bits: the logits of a 16,384-token micro-batch are past
        # 2³¹ entries (the operands' are far from it).
        tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn,
                 acc.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

# The tile of the products (BM, BN, BK, warps, stages).
TILE = (64, 64, 64, 4, 3)
# Products of at least LARGE_M rows (training, long prefills) take TILE_LARGE (None: TILE), and
# with TILE_BY_SHAPE those of fewer rows (decode steps) a tile by their N and K: TILE_NARROW for
# few outputs over a long K (o and down projections: 64 × 32 tiles fill more of the GPU, 1.4-1.5×
# faster on an H200 at 256 rows), TILE_WIDE for a vocabulary head (1.4×); bench_tiles.py times
# them. A row's numbers do not depend on the tile: on sm_90 every tile that bench_tiles.py tried
# (84 of them: BM, BN, BK of 64 or 128, warps, stages) gave every output bit for bit equal to
# TILE's, since the matrix instruction sums a row's K steps in the same order whatever the block
# around it; determinism.py --check confirms it on the device (--tile-large none and
# --tile-by-shape off go back to TILE alone).
TILE_LARGE: tuple | None = (128, 128, 64, 8, 3)
TILE_BY_SHAPE = True
TILE_NARROW = (64, 32, 128, 4, 4)
TILE_WIDE = (128, 128, 64, 8, 3)
LARGE_M = 1024


# An experiment (determinism.py --split-k S): products of K ≥ SPLIT_K_MIN split along K into S
# parts, each a program's (S times the programs: a decode step's products of few output tiles
# fill more of the GPU), their fp32 sums added in order. The parts are fixed by K and BK alone,
# so a row's arithmetic is still the same for every row count; it is not the unsplit one, and
# every pass (decode, prefill, training) takes it alike.
SPLIT_K = 1
SPLIT_K_MIN = 2048

if HAVE_TRITON:
    @triton.jit(do_not_specialize=["M"])
    def _matmul_split_kernel(X, W, P, M, N, K, KS, sxm, sxk, swn, swk,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             IEEE: tl.constexpr):
        # _matmul_kernel over the K range [ps·KS, (ps + 1)·KS) of part ps, its fp32 sum stored
        # in P[ps] ([parts, M, N]).
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k1 = tl.minimum(ps * KS + KS, K)
        for k0 in range(ps * KS, k1, BK):
            kk = k0 + rk
            a = tl.load(X + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < k1), other=0.0)
            b = tl.load(W + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < k1), other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        out = P + ps.to(tl.int64) * M * N
        tl.store(out + rm[:, None].to(tl.int64) * N + rn[None, :], acc,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _split_sum_kernel(P, Y, n, S, BLOCK: tl.constexpr):
        # Y = P[0] + P[1] + … + P[S−1] in that order, in fp32, rounded once to Y's dtype.
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        pp = P + i
        acc = tl.load(pp, mask=m, other=0.0)
        for _ in range(1, S):
            pp += n
            acc += tl.load(pp, mask=m, other=0.0)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=m)


def _matmul_split(x, w, y, tile) -> None:
    M, K = x.shape
    N = w.shape[0]
    BM, BN, BK, warps, stages = tile
    KS = triton.cdiv(triton.cdiv(K, BK), SPLIT_K) * BK
    parts = triton.cdiv(K, KS)
    p = torch.empty(parts, M, N, dtype=torch.float32, device=x.device)
    _matmul_split_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), parts)](
        x, w, p, M, N, K, KS, x.stride(0), x.stride(1), w.stride(0), w.stride(1), BM=BM, BN=BN,
        BK=BK, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    _split_sum_kernel[(triton.cdiv(M * N, 1024),)](p, y, M * N, parts, BLOCK=1024, num_warps=4)


def _tile(M: int, N: int, K: int) -> tuple:
    """The tile of an M × K by K × N product (see TILE_BY_SHAPE). Under Triton's interpreter
    always TILE: its products are NumPy's, whose sums do depend on the block."""
    if INTERPRET:
        return TILE
    if TILE_LARGE is not None and M >= LARGE_M:
        return TILE_LARGE
    if TILE_BY_SHAPE:
        if N <= 1024 and K >= 2048:
            return TILE_NARROW
        if N >= 32768:
            return TILE_WIDE
    return TILE


def matmul_triton(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ → [M, N] in out_dtype through _matmul_kernel (fp32 accumulation)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    tile = _tile(M, N, K)
    if SPLIT_K > 1 and K >= SPLIT_K_MIN:
        _matmul_split(x, w, y, tile)
        return y
    form = _form(x, w, y)
    if form != "plain" and TILE_FORM is not None and not INTERPRET:  # (interpreted: _tile's TILE)
        tile = TILE_FORM
    matmul_tiled(x, w, y, tile, form)
    return y


def matmul_tiled(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tile: tuple,
                 form: str = "plain") -> None:
    """y [M, N] = x [M, K] @ w [N, K]ᵀ through _matmul_kernel in tile (BM, BN, BK, warps,
    stages), unsplit, or through the kernel of another form (MATMUL_FORMS; the caller has
    checked with _form that TMA can take the operands). bench_tiles.py times the tiles."""
    if form != "plain":
        _matmul_tma(x, w, y, tile, form)
        return
    M, K = x.shape
    N = w.shape[0]
    BM, BN, BK, warps, stages = tile
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _matmul_kernel[grid](x, w, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                         y.stride(0), y.stride(1), BM=BM, BN=BN, BK=BK,
                         IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)


# ---- the products in Hopper's form (an experiment: MATMUL_FORM) ----

# The form of the kernel that runs the products of at least FORM_MIN_M rows (a training pass's
# forward products, long prefills):
# * "plain": _matmul_kernel (pointer loads, a program a tile; the default);
# * "tma": _matmul_tma_kernel, the operands' blocks brought into shared memory by the TMA unit
#   through tensor descriptors, the tiles in grouped order, the output stored by TMA in
#   EPILOGUE_SUBTILE parts;
# * "persistent": _matmul_persistent_kernel, the same in one program an SM that walks the tiles
#   in grouped order, its tile loop and K loop flattened into one pipelined loop;
# * "persistent-ws": _matmul_ws_kernel, the persistent walk warp-specialized by Triton (a
#   producer warp group issues the TMA loads, two consumer warp groups the products; it acts on
#   4-warp kernels only, so the tile's warps are not used), the output stored from registers.
# Every form sums an output's K steps of BK in increasing order into one fp32 accumulator with
# the same matrix instruction, rounding once at the end, with no split along K: the plain
# kernel's arithmetic, so the outputs are meant to be equal bit for bit (bench_tiles.py --forms
# says whether they are; determinism.py --matmul-form X checks the trainer's log-probs against
# the decode's, whose 256-row products stay plain). Products of fewer rows, and those whose
# operands a TMA descriptor cannot describe (not bf16/fp16, a row stride or base not 16-byte
# aligned, columns not contiguous), take the plain kernel: _form says which.
MATMUL_FORMS = ("plain", "tma", "persistent", "persistent-ws")
MATMUL_FORM = "persistent"
FORM_MIN_M = 1024
# The forms' tile (None: _tile's, as the plain kernel's): 128×256×64 on 8 warps, the fastest
# that bench_tiles.py --rows 16384 --forms found for every training product on an H200 (its
# 144 KiB of staged operands fit a Hopper SM's shared memory; TILE_LARGE stays 128×128×64 for
# the plain kernel, which other GPUs run, some with less).
TILE_FORM: tuple | None = (128, 256, 64, 8, 3)
# Row blocks a group of the grouped tile order: the tiles of GROUP_M row blocks are walked
# column block by column block, so the programs that run together share W's column blocks and
# X's GROUP_M row blocks in L2.
GROUP_M = 8
# Parts (1 or 2) of a tile's columns stored one after the other by "tma" and "persistent" (the
# rounded tile staged for the TMA store in half the shared memory, left to the pipeline).
EPILOGUE_SUBTILE = 2
_TMA_DTYPES = (torch.bfloat16, torch.float16)

if HAVE_TRITON:
    @triton.jit
    def _grouped_tile(t, tiles_m, tiles_n, GROUP: tl.constexpr):
        # Tile t of the grouped order → its row block and column block.
        per_group = GROUP * tiles_n
        first = (t // per_group) * GROUP
        rows = tl.minimum(tiles_m - first, GROUP)
        return first + (t % per_group) % rows, (t % per_group) // rows

    @triton.jit
    def _tma_dot(XD, WD, om, on, k0, acc, IEEE: tl.constexpr):
        # One K step of a tile: acc + X[om:, k0:]·W[on:, k0:]ᵀ, as _matmul_kernel's step (the
        # blocks past M, N and K zero-filled by the TMA unit as the plain kernel's masks fill
        # them).
        a = XD.load([om, k0])
        b = WD.load([on, k0])
        if IEEE:
            acc += tl.dot(a, b.T, input_precision="ieee")
        else:
            acc += tl.dot(a, b.T)
        return acc

    @triton.jit
    def _tma_store(YD, acc, om, on, BM: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr):
        # The tile rounded to Y's dtype once and stored by TMA (rows and columns past Y
        # clipped), in SUB parts of BN / SUB columns.
        if SUB == 2:
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            a0, a1 = tl.split(halves)
            YD.store([om, on], a0.to(YD.dtype))
            YD.store([om, on + BN // 2], a1.to(YD.dtype))
        else:
            YD.store([om, on], acc.to(YD.dtype))

    @triton.jit(do_not_specialize=["M"])
    def _matmul_tma_kernel(XD, WD, YD, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                           IEEE: tl.constexpr):
        # One BM × BN tile of Y = X·Wᵀ a program, in grouped order; XD, WD, YD TMA descriptors
        # of X [M, K] (blocks BM × BK), W [N, K] (BN × BK) and Y [M, N] (BM × BN / SUB). The
        # sum along K as _matmul_kernel's: steps of BK from 0 up, whole.
        pm, pn = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc = _tma_dot(XD, WD, pm * BM, pn * BN, k0, acc, IEEE)
        _tma_store(YD, acc, pm * BM, pn * BN, BM, BN, SUB)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_persistent_kernel(XD, WD, YD, M, N, K, PROGRAMS, BM: tl.constexpr,
                                  BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                                  SUB: tl.constexpr, IEEE: tl.constexpr):
        # _matmul_tma_kernel's tiles, program p taking tiles p, p + PROGRAMS, … of the grouped
        # order (PROGRAMS: the SMs). The tile loop is flattened with its K loop into one
        # software-pipelined loop (the next tile's loads start during this tile's last steps);
        # each tile's sum is still its own K loop's, from zero.
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        for t in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            pm, pn = _grouped_tile(t, tiles_m, tiles_n, GROUP)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                acc = _tma_dot(XD, WD, pm * BM, pn * BN, k0, acc, IEEE)
            _tma_store(YD, acc, pm * BM, pn * BN, BM, BN, SUB)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_ws_kernel(XD, WD, Y, M, N, K, sym, PROGRAMS, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                          IEEE: tl.constexpr):
        # _matmul_persistent_kernel's walk with the tile loop warp-specialized. The output is
        # stored from registers with _matmul_kernel's masks: Triton 3.6's Hopper warp
        # specialization fails on a TMA store in the loop ("descriptor block and tensor types
        # must match").
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        for t in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, warp_specialize=True):
            pm, pn = _grouped_tile(t, tiles_m, tiles_n, GROUP)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                acc = _tma_dot(XD, WD, pm * BM, pn * BN, k0, acc, IEEE)
            rm = pm * BM + tl.arange(0, BM)
            rn = pn * BN + tl.arange(0, BN)
            tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :],
                     acc.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe the 2-D t: contiguous columns, its base and row
    stride 16-byte aligned."""
    return (t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


_HOPPER: dict = {}


def _hopper(device: torch.device) -> bool:
    """Whether the Hopper forms may run on device: sm_90, where TMA descriptors exist and the
    forms' bits were checked against the plain kernel's (bench_tiles.py --forms on an H200);
    older GPUs have no TMA, and newer ones' matrix instructions are unchecked. Triton's
    interpreter (the CPU's tests) runs them anywhere."""
    if device.type != "cuda":
        return True
    if device not in _HOPPER:
        _HOPPER[device] = torch.cuda.get_device_capability(device)[0] == 9
    return _HOPPER[device]


def _form(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> str:
    """The kernel form of y = x·wᵀ: MATMUL_FORM for products of at least FORM_MIN_M rows whose
    operands TMA descriptors can describe (x and w bf16 or fp16 alike) on a Hopper GPU (_hopper),
    else plain."""
    if MATMUL_FORM == "plain" or x.shape[0] < FORM_MIN_M or not _hopper(x.device):
        return "plain"
    if x.dtype not in _TMA_DTYPES or w.dtype != x.dtype or \
            y.dtype not in _TMA_DTYPES + (torch.float32,):
        return "plain"
    if not (_tma_ok(x) and _tma_ok(w) and _tma_ok(y)):
        return "plain"
    return MATMUL_FORM


_SMS: dict = {}


def _programs(device: torch.device) -> int:
    """The persistent kernels' programs: the device's SMs (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _matmul_tma(x, w, y, tile, form: str) -> None:
    """y = x·wᵀ through the kernel of form ("tma", "persistent", "persistent-ws") in tile
    (BM, BN, BK, warps, stages)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = x.shape
    N = w.shape[0]
    BM, BN, BK, warps, stages = tile
    xd = TensorDescriptor(x, [M, K], [x.stride(0), 1], [BM, BK])
    wd = TensorDescriptor(w, [N, K], [w.stride(0), 1], [BN, BK])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(_programs(x.device), tiles)
    ieee = x.dtype == torch.float32  # fp32 operands (the tests, under the interpreter)
    if form == "persistent-ws":
        _matmul_ws_kernel[(programs,)](xd, wd, y, M, N, K, y.stride(0), programs, BM=BM, BN=BN,
                                       BK=BK, GROUP=GROUP_M, IEEE=ieee, num_warps=4,
                                       num_stages=stages)
        return
    sub = EPILOGUE_SUBTILE if BN % 2 == 0 else 1
    yd = TensorDescriptor(y, [M, N], [y.stride(0), 1], [BM, BN // sub])
    if form == "tma":
        _matmul_tma_kernel[(tiles,)](xd, wd, yd, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=GROUP_M,
                                     SUB=sub, IEEE=ieee, num_warps=warps, num_stages=stages)
    elif form == "persistent":
        _matmul_persistent_kernel[(programs,)](
            xd, wd, yd, M, N, K, programs, BM=BM, BN=BN, BK=BK, GROUP=GROUP_M, SUB=sub,
            IEEE=ieee, num_warps=warps, num_stages=stages)
    else:
        raise ValueError(f"matmul form {form!r}: one of {MATMUL_FORMS}")


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]ᵀ → [..., N] in x's dtype, batch-invariant: the Triton kernel on a
    GPU, matmul_tree elsewhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2):
        y = matmul_triton(x2, w.to(x2.dtype), x2.dtype)
    else:
        y = matmul_tree(x2, w).to(x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def _linear_forward(x, w, b):
    y = _MATMUL(x, w)
    return y if b is None else y + b


def _linear_backward(x, w, gy, need_x: bool, need_w: bool, need_b: bool):
    """(gx, gw, gb) of _linear_forward for its output's gradient gy, in PyTorch products (None
    where not needed)."""
    gx = gw = gb = None
    if need_x:
        gx = (gy @ w.to(gy.dtype)).to(x.dtype)
    g2 = gy.reshape(-1, gy.shape[-1])
    if need_w:
        gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(w.dtype)
    if need_b:
        gb = g2.float().sum(0).to(gy.dtype)
    return gx, gw, gb


class _Linear(torch.autograd.Function):
    """y = x·wᵀ (+ b) by the invariant `matmul`; the backward pass in plain PyTorch products."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _linear_forward(x, w, b)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        n = ctx.needs_input_grad
        return _linear_backward(x, w, gy, n[0], n[1], ctx.has_bias and n[2])


def _matmul_entry(x, w):
    return matmul(x, w)


# The product `linear` uses; tests swap it for a plain one to show the invariance checks catch it.
_MATMUL = _matmul_entry


def linear(x: torch.Tensor, w, b=None) -> torch.Tensor:
    """F.linear, batch-invariant; w may be a lora.LoRAWeight (its update made invariant by
    lora_weights)."""
    if isinstance(w, lora.LoRAWeight):
        return _Linear.apply(x, w.w, b) + w.delta(x)
    return _Linear.apply(x, w, b)


def lora_weights(sel, model, i: int, w: tuple) -> tuple:
    """Layer i's weights w with the adapters of sel (lora.One or lora.Rows) applied as
    batch-invariant updates, the same arithmetic for both: a row's update is
    linear(linear(x, A)·scale, B) of its own adapter. lora.Rows computes the updates of all its
    adapters at once with a block mask, whose sums run over the other adapters' (zero) columns
    too; here each adapter's update is computed for every row and each row keeps its own (a
    select, exact), so generation (Rows) and training (One) agree bit for bit."""
    if isinstance(sel, lora.One):
        ads, idx = [sel.ad], None
    else:
        ads, idx = list(sel.ads), sel.idx

    def update(t):
        parts = [(j, ad.a[i][t], ad.b[i][t], ad.cfg.scale) for j, ad in enumerate(ads)
                 if t in ad.a[i]]
        if not parts:
            return None

        def delta(x):
            out = None
            for j, A, B, s in parts:
                d = linear(linear(x, A) * s, B)
                if idx is not None:
                    keep = (idx == j + 1).view(-1, *([1] * (d.dim() - 1)))
                    d = torch.where(keep, d, torch.zeros_like(d))
                out = d if out is None else out + d
            return out
        return delta
    return lora._with_updates(model, w, update)


# ---- elementwise work in one kernel (a GPU's decode steps and training passes alike) ----
#
# The rotary embedding and the residual add in Triton kernels that round as the eager PyTorch
# operations round (each product and sum in fp32, rounded to the activation dtype where PyTorch
# rounds it): the same numbers, in one kernel where eager mode launches up to six (and a cast of
# the rotary tables a layer). Products of bf16 values are exact in fp32 and every step is
# rounded before the next, so no fused multiply-add can form. SwiGLU's forward is one kernel
# too, in every pass (its exp is Triton's, not the library's: the same function for the decode
# step and the trainer, not necessarily eager mode's last bit on a GPU), with its backward pass
# in one kernel (_SwiGLU). False: eager operations and autograd (determinism.py
# --fused-elementwise off).
FUSED_ELEMENTWISE = True

if HAVE_TRITON:
    @triton.jit
    def _rope_kernel(X, C, S, Y, Rc, H, D, sxr, sxh, scr, ssr, syr, syh, SIGN: tl.constexpr,
                     BH: tl.constexpr, BD: tl.constexpr):
        # Row r's H heads: y = x·cos + rotate_half(x)·sin (SIGN 1, model.apply_rope with the
        # tables cast to x's dtype), each product and the sum rounded to x's dtype; SIGN −1:
        # x·cos − rotate_half(x)·sin, the gradient of the former for tables whose two halves
        # are equal (inv_frequencies' tables are).
        r = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        half = D // 2
        m = (h[:, None] < H) & (d[None, :] < D)
        rd = tl.where(d < half, d + half, d - half)
        x = tl.load(X + r * sxr + h[:, None] * sxh + d[None, :], mask=m, other=0.0)
        xr = tl.load(X + r * sxr + h[:, None] * sxh + rd[None, :], mask=m, other=0.0)
        dt = x.dtype
        cr = r % Rc
        c = tl.load(C + cr * scr + d, mask=d < D, other=0.0).to(dt).to(tl.float32)
        s = tl.load(S + cr * ssr + d, mask=d < D, other=0.0).to(dt).to(tl.float32)
        xr = xr.to(tl.float32)
        rot = tl.where(d[None, :] < half, -xr, xr)
        a = (x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)
        b = (rot * s[None, :]).to(dt).to(tl.float32)
        if SIGN > 0:
            y = a + b
        else:
            y = a - b
        tl.store(Y + r * syr + h[:, None] * syh + d[None, :], y.to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _add_kernel(X, Yv, O, n, BLOCK: tl.constexpr):
        # model.residual_add: x + y in fp32, rounded to x's dtype.
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
        y = tl.load(Yv + i, mask=m, other=0.0).to(tl.float32)
        tl.store(O + i, (x + y).to(O.dtype.element_ty), mask=m)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int):
    H, D = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, H, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    c2, s2 = cos.reshape(-1, D), sin.reshape(-1, D)
    y = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if x3.shape[0]:
        _rope_kernel[(x3.shape[0],)](
            x3, c2, s2, y, c2.shape[0], H, D, x3.stride(0), x3.stride(1), c2.stride(0),
            s2.stride(0), y.stride(0), y.stride(1), SIGN=sign,
            BH=triton.next_power_of_2(H), BD=max(16, triton.next_power_of_2(D)), num_warps=4)
    return y.view(x.shape)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_launch(g, cos, sin, -1), None, None


def _rope_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    # The tables' rows are a suffix of x's row dimensions (broadcast over the rest), contiguous
    # along the head dimension; x in a 16-bit dtype (see FUSED_ELEMENTWISE).
    n = cos.dim() - 1
    return (x.dtype in (torch.bfloat16, torch.float16) and cos.stride(-1) == 1
            and x.dim() >= 2 + n and tuple(x.shape[x.dim() - 2 - n:-2]) == tuple(cos.shape[:-1])
            and x.shape[-1] % 2 == 0)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rope) -> torch.Tensor:
    """apply_rope(x, cos, sin) (model.apply_rope: x [..., heads, D], tables [..., D] in fp32,
    cast to x's dtype first) in _rope_kernel where use_triton and FUSED_ELEMENTWISE say so and
    the shapes fit; the same numbers."""
    if (FUSED_ELEMENTWISE and use_triton(x) and cos.shape == sin.shape
            and cos.stride() == sin.stride() and _rope_fits(x, cos)):
        return _Rope.apply(x, cos, sin)
    return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype))


def _add_launch(x, y):
    x1, y1 = x.contiguous().view(-1), y.contiguous().view(-1)
    o = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x1.numel()
    if n:
        _add_kernel[(triton.cdiv(n, 1024),)](x1, y1, o, n, BLOCK=1024, num_warps=4)
    return o


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return _add_launch(x, y)

    @staticmethod
    def backward(ctx, g):
        return g, g


def residual_add(x: torch.Tensor, y: torch.Tensor):
    """model.residual_add in _add_kernel where use_triton and FUSED_ELEMENTWISE say so (x and y
    of one dtype and shape); None elsewhere (the caller's operations)."""
    if (FUSED_ELEMENTWISE and use_triton(x) and x.dtype == y.dtype and x.shape == y.shape):
        return _Add.apply(x, y)
    return None


# The residual add after the attention and the MLP's norm in one kernel (two outputs: the sum,
# rounded as _add_kernel rounds it, and its norm, summed as _rms_kernel sums a row: the same
# chunks of ROW_BLOCK lanes, the same warps), in every pass alike. False: the two kernels
# (determinism.py --fused-add-norm off).
FUSED_ADD_NORM = True

if HAVE_TRITON:
    @triton.jit
    def _add_rms_kernel(X, Yv, S, W, Hn, N, eps, BLOCK: tl.constexpr):
        # Row r: s = x + y in fp32 rounded to S's dtype (model.residual_add), into S; then
        # _rms_kernel's arithmetic on s into Hn. The second pass adds x and y again (the same
        # bits) rather than reading S back, which other threads of the program wrote.
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * N + i, mask=i < N, other=0.0).to(tl.float32)
            y = tl.load(Yv + row * N + i, mask=i < N, other=0.0).to(tl.float32)
            sv = (x + y).to(S.dtype.element_ty)
            tl.store(S + row * N + i, sv, mask=i < N)
            sf = sv.to(tl.float32)
            acc += sf * sf
        r = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * N + i, mask=i < N, other=0.0).to(tl.float32)
            y = tl.load(Yv + row * N + i, mask=i < N, other=0.0).to(tl.float32)
            sv = (x + y).to(S.dtype.element_ty)
            w = tl.load(W + i, mask=i < N, other=0.0).to(tl.float32)
            z = (sv.to(tl.float32) * r).to(sv.dtype).to(tl.float32)
            tl.store(Hn + row * N + i, (w * z).to(Hn.dtype.element_ty), mask=i < N)


def add_rms_fits(x: torch.Tensor, y: torch.Tensor, weight) -> bool:
    """Whether add_rms_norm's kernel takes x + y and weight: FUSED_ADD_NORM, FUSED_ELEMENTWISE,
    row_kernels and RMS_BWD_TRITON; x and y of one dtype and shape, weight a plain tensor of
    that dtype and the rows' length."""
    return (FUSED_ADD_NORM and FUSED_ELEMENTWISE and row_kernels(x) and RMS_BWD_TRITON
            and x.shape[-1] <= RMS_BWD_MAX and x.dtype == y.dtype and x.shape == y.shape
            and isinstance(weight, torch.Tensor) and weight.dtype == x.dtype
            and weight.shape == x.shape[-1:])


def _add_rms_launch(x, y, weight, eps):
    x1, y1 = x.contiguous(), y.contiguous()
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = x.shape[-1]
    R = x1.numel() // max(1, N)
    if R:
        _add_rms_kernel[(R,)](x1, y1, s, weight.contiguous(), h, N, float(eps), BLOCK=ROW_BLOCK,
                              num_warps=4)
    return s, h


class _AddRMS(torch.autograd.Function):
    """add_rms_norm's kernel; the backward pass the norm's (rms_norm_backward_triton) with the
    sum's own gradient added in it, for x and y alike."""

    @staticmethod
    def forward(ctx, x, y, weight, eps):
        s, h = _add_rms_launch(x, y, weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps = eps
        return s, h

    @staticmethod
    def backward(ctx, gs, gh):
        s, weight = ctx.saved_tensors
        gx, gw = rms_norm_backward_triton(s, weight, gh, ctx.eps, res=gs)
        return gx, gx, gw, None


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight, eps: float):
    """(s, rms_norm(s, weight, eps)) for s = model.residual_add(x, y), in _add_rms_kernel where
    add_rms_fits; None elsewhere (the caller's operations)."""
    if not add_rms_fits(x, y, weight):
        return None
    return _AddRMS.apply(x, y, weight, eps)


# The q and k heads' norms (Qwen3's) and rope in one kernel a layer, reading the q/k/v product
# where it lies: per layer two _rms_kernel launches, two copies (q and k are strided views of the
# product, which _rows copies), and two _rope_kernel launches were six launches of a decode
# step's ~4 µs each. Every pass (decode steps, prefills, Score, the training layer and the
# operation-a-node layer) takes this kernel for its q and k, so a token's numbers are one
# function's whatever the pass. False: the two norms and two ropes (determinism.py
# --fused-qk off).
FUSED_QK = True

if HAVE_TRITON:
    @triton.jit
    def _qk_rope_kernel(X, WQ, WK, C, S, YQ, YK, Rc, HQ, HK, D, sxr, scr, ssr, sqr, skr, eps,
                        NORM: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        # Row r's HQ q heads and the HK k heads after them (head h at X + r·sxr + h·D): NORM,
        # each head's RMSNorm (model.rms_norm: the mean square in fp32, the head normalised and
        # rounded to X's dtype, then times its weight, WQ's or WK's, rounded again), then
        # rope as _rope_kernel rounds it (the rotated half's entries normalised alike from
        # their own loads); q heads into YQ's row, k heads into YK's.
        r = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        half = D // 2
        dm = d < D
        m = (h[:, None] < HQ + HK) & dm[None, :]
        rd = tl.where(d < half, d + half, d - half)
        xp = X + r * sxr + h[:, None] * D
        xv = tl.load(xp + d[None, :], mask=m, other=0.0)
        dt = xv.dtype
        x = xv.to(tl.float32)
        xr = tl.load(xp + rd[None, :], mask=m, other=0.0).to(tl.float32)
        if NORM:
            inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
            isq = h[:, None] < HQ
            w = tl.where(isq, tl.load(WQ + d, mask=dm, other=0.0).to(tl.float32)[None, :],
                         tl.load(WK + d, mask=dm, other=0.0).to(tl.float32)[None, :])
            wr = tl.where(isq, tl.load(WQ + rd, mask=dm, other=0.0).to(tl.float32)[None, :],
                          tl.load(WK + rd, mask=dm, other=0.0).to(tl.float32)[None, :])
            x = (w * (x * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (wr * (xr * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        cr = r % Rc
        c = tl.load(C + cr * scr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
        s = tl.load(S + cr * ssr + d, mask=dm, other=0.0).to(dt).to(tl.float32)
        rot = tl.where(d[None, :] < half, -xr, xr)
        a = (x * c[None, :]).to(dt).to(tl.float32)
        b = (rot * s[None, :]).to(dt).to(tl.float32)
        y = (a + b).to(YQ.dtype.element_ty)
        hd = h[:, None] * D + d[None, :]
        tl.store(YQ + r * sqr + hd, y, mask=m & (h[:, None] < HQ))
        tl.store(YK + r * skr + hd - HQ * D, y, mask=m & (h[:, None] >= HQ))


def _qk_rows(q: torch.Tensor, k: torch.Tensor):
    """q [..., HQ, D] and k [..., HK, D] as the kernel reads them, (q's rows [R, HQ, D], k's)
    where k's heads follow q's in each row (views of one q/k/v product) and the leading
    dimensions are one stride; else None."""
    HQ, D = q.shape[-2:]
    try:
        q3, k3 = q.view(-1, HQ, D), k.view(-1, k.shape[-2], D)
    except RuntimeError:
        return None
    e = q.element_size()
    if not (q3.shape[0] == k3.shape[0] and (q3.shape[0] < 2 or q3.stride(0) == k3.stride(0))
            and q3.stride()[1:] == (D, 1) and k3.stride()[1:] == (D, 1)
            and k.data_ptr() == q.data_ptr() + HQ * D * e):
        return None
    return q3, k3


def _qk_rope_launch(q3, k3, wq, wk, cos, sin, eps):
    R, HQ, D = q3.shape
    HK = k3.shape[1]
    c2, s2 = cos.reshape(-1, D), sin.reshape(-1, D)
    yq = torch.empty(R, HQ, D, dtype=q3.dtype, device=q3.device)
    yk = torch.empty(R, HK, D, dtype=q3.dtype, device=q3.device)
    norm = wq is not None
    if R:
        _qk_rope_kernel[(R,)](
            q3, wq if norm else q3, wk if norm else q3, c2, s2, yq, yk, c2.shape[0], HQ, HK, D,
            q3.stride(0), c2.stride(0), s2.stride(0), yq.stride(0), yk.stride(0), float(eps),
            NORM=norm, BH=triton.next_power_of_2(HQ + HK), BD=max(16, triton.next_power_of_2(D)),
            num_warps=4)
    return yq, yk


class _QKRope(torch.autograd.Function):
    """qk_rope's kernel; the backward pass rope's (_rope_kernel with SIGN −1) then the norms'
    (rms_norm_backward_triton), as for the operations one at a time."""

    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, eps):
        q3, k3 = _qk_rows(q, k)
        yq, yk = _qk_rope_launch(q3, k3, wq, wk, cos, sin, eps)
        ctx.save_for_backward(q, k, wq, wk, cos, sin)
        ctx.eps = eps
        return yq.view(q.shape), yk.view(k.shape)

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, wq, wk, cos, sin = ctx.saved_tensors
        dq, dk = _rope_launch(gq, cos, sin, -1), _rope_launch(gk, cos, sin, -1)
        if wq is None:
            return dq, dk, None, None, None, None, None
        dq, gwq = rms_norm_backward_triton(q, wq, dq, ctx.eps)
        dk, gwk = rms_norm_backward_triton(k, wk, dk, ctx.eps)
        return dq, dk, gwq, gwk, None, None, None


def qk_rope_fits(q: torch.Tensor, k: torch.Tensor, wq, wk, cos: torch.Tensor,
                 sin: torch.Tensor) -> bool:
    """Whether qk_rope's kernel takes q and k: use_triton, FUSED_QK and FUSED_ELEMENTWISE (and
    ROW_KERNELS, RMS_BWD_TRITON with norms: the norms' kernels), the shapes rope's kernel takes,
    norm weights (both or neither) plain tensors of q's dtype, k's heads after q's."""
    if not (FUSED_QK and FUSED_ELEMENTWISE and use_triton(q) and cos.shape == sin.shape
            and cos.stride() == sin.stride() and _rope_fits(q, cos) and _rope_fits(k, cos)
            and q.dtype == k.dtype and q.shape[:-2] == k.shape[:-2]
            and q.shape[-1] == k.shape[-1]):
        return False
    if (wq is None) != (wk is None):
        return False
    if wq is not None and not (
            ROW_KERNELS and RMS_BWD_TRITON and q.shape[-1] <= RMS_BWD_MAX
            and all(isinstance(t, torch.Tensor) and t.dtype == q.dtype
                    and t.shape == q.shape[-1:] and t.stride(-1) == 1 for t in (wq, wk))):
        return False
    return _qk_rows(q, k) is not None


def qk_rope(q: torch.Tensor, k: torch.Tensor, wq, wk, cos: torch.Tensor, sin: torch.Tensor,
            eps: float):
    """(rope(rms_norm(q, wq, eps)), rope(rms_norm(k, wk, eps))) (no norms where wq and wk are
    None) in _qk_rope_kernel where qk_rope_fits; None elsewhere (the caller's operations). q
    [..., HQ, D] and k [..., HK, D]: views of one q/k/v product (model.decode_pre's)."""
    if not qk_rope_fits(q, k, wq, wk, cos, sin):
        return None
    return _QKRope.apply(q, k, wq, wk, cos, sin, eps)


if HAVE_TRITON:
    @triton.jit
    def _swiglu_bwd_kernel(GU, GA, GG, I, sgu, sga, sgg, BLOCK: tl.constexpr):
        # The gradient of silu(gate)·up (gate, up: the two halves of a row of GU) for the
        # output's gradient ga, in fp32: d gate = ga·up·σ·(1 + gate·(1 − σ)), d up = ga·silu,
        # written into the row of GG as GU's halves lie.
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < I
        g = tl.load(GU + row * sgu + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * sgu + I + i, mask=m, other=0.0).to(tl.float32)
        ga = tl.load(GA + row * sga + i, mask=m, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        tl.store(GG + row * sgg + i, (ga * u * sig * (1.0 + g * (1.0 - sig))).to(
            GG.dtype.element_ty), mask=m)
        tl.store(GG + row * sgg + I + i, (ga * g * sig).to(GG.dtype.element_ty), mask=m)


    @triton.jit
    def _swiglu_kernel(GU, A, I, sgu, sa, BLOCK: tl.constexpr):
        # silu(gate)·up of a row of GU's two halves as the eager operations round it: silu in
        # fp32 (x / (1 + exp(−x))) rounded to the activations' dtype, then the product of the
        # two in fp32 rounded again.
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < I
        gr = tl.load(GU + row * sgu + i, mask=m, other=0.0)
        g = gr.to(tl.float32)
        u = tl.load(GU + row * sgu + I + i, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(gr.dtype).to(tl.float32)
        tl.store(A + row * sa + i, (s * u).to(A.dtype.element_ty), mask=m)


class _SwiGLU(torch.autograd.Function):
    """silu(gate)·up of gu's two halves in the eager operations (the same numbers), with
    _swiglu_bwd_kernel's backward pass: one kernel writing gu's gradient, where autograd of the
    eager form takes four (silu's, two products', the halves' concatenation)."""

    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return _swiglu_forward(gu)

    @staticmethod
    def backward(ctx, ga):
        gu, = ctx.saved_tensors
        return _swiglu_backward(gu, ga)


def _swiglu_forward(gu):
    """silu(gate)·up of gu's halves: in _swiglu_kernel (one kernel where eager mode takes two)
    where use_triton says so, for every pass alike (decode steps, prefills, Score and the
    training layer), so that a token's activations are one function's whatever the pass."""
    if use_triton(gu) and gu.dtype in (torch.bfloat16, torch.float16):
        gu2 = _rows(gu)
        I = gu2.shape[1] // 2
        a = torch.empty(gu2.shape[0], I, dtype=gu.dtype, device=gu.device)
        if gu2.shape[0]:
            _swiglu_kernel[(gu2.shape[0], triton.cdiv(I, 1024))](
                gu2, a, I, gu2.stride(0), a.stride(0), BLOCK=1024, num_warps=4)
        return a.view(*gu.shape[:-1], I)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(gu, ga):
    gu2, ga2 = _rows(gu), _rows(ga)
    I = ga2.shape[1]
    gg = torch.empty(gu2.shape, dtype=gu.dtype, device=gu.device)
    if gu2.shape[0]:
        _swiglu_bwd_kernel[(gu2.shape[0], triton.cdiv(I, 1024))](
            gu2, ga2, gg, I, gu2.stride(0), ga2.stride(0), gg.stride(0), BLOCK=1024,
            num_warps=4)
    return gg.view(gu.shape)


def swiglu(gu: torch.Tensor):
    """silu(gate)·up of gu's halves with _SwiGLU's backward pass where use_triton and
    FUSED_ELEMENTWISE say so; None elsewhere (the caller's operations)."""
    if FUSED_ELEMENTWISE and use_triton(gu) and gu.shape[-1] % 2 == 0:
        return _SwiGLU.apply(gu)
    return None


if HAVE_TRITON:
    @triton.jit
    def _kv_write_kernel(K, V, KC, VC, P, H, D, skb, skh, svb, svh, scb, sch, scl,
                         BH: tl.constexpr, BD: tl.constexpr):
        # Row b's new key and value ([H, D] each) into its cache row at position P[b]: copies.
        b = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        m = (h[:, None] < H) & (d[None, :] < D)
        at = b * scb + h[:, None] * sch + tl.load(P + b) * scl + d[None, :]
        k = tl.load(K + b * skb + h[:, None] * skh + d[None, :], mask=m)
        tl.store(KC + at, k, mask=m)
        v = tl.load(V + b * svb + h[:, None] * svh + d[None, :], mask=m)
        tl.store(VC + at, v, mask=m)


def kv_write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> bool:
    """A decode step's cache writes (model.decode_layer's two indexed copies and their row
    index) in _kv_write_kernel: k and v [B, kv_heads, D] into rows [0, B) of the caches
    [slots, kv_heads, length, D] at positions pos [B]; the same bytes. False (nothing written)
    where use_triton and FUSED_ELEMENTWISE say no or the dtypes or layouts differ."""
    if not (FUSED_ELEMENTWISE and use_triton(k) and k.dim() == 3
            and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and pos.dtype == torch.int64):
        return False
    B, H, D = k.shape
    if B:
        _kv_write_kernel[(B,)](k, v, k_cache, v_cache, pos.contiguous(), H, D, k.stride(0),
                               k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                               k_cache.stride(1), k_cache.stride(2),
                               BH=triton.next_power_of_2(H), BD=max(16, triton.next_power_of_2(D)),
                               num_warps=4)
    return True


# ---- RMSNorm and the log-prob head ----

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.rms_norm (fp32, cast back, then the weight) with the mean square summed by
    tree_sum; where row_kernels says so, all of it in one Triton kernel a row."""
    if row_kernels(x) and weight.shape == x.shape[-1:]:
        return _RMSNorm.apply(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    ms = row_sum(x32 * x32) / x.shape[-1]
    x32 = x32 * torch.rsqrt(ms + eps)[..., None]
    return weight * x32.to(dtype)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log Σ exp over the last dimension of x (fp32 result), summed by tree_sum in fp32 (by the
    Triton part kernels, on x as it is, where row_kernels says so)."""
    if row_kernels(x):
        return _LogSumExp.apply(x)
    x = x.float()
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m[..., 0] + torch.log(tree_sum(torch.exp(x - m)))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The temperature-1 log-prob of each row's target: logits [N, V] (any dtype, read in fp32),
    targets [N] → [N] fp32. What the sampler reports and the trainer computes (the log-sum-exp
    of the logits as they are: the sampler's, the trainer's and Score's in one dtype)."""
    lp = logits.gather(-1, targets[:, None]).squeeze(-1).float()
    return lp - logsumexp(logits)


def _head_rows(logits: torch.Tensor) -> int:
    # Row chunks of ~16 M fp32 entries on the CPU, ~1 G on a GPU (few launches a pass).
    return max(1, (_CHUNK << (6 if logits.is_cuda else 2)) // max(1, logits.shape[-1]))


if HAVE_TRITON:
    @triton.jit
    def _head_bwd_kernel(X, T, LSE, ENT, GLP, GENT, GX, N, sx, sgx, ENTROPY: tl.constexpr,
                         BLOCK: tl.constexpr):
        # A row's gradient of (log-prob of its target, entropy) in one pass over its logits:
        # glp·(1[target] − p) − gent·p·(log p + entropy), p = exp(x − lse), in fp32, written in
        # the logits' dtype.
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(T + row)
        lse = tl.load(LSE + row)
        glp = tl.load(GLP + row)
        ent = tl.load(ENT + row)
        gent = tl.load(GENT + row)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            im = i < N
            lsm = tl.load(X + row * sx + i, mask=im, other=0.0).to(tl.float32) - lse
            p = tl.exp(lsm)
            gx = tl.where(i == t, glp, 0.0) - glp * p
            if ENTROPY:
                gx -= gent * p * (lsm + ent)
            tl.store(GX + row * sgx + i, gx.to(GX.dtype.element_ty), mask=im)


if HAVE_TRITON:
    @triton.jit
    def _entropy_kernel(X, LSE, Y, N, sx, BLOCK: tl.constexpr):
        # A row's entropy −Σ p·log p, log p = x − lse, in one pass (lanes summed as
        # _row_sum_kernel sums).
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(LSE + row)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            lsm = tl.load(X + row * sx + i, mask=i < N, other=0.0).to(tl.float32) - lse
            acc += tl.where(i < N, tl.exp(lsm) * lsm, 0.0)
        tl.store(Y + row, -tl.sum(acc, axis=0))


def entropy_triton(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The entropy of each row of logits x [N, V] with log-sum-exp lse [N] (fp32, no
    gradient), in _entropy_kernel."""
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _entropy_kernel[(x2.shape[0],)](x2, lse.contiguous(), y, x2.shape[1], x2.stride(0),
                                        BLOCK=ROW_BLOCK, num_warps=4)
    return y


# The log-prob head's backward pass on a GPU: _head_bwd_kernel, one pass over the logits,
# instead of autograd of the chunked fp32 form (a dozen passes over the logits, the row chunks'
# gradients put into full-size zero tensors and added), and its entropy in one pass instead of
# four (determinism.py --head-bwd torch).
HEAD_BWD_TRITON = True


class _HeadLogprobs(torch.autograd.Function):
    """token_logprobs_entropy's forward (the same operations, so the same log-probs; the
    entropy, which no identity involves, in one pass of _entropy_kernel), with
    _head_bwd_kernel's backward pass. Saves the logits and each row's log-sum-exp, not the
    fp32 copies."""

    @staticmethod
    def forward(ctx, logits, targets, entropy_grad):
        lps, ents, lses = [], [], []
        rows = _head_rows(logits)
        for i in range(0, logits.shape[0], rows):
            x = logits[i:i + rows]  # read in fp32 by the kernels: no fp32 copy
            lse = logsumexp_triton(x)
            lps.append(x.gather(-1, targets[i:i + rows, None]).squeeze(-1).float() - lse)
            ents.append(entropy_triton(x, lse))
            lses.append(lse)
        lp, ent = torch.cat(lps), torch.cat(ents)
        ctx.save_for_backward(logits, targets, torch.cat(lses), ent)
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        logits, targets, lse, ent = ctx.saved_tensors
        x = _rows(logits)
        N, V = x.shape
        glp = torch.zeros_like(lse) if glp is None else glp.float().contiguous()
        use_ent = ctx.entropy_grad and gent is not None
        gent = gent.float().contiguous() if use_ent else glp
        gx = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
        _head_bwd_kernel[(N,)](x, targets.contiguous(), lse, ent, glp, gent, gx, V, x.stride(0),
                               gx.stride(0), ENTROPY=use_ent, BLOCK=ROW_BLOCK, num_warps=4)
        return gx, None, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool):
    """(token_logprobs, entropy) for the trainer, the entropy from the same log-softmax; rows in
    chunks so that the fp32 copies stay bounded (_HeadLogprobs where row_kernels says so and
    HEAD_BWD_TRITON)."""
    if logits.shape[0] and HEAD_BWD_TRITON and row_kernels(logits):
        return _HeadLogprobs.apply(logits, targets, entropy_grad and torch.is_grad_enabled())
    lps, ents = [], []
    rows = _head_rows(logits)
    for i in range(0, logits.shape[0], rows):
        lse = logsumexp(logits[i:i + rows])
        x = logits[i:i + rows].float()
        lps.append(x.gather(-1, targets[i:i + rows, None]).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            lsm = x - lse[:, None]
            ents.append(-row_sum(lsm.exp() * lsm))
    if not lps:
        z = logits.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(lps), torch.cat(ents)


# ---- the sampler ----

def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sampling._inverse_cdf with its sums in a fixed order: the first index whose running sum
    reaches u·(row sum), never an index of weight 0."""
    B, V = w.shape
    C = 1024
    while C >= 64 and V % C:
        C //= 2
    if C < 64 or V // C < 2:
        c = prefix_sum(w)
        target = torch.minimum(u * c[:, -1], c[:, -1])[:, None].contiguous()
        return torch.searchsorted(c, target).squeeze(1).clamp(max=V - 1)
    blocks = w.view(B, V // C, C)
    cmass = prefix_sum(row_sum(blocks))
    target = (u * cmass[:, -1])[:, None].contiguous()
    j = torch.searchsorted(cmass, target).clamp(max=V // C - 1)
    before = torch.where(j > 0, cmass.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    inner = prefix_sum(blocks.gather(1, j[:, :, None].expand(B, 1, C)).squeeze(1))
    rest = torch.minimum(target - before, inner[:, -1:]).contiguous()
    k = torch.searchsorted(inner, rest).clamp(max=C - 1)
    return (j * C + k).squeeze(1)


if HAVE_TRITON:
    @triton.jit
    def _sample_part_kernel(X, PM, T, PW, PA, N, sx, P, BLOCK: tl.constexpr, BP: tl.constexpr):
        # Part p of a row for the sampler: the part's mass Σ exp((x − M)/t) (M the row's maximum
        # from _lse_part_kernel's part maxima, t the row's temperature, 1 for a greedy row) and
        # the first index of the part's maximum, into PW and PA [rows, P].
        row = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        j = tl.arange(0, BP)
        m = tl.max(tl.load(PM + row * P + j, mask=j < P, other=float("-inf")), axis=0)
        m = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
        t = tl.load(T + row)
        t = tl.where(t <= 0.0, 1.0, t)
        i = p * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row * sx + i, mask=i < N, other=float("-inf")).to(tl.float32)
        w = tl.where(i < N, tl.exp((x - m) / t), 0.0)
        tl.store(PW + row * P + p, tl.sum(w, axis=0))
        tl.store(PA + row * P + p, p * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))

    @triton.jit
    def _sample_pick_kernel(X, PM, PW, PA, LSE, T, U, TOK, LP, N, sx, P, BLOCK: tl.constexpr,
                            BP: tl.constexpr):
        # A row's draw by the inverse CDF at u over its parts' masses (_sample_part_kernel's):
        # the first part whose running mass reaches u·(total), then in that part the first
        # entry whose running sum reaches the rest (never an entry of weight 0); a greedy row
        # (t ≤ 0) the first index of its maximum. Its log-prob x[token] − LSE[row].
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BP)
        pm = tl.load(PM + row * P + j, mask=j < P, other=float("-inf"))
        m = tl.max(pm, axis=0)
        mr = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
        t0 = tl.load(T + row)
        t = tl.where(t0 <= 0.0, 1.0, t0)
        cm = tl.cumsum(tl.load(PW + row * P + j, mask=j < P, other=0.0), axis=0)
        total = tl.sum(tl.where(j == P - 1, cm, 0.0), axis=0)
        target = tl.load(U + row) * total
        sel = tl.minimum(tl.sum(((cm < target) & (j < P)).to(tl.int32), axis=0), P - 1)
        before = tl.sum(tl.where(j == sel - 1, cm, 0.0), axis=0)
        k = tl.arange(0, BLOCK)
        i = sel * BLOCK + k
        x = tl.load(X + row * sx + i, mask=i < N, other=float("-inf")).to(tl.float32)
        inner = tl.cumsum(tl.where(i < N, tl.exp((x - mr) / t), 0.0), axis=0)
        last = tl.sum(tl.where(k == BLOCK - 1, inner, 0.0), axis=0)
        # Rounding can leave the rest just above the part's own total: the last entry with
        # weight then takes it.
        rest = tl.minimum(target - before, last)
        tok = sel * BLOCK + tl.minimum(tl.sum((inner < rest).to(tl.int32), axis=0), BLOCK - 1)
        # A greedy row: the first part holding the row's maximum, its first index of it.
        first = tl.min(tl.where(pm == m, j, BP), axis=0)
        amax = tl.load(PA + row * P + tl.minimum(first, P - 1))
        tok = tl.where(t0 <= 0.0, amax, tl.minimum(tok, N - 1))
        lp = tl.load(X + row * sx + tok).to(tl.float32) - tl.load(LSE + row)
        tl.store(TOK + row, tok.to(tl.int64))
        tl.store(LP + row, lp)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor):
    """The draws of `sample` without top-p in the Triton kernels: the logits (any float dtype,
    read in fp32) in VOCAB_PART parts, a program a part, for the log-sum-exp (logsumexp_triton's
    two kernels) and the parts' masses, then a program a row for the draw. Returns (tokens [B]
    int64, logprobs [B] fp32)."""
    x2 = _rows(logits)
    B, N = x2.shape
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return tok, lp
    pm, ps = _lse_parts(x2)
    P = pm.shape[1]
    BP = max(16, triton.next_power_of_2(P))
    lse = torch.empty(B, dtype=torch.float32, device=logits.device)
    _lse_combine_kernel[(B,)](pm, ps, lse, P, BP=BP, num_warps=4)
    t = temperature.float().contiguous()
    pw = torch.empty(B, P, dtype=torch.float32, device=logits.device)
    pa = torch.empty(B, P, dtype=torch.int32, device=logits.device)
    _sample_part_kernel[(B, P)](x2, pm, t, pw, pa, N, x2.stride(0), P, BLOCK=VOCAB_PART, BP=BP,
                                num_warps=4)
    _sample_pick_kernel[(B,)](x2, pm, pw, pa, lse, t, u.float().contiguous(), tok, lp, N,
                              x2.stride(0), P, BLOCK=VOCAB_PART, BP=BP, num_warps=4)
    return tok, lp


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           u: torch.Tensor, use_top_p: bool):
    """sampling.sample (the same draws by the inverse CDF at u) with its sums in a fixed order
    and the log-probs of token_logprobs. Returns (tokens [B] int64, logprobs [B] fp32). Where
    row_kernels says so, the rows without top-p in sample_triton's kernels (which read the
    logits in their own dtype: pass them unconverted)."""
    if row_kernels(logits) and logits.dim() == 2:
        tokens, lps = sample_triton(logits, temperature, u)
        if not use_top_p:
            return tokens, lps
        x = logits.float()
        greedy = temperature <= 0
        t = torch.where(greedy, torch.ones_like(temperature), temperature)
        w = torch.exp((x - x.amax(-1, keepdim=True)) / t[:, None])
        nucleus = _nucleus(w, top_p, u)
        tokens = torch.where((top_p < 1) & ~greedy, nucleus, tokens)
        return tokens, token_logprobs(logits, tokens)
    x = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    w = torch.exp((x - x.amax(-1, keepdim=True)) / t[:, None])
    tokens = _inverse_cdf(w, u)
    if use_top_p:
        tokens = torch.where(top_p < 1, _nucleus(w, top_p, u), tokens)
    tokens = torch.where(greedy, x.argmax(dim=-1), tokens)
    return tokens, token_logprobs(logits, tokens)


def _nucleus(w: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw at u from the smallest prefix of w sorted (descending, stable) whose mass
    reaches top_p, sums in a fixed order."""
    ws, order = w.sort(dim=-1, descending=True, stable=True)
    before = prefix_sum(ws) - ws
    ws = ws * (before < top_p[:, None] * row_sum(ws)[:, None])
    return order.gather(1, _inverse_cdf(ws, u)[:, None]).squeeze(1)


# ---- attention ----

def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`attention` in PyTorch operations (any device; the CPU's path)."""
    B, Tq, H, D = q.shape
    KV, Lk = k.shape[1], k.shape[2]
    G = H // KV
    qg = q.float().reshape(B, Tq, KV, G, 1, D)
    m = torch.full((B, Tq, KV, G), float("-inf"), device=q.device)
    l = torch.zeros((B, Tq, KV, G), device=q.device)
    acc = torch.zeros((B, Tq, KV, G, D), device=q.device)
    for c0 in range(0, Lk, KV_SPLIT):
        kc = k[:, :, c0:c0 + KV_SPLIT].float()[:, None, :, None]  # [B, 1, KV, 1, s, D]
        vc = v[:, :, c0:c0 + KV_SPLIT].float()[:, None, :, None]
        s = kc.shape[-2]
        seen = (c0 + torch.arange(s, device=q.device))[None, None, :] <= q_pos[:, :, None]
        seen = seen[:, :, None, None, :]  # [B, Tq, 1, 1, s]
        scores = tree_sum(qg * kc) * scale  # [B, Tq, KV, G, s]
        scores = torch.where(seen, scores, torch.full_like(scores, float("-inf")))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.where(seen, torch.exp(scores - m_new[..., None]), torch.zeros_like(scores))
        pv = torch.where(seen[..., None], p[..., None] * vc, torch.zeros((), device=q.device))
        l = l * alpha + tree_sum(p)
        acc = acc * alpha[..., None] + tree_sum(pv.transpose(-1, -2))
        m = m_new
    return (acc / l[..., None]).reshape(B, Tq, H, D).to(q.dtype)


if HAVE_TRITON:
    @triton.jit(do_not_specialize=["Tq", "Lk"])
    def _attention_kernel(Q, K, V, O, P, LSE, Tq, H, G, Lk, D, scale,
                          sqb, sqt, sqh, skb, skh, skl, svb, svh, svl, sob, sot, soh,
                          BM: tl.constexpr, S: tl.constexpr, BD: tl.constexpr,
                          IEEE: tl.constexpr, HG: tl.constexpr, STORE_LSE: tl.constexpr):
        # BM rows of one sequence over their keys in chunks of S positions from position 0,
        # combined in order by the online softmax in fp32. A row is a (query, head) pair: the HG
        # heads of program_id(1)'s group (HG = G: the query heads sharing one key head, whose
        # keys and values are then read once for all of them; HG = 1: one head) for consecutive
        # queries (a decode step: one query, the rest of the block masked). A row's numbers come
        # from its own query alone (the products are tile products of one shape), and a chunk
        # past a row's position is an exact no-op for it: any batch, cache length or block gives
        # a row the same result.
        pid, hg = tl.program_id(0), tl.program_id(1)
        nblk = tl.cdiv(Tq * HG, BM)
        b, r0 = pid // nblk, (pid % nblk) * BM
        r = r0 + tl.arange(0, BM)
        tm = r < Tq * HG
        t = r // HG
        h = hg * HG + r % HG
        kvh = (hg * HG) // G
        d = tl.arange(0, BD)
        dm = d < D
        pos = tl.load(P + b * Tq + t, mask=tm, other=-1)
        q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + d[None, :],
                    mask=tm[:, None] & dm[None, :], other=0.0)
        m = tl.full((BM,), float("-inf"), tl.float32)
        l = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, BD), tl.float32)
        pmax = tl.max(pos, axis=0)
        end = tl.minimum(pmax + 1, Lk)
        for c0 in range(0, end, S):
            j = c0 + tl.arange(0, S)
            # Keys past the block's last position may be anything (a cache row's stale or unset
            # entries): read as 0, so that 0·value stays 0 in the products.
            jm = (j < Lk) & (j <= pmax)
            k = tl.load(K + b * skb + kvh * skh + j[None, :] * skl + d[:, None],
                        mask=jm[None, :] & dm[:, None], other=0.0)  # [BD, S]
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            seen = (j[None, :] <= pos[:, None]) & jm[None, :]
            s = tl.where(seen, s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # (A row that has seen no key yet, a block's padding: m_new is -inf; nothing changes.)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_ref))
            p = tl.where(seen, tl.exp(s - m_ref[:, None]), 0.0)
            v = tl.load(V + b * svb + kvh * svh + j[:, None] * svl + d[None, :],
                        mask=jm[:, None] & dm[None, :], other=0.0)  # [S, BD]
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(O + b * sob + t[:, None] * sot + h[:, None] * soh + d[None, :],
                 out.to(O.dtype.element_ty), mask=tm[:, None] & dm[None, :])
        if STORE_LSE:
            # A training pass: each row's log-sum-exp of its scaled scores for the backward
            # pass ([B, Tq, H]; 0 for a row that saw no key), the output unchanged.
            lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), 0.0)
            tl.store(LSE + (b * Tq + t) * H + h, lse, mask=tm)

# Rows a program of the Triton attention takes: the same block shape for a decode step (one
# query) and a training pass (every position), so a row's products are alike in both.
ATTN_BM = 16
# Whether a program's rows are the query heads sharing a key head (each key and value read once
# for the group: half the reads of Qwen3-0.6B's decode) or one head's queries
# (determinism.py --attn-grouped off).
ATTN_GROUPED = True
# An experiment (determinism.py --attn-large BM,warps): another block (rows, warps) for passes of
# at least ATTN_LARGE_Q queries a sequence (training, prefills), the 64-key chunks and their
# order alike. Whether a row's numbers are then those of a decode step's 16-row block is the
# matrix instruction's property, not guaranteed: the device's check says.
ATTN_LARGE: tuple | None = None
ATTN_LARGE_Q = 64


def attention_triton(q, k, v, q_pos, scale, lse=None):
    """`attention` in _attention_kernel (one program per ATTN_BM queries and head). lse: an
    fp32 [B, Tq, H] tensor that takes each row's log-sum-exp (a training pass's, for
    attention_backward_triton); the output is the same with it or without."""
    B, Tq, H, D = q.shape
    KV, Lk = k.shape[1], k.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device)
    pos = q_pos.to(torch.int64).contiguous().view(-1)
    G = H // KV
    BM, warps = (ATTN_BM, 4) if ATTN_LARGE is None or Tq < ATTN_LARGE_Q else ATTN_LARGE
    HG = G if ATTN_GROUPED and G <= BM else 1
    _attention_kernel[(B * triton.cdiv(Tq * HG, BM), H // HG)](
        q, k, v, o, pos, o if lse is None else lse, Tq, H, G, Lk, D, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        BM=BM, S=KV_SPLIT, BD=max(16, triton.next_power_of_2(D)),
        IEEE=q.dtype == torch.float32, HG=HG, STORE_LSE=lse is not None, num_warps=warps)
    return o


# ---- the attention's backward pass (training) ----
#
# The gradient of the forward's function (softmax(q·kᵀ·scale) over the keys a query sees, times
# v), flash-attention-2 style: one kernel for dQ (a program a block of queries and a head, over
# its keys), then one for dK and dV (a program a block of keys and a key head, over the queries
# of its query heads). Each gradient element is summed by one program in a fixed order, with no
# atomics: two equal calls give equal gradients, whatever the device's scheduling. Not
# batch-invariant (the trainer's log-probs come from the forward, which is).

if HAVE_TRITON:
    @triton.jit
    def _bwd_dot(a, b, F32DOT: tl.constexpr):
        # F32DOT: the product in fp32 (IEEE) of the operands read as fp32: fp32 tensors, and
        # bf16 ones under Triton's interpreter (whose product of bf16 reads their bits).
        if F32DOT:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _bwd_p_ds(s, dp, lse, delta, jj, pp, jmm, scale, MASKED: tl.constexpr):
        # P = exp(s·scale − lse) and dS = P·(dP − delta) of a block of scores s (lse and delta
        # broadcast to s's shape), zero where the query does not see the key (jj > pp, or jmm
        # false); MASKED False: a block whose queries see all its keys, the same numbers
        # without the masks' work.
        if MASKED:
            seen = (jj <= pp) & jmm
            p = tl.where(seen, tl.exp(s * scale - lse), 0.0)
            ds = tl.where(seen, p * (dp - delta), 0.0)
        else:
            p = tl.exp(s * scale - lse)
            ds = p * (dp - delta)
        return p, ds

    @triton.jit
    def _dq_keys(dq, q, do, lse, delta, pos, K, V, b, kvh, skb, skh, skl, svb, svh, svl, d, dm,
                 start, stop, pmax, Lk, scale, BN: tl.constexpr, F32DOT: tl.constexpr,
                 MASKED: tl.constexpr):
        # dQ of a block of queries added over the key blocks [start, stop) in order
        # (_attention_bwd_dq_kernel's loop); MASKED False: blocks whose keys every query sees,
        # loaded and scored without the masks.
        for c0 in range(start, stop, BN):
            j = c0 + tl.arange(0, BN)
            if MASKED:
                jm = (j < Lk) & (j <= pmax)
                km = jm[None, :] & dm[:, None]
            else:
                jm = j < Lk
                km = dm[:, None]
            k = tl.load(K + b * skb + kvh * skh + j[None, :] * skl + d[:, None], mask=km,
                        other=0.0)  # [BD, BN]
            vt = tl.load(V + b * svb + kvh * svh + j[None, :] * svl + d[:, None], mask=km,
                         other=0.0)  # [BD, BN]
            s = _bwd_dot(q, k, F32DOT)
            dp = _bwd_dot(do, vt, F32DOT)
            p, ds = _bwd_p_ds(s, dp, lse[:, None], delta[:, None], j[None, :], pos[:, None],
                              jm[None, :], scale, MASKED=MASKED)
            dq += _bwd_dot(ds.to(k.dtype), tl.trans(k), F32DOT)
        return dq

    @triton.jit(do_not_specialize=["Tq", "Lk"])
    def _attention_bwd_dq_kernel(Q, K, V, O, DO, P, DQ, LSE, DELTA, Tq, H, G, Lk, D, scale,
                                 sqb, sqt, sqh, skb, skh, skl, svb, svh, svl,
                                 sob, sot, soh, sdb, sdt, sdh,
                                 BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                                 F32DOT: tl.constexpr, HAVE_LSE: tl.constexpr,
                                 FULL_BLOCKS: tl.constexpr):
        # BM queries of one head: first their log-sum-exp over the keys they see (online, in
        # fp32; HAVE_LSE: the forward's, read from LSE) and delta = Σ dO·O, both kept for the
        # dK/dV kernel; then dQ = scale · Σ_j P·(dP − delta)·k_j over the same keys, with
        # dP = dO·vᵀ.
        pid, h = tl.program_id(0), tl.program_id(1)
        nblk = tl.cdiv(Tq, BM)
        b, t0 = pid // nblk, (pid % nblk) * BM
        t = t0 + tl.arange(0, BM)
        tm = t < Tq
        kvh = h // G
        d = tl.arange(0, BD)
        dm = d < D
        qm = tm[:, None] & dm[None, :]
        pos = tl.load(P + b * Tq + t, mask=tm, other=-1)
        q = tl.load(Q + b * sqb + t[:, None] * sqt + h * sqh + d[None, :], mask=qm, other=0.0)
        do = tl.load(DO + b * sdb + t[:, None] * sdt + h * sdh + d[None, :], mask=qm, other=0.0)
        o = tl.load(O + b * sob + t[:, None] * sot + h * soh + d[None, :], mask=qm, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        pmax = tl.max(pos, axis=0)
        end = tl.minimum(pmax + 1, Lk)
        r = (b * Tq + t) * H + h
        if HAVE_LSE:
            lse = tl.load(LSE + r, mask=tm, other=0.0)
        else:
            m = tl.full((BM,), float("-inf"), tl.float32)
            l = tl.zeros((BM,), tl.float32)
            for c0 in range(0, end, BN):
                j = c0 + tl.arange(0, BN)
                jm = (j < Lk) & (j <= pmax)
                k = tl.load(K + b * skb + kvh * skh + j[None, :] * skl + d[:, None],
                            mask=jm[None, :] & dm[:, None], other=0.0)  # [BD, BN]
                s = _bwd_dot(q, k, F32DOT)
                seen = (j[None, :] <= pos[:, None]) & jm[None, :]
                s = tl.where(seen, s * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                l = l * tl.exp(m - m_ref) + tl.sum(
                    tl.where(seen, tl.exp(s - m_ref[:, None]), 0.0), axis=1)
                m = m_new
            # A query that sees no key (a padding row) has output 0 and no gradient: P is 0.
            lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), 0.0)
        dq = tl.zeros((BM, BD), tl.float32)
        # FULL_BLOCKS: the key blocks whose keys every query sees (c0 + BN − 1 ≤ the block's
        # smallest position, inside Lk) come first, in a loop of their own without the masks'
        # work; the rest in the masked loop. Two loops rather than a branch in one: Triton's
        # software pipeliner fails on a branch around the blocks' arithmetic (sm_90, aligned
        # operands; test_deterministic_kernels_compile_for_sm90).
        full_end = 0
        if FULL_BLOCKS:
            full_end = tl.maximum(tl.minimum((tl.min(pos, axis=0) + 1) // BN, Lk // BN), 0) * BN
            full_end = tl.minimum(full_end, end)
            dq = _dq_keys(dq, q, do, lse, delta, pos, K, V, b, kvh, skb, skh, skl, svb, svh, svl,
                          d, dm, 0, full_end, pmax, Lk, scale, BN, F32DOT, MASKED=False)
        dq = _dq_keys(dq, q, do, lse, delta, pos, K, V, b, kvh, skb, skh, skl, svb, svh, svl, d,
                      dm, full_end, end, pmax, Lk, scale, BN, F32DOT, MASKED=True)
        tl.store(DQ + b * sqb + t[:, None] * sqt + h * sqh + d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=qm)
        if not HAVE_LSE:
            tl.store(LSE + r, lse, mask=tm)
        tl.store(DELTA + r, delta, mask=tm)

    @triton.jit
    def _dkdv_heads(dk, dv, Q, DO, LSE, DELTA, k, v, t, tm, qm, pos, j, jm, d, b, kvh, Tq, H, G,
                    sqb, sqt, sqh, sdb, sdt, sdh, scale, F32DOT: tl.constexpr,
                    MASKED: tl.constexpr):
        # dK and dV of a block of keys (k, v) added over one block of queries t of the G query
        # heads sharing their key head (_attention_bwd_dkdv_kernel's inner loop).
        for hi in range(0, G):
            h = kvh * G + hi
            q = tl.load(Q + b * sqb + t[:, None] * sqt + h * sqh + d[None, :], mask=qm, other=0.0)
            do = tl.load(DO + b * sdb + t[:, None] * sdt + h * sdh + d[None, :], mask=qm,
                         other=0.0)
            r = (b * Tq + t) * H + h
            lse = tl.load(LSE + r, mask=tm, other=0.0)
            delta = tl.load(DELTA + r, mask=tm, other=0.0)
            st = _bwd_dot(k, tl.trans(q), F32DOT)
            dpt = _bwd_dot(v, tl.trans(do), F32DOT)
            pt, dst = _bwd_p_ds(st, dpt, lse[None, :], delta[None, :], j[:, None], pos[None, :],
                                jm[:, None], scale, MASKED=MASKED)
            dv += _bwd_dot(pt.to(do.dtype), do, F32DOT)
            dk += _bwd_dot(dst.to(q.dtype), q, F32DOT)
        return dk, dv

    @triton.jit(do_not_specialize=["Tq", "Lk"])
    def _attention_bwd_dkdv_kernel(Q, K, V, DO, P, LSE, DELTA, DK, DV, Tq, H, G, Lk, D, scale,
                                   sqb, sqt, sqh, skb, skh, skl, svb, svh, svl, sdb, sdt, sdh,
                                   sgb, sgh, sgl, sub, suh, sul,
                                   BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                                   F32DOT: tl.constexpr, FULL_BLOCKS: tl.constexpr):
        # BN keys of one key head: dV = Σ Pᵀ·dO and dK = scale · Σ (P·(dP − delta))ᵀ·q over the
        # queries of the G heads sharing it, block by block in order (blocks whose queries all
        # come before the keys skipped: they see none of them).
        pid, kvh = tl.program_id(0), tl.program_id(1)
        nblk = tl.cdiv(Lk, BN)
        b, j0 = pid // nblk, (pid % nblk) * BN
        j = j0 + tl.arange(0, BN)
        jm = j < Lk
        d = tl.arange(0, BD)
        dm = d < D
        km = jm[:, None] & dm[None, :]
        k = tl.load(K + b * skb + kvh * skh + j[:, None] * skl + d[None, :], mask=km, other=0.0)
        v = tl.load(V + b * svb + kvh * svh + j[:, None] * svl + d[None, :], mask=km, other=0.0)
        dk = tl.zeros((BN, BD), tl.float32)
        dv = tl.zeros((BN, BD), tl.float32)
        for t0 in range(0, Tq, BM):
            t = t0 + tl.arange(0, BM)
            tm = t < Tq
            pos = tl.load(P + b * Tq + t, mask=tm, other=-1)
            if tl.max(pos, axis=0) >= j0:
                # Every query of the block sees every key of this program's: no masks.
                full = (tl.min(pos, axis=0) >= j0 + BN - 1) & (j0 + BN <= Lk)
                qm = tm[:, None] & dm[None, :]
                # The branch outside the heads' loop, each side a loop without one: Triton's
                # software pipeliner fails on a branch around the blocks' arithmetic.
                if FULL_BLOCKS and full:
                    dk, dv = _dkdv_heads(dk, dv, Q, DO, LSE, DELTA, k, v, t, tm, qm, pos, j, jm,
                                         d, b, kvh, Tq, H, G, sqb, sqt, sqh, sdb, sdt, sdh,
                                         scale, F32DOT, MASKED=False)
                else:
                    dk, dv = _dkdv_heads(dk, dv, Q, DO, LSE, DELTA, k, v, t, tm, qm, pos, j, jm,
                                         d, b, kvh, Tq, H, G, sqb, sqt, sqh, sdb, sdt, sdh,
                                         scale, F32DOT, MASKED=True)
        gm = jm[:, None] & dm[None, :]
        g = b * sgb + kvh * sgh + j[:, None] * sgl + d[None, :]
        tl.store(DK + g, (dk * scale).to(DK.dtype.element_ty), mask=gm)
        u = b * sub + kvh * suh + j[:, None] * sul + d[None, :]
        tl.store(DV + u, dv.to(DV.dtype.element_ty), mask=gm)

# ---- the attention's backward pass, second form (ATTN_BWD "triton2") ----
#
# The same gradients in two kernels again, laid out as the forward's grouped programs are: a
# program's rows are (query, head) pairs of the G query heads sharing a key head (G consecutive
# rows a query, the heads' rows adjacent in memory), so that the dQ kernel reads each key and
# value block once for the group, and the dK/dV kernel's one loop over row blocks covers both
# heads (the first form loops over the heads inside each query block, a loop of G steps that is
# all Triton's software pipeliner sees, inside branches). A causal pass (the caller says the
# queries are positions 0..Lk-1) gives the dK/dV kernel its query blocks' bounds by arithmetic:
# the blocks before a key block skipped, the diagonal ones masked, the rest a loop without masks
# or positions. Powers of two by exp2 on a log-sum-exp in log2 units (one multiply fewer an
# element); programs ordered so that those with the most blocks start first (a causal pass's
# last queries, first keys), the light ones filling the last wave. Repeatable bit for bit like
# the first: no atomics, each sum in one program's fixed order (not the first form's order).

if HAVE_TRITON:
    @triton.jit
    def _dq2_keys(dq, q, do, lse2, delta, pos, K, V, kb, vb, skl, svl, d, dm, start, stop, pmax,
                  Lk, qk2, BN: tl.constexpr, F32DOT: tl.constexpr, MASKED: tl.constexpr):
        # dQ of a block of rows added over the key blocks [start, stop) in order; MASKED False:
        # blocks whose keys every row sees, loaded and scored without the masks.
        for c0 in range(start, stop, BN):
            j = c0 + tl.arange(0, BN)
            if MASKED:
                jm = (j < Lk) & (j <= pmax)
                km = jm[None, :] & dm[:, None]
            else:
                km = dm[:, None]
            k = tl.load(K + kb + j[None, :] * skl + d[:, None], mask=km, other=0.0)  # [BD, BN]
            vt = tl.load(V + vb + j[None, :] * svl + d[:, None], mask=km, other=0.0)
            s = _bwd_dot(q, k, F32DOT)
            dp = _bwd_dot(do, vt, F32DOT)
            p = tl.math.exp2(s * qk2 - lse2[:, None])
            ds = p * (dp - delta[:, None])
            if MASKED:  # (ds too: 0, whatever delta of a row that sees no key)
                seen = (j[None, :] <= pos[:, None]) & jm[None, :]
                ds = tl.where(seen, ds, 0.0)
            dq += _bwd_dot(ds.to(k.dtype), tl.trans(k), F32DOT)
        return dq

    @triton.jit(do_not_specialize=["B", "Tq", "Lk"])
    def _attention_bwd2_dq_kernel(Q, K, V, O, DO, P, DQ, LSE, DELTA, B, Tq, H, Lk, D, scale,
                                  sqb, sqt, sqh, skb, skh, skl, svb, svh, svl,
                                  sob, sot, soh, sdb, sdt, sdh,
                                  G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                  BD: tl.constexpr, F32DOT: tl.constexpr,
                                  HAVE_LSE: tl.constexpr):
        # BM rows: BM // G queries of the G heads of one key head. First their log-sum-exp
        # (HAVE_LSE: the forward's; else online over their keys, in fp32) and delta = Σ dO·O,
        # both kept for the dK/dV kernel; then dQ = scale · Σ_j P·(dP − delta)·k_j, the key
        # blocks every row sees first, unmasked, then the rest masked (as the first form).
        QB: tl.constexpr = BM // G
        pid = tl.program_id(0)
        KV = H // G
        nblk = tl.cdiv(Tq, QB)
        kvh, b = pid % KV, (pid // KV) % B
        t0 = (nblk - 1 - pid // (KV * B)) * QB  # the last queries (the most keys) first
        r = tl.arange(0, BM)
        t = t0 + r // G
        h = kvh * G + r % G
        tm = (r < QB * G) & (t < Tq)
        d = tl.arange(0, BD)
        dm = d < D
        qm = tm[:, None] & dm[None, :]
        pos = tl.load(P + b * Tq + t, mask=tm, other=-1)
        q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + d[None, :], mask=qm,
                    other=0.0)
        do = tl.load(DO + b * sdb + t[:, None] * sdt + h[:, None] * sdh + d[None, :], mask=qm,
                     other=0.0)
        o = tl.load(O + b * sob + t[:, None] * sot + h[:, None] * soh + d[None, :], mask=qm,
                    other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        pmax = tl.max(pos, axis=0)
        end = tl.minimum(pmax + 1, Lk)
        kb, vb = b * skb + kvh * skh, b * svb + kvh * svh
        lr = (b * Tq + t) * H + h
        if HAVE_LSE:
            lse = tl.load(LSE + lr, mask=tm, other=0.0)
        else:
            m = tl.full((BM,), float("-inf"), tl.float32)
            l = tl.zeros((BM,), tl.float32)
            for c0 in range(0, end, BN):
                j = c0 + tl.arange(0, BN)
                jm = (j < Lk) & (j <= pmax)
                k = tl.load(K + kb + j[None, :] * skl + d[:, None],
                            mask=jm[None, :] & dm[:, None], other=0.0)  # [BD, BN]
                s = _bwd_dot(q, k, F32DOT)
                seen = (j[None, :] <= pos[:, None]) & jm[None, :]
                s = tl.where(seen, s * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                l = l * tl.exp(m - m_ref) + tl.sum(
                    tl.where(seen, tl.exp(s - m_ref[:, None]), 0.0), axis=1)
                m = m_new
            # A row that sees no key (padding) has output 0 and no gradient: P is 0.
            lse = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), 0.0)
        LOG2E: tl.constexpr = 1.4426950408889634
        qk2 = scale * LOG2E
        full_end = tl.maximum(tl.minimum((tl.min(pos, axis=0) + 1) // BN, Lk // BN), 0) * BN
        full_end = tl.minimum(full_end, end)
        dq = tl.zeros((BM, BD), tl.float32)
        dq = _dq2_keys(dq, q, do, lse * LOG2E, delta, pos, K, V, kb, vb, skl, svl, d, dm, 0,
                       full_end, pmax, Lk, qk2, BN, F32DOT, MASKED=False)
        dq = _dq2_keys(dq, q, do, lse * LOG2E, delta, pos, K, V, kb, vb, skl, svl, d, dm,
                       full_end, end, pmax, Lk, qk2, BN, F32DOT, MASKED=True)
        tl.store(DQ + b * sqb + t[:, None] * sqt + h[:, None] * sqh + d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=qm)
        if not HAVE_LSE:
            tl.store(LSE + lr, lse, mask=tm)
        tl.store(DELTA + lr, delta, mask=tm)

    @triton.jit
    def _dkdv2_rows(dk, dv, Q, DO, P, LSE, DELTA, k, v, j, jm, rq, h, rv, d, dm, b, Tq, H,
                    sqb, sqt, sqh, sdb, sdt, sdh, start, stop, qk2, QB: tl.constexpr,
                    F32DOT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
        # dK and dV of a block of keys (k, v) added over the row blocks of queries
        # [start, stop) (QB a block, each with the G heads' rows) in order. MASKED False: rows
        # that see every key of the block. Masked, CAUSAL: a query sees the keys up to its
        # index; else up to its position in P.
        LOG2E: tl.constexpr = 1.4426950408889634
        for t0 in range(start, stop, QB):
            t = t0 + rq
            tm = rv & (t < Tq)
            qm = tm[:, None] & dm[None, :]
            q = tl.load(Q + b * sqb + t[:, None] * sqt + h[:, None] * sqh + d[None, :], mask=qm,
                        other=0.0)  # [BM, BD]
            do = tl.load(DO + b * sdb + t[:, None] * sdt + h[:, None] * sdh + d[None, :],
                         mask=qm, other=0.0)
            lr = (b * Tq + t) * H + h
            lse2 = tl.load(LSE + lr, mask=tm, other=0.0) * LOG2E
            delta = tl.load(DELTA + lr, mask=tm, other=0.0)
            st = _bwd_dot(k, tl.trans(q), F32DOT)  # [BN, BM]
            dpt = _bwd_dot(v, tl.trans(do), F32DOT)
            pt = tl.math.exp2(st * qk2 - lse2[None, :])
            dst = pt * (dpt - delta[None, :])
            if MASKED:
                if CAUSAL:
                    seen = j[:, None] <= t[None, :]
                else:
                    pos = tl.load(P + b * Tq + t, mask=tm, other=-1)
                    seen = (j[:, None] <= pos[None, :]) & jm[:, None]
                pt = tl.where(seen, pt, 0.0)
                dst = tl.where(seen, dst, 0.0)
            # (Rows past Tq read q and dO as 0: they add exactly 0 to both.)
            dv += _bwd_dot(pt.to(do.dtype), do, F32DOT)
            dk += _bwd_dot(dst.to(q.dtype), q, F32DOT)
        return dk, dv

    @triton.jit(do_not_specialize=["B", "Tq", "Lk"])
    def _attention_bwd2_dkdv_kernel(Q, K, V, DO, P, LSE, DELTA, DK, DV, B, Tq, H, Lk, D, scale,
                                    sqb, sqt, sqh, skb, skh, skl, svb, svh, svl, sdb, sdt, sdh,
                                    sgb, sgh, sgl, sub, suh, sul,
                                    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                    BD: tl.constexpr, F32DOT: tl.constexpr,
                                    CAUSAL: tl.constexpr):
        # BN keys of one key head: dV = Σ Pᵀ·dO and dK = scale · Σ (P·(dP − delta))ᵀ·q over the
        # rows (queries × the G heads sharing the key head) in blocks of BM, in order. CAUSAL
        # (Tq = Lk, the queries' positions their indices): the row blocks before the keys
        # skipped, those that straddle them masked, the rest without masks; else every block
        # masked by the positions in P.
        QB: tl.constexpr = BM // G
        pid = tl.program_id(0)
        KV = H // G
        kvh, b = pid % KV, (pid // KV) % B
        j0 = (pid // (KV * B)) * BN  # the first keys (the most queries) first
        j = j0 + tl.arange(0, BN)
        jm = j < Lk
        d = tl.arange(0, BD)
        dm = d < D
        km = jm[:, None] & dm[None, :]
        k = tl.load(K + b * skb + kvh * skh + j[:, None] * skl + d[None, :], mask=km, other=0.0)
        v = tl.load(V + b * svb + kvh * svh + j[:, None] * svl + d[None, :], mask=km, other=0.0)
        r = tl.arange(0, BM)
        rq, h, rv = r // G, kvh * G + r % G, r < QB * G
        dk = tl.zeros((BN, BD), tl.float32)
        dv = tl.zeros((BN, BD), tl.float32)
        LOG2E: tl.constexpr = 1.4426950408889634
        qk2 = scale * LOG2E
        if CAUSAL:
            # A block [t0, t0 + QB) is whole when t0 ≥ the last key j0 + BN − 1.
            lo = (j0 // QB) * QB
            mid = tl.minimum(tl.cdiv(j0 + BN - 1, QB) * QB, tl.cdiv(Tq, QB) * QB)
            dk, dv = _dkdv2_rows(dk, dv, Q, DO, P, LSE, DELTA, k, v, j, jm, rq, h, rv, d, dm, b,
                                 Tq, H, sqb, sqt, sqh, sdb, sdt, sdh, lo, mid, qk2, QB, F32DOT,
                                 MASKED=True, CAUSAL=True)
            dk, dv = _dkdv2_rows(dk, dv, Q, DO, P, LSE, DELTA, k, v, j, jm, rq, h, rv, d, dm, b,
                                 Tq, H, sqb, sqt, sqh, sdb, sdt, sdh, mid, Tq, qk2, QB, F32DOT,
                                 MASKED=False, CAUSAL=True)
        else:
            dk, dv = _dkdv2_rows(dk, dv, Q, DO, P, LSE, DELTA, k, v, j, jm, rq, h, rv, d, dm, b,
                                 Tq, H, sqb, sqt, sqh, sdb, sdt, sdh, 0, Tq, qk2, QB, F32DOT,
                                 MASKED=True, CAUSAL=False)
        gm = jm[:, None] & dm[None, :]
        g = b * sgb + kvh * sgh + j[:, None] * sgl + d[None, :]
        tl.store(DK + g, (dk * scale).to(DK.dtype.element_ty), mask=gm)
        u = b * sub + kvh * suh + j[:, None] * sul + d[None, :]
        tl.store(DV + u, dv.to(DV.dtype.element_ty), mask=gm)

# The attention's backward pass: "triton" (the first form's kernels above), "triton2" (the
# second form's; determinism.py --attn-bwd triton2) or "sdpa" (PyTorch's attention recomputed
# under its strict deterministic mode; --attn-bwd sdpa). The first form's kernels'
# blocks (queries, keys, warps, stages): many rows of what a program accumulates (dQ: queries,
# dK/dV: keys), few of what it streams, as the flash-attention-2 Triton tutorial has them; at
# head dim 128 in bf16 these compile for sm_90 without spilling registers (ptxas -v). Any block
# gives repeatable gradients (determinism.py --attn-bwd-dq, --attn-bwd-dkdv).
# fp32 operands (an fp32 model: products of fp32 FMAs, no tensor cores) take smaller blocks, which
# compile without spilling likewise.
ATTN_BWD = "triton2"
ATTN_BWD_DQ = (128, 32, 8, 3)
ATTN_BWD_DKDV = (32, 128, 8, 2)
ATTN_BWD_DQ_F32 = (32, 32, 4, 2)
ATTN_BWD_DKDV_F32 = (32, 16, 4, 1)
# The second form's blocks (rows, keys, warps, stages), rows (query, head) pairs of a key head's
# G query heads (Qwen3-0.6B's 2: 128 rows are 64 queries); its own, so that the bench times both
# forms side by side (bench_det_train.py --dq2, --dkdv2; determinism.py --attn-bwd2-dq,
# --attn-bwd2-dkdv). A key block's rows are whole blocks of queries (BM // G of them), and a
# group larger than BM rows takes the first form. At head dim 128 in bf16 these compile for sm_90
# without spilling registers (ptxas -v).
ATTN_BWD2_DQ = (128, 32, 8, 3)
ATTN_BWD2_DKDV = (32, 128, 8, 3)
ATTN_BWD2_DQ_F32 = (32, 32, 4, 1)
ATTN_BWD2_DKDV_F32 = (32, 32, 4, 1)
# The backward kernels' blocks whose queries all see all the keys (a causal pass's blocks below
# the diagonal: most of them) skip the masks' compares and selects, the same numbers. False:
# every block masked (determinism.py --attn-full-blocks off).
ATTN_BWD_FULL_BLOCKS = True
# A training pass's forward keeps each row's log-sum-exp (one fp32 store a row) for the dQ kernel,
# which otherwise computes it again in a pass over the keys (a quarter of its products). False:
# recomputed (determinism.py --attn-lse off).
ATTN_LSE = True


# The ATTN_BWD values that are Triton kernels (the forward's log-sum-exp, the training layer).
TRITON_BWD = ("triton", "triton2")


def _attention_lse(q) -> torch.Tensor | None:
    """The log-sum-exp buffer of a training pass's forward (ATTN_LSE with the Triton backward),
    or None."""
    if not (ATTN_LSE and ATTN_BWD in TRITON_BWD):
        return None
    B, Tq, H, _ = q.shape
    return torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)


def attention_backward_triton(q, k, v, o, q_pos, go, scale, dk=None, dv=None, lse=None,
                              causal=False):
    """The gradients (dq, dk, dv) of attention_triton's output o for its output's gradient go,
    in the two kernels above (q [B, Tq, H, D], k and v [B, KV, Lk, D]): the first form's, or
    the second's (ATTN_BWD "triton2"). Repeatable bit for bit: no atomics, each sum in one
    program's fixed order. dk, dv: where to write those (views of k's shape, contiguous along
    D; else new tensors). lse: the forward's log-sum-exp of each row (attention_triton's; else
    the dQ kernel computes it in a pass over the keys). causal: the caller says q_pos is
    0..Lk-1 in every row (the second form's dK/dV kernel then skips, masks and loops by
    arithmetic; the gradients the same function's either way)."""
    B, Tq, H, D = q.shape
    KV, Lk = k.shape[1], k.shape[2]
    G = H // KV
    tiles = _bwd2_tiles(q.dtype) if ATTN_BWD == "triton2" else None
    second = tiles is not None and G <= tiles[0][0]  # (a larger group: the first form)
    # dq takes q's strides; k and v are read through theirs (the training pass's are views).
    q, o, go = q.contiguous(), o.contiguous(), go.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    pos = q_pos.to(torch.int64).contiguous().view(-1)
    BD = max(16, triton.next_power_of_2(D))
    f32 = q.dtype == torch.float32 or INTERPRET
    dq = torch.empty_like(q)
    have_lse = lse is not None
    if not have_lse:
        lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    dq_args = (q, k, v, o, go, pos, dq, lse, delta)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    if second:
        BM, BN, warps, stages = tiles[0]
        _attention_bwd2_dq_kernel[(B * KV * triton.cdiv(Tq, BM // G),)](
            *dq_args, B, Tq, H, Lk, D, scale, *strides, o.stride(0), o.stride(1), o.stride(2),
            go.stride(0), go.stride(1), go.stride(2),
            G=G, BM=BM, BN=BN, BD=BD, F32DOT=f32, HAVE_LSE=have_lse, num_warps=warps,
            num_stages=stages)
    else:
        BM, BN, warps, stages = ATTN_BWD_DQ_F32 if q.dtype == torch.float32 else ATTN_BWD_DQ
        _attention_bwd_dq_kernel[(B * triton.cdiv(Tq, BM), H)](
            *dq_args, Tq, H, G, Lk, D, scale, *strides, o.stride(0), o.stride(1), o.stride(2),
            go.stride(0), go.stride(1), go.stride(2),
            BM=BM, BN=BN, BD=BD, F32DOT=f32, HAVE_LSE=have_lse,
            FULL_BLOCKS=ATTN_BWD_FULL_BLOCKS, num_warps=warps, num_stages=stages)
    if dk is None:
        dk = torch.empty(B, KV, Lk, D, dtype=k.dtype, device=k.device)
    if dv is None:
        dv = torch.empty(B, KV, Lk, D, dtype=v.dtype, device=v.device)
    dkdv_args = (q, k, v, go, pos, lse, delta, dk, dv)
    strides += (go.stride(0), go.stride(1), go.stride(2), dk.stride(0), dk.stride(1),
                dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2))
    if second:
        BM, BN, warps, stages = tiles[1]
        _attention_bwd2_dkdv_kernel[(B * KV * triton.cdiv(Lk, BN),)](
            *dkdv_args, B, Tq, H, Lk, D, scale, *strides,
            G=G, BM=BM, BN=BN, BD=BD, F32DOT=f32, CAUSAL=causal and Tq == Lk,
            num_warps=warps, num_stages=stages)
    else:
        BM, BN, warps, stages = ATTN_BWD_DKDV_F32 if q.dtype == torch.float32 else ATTN_BWD_DKDV
        _attention_bwd_dkdv_kernel[(B * triton.cdiv(Lk, BN), KV)](
            *dkdv_args, Tq, H, G, Lk, D, scale, *strides,
            BM=BM, BN=BN, BD=BD, F32DOT=f32, FULL_BLOCKS=ATTN_BWD_FULL_BLOCKS, num_warps=warps,
            num_stages=stages)
    return dq, dk, dv


def _bwd2_tiles(dtype) -> tuple:
    """The second form's (dQ, dK/dV) blocks for operands of dtype."""
    if dtype == torch.float32:
        return ATTN_BWD2_DQ_F32, ATTN_BWD2_DKDV_F32
    return ATTN_BWD2_DQ, ATTN_BWD2_DKDV


@contextlib.contextmanager
def _strict_determinism():
    """torch.use_deterministic_algorithms(True) inside the block, as it was after. PyTorch's
    flash and memory-efficient attention backward passes accumulate dQ with atomics unless the
    strict mode is on (warn_only keeps the atomics): two equal runs would drift apart in the
    last bits of a gradient. cuBLAS's check in that mode wants CUBLAS_WORKSPACE_CONFIG set (one
    stream: its products are repeatable anyway)."""
    was, warn = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


class _Attention(torch.autograd.Function):
    """The Triton attention forward; the backward pass the gradient of the same function, not
    batch-invariant but repeatable: attention_backward_triton (ATTN_BWD "triton", "triton2"),
    or PyTorch's
    attention recomputed with its kernels in PyTorch's deterministic mode. causal: the queries
    are positions 0..Lk-1 of their sequence, so SDPA takes its causal (flash) kernel instead of
    a mask."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, scale, causal, grad):
        lse = _attention_lse(q) if grad else None
        o = attention_triton(q, k, v, q_pos, scale, lse=lse)
        ctx.save_for_backward(q, k, v, q_pos, o, lse)
        ctx.scale, ctx.causal = scale, causal
        return o

    @staticmethod
    def backward(ctx, go):
        q, k, v, q_pos, o, lse = ctx.saved_tensors
        if ATTN_BWD in TRITON_BWD:
            gq, gk, gv = attention_backward_triton(q, k, v, o, q_pos, go, ctx.scale, lse=lse,
                                                   causal=ctx.causal)
            return gq, gk, gv, None, None, None, None
        with torch.enable_grad(), _strict_determinism():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            Lk = k.shape[2]
            if ctx.causal and q.shape[1] == Lk:
                mask = None
            else:
                mask = (torch.arange(Lk, device=q.device)[None, None, :]
                        <= q_pos[:, :, None])[:, None]
            o = F.scaled_dot_product_attention(
                q_.transpose(1, 2), k_, v_, attn_mask=mask, is_causal=mask is None,
                scale=ctx.scale, enable_gqa=q.shape[2] != k.shape[1]).transpose(1, 2)
            gq, gk, gv = torch.autograd.grad(o, (q_, k_, v_), go)
        return gq, gk, gv, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float, causal: bool = False) -> torch.Tensor:
    """Causal grouped-query attention, batch-invariant: q [B, Tq, H, D] (query rows), k and v
    [B, KV, Lk, D] (keys and values at positions 0..Lk-1: a sequence's own, or cache rows),
    q_pos [B, Tq] each query's position; a query sees the keys at positions ≤ its own. Returns
    [B, Tq, H, D] in q's dtype. Keys past Lk or past a query's position never count, so the
    cache's length and whatever it holds beyond change nothing. causal: the caller says q_pos
    is 0..Lk-1 in every row (a training pass; the gradient then takes the causal kernel)."""
    if use_triton(q):
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad)
        return _Attention.apply(q, k, v, q_pos, scale, causal, grad)
    return attention_torch(q, k, v, q_pos, scale)


# ---- a training layer in one autograd node ----
#
# model.block_forward's deterministic layer builds about twenty autograd nodes (the norms,
# products, rope, attention, residual adds and the views between them): each a Python Function's
# bookkeeping in the forward and a call of the autograd engine in the backward, and the backward
# launches kernels of its own for the residual gradients' sums and the q/k/v gradient's
# concatenation. _Layer runs the same forward (the same kernels on the same inputs, so the same
# numbers) as one node, with its backward pass written out: the residual gradients added inside
# the RMSNorm backward kernels, and the q and k norms' and the attention's dV gradients written
# in place into the q/k/v product's gradient. False: a node an operation (determinism.py
# --layer-fn off).
LAYER_FN = True


def layer(cfg, x: torch.Tensor, w: tuple, cos: torch.Tensor, sin: torch.Tensor):
    """model.block_forward's deterministic layer (x [B, T, hidden] → (x, k, v), k and v
    [B, kv_heads, T, D]) as one _Layer node where it applies: a pass with gradients through the
    GPU's kernels and their backward passes (use_triton, ROW_KERNELS, RMS_BWD_TRITON,
    FUSED_ELEMENTWISE, ATTN_BWD "triton" or "triton2"), 16-bit activations (the rope
    kernel's), rope tables [T, D] and plain weight tensors (no adapters); None elsewhere (the
    caller's operations)."""
    if not (LAYER_FN and torch.is_grad_enabled() and use_triton(x) and ROW_KERNELS
            and RMS_BWD_TRITON and FUSED_ELEMENTWISE and ATTN_BWD in TRITON_BWD):
        return None
    if (x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float16)
            or max(cfg.hidden, cfg.head_dim) > RMS_BWD_MAX or cfg.head_dim % 2
            or cos.shape != sin.shape or cos.stride() != sin.stride()
            or tuple(cos.shape) != (x.shape[1], cfg.head_dim) or cos.stride(-1) != 1):
        return None
    if any(t is not None and not isinstance(t, torch.Tensor) for t in w):
        return None  # a lora.LoRAWeight
    if not (x.requires_grad or any(t is not None and t.requires_grad for t in w)):
        return None
    return _Layer.apply(x, cos, sin, cfg, *w)


class _Layer(torch.autograd.Function):
    """The deterministic training layer (layer) in one autograd node."""

    @staticmethod
    def forward(ctx, x, cos, sin, cfg, *w):
        # model.block_forward's operations, in its order, through the kernels its Functions run.
        attn_norm, wqkv, bqkv, q_norm, k_norm, wo, bo, mlp_norm, w13, w2 = w
        B, T, _ = x.shape
        D, eps = cfg.head_dim, cfg.rms_eps
        h = rms_norm_triton(x, attn_norm, eps)
        qkv = _linear_forward(h, wqkv, bqkv)
        q, k, v = _split_qkv(cfg, qkv)
        wq, wk = (q_norm, k_norm) if cfg.qk_norm else (None, None)
        if qk_rope_fits(q, k, wq, wk, cos, sin):  # the kernel of every other pass
            qr, kr = _qk_rope_launch(*_qk_rows(q, k), wq, wk, cos, sin, eps)
            qr, kr = qr.view(q.shape), kr.view(k.shape)
        else:
            if cfg.qk_norm:
                q, k = rms_norm_triton(q, q_norm, eps), rms_norm_triton(k, k_norm, eps)
            qr, kr = _rope_launch(q, cos, sin, 1), _rope_launch(k, cos, sin, 1)
        kt, vt = kr.transpose(1, 2), v.transpose(1, 2)
        pos = torch.arange(T, device=x.device).expand(B, T)
        lse = _attention_lse(qr)
        o = attention_triton(qr, kt, vt, pos, D ** -0.5, lse=lse).flatten(2)
        y1 = _linear_forward(o, wo, bo)
        if add_rms_fits(x, y1, mlp_norm):  # the kernel of every other pass
            x1, h2 = _add_rms_launch(x, y1, mlp_norm, eps)
        else:
            x1 = _add_launch(x, y1)
            h2 = rms_norm_triton(x1, mlp_norm, eps)
        gu = _linear_forward(h2, w13, None)
        a = _swiglu_forward(gu)
        x2 = _add_launch(x1, _linear_forward(a, w2, None))
        ctx.save_for_backward(x, h, qkv, qr, kr, o, x1, h2, gu, a, cos, sin, pos, lse, *w)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return x2, kt, vt

    @staticmethod
    def backward(ctx, gx2, gkt, gvt):
        x, h, qkv, qr, kr, o, x1, h2, gu, a, cos, sin, pos, lse, *w = ctx.saved_tensors
        attn_norm, wqkv, bqkv, q_norm, k_norm, wo, bo, mlp_norm, w13, w2 = w
        cfg = ctx.cfg
        need = ctx.needs_input_grad[4:]
        B, T, _ = x.shape
        H, KV, D, eps = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rms_eps
        if gx2 is None:
            gx2 = torch.zeros_like(x)
        # The MLP, then its norm's gradient plus the residual's (gx2) in one kernel.
        ga, gw2, _ = _linear_backward(a, w2, gx2, True, need[9], False)
        ggu = _swiglu_backward(gu, ga)
        gh2, gw13, _ = _linear_backward(h2, w13, ggu, True, need[8], False)
        gx1, gmlp = rms_norm_backward_triton(x1, mlp_norm, gh2, eps, res=gx2)
        go, gwo, gbo = _linear_backward(o, wo, gx1, True, need[5], bo is not None and need[6])
        # The attention: dQ, dK (rope's output's) and dV, dV into its place in the q/k/v
        # gradient; then rope's and the q/k norms' gradients, written into theirs.
        gqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        gq, gk, gv = _split_qkv(cfg, gqkv)
        dk = torch.empty(B, T, KV, D, dtype=kr.dtype, device=kr.device)
        dq, _, _ = attention_backward_triton(qr, kr.transpose(1, 2), _split_qkv(cfg, qkv)[2]
                                             .transpose(1, 2), o.view(B, T, H, D), pos,
                                             go.view(B, T, H, D), D ** -0.5,
                                             dk=dk.transpose(1, 2), dv=gv.transpose(1, 2),
                                             lse=lse, causal=True)
        if gkt is not None:  # the keys and values used outside the layer too
            dk += gkt.transpose(1, 2)
        if gvt is not None:
            gv += gvt.transpose(1, 2)
        dq, dk = _rope_launch(dq, cos, sin, -1), _rope_launch(dk, cos, sin, -1)
        gqn = gkn = None
        if cfg.qk_norm:
            q, k, _ = _split_qkv(cfg, qkv)
            gqn = rms_norm_backward_triton(q, q_norm, dq, eps, out=gq)[1]
            gkn = rms_norm_backward_triton(k, k_norm, dk, eps, out=gk)[1]
        else:
            gq.copy_(dq)
            gk.copy_(dk)
        gh, gwqkv, gbqkv = _linear_backward(h, wqkv, gqkv, True, need[1],
                                            bqkv is not None and need[2])
        gx, gattn = rms_norm_backward_triton(x, attn_norm, gh, eps, res=gx1)
        return (gx, None, None, None, gattn, gwqkv, gbqkv, gqn, gkn, gwo, gbo, gmlp, gw13, gw2)


def _split_qkv(cfg, qkv: torch.Tensor):
    """model.decode_pre's views of the q/k/v product: q [..., heads, D], k and v
    [..., kv_heads, D]."""
    q, k, v = qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
    return (q.unflatten(-1, (cfg.heads, cfg.head_dim)),
            k.unflatten(-1, (cfg.kv_heads, cfg.head_dim)),
            v.unflatten(-1, (cfg.kv_heads, cfg.head_dim)))
