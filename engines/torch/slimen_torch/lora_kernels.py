"""The decode step's LoRA expand in one Triton kernel (lora.Fused), with its PyTorch equivalent.

`expand(y, s, b, idx, scale, part, r)` returns y + ((s ∘ M)·bᵀ), the table's update of a fused
projection added to its base product y: s = x·A_fᵀ is the shrink of every slot (one product,
lora.Table's layout), M keeps in row i the r columns of slot idx[i] (0: none) scaled by that
slot's alpha/rank, b is the layer's B_f. lora.Packed does the same in three kernels after the
shrink (the mask's product, the expand's product, the add); here it is one, which reads each
tile of y once and only the columns of the output part its tile lies in (part: the table part
of each BN-column chunk of the output, -1 where no adapter targets it).

The roundings are Packed's in the model's dtype (the mask's product, the expand's product and
the add each rounded), so the two agree up to the order of the expand's sums. Registered as the
custom op slimen::lora_expand, so the compiled decode layers call it as one opaque operation.
`available(device)`: on a CUDA device, or on the CPU when TRITON_INTERPRET=1 (the tests);
elsewhere the op runs `expand_reference`.

The launch's tile (BM rows, WARPS warps a program) is a module-level switch, so that
bench_lora.py's diff section compares tiles on a GPU in one process; the default is the one
docs/performance.md measured best. Another BM or WARPS gives the default's results bit for bit,
except that it may make the GPU's compiler pick another tensor-core instruction for the product
(tests/test_lora_table.py checks them under the interpreter, and on a GPU). An early-load
form, one with programmatic dependent launch and one writing into the folded product in place
were measured and deleted: none bought more than 1-2% of a decode step (performance.md).
"""

from __future__ import annotations

import torch

from .triton_env import HAVE_TRITON, INTERPRET, available, tl, triton  # noqa: F401
from .triton_env import pow2 as _pow2

# Rows and output columns of a program's tile (BN: at most; lora.Table picks one that divides
# every part of the fused outputs, so that no tile straddles two parts), and the warps of a
# program. At 256 rows and BN 128 (Qwen3-0.6B's table) a launch has cdiv(256, BM) × N / 128
# programs: at BM 16, 512 for q/k/v (N 4,096), 128 for o (1,024), 768 for gate/up (6,144) and
# 128 for down (1,024), against the H200's 132 multiprocessors. BM 16 measured best on one H200
# (a decode step of 256 rows over 8 adapters: 3,476 µs against 3,536 at BM 64, 3,483 at 32,
# 3,668 at BM 128 on 8 warps); tl.dot takes no fewer than 16 rows.
BM, BN_MAX = 16, 128
WARPS = 4


if HAVE_TRITON:
    @triton.jit
    def _expand_kernel(Y, S, B, IDX, SCALE, PART, O, M, R, CR, soff, sym, ssm, sbn, som,
                       BM: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                       F32DOT: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        rin = rows < M
        y = tl.load(Y + rows[:, None] * sym + cols[None, :], mask=rin[:, None], other=0.0)
        out = y
        p = tl.load(PART + pn)
        if p >= 0:
            slot = tl.load(IDX + rows, mask=rin, other=0)
            sc = tl.load(SCALE + slot - 1, mask=rin & (slot > 0), other=0.0)
            sc = sc.to(Y.dtype.element_ty).to(tl.float32)  # Packed's mask is in the model's dtype
            k = tl.arange(0, BC)
            # Only the row's own slot's columns of part p are read: the other slots' (whatever
            # they hold) never reach the row's result.
            keep = rin[:, None] & (k[None, :] < CR) & (k[None, :] // R + 1 == slot[:, None])
            s = tl.load(S + soff + rows[:, None] * ssm + p * CR + k[None, :], mask=keep,
                        other=0.0)
            s = (s.to(tl.float32) * sc[:, None]).to(Y.dtype.element_ty)
            b = tl.load(B + cols[:, None] * sbn + p * CR + k[None, :], mask=k[None, :] < CR,
                        other=0.0)
            if F32DOT:  # fp32 tensors, and bf16 under the interpreter (whose bf16 dot is wrong)
                d = tl.dot(s.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
            else:
                d = tl.dot(s, tl.trans(b))
            d = d.to(Y.dtype.element_ty).to(tl.float32)
            out = (y.to(tl.float32) + d).to(Y.dtype.element_ty)
        tl.store(O + rows[:, None] * som + cols[None, :], out, mask=rin[:, None])


def expand_reference(y, s, b, idx, scale, part, r: int, soff: int = 0):
    """expand in PyTorch: Packed's arithmetic, the mask made from idx and scale."""
    cap = scale.shape[0]
    y, s = y[:, :b.shape[0]], s[:, soff:soff + b.shape[1]]
    ids = torch.arange(1, cap + 1, device=idx.device)
    on = (idx[:, None] == ids[None, :]).to(torch.float32) * scale
    m = on[:, :, None].expand(-1, -1, r).reshape(idx.shape[0], cap * r).to(y.dtype)
    parts = b.shape[1] // (cap * r)
    return y + torch.nn.functional.linear(s * m.repeat(1, parts), b)


def _launch(y, s, b, idx, scale, part, r: int, soff: int) -> torch.Tensor:
    """The kernel in the module's tile (BM, WARPS) into a new tensor."""
    M, N = y.shape[0], b.shape[0]
    cr = scale.shape[0] * r
    bn = N // part.shape[0]
    out = y.new_empty(M, N)
    grid = (triton.cdiv(M, BM), part.shape[0])
    _expand_kernel[grid](y, s, b, idx, scale, part, out, M, r, cr, soff, y.stride(0),
                         s.stride(0), b.stride(0), out.stride(0), BM=BM, BN=bn,
                         BC=max(16, _pow2(cr)), F32DOT=y.dtype == torch.float32 or INTERPRET,
                         num_warps=WARPS)
    return out


@torch.library.custom_op("slimen::lora_expand", mutates_args=())
def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, idx: torch.Tensor,
                scale: torch.Tensor, part: torch.Tensor, r: int, soff: int) -> torch.Tensor:
    if available(y.device):
        return _launch(y, s, b, idx, scale, part, r, soff)
    return expand_reference(y, s, b, idx, scale, part, r, soff)


@lora_expand.register_fake
def _(y, s, b, idx, scale, part, r, soff):
    return y.new_empty(y.shape[0], b.shape[0])


def expand(y, s, b, idx, scale, part, r: int, soff: int = 0) -> torch.Tensor:
    """y + ((s ∘ M)·bᵀ) (the module comment): y the base product (its first N columns), s the
    shrink (its columns soff … soff + parts·cap·r), b [N, parts·cap·r], idx [rows] the rows'
    slots, scale [cap] the slots' alpha/rank, part [N / BN] the table part of each chunk of BN
    output columns (-1: none). Contiguous rows; y and s may be one tensor (Table.fold's product,
    read in place: no slices copied)."""
    return lora_expand(y, s, b, idx, scale, part, r, soff)
