"""Offline acceptance of every drafter on every evaluation set, in one run.

    python benchmarks/offline.py [--drafter dspark=checkpoints/.../dspark ...] [--batch-size 8]

Runs `dspark-trt eval`'s evaluation (speculative decoding through `LLM`, tau counting the bonus
token, conditional per-position acceptance) for each drafter x dataset x temperature, and
writes `benchmarks/results/offline.json` (the list of eval outputs, macro averages per drafter
and temperature, the ratios the paper reports, and each drafter's calibration report),
`offline.md` (tables) and `offline_<dataset>.png` (per-position acceptance; named after `--output`,
so two outputs in one folder keep their own).
Default drafters: whichever of checkpoints/smollm2-135m-instruct/{dspark,dflash,eagle3,mtp1} exist.
Resumable: runs already in the output (same --max-tokens) are kept and skipped, and the files are
rewritten after every run; macro averages and ratios appear once a drafter has every dataset.
Parallel sweeps: run one drafter per process, each with its own --output, then

    python benchmarks/offline.py --max-tokens 32 --merge part1.json --merge part2.json ...

which adds their runs to --output (a run of the same drafter, dataset and temperature replaces
the one there) and rewrites the outputs without evaluating anything. At T > 0 one run is one
sample: `--seed S` draws another (one output per seed; `experiments/seed_spread.py` compares two
drafters over several).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct"
DATASETS = {"mt-bench": 80, "humaneval": 164, "gsm8k": 200}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--dataset", action="append", default=[], help="NAME[:NUM_PROMPTS] (repeatable)")
    parser.add_argument("--temperature", action="append", type=float, default=[])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="tau does not depend on it; time does")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/offline.json"))
    parser.add_argument("--seed", type=int, default=0,
                        help="prompt i samples with seed SEED + i (T > 0); another SEED draws another sample of "
                             "the same prompts, for the spread of tau at T > 0 (runs are kept apart by it)")
    parser.add_argument("--merge", action="append", type=Path, default=[],
                        help="offline.json of another sweep (same --max-tokens) to merge in; evaluates nothing")
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams
    from dspark_trt.training.evaluate import evaluate
    from dspark_trt.training.prompts import load_prompts

    drafters = dict(d.split("=", 1) for d in args.drafter) or {
        kind: str(CHECKPOINTS / kind) for kind in ("dspark", "dflash", "eagle3", "mtp1") if (CHECKPOINTS / kind).is_dir()}
    datasets = dict((d.split(":")[0], int(d.split(":")[1]) if ":" in d else DATASETS.get(d)) for d in args.dataset) \
        or DATASETS
    temperatures = args.temperature or [0.0, 1.0]

    # Resumable: runs already in the output (same max_tokens) are kept and not repeated, and the
    # output is rewritten after every run, so an interrupted sweep continues where it stopped.
    previous = json.loads(args.output.read_text()) if args.output.is_file() else {}
    runs = previous["runs"] if previous.get("max_tokens") == args.max_tokens else []
    other_seeds = {r.get("seed", 0) for r in runs} - {args.seed}
    if other_seeds:  # macro averages are over one sample of each dataset: one seed per output
        print(f"error: {args.output} holds runs of --seed {sorted(other_seeds)}, not {args.seed}; "
              "give this seed its own --output", file=sys.stderr)
        return 2
    if args.merge:
        return merge(args.output, runs, previous.get("calibration", {}), args.merge, args.max_tokens, datasets,
                     temperatures, args.seed)
    calibration, ran = dict(previous.get("calibration", {})), False  # reports of drafters not rerun stay
    for name, path in drafters.items():
        report = Path(path) / "calibration.json"
        if report.is_file():
            calibration[name] = json.loads(report.read_text())
        else:  # a report kept from an earlier sweep must not outlive the calibration it describes
            calibration.pop(name, None)
        todo = [(d, c, t) for d, c in datasets.items() for t in temperatures
                if not any(r["drafter"] == name and r["dataset"] == d and r["temperature"] == t for r in runs)]
        if not todo:
            continue
        llm = LLM(target="default", drafter=path, max_batch_size=args.batch_size, policy="all")  # tau of the whole block
        for dataset, count, temperature in todo:
            prompts = [llm.encode_chat(p.messages) for p in load_prompts(dataset, count)]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed + i)
                      for i in range(len(prompts))]
            result = evaluate(llm, prompts, params, args.batch_size, compare_plain=False)
            runs.append({"drafter": name, "dataset": dataset, "temperature": temperature, "seed": args.seed, **result})
            print(f"{name:8s} {dataset:10s} T={temperature}: tau {result['accept_length']:.2f}", flush=True)
            write_outputs(args.output, runs, calibration, args.max_tokens, datasets, temperatures)
            ran = True
    if not ran:  # everything was already there: still refresh the tables, plots and calibration
        write_outputs(args.output, runs, calibration, args.max_tokens, datasets, temperatures)
    print(f"wrote {args.output}")
    return 0


def merge(output: Path, runs: list, calibration: dict, parts: list[Path], max_tokens: int, datasets,
          temperatures, seed: int) -> int:
    """Add the runs of other sweeps' outputs to `runs` (and their calibration reports to
    `calibration`); a part's run replaces the same cell's."""
    for part in parts:
        data = json.loads(part.read_text())
        if data.get("max_tokens") != max_tokens:
            print(f"error: {part} was run with --max-tokens {data.get('max_tokens')}, not {max_tokens}", file=sys.stderr)
            return 2
        if any(run.get("seed", 0) != seed for run in data["runs"]):
            print(f"error: {part} holds runs of another --seed than {seed} (merge one seed at a time, "
                  "giving it as --seed)", file=sys.stderr)
            return 2
        for run in data["runs"]:
            cell = (run["drafter"], run["dataset"], run["temperature"])
            runs = [r for r in runs if (r["drafter"], r["dataset"], r["temperature"]) != cell] + [run]
        calibration.update(data.get("calibration", {}))
    write_outputs(output, runs, calibration, max_tokens, datasets, temperatures)
    print(f"merged {len(parts)} file(s) into {output}: {len(runs)} runs")
    return 0


def write_outputs(output: Path, runs, calibration, max_tokens, datasets, temperatures) -> None:
    """offline.json, offline.md and the per-dataset PNGs from the runs so far."""
    canonical = ["dspark", "dflash", "eagle3", "mtp1"]  # then any others, in order of appearance
    names = sorted(dict.fromkeys(r["drafter"] for r in runs),
                   key=lambda n: canonical.index(n) if n in canonical else len(canonical))
    temperatures = sorted({*temperatures, *(r["temperature"] for r in runs)})
    macro = {}
    for name in names:
        for temperature in temperatures:
            taus = [r["accept_length"] for r in runs if r["drafter"] == name and r["temperature"] == temperature]
            if len(taus) == len(datasets):  # a macro average only over the full set of datasets
                macro[f"{name}@T={temperature}"] = sum(taus) / len(taus)
    ratios = {}
    for temperature in temperatures:
        for baseline in ("dflash", "eagle3", "mtp1"):
            ours, theirs = macro.get(f"dspark@T={temperature}"), macro.get(f"{baseline}@T={temperature}")
            if ours and theirs:
                ratios[f"dspark/{baseline}@T={temperature}"] = ours / theirs
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"runs": runs, "macro_accept_length": macro, "ratios": ratios,
                                  "calibration": calibration, "max_tokens": max_tokens}, indent=2) + "\n")
    write_markdown(output.with_suffix(".md"), runs, macro, ratios, names, datasets, temperatures)
    plot(output, runs, datasets, temperatures)


def write_markdown(path: Path, runs, macro, ratios, drafters, datasets, temperatures) -> None:
    lines = ["| drafter | T | " + " | ".join(datasets) + " | macro tau |", "|---" * (len(datasets) + 3) + "|"]
    for name in drafters:
        for t in temperatures:
            cells = [next((f"{r['accept_length']:.2f}" for r in runs if r["drafter"] == name
                           and r["dataset"] == d and r["temperature"] == t), "-") for d in datasets]
            average = macro.get(f"{name}@T={t}")
            lines.append(f"| {name} | {t} | " + " | ".join(cells) + f" | {'-' if average is None else f'{average:.2f}'} |")
    lines += ["", *(f"- {k}: {v:.2f}x" for k, v in ratios.items())]
    path.write_text("\n".join(lines) + "\n")


def plot(output: Path, runs, datasets, temperatures) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for dataset in datasets:
        figure, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 3.5), squeeze=False)
        for axis, t in zip(axes[0], temperatures):
            for r in runs:
                if r["dataset"] == dataset and r["temperature"] == t:
                    rates = r["per_position_acceptance"]
                    axis.plot(range(1, len(rates) + 1), rates, marker="o", label=r["drafter"])
            axis.set(title=f"{dataset}, T={t}", xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)",
                     ylim=(0, 1))
            axis.legend()
        figure.tight_layout()
        figure.savefig(output.with_name(f"{output.stem}_{dataset}.png"), dpi=100)  # beside its own JSON
        plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
