"""How sure is a tau ratio at T > 0? Two drafters' macro tau over several sampling seeds.

    python benchmarks/offline.py --drafter A=... --drafter B=... --temperature 1 --max-tokens 32 \
        --batch-size 32 --seed 100000 --output seed1.json        # and --seed 200000 ... (one output each)
    python benchmarks/experiments/seed_spread.py --numerator A --denominator B --temperature 1 \
        --input benchmarks/results/offline.json --input seed1.json ... --output spread.json

At T > 0 a run of `benchmarks/offline.py` is one sample: the same prompts with another seed
generate other text and draw other drafts, so two drafters' macro taus differ by chance as well
as by skill. Reads offline.py outputs only (no model, no CPU time); for every seed in them the
inputs together must hold both drafters on every dataset at the temperature, in one input or in
several (a sweep per drafter); a run found twice is refused.
Writes per seed the macro tau of each drafter and their ratio; across seeds the mean ratio with a
95% t-interval (the seeds are independent samples); and the pooled ratio: each drafter's tau per
dataset from all seeds' steps together (accepted + steps over steps, which is what tau is), then
macro-averaged, which weighs every step alike. A PNG beside the JSON shows both drafters' macro
tau seed by seed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

# Two-sided 95% quantiles of Student's t by degrees of freedom (scipy is only a test dependency, not bench's).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def macro(per_dataset: dict[str, float]) -> float:
    return sum(per_dataset.values()) / len(per_dataset)


def runs_by_seed(inputs: list[dict], drafters: tuple[str, ...], temperature: float) -> dict[int, dict]:
    """seed -> drafter -> dataset -> run, from all inputs (a seed's runs may come from several
    outputs, e.g. one drafter per sweep); a cell found twice is refused, not silently picked."""
    found: dict[int, dict] = {}
    for data in inputs:
        for run in data["runs"]:
            if run["drafter"] not in drafters or run["temperature"] != temperature:
                continue
            cell = found.setdefault(run.get("seed", 0), {name: {} for name in drafters})[run["drafter"]]
            if run["dataset"] in cell:
                raise ValueError(f"{data['_path']}: {run['drafter']} on {run['dataset']} at T={temperature}, "
                                 f"seed {run.get('seed', 0)}, is in more than one input")
            cell[run["dataset"]] = run
    return dict(sorted(found.items()))


def spread(inputs: list[dict], numerator: str, denominator: str, temperature: float) -> dict:
    """`inputs`: offline.py outputs (each one seed) -> per-seed and pooled macro taus and ratios."""
    per_seed, totals = [], {numerator: {}, denominator: {}}
    by_seed = runs_by_seed(inputs, (numerator, denominator), temperature)
    if not by_seed:
        raise ValueError(f"no runs of {numerator} or {denominator} at T={temperature} in the inputs")
    datasets = set(next(iter(by_seed.values()))[numerator])
    for seed, found in by_seed.items():
        names = {name: set(c) for name, c in found.items()}
        if not datasets or any(n != datasets for n in names.values()):
            raise ValueError(f"seed {seed}: needs {numerator} and {denominator} on the same datasets at "
                             f"T={temperature}; the inputs have {({k: sorted(v) for k, v in names.items()})}")
        taus = {name: {d: r["accept_length"] for d, r in c.items()} for name, c in found.items()}
        per_seed.append({"seed": seed, "macro_tau": {name: macro(t) for name, t in taus.items()},
                         "ratio": macro(taus[numerator]) / macro(taus[denominator])})
        for name, c in found.items():
            for d, r in c.items():
                steps, accepted = totals[name].get(d, (0, 0))
                totals[name][d] = (steps + r["num_steps"], accepted + r["num_accepted_tokens"])
    ratios = [row["ratio"] for row in per_seed]
    mean = statistics.fmean(ratios)
    half_width = None
    if len(ratios) > 1:
        half_width = T_975[min(len(ratios) - 1, max(T_975))] * statistics.stdev(ratios) / math.sqrt(len(ratios))
    pooled = {name: {d: (steps + accepted) / steps for d, (steps, accepted) in t.items()} for name, t in totals.items()}
    return {
        "numerator": numerator, "denominator": denominator, "temperature": temperature,
        "datasets": sorted(datasets), "num_seeds": len(per_seed), "per_seed": per_seed,
        "mean_ratio": mean, "ratio_95ci": None if half_width is None else [mean - half_width, mean + half_width],
        "pooled_tau": pooled, "pooled_macro_tau": {name: macro(t) for name, t in pooled.items()},
        "pooled_ratio": macro(pooled[numerator]) / macro(pooled[denominator]),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    seeds = [str(row["seed"]) for row in result["per_seed"]]
    for name in (result["numerator"], result["denominator"]):
        taus = [row["macro_tau"][name] for row in result["per_seed"]]
        line = ax.plot(range(len(seeds)), taus, marker="o", label=name)[0]
        ax.axhline(result["pooled_macro_tau"][name], color=line.get_color(), linestyle="--", alpha=0.6)
    ax.set_xticks(range(len(seeds)), seeds, rotation=30, fontsize=7)
    ax.set(xlabel="sampling seed (offline.py --seed)", ylabel=f"macro tau at T={result['temperature']}",
           title=f"pooled ratio {result['pooled_ratio']:.3f} (dashed: pooled macro tau)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", type=Path, required=True, help="offline.py output (repeatable)")
    parser.add_argument("--numerator", required=True, help="drafter name as in the inputs, e.g. dspark")
    parser.add_argument("--denominator", required=True, help="drafter name as in the inputs, e.g. eagle3")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    inputs = []
    for path in args.input:
        try:
            inputs.append({**json.loads(path.read_text()), "_path": str(path)})
        except (OSError, ValueError) as exc:
            parser.error(f"--input {path}: {exc}")
    try:
        result = spread(inputs, args.numerator, args.denominator, args.temperature)
    except ValueError as exc:
        parser.error(str(exc))
    result["command"] = "python benchmarks/experiments/seed_spread.py " + " ".join(
        [f"--input {p}" for p in args.input] + [f"--numerator {args.numerator}", f"--denominator {args.denominator}",
                                                f"--temperature {args.temperature}", f"--output {args.output}"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    plot(result, args.output.with_suffix(".png"))
    for row in result["per_seed"]:
        print(f"seed {row['seed']}: {row['macro_tau']} ratio {row['ratio']:.3f}")
    ci = result["ratio_95ci"]
    print(f"mean ratio {result['mean_ratio']:.3f}" + (f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else "")
          + f", pooled {result['pooled_ratio']:.3f} over {result['num_seeds']} seeds -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
