"""GFLOP/s of numpy's float32 product c = a·bᵀ on the engine's shapes, the same list as
BenchmarkMatMulShapes in matmul_test.go (run with OPENBLAS_NUM_THREADS=1 for one thread):

    python numpy_matmul.py
"""

import time

import numpy as np

# name, m, n, k: builtin:tiny-arith's products on a 4096-row training chunk, a 64-row decode step
# and a weight gradient over 4096 rows.
SHAPES = [("mlp-up 4096x192x64", 4096, 192, 64), ("mlp-down 4096x64x192", 4096, 64, 192),
          ("attn 4096x64x64", 4096, 64, 64), ("decode 64x192x64", 64, 192, 64),
          ("grad 192x64x4096", 192, 64, 4096), ("head 4096x102x64", 4096, 102, 64)]

rng = np.random.default_rng(1)
for name, m, n, k in SHAPES:
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    c = np.empty((m, n), dtype=np.float32)
    np.matmul(a, b.T, out=c)
    reps, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.5:
        np.matmul(a, b.T, out=c)
        reps += 1
    dt = (time.perf_counter() - t) / reps
    print(f"{name}: {2 * m * n * k / dt / 1e9:.1f} GFLOP/s")
