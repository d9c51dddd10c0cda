"""What huge pages buy the CPU engine: the same target loaded twice, its packed weights in 4 KB
pages and in 2 MB-aligned huge-page chunks (`kernels/huge_pages.py`), steps alternated.

    python benchmarks/huge_pages.py [--dtype bfloat16|int4] [--tokens 1,8] [--steps 250]
                                    [--context 300] [--output benchmarks/results/huge_pages.json]

A step streams every weight once; in 4 KB pages each page is a TLB miss and a page walk. Both
copies run in this process, one step each in turn (the order flipped every pair), one request
with a `--context`-token context, T new tokens; so machine drift moves both alike. Reports each
copy's median ms, the median of the per-pair ratios (huge / 4 KB), and how much of the process
Linux backed with huge pages (`AnonHugePages`). Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from cpu_engines import cpu_summary, parse_counts, write_json

ORDER = (("4k", "off"), ("huge", "on"))  # (copy, DSPARK_TRT_HUGE_PAGES while its weights are packed)


def anon_huge_mb() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int4"))
    parser.add_argument("--tokens", default="1,8", help="comma-separated new tokens per step")
    parser.add_argument("--steps", type=int, default=250, help="timed steps of each copy per token count")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/huge_pages.json"))
    args = parser.parse_args()
    token_counts = parse_counts(parser, "--tokens", args.tokens)
    if args.steps < 20 or args.context < 1:
        parser.error("--steps must be >= 20 and --context >= 1")

    import dspark_trt  # noqa: F401  (before torch: the CPU threading policy)
    import torch

    from dspark_trt.kernels import cpu_kernels
    from dspark_trt.models.linear import resolve_dtype
    from dspark_trt.models.loading import load_target

    if not cpu_kernels.available():
        parser.error(f"our CPU kernels do not run here: {cpu_kernels.unavailable_reason()}")
    copies = {}
    for name, setting in ORDER:
        os.environ["DSPARK_TRT_HUGE_PAGES"] = setting
        model = load_target("default", resolve_dtype(args.dtype)).model
        cache = model.new_pool(1, args.context + max(token_counts) + 1).allocate()
        with torch.inference_mode():  # the prompt, which also packs the weights (in pages as set above)
            prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
            model(prompt, [args.context], [cache], torch.tensor([args.context - 1]), ())
        copies[name] = (model, cache)
    os.environ.pop("DSPARK_TRT_HUGE_PAGES")

    rows = []
    with torch.inference_mode():
        for count in token_counts:
            ids, logit_rows = torch.full((count,), 5), torch.arange(count)
            seconds = {name: [] for name, _ in ORDER}
            for step in range(args.steps + 10):
                for name, _ in (ORDER if step % 2 == 0 else ORDER[::-1]):
                    model, cache = copies[name]
                    start = time.perf_counter()
                    model(ids, [count], [cache], logit_rows, ())
                    elapsed = time.perf_counter() - start
                    cache.truncate(args.context)
                    if step >= 10:  # warm-up
                        seconds[name].append(elapsed)
            ratios = [huge / small for huge, small in zip(seconds["huge"], seconds["4k"])]
            rows.append({"tokens": count, "pages_4k_ms": round(statistics.median(seconds["4k"]) * 1e3, 3),
                         "huge_pages_ms": round(statistics.median(seconds["huge"]) * 1e3, 3),
                         "paired_ratio_median": round(statistics.median(ratios), 3)})
            print(f"{count} token(s): 4 KB pages {rows[-1]['pages_4k_ms']:.2f} ms, huge pages "
                  f"{rows[-1]['huge_pages_ms']:.2f} ms, per-pair ratio {rows[-1]['paired_ratio_median']:.3f}")
    result = {"cpu": cpu_summary(), "kernel_isa": cpu_kernels.isa(), "dtype": args.dtype, "context": args.context,
              "steps": args.steps, "anon_huge_pages_mb": anon_huge_mb(), "rows": rows}
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
