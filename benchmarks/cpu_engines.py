"""Which CPU engine to serve the target with on this machine: the whole step, side by side.

    python benchmarks/cpu_engines.py [--tokens 1,2,4,8,16] [--context 300] [--repeats 7]
                                     [--onnx ENGINE_DIR/onnx/target.onnx] [--no-ort]
                                     [--output benchmarks/results/cpu_engines.json]

One request with a `--context`-token context, T new tokens, logits at every new token and the
drafter's feature layers returned: a verification step of T - 1 draft tokens. Medians of
`--repeats`, ms. Candidates (issue #42, item 1), each a whole step (attention, norms, KV writes):
- `kernels_<isa>`: our C kernels (`kernels/cpu_kernels.c`, bf16 weights, fp32 activations) for
  every instruction set this CPU runs (AVX-512, AVX2+FMA), each in its own process
  (`DSPARK_TRT_KERNEL_ISA` picks the variant once per process); `kernels_int4`: the same with
  `--dtype int4` (4-bit layer matrices, AMX-INT8 CPUs only), against its own weight-read floor;
- `torch_fp32`: the fp32 PyTorch reference (OpenBLAS/oneDNN), what a CPU without our kernels ran;
- `ort_fp32` / `ort_int4`: ONNX Runtime (MLAS) over the builder's `target.onnx` as exported (the
  KV pool goes in as `past_*` and comes out copied as `present_*`), and the same graph with its
  weights quantized to int4 `MatMulNBits` (block 32, asymmetric like the GGUF's Q4_1, accuracy
  level 4). Without `--onnx` the target graph is exported here first (~30 s).
The weight-read floor of each dtype (bytes read per step over the read bandwidth measured in the
same run) is reported beside it. Writes JSON and a PNG (ms per step against new tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CANDIDATE_ENV = "DSPARK_TRT_BENCH_CANDIDATE"  # set in the child process that measures one candidate


def cpu_summary() -> dict:
    """The CPU's name and the instruction sets that decide which kernels run."""
    flags, name = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd")
    return {"name": name, "cores": os.cpu_count(), "isa": [f for f in wanted if f in flags]}


def parse_counts(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of positive integers given as `option` (`"1,4,8"`), or the parser's
    usage error naming the option."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"{option} must be comma-separated integers, got {text!r}")
    if not counts or min(counts) < 1:
        parser.error(f"{option} must list positive counts, got {text!r}")
    return counts


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON at `path`, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)


def time_steps(step, tokens: list[int], repeats: int) -> dict[str, float]:
    """Median ms of `step(T)` for each T. Each repeat goes over every T in turn (after one warm-up
    call each), so drift on a shared machine moves all of them alike and their ratios hold."""
    for count in tokens:
        step(count)
    samples = {count: [] for count in tokens}
    for _ in range(repeats):
        for count in tokens:
            start = time.perf_counter()
            step(count)
            samples[count].append(time.perf_counter() - start)
    return {str(count): statistics.median(values) * 1e3 for count, values in samples.items()}


def measure_ours(dtype_name: str, tokens: list[int], context: int, repeats: int) -> dict:
    """Our runtime's target step (`TargetModel.forward`) at `dtype_name` in this process."""
    import dspark_trt  # noqa: F401  (first: the CPU threading policy)
    import torch

    from dspark_trt.kernels import cpu_kernels
    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.loading import load_target

    dtype = getattr(torch, dtype_name)
    target = load_target("default", dtype=dtype)
    model = target.model
    layers = tuple(load_drafter("default", target).config.feature_layers)
    pool = model.new_pool(1, 512)
    cache = pool.allocate()
    generator = torch.Generator().manual_seed(0)
    model(torch.randint(0, target.config.vocab_size, (context,), generator=generator), [context], [cache],
          torch.tensor([context - 1]), ())

    def step(count: int) -> None:
        ids = torch.randint(0, target.config.vocab_size, (count,), generator=generator)
        model(ids, [count], [cache], torch.arange(count), layers)
        cache.truncate(context)

    isa = cpu_kernels.isa() if dtype in (torch.bfloat16, torch.int4) and model._runs_cpu_kernels() else None
    return {"ms": time_steps(step, tokens, repeats), "kernel_isa": isa, "weight_bytes": model.weight_bytes()}


def export_target_onnx(folder: Path) -> Path:
    """The builder's target graph for the default config (what `dspark-trt build` writes)."""
    import dspark_trt  # noqa: F401

    from dspark_trt.builder import onnx_export
    from dspark_trt.config import load_build_config
    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.loading import load_target

    config = load_build_config("default")
    target = load_target("default")
    layers = tuple(load_drafter("default", target).config.feature_layers)
    feeds, _ = onnx_export.sample_target_inputs(target, config, layers)
    path = folder / "target.onnx"
    onnx_export.export_target(target, layers, config, feeds, path)
    return path


def measure_ort(path: Path, quantize: bool, tokens: list[int], context: int, repeats: int) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    if quantize:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), block_size=32, is_symmetric=False, accuracy_level=4)
        quantizer.process()
        path = path.with_name("target.int4.onnx")
        quantizer.model.save_model_to_file(str(path), use_external_data_format=True)
    graph = onnx.load(str(path), load_external_data=False).graph
    shape = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    num_layers, _, kv_heads, _, head_dim = shape["past_keys"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((num_layers, 1, kv_heads, 512, head_dim)).astype(np.float32) * 0.1 for _ in range(2)]

    def step(count: int) -> None:
        session.run(None, {"input_ids": rng.integers(0, 49152, count).astype(np.int64),
                           "positions": np.arange(context, context + count, dtype=np.int64),
                           "token_slots": np.zeros(count, np.int64), "logits_indices": np.arange(count, dtype=np.int64),
                           "past_keys": pool[0], "past_values": pool[1]})

    weight_bytes = sum(int(np.prod(t.dims)) * (4 if t.data_type == onnx.TensorProto.FLOAT else 1)
                       for t in onnx.load(str(path)).graph.initializer if len(t.dims) == 2 and "embed" not in t.name)
    return {"ms": time_steps(step, tokens, repeats), "weight_bytes_approx": weight_bytes}


def child(args, tokens: list[int]) -> None:
    """Measure one candidate (named by CANDIDATE_ENV) at `tokens` new tokens a step and print its JSON."""
    name = os.environ[CANDIDATE_ENV]
    if name == "kernels_int4":
        result = measure_ours("int4", tokens, args.context, args.repeats)
    elif name.startswith("kernels_"):
        result = measure_ours("bfloat16", tokens, args.context, args.repeats)
    elif name == "torch_fp32":
        result = measure_ours("float32", tokens, args.context, args.repeats)
    else:
        result = measure_ort(Path(args.onnx), name == "ort_int4", tokens, args.context, args.repeats)
    print("RESULT " + json.dumps(result))


def run_candidate(name: str, args, extra_env: dict) -> dict | None:
    env = {**os.environ, CANDIDATE_ENV: name, **extra_env}
    command = [sys.executable, __file__, "--tokens", args.tokens, "--context", str(args.context),
               "--repeats", str(args.repeats)] + (["--onnx", str(args.onnx)] if args.onnx else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"  {name}: failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,6,8,12,16", help="new tokens per step to measure")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the request's KV cache")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--onnx", type=Path, help="the builder's target.onnx (default: export it here)")
    parser.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime candidates")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "cpu_engines.json")
    args = parser.parse_args()
    tokens = parse_counts(parser, "--tokens", args.tokens)
    if CANDIDATE_ENV in os.environ:
        child(args, tokens)
        return 0

    sys.path.insert(0, str(HERE))
    from decode_speed import read_bandwidth_gbs

    import dspark_trt  # noqa: F401
    from dspark_trt.kernels import cpu_kernels

    cpu = cpu_summary()
    print(f"CPU: {cpu['name']} x{cpu['cores']}, {' '.join(cpu['isa'])}")
    candidates = {f"kernels_{isa}": {"DSPARK_TRT_KERNEL_ISA": isa} for isa in cpu_kernels.supported_isas()}
    if cpu_kernels.q4_available():  # --dtype int4: 4-bit layer matrices (AMX-INT8)
        candidates["kernels_int4"] = {}
    candidates["torch_fp32"] = {"DSPARK_TRT_BF16_KERNEL": "off"}
    with tempfile.TemporaryDirectory() as scratch:
        if not args.no_ort:
            if args.onnx is None:
                print("exporting the target graph (the builder's target.onnx) ...")
                args.onnx = export_target_onnx(Path(scratch))
            candidates.update(ort_fp32={}, ort_int4={})
        results = {}
        for name, env in candidates.items():
            print(f"measuring {name} ...")
            measured = run_candidate(name, args, env)
            if measured is not None:
                results[name] = measured
                print("  " + ", ".join(f"{t} tok {ms:.1f} ms" for t, ms in measured["ms"].items()))
    bandwidth = read_bandwidth_gbs()
    bf16_bytes = next((r["weight_bytes"] for n, r in results.items() if n.startswith("kernels_") and n != "kernels_int4"),
                      None)
    floors = {}
    if bf16_bytes:
        floors = {"bfloat16": bf16_bytes / (bandwidth * 1e9) * 1e3, "float32": 2 * bf16_bytes / (bandwidth * 1e9) * 1e3}
    if "kernels_int4" in results:  # its own bytes: the 4-bit blocks and the bf16 LM head
        floors["int4"] = results["kernels_int4"]["weight_bytes"] / (bandwidth * 1e9) * 1e3
    summary = {}
    for name, result in results.items():
        ms = result["ms"]
        one = ms["1"]
        entry = {"one_token_ms": one, "ratio_to_one_token": {t: v / one for t, v in ms.items()}}
        floor = floors.get("int4" if name == "kernels_int4" else "bfloat16" if name.startswith("kernels_")
                           else "float32" if "fp32" in name else None)
        if floor:
            entry["one_token_over_floor"] = one / floor
        summary[name] = entry
    report = {"command": "python benchmarks/cpu_engines.py " + " ".join(sys.argv[1:]), "cpu": cpu,
              "context_tokens": args.context, "repeats": args.repeats, "read_bandwidth_gb_s": bandwidth,
              "weight_read_floor_ms": floors, "step_ms": {n: r["ms"] for n, r in results.items()}, "summary": summary}
    write_json(args.output, report)
    plot(report, args.output.with_suffix(".png"))
    for name, entry in summary.items():
        ratios = entry["ratio_to_one_token"]
        print(f"{name:14s} 1 tok {entry['one_token_ms']:6.1f} ms"
              + (f" ({entry['one_token_over_floor']:.2f}x floor)" if "one_token_over_floor" in entry else "")
              + "; " + ", ".join(f"{t}: {r:.2f}x" for t, r in ratios.items() if t != "1"))
    print(f"wrote {args.output}")
    return 0


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, ms in report["step_ms"].items():
        axis.plot([int(t) for t in ms], list(ms.values()), marker="o", label=name)
    for dtype, floor in report["weight_read_floor_ms"].items():
        axis.axhline(floor, linestyle=":", color="grey")
        axis.annotate(f"{dtype} weight-read floor", (1, floor), fontsize=8, color="grey")
    axis.set_xlabel("new tokens in the step (1 request, %d-token context)" % report["context_tokens"])
    axis.set_ylabel("ms per target step")
    axis.set_title(f"{report['cpu']['name']} x{report['cpu']['cores']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
