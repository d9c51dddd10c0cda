"""Would a pre-packed small-M GEMM make verification cheap on this CPU? A measured prototype.

    python benchmarks/experiments/prepacked_gemm.py [--output benchmarks/results/experiments/prepacked_gemm.json]

Verifying a block costs the target one step over 2-8 rows instead of 1. On this 2-core AVX2
CPU that step costs ~1.7-2x a 1-row one, which is what makes speculation lose here: numpy's
OpenBLAS multiplies 1 row by a weight at memory speed (a GEMV), but for 2-8 rows it runs a GEMM
that re-packs the whole weight on every call. A kernel whose weights are packed once, at load,
reads each weight once per call whatever the row count.

This script compiles such a kernel (C with AVX2/FMA intrinsics, OpenMP over column panels;
weights packed `[N/8, K, 8]`, up to 8 rows kept in 8 registers, software prefetch) with the
system's `gcc`, and times it against OpenBLAS on SmolLM2-135M's 121 weight matrices (random
values, fp32, ~540 MB, so every pass streams them from memory), side by side in one process.
It is an experiment, not part of the runtime: shipping it needs a compiler at install time,
a second copy of the weights, and care with three thread pools (OpenBLAS, torch's and this
kernel's OpenMP) on two cores.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL = r"""
#include <immintrin.h>
/* y[M, N] = x[M, K] @ W for M <= 8. wp: W packed as [N/8][K][8]; xt: x transposed, zero-padded, [K][8]. */
void small_gemm(const float *xt, const float *wp, float *y, int M, int K, int N) {
    int panels = N / 8;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < panels; b++) {
        const float *w = wp + (long)b * K * 8;
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            _mm_prefetch((const char *)(w + k * 8 + 1024), _MM_HINT_T0);  /* 4 KB ahead in this panel */
            __m256 wk = _mm256_loadu_ps(w + k * 8);
            const float *xk = xt + k * 8;
            #pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + r), wk, acc[r]);
        }
        for (int r = 0; r < M; r++) _mm256_storeu_ps(y + (long)r * N + b * 8, acc[r]);
    }
}
"""

# SmolLM2-135M: per layer q/k/v fused [576 -> 960], o [576 -> 576], gate/up fused [576 -> 3072],
# down [1536 -> 576]; 30 layers; the LM head [576 -> 49152].
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def compile_kernel(folder: Path) -> ctypes.CDLL:
    source, library = folder / "small_gemm.c", folder / "small_gemm.so"
    source.write_text(KERNEL)
    subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(library)],
                   check=True)
    return ctypes.CDLL(str(library))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=7, help="passes per measurement (the best is kept)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before OpenMP starts: idle threads must not spin
    import numpy as np

    with tempfile.TemporaryDirectory() as folder:
        kernel = compile_kernel(Path(folder))
        pointer = ctypes.POINTER(ctypes.c_float)
        rng = np.random.default_rng(0)
        weights = [rng.standard_normal(shape, dtype=np.float32) for shape in SHAPES]  # [K, N]
        packed = [np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1] // 8, 8).transpose(1, 0, 2)) for w in weights]

        def prepacked(x, panels):  # x [rows, K] @ the weight packed as panels [N/8, K, 8]
            rows, k = x.shape
            width = panels.shape[0] * 8
            xt = np.zeros((k, 8), np.float32)
            xt[:, :rows] = x.T
            y = np.empty((rows, width), np.float32)
            kernel.small_gemm(xt.ctypes.data_as(pointer), panels.ctypes.data_as(pointer), y.ctypes.data_as(pointer),
                              rows, k, width)
            return y

        def best_ms(one_pass):
            one_pass()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - start)
            return min(times) * 1e3

        results = []
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in (576, 1536)}
            error = max(float(np.abs(prepacked(inputs[w.shape[0]], p) - inputs[w.shape[0]] @ w).max())
                        for w, p in zip(weights[:4], packed[:4]))
            openblas = best_ms(lambda: [inputs[w.shape[0]] @ w for w in weights])  # noqa: B023 (timed now)
            ours = best_ms(lambda: [prepacked(inputs[p.shape[1]], p) for p in packed])  # noqa: B023 (timed now)
            results.append({"rows": rows, "openblas_ms": openblas, "prepacked_ms": ours,
                            "ratio": openblas / ours, "max_abs_difference": error})
            print(f"{rows} rows: OpenBLAS {openblas:.1f} ms, pre-packed {ours:.1f} ms per pass over the 121 "
                  f"matrices ({openblas / ours:.2f}x); max |difference| {error:.1e}", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"shapes": "SmolLM2-135M, 121 matrices, fp32", "results": results},
                                          indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
