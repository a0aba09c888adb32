"""Triton kernels for the GPU hot paths, each with a plain PyTorch equivalent that it is tested
against (tests/test_kernels.py, on the CPU under TRITON_INTERPRET=1):

* `decode_attention`: one new token per cache row — writes its key and value into the cache and
  attends over positions [0, pos] — reading each key and value once. When rows × heads are too
  few to fill the GPU each row is split over several programs whose partial results a second
  kernel combines (flash-decoding). It reads only the positions a row has, not the whole length
  bucket.
* `sample_and_advance`: the sampler of sampling.py for rows without top-p in two kernels (chunk
  statistics, then the inverse CDF inside the one chunk that holds the target), the per-row uniform
  hashed inside the kernel, and the decode step state advanced in the same kernel.
* `gemv`: batch-1 matrix-vector products with the RMSNorm of the input fused in front and the
  SwiGLU or the residual add fused behind; with `decode_attention(rope=…)`, which applies the
  q/k RMSNorm and the rotary embedding itself, the batch-1 decode layer is five kernels (six when
  the attention is split) instead of about eleven.
* `linear_logprobs`: the log-prob of each target token and the entropy of the fp32 softmax of
  hidden·Wᵀ, in chunks of rows, never materialising the whole [N, vocabulary] logits in fp32 (the
  backward pass recomputes each chunk's logits). The element-wise passes are Triton kernels on a
  GPU and PyTorch elsewhere.
* `adamw`: the mixed-precision optimizer step of one parameter in one pass: the bf16 gradient
  scaled by the clip coefficient, torch.optim.AdamW's update of the fp32 master and its two
  moments, the bf16 parameter written from the new master, all skipped when a device flag says
  the step's loss or gradient norm is not finite (train.Trainer's fused step).

`available(device)` says whether the Triton kernels can run there: on a CUDA device, or on the CPU
when TRITON_INTERPRET=1 was set before this module was imported (the tests do).
"""

from __future__ import annotations

import os

import torch

from .model import kv_read, kv_write
from .triton_env import HAVE_TRITON, INTERPRET, available, tl, triton  # noqa: F401
from .triton_env import pow2 as _pow2

try:  # Grid dependency control (Hopper and later), for programmatic dependent launch.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except Exception:  # pragma: no cover - another Triton version
    HAVE_GDC = False

if HAVE_TRITON and INTERPRET:
    # Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array,
    # which NumPy 2 refuses; loops with bounds computed in the kernel need it (tests only).
    try:
        from triton.runtime import interpreter as _interp

        _patch_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__",
                           lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
    except AttributeError:  # pragma: no cover - another Triton version
        pass
    # Its fp32 → float8e4nv cast rounds half up and loses the carry into the exponent (7.87 →
    # 4.0, not 8.0), where the GPU's cvt.rn rounds to nearest even as PyTorch's cast does: the
    # fp8 KV cache's store is rounded by PyTorch here (tests only).
    try:
        import numpy as _np

        _fp_to_fp = _interp.InterpreterBuilder.create_fp_to_fp

        def _create_fp_to_fp(self, src, dst_type, rounding_mode):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
                data = torch.from_numpy(_np.ascontiguousarray(src.data, dtype=_np.float32))
                return _interp.TensorHandle(
                    data.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dst_type.scalar)
            return _fp_to_fp(self, src, dst_type, rounding_mode)

        _interp.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp
    except AttributeError:  # pragma: no cover - another Triton version
        pass
    # Its fp32 → bf16 cast truncates, where the GPU's cvt.rn and PyTorch round to nearest even:
    # rounded by PyTorch here, so a kernel's bf16 stores equal PyTorch's casts (tests only).
    try:
        _cast_impl = _interp.InterpreterBuilder.cast_impl

        def _cast_rne(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                data = torch.from_numpy(_np.ascontiguousarray(src.data, dtype=_np.float32))
                return _interp.TensorHandle(
                    data.to(torch.bfloat16).view(torch.uint16).numpy(), dst_type.scalar)
            return _cast_impl(self, src, dst_type)

        _interp.InterpreterBuilder.cast_impl = _cast_rne
        _interp.InterpreterBuilder.create_fp_trunc = \
            lambda self, src, dst_type: self.cast_impl(src, dst_type)
    except AttributeError:  # pragma: no cover - another Triton version
        pass


_PDL: dict = {}


def _pdl(device: torch.device) -> bool:
    """Whether the decode kernels use programmatic dependent launch on this device: a kernel is
    launched while the previous one still runs, starts the loads that do not depend on it (the
    batch-1 products' weights) and waits for it with griddepcontrol.wait. At batch 1 a decode step
    is ~170 short kernels, each of which otherwise starts only when the previous one has finished.
    Needs compute capability 9.0 (Hopper) or later; SLIMEN_PDL=0 turns it off."""
    if device.type != "cuda" or INTERPRET or not HAVE_GDC:
        return False
    on = _PDL.get(device.index)
    if on is None:
        on = (os.environ.get("SLIMEN_PDL", "1") != "0"
              and torch.cuda.get_device_capability(device)[0] >= 9)
        _PDL[device.index] = on
    return on


if HAVE_TRITON:
    # ---------------------------------------------------------------------------------------
    # Decode attention
    # ---------------------------------------------------------------------------------------

    @triton.jit
    def _norm_rope(x, xr, w, wr, cos, sin, d, eps, D: tl.constexpr, QK_NORM: tl.constexpr,
                   dt: tl.constexpr, AX: tl.constexpr):
        """q/k RMSNorm (Qwen3) and rotary embedding of heads x [..., DP] (fp32), xr the same
        values at the rotate_half indices, w/wr the norm weight at both; rounded to dt where
        model.qkv_from_normed rounds. Returns dt."""
        if QK_NORM:
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=AX, keep_dims=True) / D + eps)
            x = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            xr = ((xr * r).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
        xr = tl.where(d < D // 2, -xr, xr)
        return ((x * cos).to(dt).to(tl.float32) + (xr * sin).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _load_norm_rope(p, d, rot, mask, wn_ptr, cos, sin, eps, D: tl.constexpr,
                        QK_NORM: tl.constexpr, dt: tl.constexpr, AX: tl.constexpr):
        """_norm_rope of the raw heads at p + d (mask; rot: the rotate_half indices of d), with
        the q or k norm weight at wn_ptr (read only with QK_NORM)."""
        w = cos
        wr = cos
        if QK_NORM:
            w = tl.load(wn_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            wr = tl.load(wn_ptr + rot, mask=d < D, other=0.0).to(tl.float32)
        return _norm_rope(tl.load(p + d, mask=mask, other=0.0).to(tl.float32),
                          tl.load(p + rot, mask=mask, other=0.0).to(tl.float32),
                          w, wr, cos, sin, d, eps, D, QK_NORM, dt, AX)

    @triton.jit
    def _attend(q, kc, vc, sc_l, d, dmask, start, end, scale, m, l, acc, BL: tl.constexpr,
                KV8: tl.constexpr, F32DOT: tl.constexpr):
        """Online softmax of the queries q [rows, DP] over positions [start, end) of one row's
        keys kc and values vc (a position every sc_l elements), continuing the state (m, l, acc);
        returns it. Over an fp8 cache the products run in fp16: e4m3 converts to fp16 in one
        instruction for two values (to bf16 it takes a trip through fp32, and the conversion
        bounded the kernel), exactly; q and the probabilities lose nothing in fp16 that bf16
        keeps."""
        for s0 in range(start, end, BL):
            p_i = s0 + tl.arange(0, BL)
            valid = p_i < end
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(kc + p_i[:, None] * sc_l + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vc + p_i[:, None] * sc_l + d[None, :], mask=kv_mask, other=0.0)
            if KV8:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
            if F32DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return m, l, acc

    @triton.jit
    def _decode_attn_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, part_ptr,
                            ml_ptr, qn_ptr, kw_ptr, cos_ptr, sin_ptr, sq_b, sq_h, skn_b, skn_h,
                            svn_b, svn_h, sc_b, sc_h, sc_l, so_b, so_h, s_cos, scale, eps,
                            split_len, n_heads,
                            GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, BL: tl.constexpr, NSPLIT: tl.constexpr,
                            F32DOT: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                            KV8: tl.constexpr = False, PDL: tl.constexpr = False,
                            SHARE: tl.constexpr = False, sh_ptr=None):
        if PDL:
            gdc_launch_dependents()
            if not SHARE:
                gdc_wait()
            # SHARE: the previous kernel is _shared_prefix_kernel, whose programs release this
            # one only after their own wait for the layer's q/k/v: this one attends its row's
            # own positions while that pass still runs, and waits for it before merging.
        b = tl.program_id(0).to(tl.int64)  # row offsets can pass 2³¹ elements
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr + b)
        start = sp * split_len
        shared = 0
        if SHARE:  # (one split) positions [0, shared) were attended by _shared_prefix_kernel
            shared = tl.load(sh_ptr + b)
            start = shared
        end = tl.minimum(start + split_len, pos + 1)
        d = tl.arange(0, DP)
        dmask = d < D
        dt = q_ptr.dtype.element_ty  # the compute dtype (KV8: the cache holds float8_e4m3fn)
        kc = kc_ptr + b * sc_b + kvh * sc_h
        vc = vc_ptr + b * sc_b + kvh * sc_h
        if ROPE:
            # q and the new k arrive as the raw projections: norm and rope them here.
            rot = tl.where(d < D // 2, d + D // 2, d - D // 2)
            cos = tl.load(cos_ptr + pos * s_cos + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
            sin = tl.load(sin_ptr + pos * s_cos + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        # The program whose split holds the new position writes the new key and value first.
        if (pos >= start) & (pos < start + split_len):
            kp = kn_ptr + b * skn_b + kvh * skn_h
            if ROPE:
                kn = _load_norm_rope(kp, d, rot, dmask, kw_ptr, cos, sin, eps, D, QK_NORM, dt, 0)
            else:
                kn = tl.load(kp + d, mask=dmask)
            vn = tl.load(vn_ptr + b * svn_b + kvh * svn_h + d, mask=dmask)
            if KV8:
                # Saturated into fp8's finite range (a plain cast would make NaN of an outlier).
                kn = tl.minimum(tl.maximum(kn.to(tl.float32), -448.0), 448.0)
                vn = tl.minimum(tl.maximum(vn.to(tl.float32), -448.0), 448.0)
                kn = kn.to(kc_ptr.dtype.element_ty)
                vn = vn.to(vc_ptr.dtype.element_ty)
            tl.store(kc + pos * sc_l + d, kn, mask=dmask)
            tl.store(vc + pos * sc_l + d, vn, mask=dmask)
        tl.debug_barrier()
        g = tl.arange(0, GP)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        qmask = gmask[:, None] & dmask[None, :]
        qp = q_ptr + b * sq_b + heads[:, None] * sq_h
        if ROPE:
            q = _load_norm_rope(qp, d[None, :], rot[None, :], qmask, qn_ptr, cos[None, :],
                                sin[None, :], eps, D, QK_NORM, dt, 1)
        else:
            q = tl.load(qp + d[None, :], mask=qmask, other=0.0)
        if F32DOT:
            q = q.to(tl.float32)
        elif KV8:
            q = q.to(tl.float16)  # the products over an fp8 cache run in fp16 (_attend)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        m, l, acc = _attend(q, kc, vc, sc_l, d, dmask, start, end, scale, m, l, acc, BL, KV8,
                            F32DOT)
        if SHARE:
            if PDL:
                gdc_wait()
            if shared > 0:  # merge the shared prefix's softmax state (positions [0, shared))
                row = b * n_heads + heads
                m1 = tl.load(ml_ptr + row * 2, mask=gmask, other=float("-inf"))
                l1 = tl.load(ml_ptr + row * 2 + 1, mask=gmask, other=0.0)
                acc1 = tl.load(part_ptr + row[:, None] * DP + d[None, :], mask=gmask[:, None],
                               other=0.0)
                mx = tl.maximum(m, m1)
                w1 = tl.where(m1 > float("-inf"), tl.exp(m1 - mx), 0.0)
                w2 = tl.exp(m - mx)
                l = l1 * w1 + l * w2
                acc = acc1 * w1[:, None] + acc * w2[:, None]
                m = mx
        if NSPLIT == 1:
            o = acc / l[:, None]
            tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=qmask)
        else:
            row = (b * n_heads + heads) * NSPLIT + sp  # [GP]
            tl.store(part_ptr + row[:, None] * DP + d[None, :], acc, mask=gmask[:, None])
            tl.store(ml_ptr + row * 2, m, mask=gmask)
            tl.store(ml_ptr + row * 2 + 1, l, mask=gmask)

    @triton.jit
    def _shared_prefix_kernel(q_ptr, kc_ptr, vc_ptr, grp_ptr, sh_ptr, part_ptr, ml_ptr, pos_ptr,
                              qn_ptr, cos_ptr, sin_ptr, sq_b, sq_h, sc_b, sc_h, sc_l, s_cos,
                              scale, eps, n_heads,
                              GROUP: tl.constexpr, NMAX: tl.constexpr, MQ: tl.constexpr,
                              D: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr,
                              F32DOT: tl.constexpr, KV8: tl.constexpr = False,
                              PDL: tl.constexpr = False, ROPE: tl.constexpr = False,
                              QK_NORM: tl.constexpr = False):
        """The prompt a group of rows shares, read once for all of them: program (lead, kv head)
        attends the queries of the group's rows (grp[lead, :NMAX], -1 past them; only a row whose
        first entry is itself leads) over positions [0, shared[lead]) of the lead's row, whose
        keys and values every member holds too, and leaves each (row, head)'s softmax state
        (max, sum, weighted values) in ml and part for _decode_attn_kernel to continue. ROPE:
        the queries are the raw projections, normalised (QK_NORM) and rotated at each member's
        position here as _decode_attn_kernel does."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        if tl.load(grp_ptr + b * NMAX) != b:
            return  # (an exit releases the dependent attention kernel as a trigger does)
        if PDL:
            # The attention kernel after this one starts once every program here has passed
            # this wait (q/k/v written) and runs beside the rest of this pass.
            gdc_wait()
            gdc_launch_dependents()
        P = tl.load(sh_ptr + b)
        i = tl.arange(0, MQ)  # query rows: member i // GROUP, head kvh·GROUP + i % GROUP
        rows = tl.load(grp_ptr + b * NMAX + i // GROUP, mask=i < NMAX * GROUP, other=-1)
        qmask_r = rows >= 0
        heads = kvh * GROUP + i % GROUP
        d = tl.arange(0, DP)
        dmask = d < D
        qmask = qmask_r[:, None] & dmask[None, :]
        rsafe = tl.where(qmask_r, rows, 0)
        qp = q_ptr + rsafe[:, None] * sq_b + heads[:, None] * sq_h
        if ROPE:
            dt = q_ptr.dtype.element_ty
            rot = tl.where(d < D // 2, d + D // 2, d - D // 2)
            p = tl.load(pos_ptr + rsafe, mask=qmask_r, other=0)
            cs = p[:, None] * s_cos + d[None, :]
            cos = tl.load(cos_ptr + cs, mask=qmask, other=0.0).to(dt).to(tl.float32)
            sin = tl.load(sin_ptr + cs, mask=qmask, other=0.0).to(dt).to(tl.float32)
            q = _load_norm_rope(qp, d[None, :], rot[None, :], qmask, qn_ptr, cos, sin, eps, D,
                                QK_NORM, dt, 1)
        else:
            q = tl.load(qp + d[None, :], mask=qmask, other=0.0)
        if F32DOT:
            q = q.to(tl.float32)
        elif KV8:
            q = q.to(tl.float16)
        kc = kc_ptr + b * sc_b + kvh * sc_h
        vc = vc_ptr + b * sc_b + kvh * sc_h
        m = tl.full([MQ], float("-inf"), tl.float32)
        l = tl.zeros([MQ], tl.float32)
        acc = tl.zeros([MQ, DP], tl.float32)
        m, l, acc = _attend(q, kc, vc, sc_l, d, dmask, 0, P, scale, m, l, acc, BL, KV8, F32DOT)
        row = rsafe * n_heads + heads
        tl.store(part_ptr + row[:, None] * DP + d[None, :], acc, mask=qmask_r[:, None])
        tl.store(ml_ptr + row * 2, m, mask=qmask_r)
        tl.store(ml_ptr + row * 2 + 1, l, mask=qmask_r)

    @triton.jit
    def _decode_attn_combine(part_ptr, ml_ptr, o_ptr, so_b, so_h, n_heads,
                             D: tl.constexpr, DP: tl.constexpr, NSPLIT: tl.constexpr,
                             NSP: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, NSP)
        smask = s < NSPLIT
        row = (b * n_heads + h) * NSPLIT + s
        m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
        l = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
        d = tl.arange(0, DP)
        part = tl.load(part_ptr + row[:, None] * DP + d[None, :], mask=smask[:, None], other=0.0)
        mx = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
        o = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + b * so_b + h * so_h + d, o.to(o_ptr.dtype.element_ty), mask=d < D)

    # ---------------------------------------------------------------------------------------
    # Sampling
    # ---------------------------------------------------------------------------------------

    @triton.jit
    def _sample_stats(logits_ptr, temp_ptr, stats_ptr, idx_ptr, V, s_row, NC,
                      C: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        i = c * C + tl.arange(0, C)
        x = tl.load(logits_ptr + b * s_row + i, mask=i < V, other=float("-inf")).to(tl.float32)
        t = tl.load(temp_ptr + b)
        t = tl.where(t <= 0, 1.0, t)
        m = tl.max(x, 0)
        j = tl.argmax(x, 0)
        live = x > float("-inf")
        s = tl.sum(tl.where(live, tl.exp((x - m) / t), 0.0), 0)
        z = tl.sum(tl.where(live, tl.exp(x - m), 0.0), 0)
        base = stats_ptr + (b * NC + c) * 3
        tl.store(base, m)
        tl.store(base + 1, s)
        tl.store(base + 2, z)
        tl.store(idx_ptr + b * NC + c, (c * C + j).to(tl.int64))

    @triton.jit
    def _mul32(x, lo, hi, m32):
        # (x·c) mod 2³² for x < 2³² in int64, c = hi·2¹⁶ + lo: as sampling._mul32.
        return (x * lo + (((x * hi) & 0xFFFF) << 16)) & m32

    @triton.jit
    def _mix32(x, m32):
        x = x ^ (x >> 16)
        x = _mul32(x, 0x352D, 0x7FEB, m32)
        x = x ^ (x >> 15)
        x = _mul32(x, 0xA68B, 0x846C, m32)
        return x ^ (x >> 16)

    @triton.jit
    def _sample_pick(logits_ptr, temp_ptr, stats_ptr, idx_ptr, key_ptr, step_ptr, active_ptr,
                     pos_ptr, tok_ptr, out_tok_ptr, out_lp_ptr, V, s_row, NC, max_pos,
                     m32, golden, u_ptr, C: tl.constexpr, NCP: tl.constexpr,
                     ADVANCE: tl.constexpr, HAS_U: tl.constexpr):
        b = tl.program_id(0)
        # The uniform of sampling.uniform: two rounds of mix32 on 32-bit words, 24 bits.
        # m32 = 2³² − 1 and golden = 0x9E3779B9 come as int64 arguments: as literals Triton would
        # type them uint32.
        key = tl.load(key_ptr + b).to(tl.int64)
        step = tl.load(step_ptr + b).to(tl.int64)
        h = _mix32(_mix32(key ^ (step & m32), m32) ^ golden, m32)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if HAS_U:
            u = tl.load(u_ptr + b)

        t = tl.load(temp_ptr + b)
        greedy = t <= 0
        t = tl.where(greedy, 1.0, t)
        c = tl.arange(0, NCP)
        cmask = c < NC
        base = stats_ptr + (b * NC + c) * 3
        m = tl.load(base, mask=cmask, other=float("-inf"))
        s = tl.load(base + 1, mask=cmask, other=0.0)
        z = tl.load(base + 2, mask=cmask, other=0.0)
        M = tl.max(m, 0)
        mass = tl.where(m > float("-inf"), s * tl.exp((m - M) / t), 0.0)
        prefix = tl.cumsum(mass, 0)
        total = tl.sum(tl.where(c == NC - 1, prefix, 0.0), 0)
        target = u * total
        j = tl.minimum(tl.sum((prefix < target).to(tl.int32), 0), NC - 1)
        before = tl.sum(tl.where(c == j - 1, prefix, 0.0), 0)
        i = j * C + tl.arange(0, C)
        x = tl.load(logits_ptr + b * s_row + i, mask=i < V, other=float("-inf")).to(tl.float32)
        w = tl.where(x > float("-inf"), tl.exp((x - M) / t), 0.0)
        inner = tl.cumsum(w, 0)
        # Rounding can leave the rest of the target above the chunk's running total (the chunk
        # sums above, tl.sum and the scan each add in their own order): capped by the scan's own
        # last entry (its largest: the weights are not negative), the first entry reaching the
        # rest has weight, as in sampling._inverse_cdf. Capped by tl.sum(w) instead, a rest past
        # the scan's total counted every entry of the chunk, those past V too: a token of a
        # partial last chunk outside the vocabulary (qwen3-50m's 624 tokens: 2047), which the
        # next step's embedding fails on (a device-side assertion).
        rest = tl.minimum(target - before, tl.max(inner, 0))
        k = tl.minimum(tl.sum((inner < rest).to(tl.int32), 0), C - 1)
        tok = tl.minimum(j * C + k, V - 1).to(tl.int64)  # (never past the vocabulary)
        # Greedy: the first chunk with the largest maximum, and its first arg-max.
        jg = tl.argmax(m, 0)
        gtok = tl.sum(tl.where(c == jg, tl.load(idx_ptr + b * NC + c, mask=cmask, other=0), 0), 0)
        tok = tl.where(greedy, gtok, tok)
        lse = M + tl.log(tl.sum(tl.where(m > float("-inf"), z * tl.exp(m - M), 0.0), 0))
        lp = tl.load(logits_ptr + b * s_row + tok).to(tl.float32) - lse
        tl.store(out_tok_ptr + b, tok)
        tl.store(out_lp_ptr + b, lp)
        if ADVANCE:
            act = tl.load(active_ptr + b)
            p = tl.load(pos_ptr + b)
            tl.store(tok_ptr + b, tok)
            tl.store(pos_ptr + b, tl.where(act, tl.minimum(p + 1, max_pos), p))
            tl.store(step_ptr + b, step + act.to(tl.int64))

    # ---------------------------------------------------------------------------------------
    # Batch-1 layer: fused matrix-vector products and rope
    # ---------------------------------------------------------------------------------------

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, nw_ptr, out_ptr, N, K, up_off, eps,
                     NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                     HAS_RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        nmask = rn < N
        dt = out_ptr.dtype.element_ty
        if PDL:
            # Programmatic dependent launch (see _pdl): the next kernel may start now, and this
            # one loads its weights, which no earlier kernel writes, before it waits for the
            # previous kernel's output. The tile is then already on its way while that kernel
            # finishes, instead of after it (K ≤ BK whenever PDL is on: one tile a row).
            gdc_launch_dependents()
            rk = tl.arange(0, BK)
            kmask = rk < K
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wmask, other=0.0)
            w2 = w
            if SWIGLU:
                w2 = tl.load(w_ptr + (rn[:, None] + up_off) * K + rk[None, :], mask=wmask,
                             other=0.0)
            gdc_wait()
            x = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            if NORM:
                r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)
                g = tl.load(nw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
                x = ((x * r).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
            acc = w.to(tl.float32) * x[None, :]
            acc2 = w2.to(tl.float32) * x[None, :]
        else:
            r = 1.0
            if NORM:
                ss = tl.zeros([BK], tl.float32)
                for k0 in range(0, K, BK):
                    rk = k0 + tl.arange(0, BK)
                    xk = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                    ss += xk * xk
                r = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
            acc = tl.zeros([BN, BK], tl.float32)
            acc2 = tl.zeros([BN, BK], tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                kmask = rk < K
                x = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
                if NORM:
                    # As model.rms_norm: normalise in fp32, round, then scale by the weight and
                    # round.
                    g = tl.load(nw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
                    x = ((x * r).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
                wmask = nmask[:, None] & kmask[None, :]
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wmask, other=0.0)
                acc += w.to(tl.float32) * x[None, :]
                if SWIGLU:
                    w2 = tl.load(w_ptr + (rn[:, None] + up_off) * K + rk[None, :], mask=wmask,
                                 other=0.0)
                    acc2 += w2.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        if SWIGLU:
            gate = y.to(dt).to(tl.float32)
            up = tl.sum(acc2, 1).to(dt).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
        if HAS_RES:
            y = y.to(dt).to(tl.float32) + tl.load(res_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(dt), mask=nmask)

    # ---------------------------------------------------------------------------------------
    # Log-probs and entropy of softmax(hidden·Wᵀ), row statistics and their gradient
    # ---------------------------------------------------------------------------------------

    @triton.jit
    def _lse_stats_kernel(logits_ptr, tgt_ptr, out_ptr, V, s_row, BV: tl.constexpr):
        r = tl.program_id(0)
        row = logits_ptr + r.to(tl.int64) * s_row
        m = tl.full([BV], float("-inf"), tl.float32)
        s = tl.zeros([BV], tl.float32)
        a = tl.zeros([BV], tl.float32)
        for v0 in range(0, V, BV):
            i = v0 + tl.arange(0, BV)
            x = tl.load(row + i, mask=i < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            scale = tl.where(m_new > float("-inf"), tl.exp(m - m_new), 0.0)
            e = tl.where(x > float("-inf"), tl.exp(x - m_new), 0.0)
            xs = tl.where(x > float("-inf"), x, 0.0)
            s = s * scale + e
            a = a * scale + e * xs
            m = m_new
        M = tl.max(m, 0)
        f = tl.where(m > float("-inf"), tl.exp(m - M), 0.0)
        S = tl.sum(s * f, 0)
        A = tl.sum(a * f, 0)
        lse = M + tl.log(S)
        t = tl.load(tgt_ptr + r)
        xt = tl.load(row + t).to(tl.float32)
        tl.store(out_ptr + r * 3, xt - lse)  # log-prob of the target
        tl.store(out_ptr + r * 3 + 1, lse - A / S)  # entropy
        tl.store(out_ptr + r * 3 + 2, lse)

    @triton.jit
    def _logprob_grad_kernel(logits_ptr, tgt_ptr, stats_ptr, g_ptr, V, s_row,
                             HAS_ENT: tl.constexpr, BV: tl.constexpr):
        # In place: logits row → d(loss)/d(logits) = g_lp·(onehot − p) − g_ent·p·(x − lse + H).
        r = tl.program_id(0)
        c = tl.program_id(1)
        row = logits_ptr + r.to(tl.int64) * s_row
        i = c * BV + tl.arange(0, BV)
        imask = i < V
        x = tl.load(row + i, mask=imask, other=0.0).to(tl.float32)
        ent = tl.load(stats_ptr + r * 3 + 1)
        lse = tl.load(stats_ptr + r * 3 + 2)
        g_lp = tl.load(g_ptr + r * 2)
        p = tl.exp(x - lse)
        grad = -p * g_lp
        if HAS_ENT:
            g_ent = tl.load(g_ptr + r * 2 + 1)
            grad -= g_ent * p * (x - lse + ent)
        t = tl.load(tgt_ptr + r)
        grad = tl.where(i == t, grad + g_lp, grad)
        tl.store(row + i, grad.to(logits_ptr.dtype.element_ty), mask=imask)

    # ---------------------------------------------------------------------------------------
    # AdamW over fp32 masters from bf16 gradients
    # ---------------------------------------------------------------------------------------

    @triton.jit
    def _adamw_kernel(p_ptr, m_ptr, g_ptr, ea_ptr, eas_ptr, sc_ptr, n, decay, beta1c, beta2,
                      beta2c, eps, WRITE_P: tl.constexpr, BLOCK: tl.constexpr):
        # sc: [clip coefficient, non-finite flag, lr / bias_correction1, √bias_correction2]
        if tl.load(sc_ptr + 1) != 0.0:  # a skipped step reads and writes nothing
            return
        coef = tl.load(sc_ptr)
        step_size = tl.load(sc_ptr + 2)
        bc2_sqrt = tl.load(sc_ptr + 3)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n  # (the skip is not in the mask: n's divisibility keeps loads vectorised)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        ea = tl.load(ea_ptr + offs, mask=mask, other=0.0)
        eas = tl.load(eas_ptr + offs, mask=mask, other=0.0)
        m = m * decay  # decoupled weight decay: p *= 1 − lr·wd
        ea = ea + beta1c * (g - ea)  # exp_avg.lerp_(g, 1 − β1)
        eas = eas * beta2 + beta2c * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(eas), bc2_sqrt) + eps
        m = m - step_size * tl.div_rn(ea, denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(ea_ptr + offs, ea, mask=mask)
        tl.store(eas_ptr + offs, eas, mask=mask)
        if WRITE_P:
            tl.store(p_ptr + offs, m.to(p_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------------------------
# Decode attention
# -------------------------------------------------------------------------------------------

ATTN_MIN_SPLIT = 64  # positions; attention_splits' default (module-level so a benchmark can sweep it)
GEMV_TILE = 8192  # elements of a batch-1 product's tile (_gemv_blocks)
GEMV_WARPS = 4
# The decode attention's launch: positions a tile, warps and software-pipeline stages (0:
# Triton's), by whether rows are split (flash-decoding, up to ~16 rows) and whether the cache holds
# fp8. Module-level so that a benchmark can sweep them (bench.py sweep_attn). The batched entries
# were swept at batch 256 over positions 0-383 (docs/performance.md): small tiles on few warps let
# more programs share a multiprocessor, which at short lengths hides their fixed latency and over
# an fp8 cache leaves warps enough to convert what they load. The split bf16 entry (batch 1)
# pipelines two tiles, the fastest of sweep_b1's launches.
ATTN_LAUNCH = {(True, False): (64, 4, 2), (True, True): (64, 4, 0),  # split rows
               (False, False): (32, 2, 0), (False, True): (32, 1, 0)}  # one program a row


def attention_splits(B: int, kv_heads: int, L: int, min_split: int = 0) -> int:
    """How many programs share one row's keys. A program reads its positions one tile after
    another, each a trip to memory, so when rows × heads are too few to fill the GPU a row is
    split (flash-decoding) into pieces of at least min_split positions, for ~256 programs."""
    if B * kv_heads >= 128:
        return 1
    min_split = min_split or ATTN_MIN_SPLIT
    return max(1, min(-(-L // min_split), -(-256 // (B * kv_heads)), 16))


def decode_attention(q, k_new, v_new, k_cache, v_cache, pos, L: int, scale: float,
                     nsplit: int = 0, rope=None, shared=None):
    """q [B, heads, D]; k_new, v_new [B, kv_heads, D]: the new token of rows [0, B). Writes
    k_new/v_new into k_cache/v_cache [slots, kv_heads, max_len, D] at pos [B] and returns the
    attention output [B, heads, D] over positions [0, pos] of each row. L (≥ pos + 1 for every
    row) only sets the number of splits (nsplit, unless given). With rope = (q_norm, k_norm,
    cos, sin, eps) q and k_new are the raw projections: the kernel applies the q/k RMSNorm
    (when q_norm is not None) and the rotary embedding at pos (cos/sin: the model's fp32 tables)
    as model.qkv_from_normed does. The cache may hold float8_e4m3fn (engine.Options.kv_cache_dtype
    "fp8") while q and the new key and value are in the compute dtype: the new ones are stored
    saturated at ±448, the cached ones converted to fp16 (exactly) as they are loaded, and the
    attention's two products run in fp16.

    shared = (grp [≥B, NMAX], plen [≥B]), both int64: rows holding the same keys and values in
    positions [0, plen) (the samples of one prompt) read them once as a group. Row r leads the
    group grp[r] lists (its first entry r, -1 past the members, at most NMAX) and every member
    has plen = the shared length; a row in no group has plen 0. The shared positions are read
    from the lead's row only, so a member's own copy of them may be stale or overwritten, but
    the lead's must hold them. Used only when rows are not split (nsplit 1); with rope the
    shared pass normalises and rotates the queries too."""
    assert k_cache.dtype in (q.dtype, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype
    B, H, D = q.shape
    KV = k_new.shape[1]
    group = H // KV
    if nsplit <= 0:
        nsplit = attention_splits(B, KV, L)
    kv8 = k_cache.dtype == torch.float8_e4m3fn
    BL, warps, stages = ATTN_LAUNCH[(nsplit > 1, kv8)]
    BL = BL if D <= 128 else min(BL, 32)
    split_len = -(-L // nsplit)
    split_len = -(-split_len // BL) * BL
    nsplit = -(-L // split_len)
    DP = max(16, _pow2(D))
    pdl = _pdl(q.device)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    share = shared is not None and nsplit == 1
    if nsplit > 1 or share:
        part = torch.empty(B * H * nsplit, DP, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * H * nsplit, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = o
    q, k_new, v_new = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k_new, v_new))
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    if rope is not None:
        q_norm, k_norm, cos, sin, eps = rope
        assert cos.stride(1) == 1 and cos.stride() == sin.stride()
        qk_norm = q_norm is not None
    else:
        q_norm = k_norm = cos = sin = None
        eps, qk_norm = 0.0, False
    f32dot = INTERPRET or q.dtype == torch.float32
    if share:
        grp, plen = shared
        nmax = grp.shape[1]
        _shared_prefix_kernel[(B, KV)](
            q, k_cache, v_cache, grp, plen, part, ml, pos, q_norm if qk_norm else o,
            cos if rope is not None else o, sin if rope is not None else o, q.stride(0),
            q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            cos.stride(0) if rope is not None else 0, scale, eps, H, GROUP=group, NMAX=nmax,
            MQ=max(16, _pow2(nmax * group)), D=D, DP=DP, BL=BL, F32DOT=f32dot, KV8=kv8, PDL=pdl,
            ROPE=rope is not None, QK_NORM=qk_norm, launch_pdl=pdl, num_warps=4)
    _decode_attn_kernel[(B, KV, nsplit)](
        q, k_new, v_new, k_cache, v_cache, pos, o, part, ml,
        q_norm if qk_norm else o, k_norm if qk_norm else o,
        cos if rope is not None else o, sin if rope is not None else o,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        o.stride(0), o.stride(1), cos.stride(0) if rope is not None else 0, scale, eps,
        split_len, H, GROUP=group, GP=max(16, _pow2(group)), D=D, DP=DP, BL=BL,
        NSPLIT=nsplit, F32DOT=f32dot, ROPE=rope is not None, QK_NORM=qk_norm, KV8=kv8, PDL=pdl,
        SHARE=share, sh_ptr=shared[1] if share else pos, launch_pdl=pdl, num_warps=warps,
        **({"num_stages": stages} if stages else {}))
    if nsplit > 1:
        _decode_attn_combine[(B, H)](part, ml, o, o.stride(0), o.stride(1), H, D=D, DP=DP,
                                     NSPLIT=nsplit, NSP=max(2, _pow2(nsplit)), PDL=pdl,
                                     launch_pdl=pdl, num_warps=4)
    return o


def decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, L: int, scale: float):
    """The same in PyTorch (model.decode_layer's arithmetic): the reference of the tests."""
    B, H, D = q.shape
    KV = k_new.shape[1]
    rows = torch.arange(B, device=q.device)
    kv_write(k_cache, (rows, slice(None), pos), k_new)
    kv_write(v_cache, (rows, slice(None), pos), v_new)
    keys = kv_read(k_cache, (slice(None, B), slice(None), slice(None, L)), q.dtype)
    values = kv_read(v_cache, (slice(None, B), slice(None), slice(None, L)), q.dtype)
    mask = torch.arange(L, device=q.device)[None, :] <= pos[:, None]
    qg = q.view(B, KV, H // KV, D)
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(values.dtype)
    return torch.matmul(p, values).reshape(B, H, D)


# -------------------------------------------------------------------------------------------
# Sampling
# -------------------------------------------------------------------------------------------

SAMPLE_CHUNK = 2048


def sample_and_advance(logits, temperature, key, step, active=None, pos=None, tok=None,
                       out_tok=None, out_lp=None, max_pos: int = 0, chunk: int = SAMPLE_CHUNK,
                       u=None):
    """sampling.sample for rows without top-p, u = sampling.uniform(key, step) computed inside.

    logits [B, V] (bf16 or fp32, read as fp32); temperature, key, step: the first B entries are
    used. Writes tokens and temperature-1 log-probs into out_tok/out_lp (allocated when None) and
    returns them (u [B], when given, replaces the hashed uniforms). With active/pos/tok given it also advances the decode state of the rows as
    Generator._decode does: tok ← token; where active, pos ← min(pos + 1, max_pos) and step += 1.
    """
    B, V = logits.shape
    assert logits.stride(1) == 1
    dev = logits.device
    NC = -(-V // chunk)
    stats = torch.empty(B, NC, 3, dtype=torch.float32, device=dev)
    idx = torch.empty(B, NC, dtype=torch.long, device=dev)
    if out_tok is None:
        out_tok = torch.empty(B, dtype=torch.long, device=dev)
        out_lp = torch.empty(B, dtype=torch.float32, device=dev)
    advance = pos is not None
    if not advance:
        active, pos, tok = out_tok, out_tok, out_tok  # unused
    _sample_stats[(B, NC)](logits, temperature, stats, idx, V, logits.stride(0), NC, C=chunk,
                           num_warps=4)
    _sample_pick[(B,)](logits, temperature, stats, idx, key, step, active, pos, tok, out_tok,
                       out_lp, V, logits.stride(0), NC, max_pos, 0xFFFFFFFF, 0x9E3779B9,
                       u if u is not None else temperature, C=chunk, NCP=max(2, _pow2(NC)),
                       ADVANCE=advance, HAS_U=u is not None, num_warps=8)
    return out_tok[:B], out_lp[:B]


# -------------------------------------------------------------------------------------------
# Batch-1 decode layer
# -------------------------------------------------------------------------------------------

def _gemv_blocks(N: int, K: int) -> tuple[int, int]:
    """Rows and columns of a program's tile: the whole row (up to 8,192 columns) in one load, so
    every program has all its bytes in flight at once, and ~8,192 elements a tile, so there are
    many programs per multiprocessor (a 1,024 × 4,096 product: 512 programs of 8 rows)."""
    bk = max(16, min(_pow2(K), 8192))
    bn = max(2, min(_pow2(N), max(1, GEMV_TILE // bk)))
    return bn, bk


def gemv(x, w, out, *, bias=None, res=None, norm_w=None, eps: float = 0.0,
         swiglu: bool = False):
    """out [N] = (res +) f(W · n(x)) for one row x [K]: n is the RMSNorm with weight norm_w (as
    model.rms_norm) when given; with swiglu W is [2N, K] (gate rows, then up rows) and f(y) =
    silu(gate)·up; bias is added to W·n(x). Rounded to out's dtype where the eager model rounds."""
    K = x.shape[-1]
    N = out.shape[-1]
    bn, bk = _gemv_blocks(N, K)
    dummy = out
    if swiglu and bn > 2:
        bn //= 2  # two tiles a program: gate and up rows
    pdl = K <= bk and _pdl(out.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, bias if bias is not None else dummy, res if res is not None else dummy,
        norm_w if norm_w is not None else dummy, out, N, K, N if swiglu else 0, eps,
        NORM=norm_w is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu,
        HAS_RES=res is not None, BN=bn, BK=bk, PDL=pdl, launch_pdl=pdl, num_warps=GEMV_WARPS)
    return out


# -------------------------------------------------------------------------------------------
# Log-probs and entropy of softmax(hidden·Wᵀ) without materialising all fp32 logits
# -------------------------------------------------------------------------------------------

CHUNK_ELEMENTS = 1 << 29  # logits per chunk: 1 GiB in bf16
# Logits of the forward pass kept for the backward pass (whole chunks, up to this many elements:
# 4 GiB in bf16) instead of recomputed there: one matrix product a kept chunk fewer.
KEEP_ELEMENTS = 1 << 31


def _chunks(n: int, V: int, budget: int):
    rows = max(1, budget // V)
    return [(i, min(n, i + rows)) for i in range(0, n, rows)]


def _stats_torch(logits, targets):
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(1, targets[:, None]).squeeze(1) - lse
    p = torch.exp(x - lse[:, None])
    ent = lse - (p * x).sum(-1)
    return torch.stack([logp, ent, lse], 1)


def _grad_torch(logits, targets, stats, g, has_ent):
    x = logits.float()
    lse, ent = stats[:, 2:3], stats[:, 1:2]
    p = torch.exp(x - lse)
    grad = -p * g[:, :1]
    if has_ent:
        grad -= g[:, 1:] * p * (x - lse + ent)
    grad.scatter_add_(1, targets[:, None], g[:, :1])
    return grad.to(logits.dtype)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, use_triton, budget, keep):
        h = hidden.to(weight.dtype)
        N, V = h.shape[0], weight.shape[0]
        stats = torch.empty(N, 3, dtype=torch.float32, device=h.device)
        kept, room = [], keep if any(ctx.needs_input_grad[:2]) else 0
        for a, b in _chunks(N, V, budget):
            logits = h[a:b] @ weight.t()
            if use_triton:
                _lse_stats_kernel[(b - a,)](logits, targets[a:b], stats[a:b], V,
                                            logits.stride(0), BV=2048, num_warps=8)
            else:
                stats[a:b] = _stats_torch(logits, targets[a:b])
            if logits.numel() <= room:
                kept.append(logits)
                room -= logits.numel()
            del logits
        ctx.kept = kept
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, targets, stats)
        ctx.use_triton, ctx.budget, ctx.hidden_dtype = use_triton, budget, hidden.dtype
        ctx.mark_non_differentiable(stats)
        return stats[:, 0].clone(), stats[:, 1].clone(), stats

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_stats):
        h, weight, targets, stats = ctx.saved_tensors
        N, V = h.shape[0], weight.shape[0]
        has_ent = g_ent is not None
        g = torch.zeros(N, 2, dtype=torch.float32, device=h.device)
        if g_logp is not None:
            g[:, 0] = g_logp
        if has_ent:
            g[:, 1] = g_ent
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) \
            if need_w else None
        kept, ctx.kept = ctx.kept, []
        for i, (a, b) in enumerate(_chunks(N, V, ctx.budget)):
            if i < len(kept):  # the forward's (the gradient is written over them)
                logits, kept[i] = kept[i], None
            else:
                logits = h[a:b] @ weight.t()
            if ctx.use_triton:
                BV = 2048
                _logprob_grad_kernel[(b - a, triton.cdiv(V, BV))](
                    logits, targets[a:b], stats[a:b], g[a:b], V, logits.stride(0),
                    HAS_ENT=has_ent, BV=BV, num_warps=8)
                gl = logits
            else:
                gl = _grad_torch(logits, targets[a:b], stats[a:b], g[a:b], has_ent)
            if need_h:
                torch.mm(gl, weight, out=grad_h[a:b])
            if need_w:
                if gl.dtype == grad_w.dtype:
                    grad_w.addmm_(gl.t(), h[a:b])
                elif gl.is_cuda:  # the GEMM adds its bf16 product into the fp32 sum itself
                    torch.addmm(grad_w, gl.t(), h[a:b], out_dtype=torch.float32, out=grad_w)
                else:
                    grad_w += (gl.t() @ h[a:b]).float()
            del logits, gl
        if need_h:
            grad_h = grad_h.to(ctx.hidden_dtype)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def linear_logprobs(hidden, weight, targets, entropy_grad: bool = False, *,
                    use_triton: bool | None = None, budget: int = CHUNK_ELEMENTS,
                    keep: int = KEEP_ELEMENTS):
    """(log-prob of each target [N], entropy [N]) of softmax(hidden·weightᵀ) in fp32, computed in
    chunks of rows: train.token_logprobs(hidden @ weight.T, targets) without the [N, V] fp32
    tensors. The entropy carries a gradient only when entropy_grad. The matrix products run in
    weight's dtype (bf16 on a GPU). When a gradient is wanted, the first chunks' logits, up to
    keep elements, are kept for the backward pass; the others are recomputed there."""
    if use_triton is None:
        use_triton = available(hidden.device)
    logp, ent, _ = _LinearLogprobs.apply(hidden, weight, targets, use_triton, budget, keep)
    if not entropy_grad:
        ent = ent.detach()
    return logp, ent


# -------------------------------------------------------------------------------------------
# AdamW over fp32 masters from bf16 gradients
# -------------------------------------------------------------------------------------------

ADAMW_BLOCK = 2048  # elements a program (module-level so a benchmark can sweep them)
ADAMW_WARPS = 4


def adamw_scalars(coef, bad, steps, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """The per-parameter scalars of `adamw` as one [n, 4] fp32 tensor on coef's device, made there
    without a read-back: the clip coefficient (a 0-d tensor), the non-finite flag (0-d, nonzero
    skips), lr / (1 − β1^t) and √(1 − β2^t) for each parameter's step count t (steps: its 0-d
    tensors before this step; t counts this one), in fp64 as torch.optim.AdamW computes them."""
    dev = coef.device
    t = torch.stack([s.to(dev) for s in steps]).double() + 1
    n = t.numel()
    return torch.stack([coef.double().expand(n), bad.double().expand(n),
                        lr / (1 - beta1 ** t), (1 - beta2 ** t).sqrt()], 1).float()


def adamw(param, master, grad, exp_avg, exp_avg_sq, sc, *, lr: float, beta1: float, beta2: float,
          eps: float, weight_decay: float, use_triton: bool = True) -> None:
    """One step of torch.optim.AdamW (decoupled weight decay, no amsgrad) on the fp32 master from
    grad (any float dtype) scaled by sc[0], writing master, exp_avg and exp_avg_sq in place and
    param (the low-precision copy; None or master itself: not written) from the new master;
    nothing at all when sc[1] is nonzero. sc: a row of adamw_scalars. One pass over memory with
    the Triton kernel; use_triton=False: the same in PyTorch operations (on the device too, no
    read-back), for tensors the kernel does not take (not contiguous) and after it failed."""
    write_p = param is not None and param is not master
    args = (1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps)
    n = master.numel()
    if use_triton and all(t.is_contiguous() for t in (master, grad, exp_avg, exp_avg_sq, sc)) \
            and (not write_p or param.is_contiguous()):
        _adamw_kernel[(triton.cdiv(n, ADAMW_BLOCK),)](
            param if write_p else master, master, grad, exp_avg, exp_avg_sq, sc, n, *args,
            WRITE_P=write_p, BLOCK=ADAMW_BLOCK, num_warps=ADAMW_WARPS)
        return
    decay, beta1c, beta2, beta2c, eps = args
    with torch.no_grad():
        keep = sc[1] == 0
        g = grad.float() * sc[0]
        ea = exp_avg.lerp(g, beta1c)
        eas = exp_avg_sq * beta2 + beta2c * (g * g)
        m = master * decay - sc[2] * (ea / (eas.sqrt() / sc[3] + eps))
        if write_p:
            param.copy_(torch.where(keep, m.to(param.dtype), param))
        master.copy_(torch.where(keep, m, master))
        exp_avg.copy_(torch.where(keep, ea, exp_avg))
        exp_avg_sq.copy_(torch.where(keep, eas, exp_avg_sq))
