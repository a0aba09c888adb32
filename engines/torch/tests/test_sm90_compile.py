"""The deterministic mode's Triton kernels with loops of matrix products (and the decode step's
LoRA expand) compile for an H100/H200 (sm_90) in the configurations the GPU runs, checked here
on the CPU: Triton compiles ahead of time for a target it is told (its wheel ships ptxas), so a
kernel that the interpreter runs but the GPU's compiler rejects fails CI instead of a device run.
The arguments are typed as a GPU launch specializes them: pointers and the integers that are
multiples of 16 marked divisible by 16 (what makes the software pipeliner act, and where it once
failed on a branch inside a kernel's loop). The compiles run in a child process without
TRITON_INTERPRET, which the other tests set and under which Triton's code generator does not
work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# Qwen3-0.6B's attention (16 query heads, 8 key heads, head dim 128) in bf16: the strides and
# sizes a launch passes are multiples of 16 except the group size G and the position counts.
ALIGNED_INTS = {"H", "D", "N", "K", "KS", "sqb", "sqt", "sqh", "skb", "skh", "skl", "svb", "svh",
                "svl", "sob", "sot", "soh", "sdb", "sdt", "sdh", "sgb", "sgh", "sgl", "sub", "suh",
                "sul", "sx", "sxm", "swn", "sym", "ssm", "sbn", "som", "CR", "soff", "sxr",
                "scr", "ssr", "sqr", "skr"}
ATTN = dict(Q="bf16", K="bf16", V="bf16", O="bf16", DO="bf16", P="i64", DQ="bf16", LSE="fp32",
            DELTA="fp32", DK="bf16", DV="bf16")


def configs(bi):
    """(name, kernel, pointers, constexprs, warps, stages) of each launch form to compile."""
    out = []
    BM, BN, warps, stages = bi.ATTN_BWD_DQ
    for lse in (False, True):
        for full in (False, True):
            out.append((f"dq-lse{int(lse)}-full{int(full)}", bi._attention_bwd_dq_kernel, ATTN,
                        dict(BM=BM, BN=BN, BD=128, F32DOT=False, HAVE_LSE=lse, FULL_BLOCKS=full),
                        warps, stages))
    BM, BN, warps, stages = bi.ATTN_BWD_DKDV
    for full in (False, True):
        out.append((f"dkdv-full{int(full)}", bi._attention_bwd_dkdv_kernel, ATTN,
                    dict(BM=BM, BN=BN, BD=128, F32DOT=False, FULL_BLOCKS=full), warps, stages))
    # The second form (ATTN_BWD "triton2"), Qwen3's 2 query heads a key head.
    BM, BN, warps, stages = bi.ATTN_BWD2_DQ
    for lse in (False, True):
        out.append((f"dq2-lse{int(lse)}", bi._attention_bwd2_dq_kernel, ATTN,
                    dict(G=2, BM=BM, BN=BN, BD=128, F32DOT=False, HAVE_LSE=lse), warps, stages))
    BM, BN, warps, stages = bi.ATTN_BWD2_DKDV
    for causal in (False, True):
        out.append((f"dkdv2-causal{int(causal)}", bi._attention_bwd2_dkdv_kernel, ATTN,
                    dict(G=2, BM=BM, BN=BN, BD=128, F32DOT=False, CAUSAL=causal), warps, stages))
    for lse in (False, True):
        out.append((f"attention-lse{int(lse)}", bi._attention_kernel,
                    dict(ATTN, LSE="fp32" if lse else "bf16"),
                    dict(BM=bi.ATTN_BM, S=bi.KV_SPLIT, BD=128, IEEE=False, HG=2, STORE_LSE=lse),
                    4, 3))
    for tname, tile in (("tile", bi.TILE), ("tile-large", bi.TILE_LARGE),
                        ("tile-narrow", bi.TILE_NARROW), ("tile-wide", bi.TILE_WIDE)):
        BM, BN, BK, warps, stages = tile
        consts = dict(BM=BM, BN=BN, BK=BK, IEEE=False)
        out.append((f"matmul-{tname}", bi._matmul_kernel, dict(X="bf16", W="bf16", Y="bf16"),
                    consts, warps, stages))
        out.append((f"matmul-split-{tname}", bi._matmul_split_kernel,
                    dict(X="bf16", W="bf16", P="fp32"), consts, warps, stages))
    # The products' Hopper forms (batch_invariant.MATMUL_FORM) in the large tile and a 128 × 256
    # one, on TMA descriptors of bf16 blocks (the tile's); the warp-specialized one on 4 warps.
    for tname, tile in (("tile-large", bi.TILE_LARGE or bi.TILE),
                        ("128x256", (128, 256, 64, 8, 3))):
        BM, BN, BK, warps, stages = tile
        descs = dict(XD=f"tensordesc<bf16[{BM}, {BK}]>", WD=f"tensordesc<bf16[{BN}, {BK}]>")
        for sub in (1, 2):
            consts = dict(BM=BM, BN=BN, BK=BK, GROUP=bi.GROUP_M, SUB=sub, IEEE=False)
            typed = dict(descs, YD=f"tensordesc<bf16[{BM}, {BN // sub}]>")
            out.append((f"matmul-tma-sub{sub}-{tname}", bi._matmul_tma_kernel, typed, consts,
                        warps, stages))
            out.append((f"matmul-persistent-sub{sub}-{tname}", bi._matmul_persistent_kernel,
                        typed, consts, warps, stages))
        out.append((f"matmul-ws-{tname}", bi._matmul_ws_kernel, dict(descs, Y="bf16"),
                    dict(BM=BM, BN=BN, BK=BK, GROUP=bi.GROUP_M, IEEE=False), 4, stages))
    # The log-sum-exp and the sampler over a vocabulary (bf16 logits; Qwen3's 75 parts in 128).
    part = bi.VOCAB_PART
    out.append(("lse-part", bi._lse_part_kernel, dict(X="bf16", PM="fp32", PS="fp32"),
                dict(BLOCK=part), 4, 3))
    out.append(("lse-combine", bi._lse_combine_kernel, dict(PM="fp32", PS="fp32", Y="fp32"),
                dict(BP=128), 4, 3))
    out.append(("sample-part", bi._sample_part_kernel,
                dict(X="bf16", PM="fp32", T="fp32", PW="fp32", PA="i32"),
                dict(BLOCK=part, BP=128), 4, 3))
    out.append(("sample-pick", bi._sample_pick_kernel,
                dict(X="bf16", PM="fp32", PW="fp32", PA="i32", LSE="fp32", T="fp32", U="fp32",
                     TOK="i64", LP="fp32"), dict(BLOCK=part, BP=128), 4, 3))
    # The decode step's cache writes (Qwen3's 8 key heads of 128) and SwiGLU's forward.
    out.append(("kv-write", bi._kv_write_kernel, dict(K="bf16", V="bf16", KC="bf16", VC="bf16",
                                                      P="i64"), dict(BH=8, BD=128), 4, 3))
    out.append(("swiglu", bi._swiglu_kernel, dict(GU="bf16", A="bf16"), dict(BLOCK=1024), 4, 3))
    out.append(("add-rms", bi._add_rms_kernel, dict(X="bf16", Yv="bf16", S="bf16", W="bf16",
                                                    Hn="bf16"), dict(BLOCK=bi.ROW_BLOCK), 4, 3))
    # The q and k heads' norms and rope (Qwen3's 16 + 8 heads of 128; Llama's without norms).
    for norm in (True, False):
        out.append((f"qk-rope-norm{int(norm)}", bi._qk_rope_kernel,
                    dict(X="bf16", WQ="bf16", WK="bf16", C="fp32", S="fp32", YQ="bf16",
                         YK="bf16"), dict(NORM=norm, BH=32, BD=128), 4, 3))
    # The decode step's LoRA expand (lora_kernels.py) in bf16: 8 slots of rank 8 (the bench's),
    # rank 16 and 64 slots of rank 4 (the columns of a part: 64, 128, 256).
    from slimen_torch import lora_kernels as lk
    lkp = dict(Y="bf16", S="bf16", B="bf16", IDX="i64", SCALE="fp32", PART="i32", O="bf16")
    for bc in (64, 128, 256):
        out.append((f"lora-expand-bc{bc}", lk._expand_kernel, lkp,
                    dict(BM=lk.BM, BN=lk.BN_MAX, BC=bc, F32DOT=False), lk.WARPS, 1))
    # Its other tiles (lora_kernels' switches BM and WARPS, bench_lora's diff variants).
    for bm, warps in ((64, 4), (32, 4), (16, 2), (128, 8)):
        out.append((f"lora-expand-bm{bm}-w{warps}", lk._expand_kernel, lkp,
                    dict(BM=bm, BN=lk.BN_MAX, BC=64, F32DOT=False), warps, 1))
    return out


def names() -> list[str]:
    """configs()' names, read in this process (under the interpreter: the names alone)."""
    sys.path.insert(0, str(HERE.parent))
    from slimen_torch import batch_invariant as bi
    return [c[0] for c in configs(bi)] if bi.HAVE_TRITON else []


NAMES = names()


def compile_sm90(triton, kernel, pointers: dict, consts: dict, warps: int, stages: int):
    """Compiles the @triton.jit kernel for sm_90: pointers name → element type (or a host TMA
    descriptor's type, "tensordesc<bf16[BM, BK]>"), consts its constexpr arguments; every other
    argument an i32 (scale and eps fp32)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, attrs, constexprs = {}, {}, {}
    for i, a in enumerate(kernel.arg_names):
        if a in consts:
            sig[a], constexprs[(i,)] = "constexpr", consts[a]
        elif a in pointers and pointers[a].startswith("tensordesc"):
            sig[a] = pointers[a]  # a TMA descriptor made on the host: its type as given
        elif a in pointers:
            sig[a], attrs[(i,)] = "*" + pointers[a], [["tt.divisibility", 16]]
        elif a in ("scale", "eps"):
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
            if a in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(consts) - set(kernel.arg_names)
    assert not missing, f"{kernel.fn.__name__} has no argument {missing}"
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "num_stages": stages})


def main():
    """Compiles every configuration; one JSON object on stdout: name → "ok" or the error."""
    import triton
    sys.path.insert(0, str(HERE.parent))
    from slimen_torch import batch_invariant as bi
    res = {}
    for name, kernel, pointers, consts, warps, stages in configs(bi):
        try:
            compile_sm90(triton, kernel, pointers, consts, warps, stages)
            res[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the report names it
            res[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    print(json.dumps(res))


@pytest.fixture(scope="module")
def compiled():
    triton = pytest.importorskip("triton")
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or \
        Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not Path(ptxas).exists():
        pytest.skip("Triton's wheel has no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_the_deterministic_kernels_compile_for_sm90(compiled, name):
    assert compiled[name] == "ok", compiled[name]


if __name__ == "__main__":
    main()
