"""What one target step's matmuls cost by row count, for every CPU kernel we could use, side by side.

    python benchmarks/matmul_kernels.py [--rows 1,2,4,8,16,32,64] [--output benchmarks/results/matmul_kernels.json]

SmolLM2-135M's 121 weight matrices (q/k/v fused, o, gate/up fused, down; 30 layers) plus the
LM head, random values, one pass over all of them per measurement (~540 MB in fp32, ~270 MB
in bf16: every pass streams them from memory, as a decode step does). Kernels:
- `numpy_fp32`: numpy's OpenBLAS, our fp32 path (`models/linear.py`);
- `torch_fp32`: `x @ W` through torch (MKL);
- `onednn_bf16`: `F.linear` in bf16 through oneDNN;
- `onednn_bf16_packed`: oneDNN with the weights pre-packed once (`mkldnn._linear_pointwise`);
- `int8_weight_only`: `torch._weight_int8pack_mm` (int8 weights, bf16 activations);
- `ours_bf16`: our packed kernel (`kernels/cpu_kernels.c`), the `--dtype bfloat16` path.
The weight-read floor of a dtype is its weight bytes over the read bandwidth measured in the
same run. Writes JSON and a PNG (ms per pass against rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)
import torch
import torch.nn.functional as F
from decode_speed import read_bandwidth_gbs

from dspark_trt.kernels import cpu_kernels

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)


def kernels(weights: list[torch.Tensor]) -> dict:
    """name -> (prepared weights, fn(x, prepared) -> y): the preparation is done once, outside the timing."""
    lp = torch.ops.mkldnn._linear_pointwise
    found = {
        "numpy_fp32": ([w.t().contiguous().numpy() for w in weights], lambda x, w: x.numpy() @ w),
        "torch_fp32": ([w.t().contiguous() for w in weights], lambda x, w: x @ w),
        "onednn_bf16": ([w.bfloat16() for w in weights], lambda x, w: F.linear(x.bfloat16(), w).float()),
    }
    try:  # oneDNN packs bf16 weights only where the CPU has AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        found["onednn_bf16_packed"] = ([torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in weights],
                                       lambda x, w: lp(x.bfloat16(), w, None, "none", [], "").float())
    except RuntimeError as error:
        print(f"onednn_bf16_packed: skipped ({error})", flush=True)
    scales = [w.abs().amax(1) / 127 for w in weights]
    found["int8_weight_only"] = ([(torch.round(w / s[:, None]).to(torch.int8), s.bfloat16())
                                  for w, s in zip(weights, scales)],
                                 lambda x, w: torch._weight_int8pack_mm(x.bfloat16(), w[0], w[1]))
    if cpu_kernels.available():
        found["ours_bf16"] = ([cpu_kernels.PackedWeight(w.t()) for w in weights], cpu_kernels.matmul)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5, help="passes per point (the fastest is kept)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/matmul_kernels.json"))
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) * 0.02 for inp, out in SHAPES]  # [out, in]
    bandwidth = read_bandwidth_gbs()
    num_weights = sum(w.numel() for w in weights)
    floors_ms = {"fp32": num_weights * 4 / bandwidth / 1e6, "bf16": num_weights * 2 / bandwidth / 1e6,
                 "int8": num_weights / bandwidth / 1e6}
    results: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name, (prepared, fn) in kernels(weights).items():
            results[name] = {}
            for rows in rows_list:
                xs = [torch.randn(rows, inp, generator=generator) for inp, _ in SHAPES]
                for x, w in zip(xs, prepared):  # warm-up (kernel selection, page faults)
                    fn(x, w)
                best = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for x, w in zip(xs, prepared):
                        fn(x, w)
                    best = min(best, time.perf_counter() - start)
                results[name][rows] = best * 1e3
            print(name, " ".join(f"{r}:{ms:.1f}" for r, ms in results[name].items()), "ms", flush=True)
    report = {"command": f"python benchmarks/matmul_kernels.py --rows {args.rows} --repeats {args.repeats}",
              "shapes": "SmolLM2-135M: 121 matrices + LM head", "read_bandwidth_gbs": bandwidth,
              "weight_read_floor_ms": floors_ms, "ms_per_pass": results,
              "ratio_to_one_row": {n: {r: ms / v[rows_list[0]] for r, ms in v.items()} for n, v in results.items()},
              "bf16_kernel": cpu_kernels.unavailable_reason() or "available"}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, values in results.items():
        axis.plot(list(values), list(values.values()), marker="o", label=name, linewidth=2.5 if "ours" in name else 1)
    for dtype, ms in floors_ms.items():
        if dtype != "int8":
            axis.axhline(ms, linestyle=":", color="gray")
            axis.text(rows_list[-1], ms, f" {dtype} weight-read floor", va="bottom", ha="right", fontsize=8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("rows (tokens in the step)")
    axis.set_ylabel("ms per pass over SmolLM2-135M's matrices")
    axis.set_title(f"CPU matmul kernels by row count ({bandwidth:.0f} GB/s read)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
