"""The deterministic mode's fixed-tile product (batch_invariant._matmul_kernel) against cuBLAS on
a decode step's products, for each tile of a grid: which tile to run, and whether it keeps the
numbers. A decode step's products take most of the mode's decode time (about 19 µs each against
cuBLAS's 7 on an H200 at 256 rows), so the tile is the lever.

    python engines/torch/bench_tiles.py [--rows 256] [--shape qwen3-0.6b] [--top 5]
    python engines/torch/bench_tiles.py --rows 16384   # a training pass's forward products

For each product of the shape's layer (q/k/v, o, gate/up, down) and the vocabulary head, at --rows
rows: cuBLAS's time, the current tile's (batch_invariant._tile, by the product's shape), and the
fastest tiles of the grid (BM, BN, BK, warps, stages) with their time and two checks of their
numbers: "same" (every output equal bit for bit to the current tile's: a tile that keeps them can
replace it without changing a single log-prob) and "invariant" (rows 0..7 of the --rows-row product
equal the product of those 8 rows alone, and of row 0 alone: the row's numbers do not depend on the
batch). Times are device µs per product, the median of 5 replays of a CUDA graph of 20 products (a
decode step replays its graph likewise, so launch overhead is left out). Ends with the decode
step's product time at the current tile and at the best keeping tile per product, summed over the
layers.

--forms times other forms of the kernel (batch_invariant.MATMUL_FORMS: "tma", "persistent",
"persistent-ws", TMA descriptors on Hopper) on their own grid of tiles, each checked as above
against the current plain tile's outputs: a form whose tiles are all "same" and "invariant" can
take a training pass's products (determinism.py --matmul-form) without changing a log-prob. For
each form the table has a row a product, and the end the sum over a pass's products at the best
tile per product and at the best single tile (the one --tile-large would set for every product
of at least batch_invariant.FORM_MIN_M rows):

    python engines/torch/bench_tiles.py --rows 16384 --forms tma,persistent,persistent-ws
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from slimen_torch import batch_invariant as bi  # noqa: E402

SHAPES = {"qwen3-0.6b": dict(hidden=1024, heads=16, kv=8, head_dim=128, inter=3072,
                             layers=28, vocab=151936)}


def products(s):
    """(name, N, K, count a step) of a decode step's products."""
    q = s["heads"] * s["head_dim"] + 2 * s["kv"] * s["head_dim"]
    return [("qkv", q, s["hidden"], s["layers"]),
            ("o", s["hidden"], s["heads"] * s["head_dim"], s["layers"]),
            ("gate_up", 2 * s["inter"], s["hidden"], s["layers"]),
            ("down", s["hidden"], s["inter"], s["layers"]),
            ("head", s["vocab"], s["hidden"], 1)]


def run(x, w, tile, form="plain", sub=None):
    """x·wᵀ by the kernel of form in tile; sub: the TMA forms' EPILOGUE_SUBTILE (None: as
    set)."""
    if sub is not None:
        bi.EPILOGUE_SUBTILE = sub
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    bi.matmul_tiled(x, w, y, tile, form)
    return y


def form_grid(form: str, rows: int, plain: list) -> list:
    """(tile, epilogue parts or None) of form to try: the plain kernel's grid, or the TMA forms'
    smaller one (128-row tiles for a training pass's rows, 64-row ones too for a decode's; the
    warp-specialized form on 4 warps only: Triton's Hopper warp specialization wants those)."""
    if form == "plain":
        return [(t, None) for t in plain]
    tiles = [(128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3),
             (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
             (128, 128, 128, 8, 3), (128, 256, 128, 8, 2)]
    if rows < 1024:
        tiles += [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4),
                  (64, 256, 64, 4, 3), (64, 128, 128, 4, 3)]
    if form == "persistent-ws":
        return [(t, None) for t in dict.fromkeys(t[:3] + (4, t[4]) for t in tiles)]
    return [(t, sub) for t in tiles for sub in (1, 2)]


def tile_name(tile, sub) -> str:
    return ",".join(map(str, tile)) + ("" if sub is None else f"/sub{sub}")


def timed(fn, reps=20) -> float:
    """Device µs per call: the median of 5 replays of a graph of reps calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--forms", default="plain",
                    help="comma-separated kernel forms to time, of " + ",".join(bi.MATMUL_FORMS))
    a = ap.parse_args()
    forms = a.forms.split(",")
    bad = [f for f in forms if f not in bi.MATMUL_FORMS]
    if bad:
        ap.error(f"--forms: {bad} not in {bi.MATMUL_FORMS}")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    # 128×256 tiles only on 8 warps and for training passes' row counts (--rows 1024 or more):
    # at a decode step's 256 rows they leave most of the GPU idle.
    plain = [t for t in itertools.product((64, 128), (32, 64, 128, 256), (64, 128), (4, 8),
                                          (3, 4, 5))
             if t[0] * t[1] <= 128 * 128 or t[0] == 64 or (a.rows >= 1024 and t[3] == 8)]
    grids = {f: form_grid(f, a.rows, plain) for f in forms}
    saved_sub = bi.EPILOGUE_SUBTILE
    print(f"device: {torch.cuda.get_device_name()}; rows {a.rows}; the current tiles by shape "
          "(batch_invariant._tile, the plain kernel) against "
          + "; ".join(f"{f}'s grid of {len(grids[f])} tiles" for f in forms))
    # Each product's operands, the current plain tile's outputs and times, first; then the
    # forms one after the other, each ending with its sums (a form that hangs or fails keeps
    # the ones before).
    cases, total_cur, total_cublas = [], 0.0, 0.0
    for name, N, K, count in products(SHAPES[a.shape]):
        x = torch.randn(a.rows, K, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) / K ** 0.5
        cur = bi._tile(a.rows, N, K)  # the tile the mode runs now (by the product's shape)
        ref = run(x, w, cur)
        t_cublas = timed(lambda: x @ w.t())
        t_cur = timed(lambda: run(x, w, cur))
        total_cur += t_cur * count
        total_cublas += t_cublas * count
        cases.append((name, N, K, count, x, w, ref, t_cublas, t_cur))
    what = "a decode step's" if a.rows < 1024 else f"a forward pass's ({a.rows} tokens)"
    print(f"\n{what} products: cuBLAS {total_cublas / 1000:.2f} ms, current plain tiles "
          f"{total_cur / 1000:.2f} ms")
    print("\n| product | form | N × K | cuBLAS µs | current tile µs | best tiles (µs, same, "
          "invariant) |")
    print("|---|---|---|---:|---:|---|")
    sums = []
    for form in forms:
        total_best = 0.0
        single = {}  # (tile, sub) → [µs × count summed, every output kept, products timed]
        for name, N, K, count, x, w, ref, t_cublas, t_cur in cases:
            rows = []
            for tile, sub in grids[form]:
                try:
                    y = run(x, w, tile, form, sub)
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a tile that does not compile or fit: skipped
                    continue
                same = torch.equal(y, ref)
                inv = torch.equal(y[:8], run(x[:8].clone(), w, tile, form, sub)) and \
                    torch.equal(y[:1], run(x[:1].clone(), w, tile, form, sub))
                del y
                us = timed(lambda: run(x, w, tile, form, sub))
                rows.append((us, (tile, sub), same, inv))
                acc = single.setdefault((tile, sub), [0.0, True, 0])
                acc[0] += us * count
                acc[1] = acc[1] and same and inv
                acc[2] += 1
            rows.sort(key=lambda r: r[0])
            keep = [r for r in rows if r[2] and r[3]]
            best = keep[0][0] if keep else t_cur
            total_best += min(best, t_cur) * count
            shown = rows[:a.top] + [r for r in keep[:2] if r not in rows[:a.top]]
            cells = "; ".join(f"{tile_name(*t)}: {us:.1f} ({'same' if s else 'differs'}, "
                              f"{'inv' if i else 'NOT inv'})" for us, t, s, i in shown)
            print(f"| {name} | {form} | {N} × {K} | {t_cublas:.1f} | {t_cur:.1f} | {cells} |",
                  flush=True)
        ones = sorted((v[0], k) for k, v in single.items() if v[1] and v[2] == len(cases))
        broke = sorted(tile_name(*k) for k, v in single.items() if not v[1])
        one = "; ".join(f"{tile_name(*k)} {us / 1000:.2f} ms" for us, k in ones[:3]) or "none"
        sums.append(f"- {form}: best keeping tile per product {total_best / 1000:.2f} ms; best "
                    f"single tiles keeping every product: {one}"
                    + (f"; tiles that changed a number: {', '.join(broke)}" if broke else ""))
        print(sums[-1], flush=True)
    bi.EPILOGUE_SUBTILE = saved_sub
    print(f"\n{what} products: cuBLAS {total_cublas / 1000:.2f} ms, current plain tiles "
          f"{total_cur / 1000:.2f} ms")
    print("\n".join(sums))
    return 0


if __name__ == "__main__":
    sys.exit(main())
