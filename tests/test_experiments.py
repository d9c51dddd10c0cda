"""The experiment scripts' arithmetic (benchmarks/experiments/): what they compute from outputs
already on disk, on outputs built here, so a wrong sum or a silently mixed input fails."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))
from seed_spread import spread  # noqa: E402


def offline_output(seed: int, counts: dict[tuple[str, str], tuple[int, int]], temperature: float = 1.0) -> dict:
    """An offline.py output: (drafter, dataset) -> (num_steps, num_accepted_tokens)."""
    runs = [{"drafter": drafter, "dataset": dataset, "temperature": temperature, "seed": seed,
             "num_steps": steps, "num_accepted_tokens": accepted, "accept_length": (steps + accepted) / steps}
            for (drafter, dataset), (steps, accepted) in counts.items()]
    return {"runs": runs, "max_tokens": 32, "_path": f"seed{seed}.json"}


def write_output(path: Path, data: dict) -> Path:
    """`data` as offline.py writes it (without the in-memory `_path`)."""
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "_path"}))
    return path


def test_seed_spread_per_seed_and_pooled_ratios():
    first = offline_output(0, {("a", "x"): (100, 100), ("a", "y"): (100, 50), ("b", "x"): (100, 80), ("b", "y"): (50, 25)})
    second = offline_output(7, {("a", "x"): (300, 0), ("a", "y"): (100, 50), ("b", "x"): (100, 80), ("b", "y"): (50, 25)})
    result = spread([first, second], "a", "b", 1.0)

    # seed 0: a = (2.0 + 1.5) / 2 = 1.75, b = (1.8 + 1.5) / 2 = 1.65; seed 7: a = (1.0 + 1.5) / 2 = 1.25
    assert [row["ratio"] for row in result["per_seed"]] == pytest.approx([1.75 / 1.65, 1.25 / 1.65])
    assert result["mean_ratio"] == pytest.approx((1.75 / 1.65 + 1.25 / 1.65) / 2)
    low, high = result["ratio_95ci"]
    assert low < result["mean_ratio"] < high
    # pooled: a on x = (400 + 100) / 400 = 1.25, a on y = 1.5; b unchanged
    assert result["pooled_tau"]["a"] == pytest.approx({"x": 1.25, "y": 1.5})
    assert result["pooled_ratio"] == pytest.approx(((1.25 + 1.5) / 2) / 1.65)


def test_seed_spread_refuses_mismatched_inputs():
    whole = offline_output(0, {("a", "x"): (10, 5), ("b", "x"): (10, 5)})
    with pytest.raises(ValueError, match="same datasets"):
        spread([offline_output(1, {("a", "x"): (10, 5)})], "a", "b", 1.0)  # b missing
    with pytest.raises(ValueError, match="no runs of a or b at T=0.0"):
        spread([whole], "a", "b", 0.0)
    with pytest.raises(ValueError, match="more than one input"):
        spread([whole, offline_output(0, {("a", "x"): (10, 4)})], "a", "b", 1.0)


def test_seed_spread_joins_one_seeds_runs_from_several_inputs():
    """A sweep per drafter: seed 3's runs of a and b in two outputs count as one sample."""
    joined = spread([offline_output(3, {("a", "x"): (10, 5)}), offline_output(3, {("b", "x"): (10, 4)}),
                     offline_output(4, {("a", "x"): (10, 6), ("b", "x"): (10, 4)})], "a", "b", 1.0)
    assert [row["seed"] for row in joined["per_seed"]] == [3, 4]
    assert [row["ratio"] for row in joined["per_seed"]] == pytest.approx([1.5 / 1.4, 1.6 / 1.4])


def test_seed_spread_cli_writes_json_and_reports_bad_input(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "seed_spread.py"
    good = write_output(tmp_path / "seed0.json", offline_output(0, {("a", "x"): (10, 5), ("b", "x"): (10, 4)}))
    out = tmp_path / "spread.json"
    done = subprocess.run([sys.executable, str(script), "--input", str(good), "--numerator", "a",
                           "--denominator", "b", "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["pooled_ratio"] == pytest.approx(1.5 / 1.4)

    failed = subprocess.run([sys.executable, str(script), "--input", str(tmp_path / "missing.json"), "--numerator",
                             "a", "--denominator", "b", "--output", str(out)], capture_output=True, text=True)
    assert failed.returncode == 2 and "missing.json" in failed.stderr and "Traceback" not in failed.stderr


def test_offline_keeps_one_seed_per_output(tmp_path):
    """A macro tau is over one sample of each dataset: offline.py refuses to add another seed's runs
    to an output (before loading any model), for evaluation and for --merge alike."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "offline.py"
    output, part = tmp_path / "offline.json", tmp_path / "part.json"
    data = offline_output(0, {("a", "x"): (10, 5)})
    write_output(output, data)
    done = subprocess.run([sys.executable, str(script), "--max-tokens", "32", "--seed", "100", "--drafter", "a=nowhere",
                           "--output", str(output)], capture_output=True, text=True)
    assert done.returncode == 2 and "--seed [0], not 100" in done.stderr

    write_output(part, offline_output(5, {("a", "x"): (10, 4)}))
    done = subprocess.run([sys.executable, str(script), "--max-tokens", "32", "--merge", str(part), "--output",
                           str(output)], capture_output=True, text=True)
    assert done.returncode == 2 and "another --seed" in done.stderr
    assert json.loads(output.read_text())["runs"] == data["runs"]  # untouched


def test_train_on_gpu_run_specs_name_each_run_and_refuse_bad_ones():
    """`train_on_gpu.py --kinds dspark,eagle3,dspark:5`: a depth after the kind makes its own run
    (folder and export `dspark-5layer`); an unknown kind, a bad depth or a run named twice is refused."""
    from train_on_gpu import RunSpec, parse_runs

    specs = parse_runs("dspark,eagle3,dspark:5")
    assert specs == (RunSpec("dspark"), RunSpec("eagle3"), RunSpec("dspark", 5))
    assert [spec.name for spec in specs] == ["dspark", "eagle3", "dspark-5layer"]
    for bad, message in (("dspark,medusa", "unknown kind 'medusa'"), ("dspark:0", "positive integer"),
                         ("dspark:x", "positive integer"), ("eagle3,eagle3", "names a run twice")):
        with pytest.raises(ValueError, match=message):
            parse_runs(bad)


def test_draft_vocab_reach_widens_a_drafter_without_changing_what_it_drafted(tiny_llama, tmp_path):
    """`draft_vocab_reach.widened`: the old tokens keep their logits and confidences exactly (a
    previous token that joins the vocabulary reads the out-of-vocabulary row it was trained
    with), the new ones follow in frequency order, and a block's logits gain their columns."""
    from collections import Counter

    import torch
    from draft_vocab_reach import widened
    from tiny_drafters import FEATURE_LAYERS, make_drafter

    from dspark_trt.models.drafter_io import build_drafter
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import ensure_features, load_sequences, make_batch
    from dspark_trt.training.losses import draft_logits

    target = load_target(tiny_llama)
    # varied responses (the tiny random target's own repeat one token), with their target features
    pick = random.Random(0).choice
    rows = [{"id": f"rows/{i}", "domain": "math", "temperature": 0.0, "prompt_ids": [1, 5, 9, 13], "finish_reason": "length",
             "response_ids": [pick(range(1000, 1040)) for _ in range(40)]} for i in range(4)]
    features_dir = tmp_path / "features"
    ensure_features(target, rows, features_dir, FEATURE_LAYERS)
    frequent = [t for t, _ in Counter(t for row in rows for t in row["response_ids"]).most_common()]
    left_out = frequent[::2]  # tokens of the responses that the drafter cannot propose
    base = make_drafter(target, vocab_size=512, prefix_layer=True)
    vocab = torch.tensor([t for t in range(target.config.vocab_size) if t not in set(left_out)][:512])
    state = {**base.state_dict(), "draft_vocab": vocab}
    drafter = build_drafter(base.config, vocab)
    drafter.load_state_dict(state)
    drafter = drafter.attach_target(target.model).eval()
    with torch.no_grad():
        drafter.confidence.weight.normal_(std=0.5)
        drafter.previous_embedding.weight[-1].normal_(std=3.0)  # an OOV row unlike the others
    new_tokens = [t for t in frequent if t not in set(vocab.tolist())]
    wide = widened(drafter, target.model, frequent, 512 + 16)
    assert wide.draft_vocab.tolist() == drafter.draft_vocab.tolist() + new_tokens[:16]
    batch = make_batch(load_sequences(rows, features_dir), 6, 4, 2, 64, torch.Generator().manual_seed(0))
    assert torch.isin(batch.previous_tokens, torch.tensor(new_tokens[:16])).any()  # the OOV-row case is exercised
    with torch.no_grad():
        (logits, confidence), (wide_logits, wide_confidence) = draft_logits(drafter, batch), draft_logits(wide, batch)
    assert wide_logits.shape[-1] == 512 + 16
    assert torch.allclose(wide_logits[..., :512], logits, atol=1e-5)
    assert torch.allclose(wide_confidence, confidence, atol=1e-5)
    with pytest.raises(SystemExit, match="only"):
        widened(drafter, target.model, frequent[:20], 512 + 10_000)

    # measure's bins by the target's top-1 probability: each holds the share of supervised slots whose
    # target p(greedy token) falls in it (computed here from the batches' target states), and their
    # acceptances, weighted by share, give the per-slot acceptance pooled over slots
    from draft_vocab_reach import measure

    from dspark_trt.models.target import rms_norm

    sequences = load_sequences(rows, features_dir)
    generator, per_slot, top1 = torch.Generator().manual_seed(0), torch.zeros(4, dtype=torch.float64), []
    for start in range(0, len(sequences), 3):  # the batches measure draws: the same seeded anchors
        batch = make_batch(sequences[start : start + 3], 6, 4, 2, 64, generator)
        per_slot += batch.valid.sum((0, 1)).double()
        hidden = rms_norm(batch.target_hidden, target.model.final_norm.detach(), target.config.rms_norm_eps)
        logits = hidden @ target.model.lm_head.weight_t.detach().float()
        top1 += (logits.max(-1).values - logits.logsumexp(-1)).exp()[batch.valid].tolist()  # p(greedy token)
    assert len(top1) == int(per_slot.sum())
    # the tiny target is sure of itself (and repeats states): edges between its own distinct values
    # fill every bin and stay clear of float rounding
    distinct = sorted(set(top1))
    cut = [len(distinct) * q // 4 for q in (1, 2, 3)]
    edges = (0.0, *((distinct[i - 1] + distinct[i]) / 2 for i in cut), 1.0)
    assert len(set(edges)) == 5
    figures = measure(drafter, sequences, 6, 3, target.model.final_norm.detach(), target.config.rms_norm_eps,
                      target.model.lm_head.weight_t.detach().float(), top1_bins=edges)
    bins = figures["by_target_top1"]
    assert [b["top1"] for b in bins] == [[edges[i], edges[i + 1]] for i in range(4)]
    for b in bins:
        inside = sum(b["top1"][0] <= p < b["top1"][1] or (p == 1.0 == b["top1"][1]) for p in top1)
        assert inside > 0 and b["share"] == pytest.approx(inside / len(top1), abs=1e-6)
    pooled = float((torch.tensor(figures["t0"], dtype=torch.float64) * per_slot).sum() / per_slot.sum())
    assert sum(b["share"] * (b["t0"] or 0.0) for b in bins) == pytest.approx(pooled, abs=1e-9)
    # each bin's slot-1 / slots-2+ and copy / other cells partition its slots and its acceptances
    for b in bins:
        groups = [g for g in (b["slot1"], b["slots2plus"]) if g["slots"]]
        assert sum(g["slots"] for g in groups) == round(b["share"] * len(top1))
        accepted = sum(g["slots"] * (g["copy_share"] * (g["t0_copy"] or 0.0)
                                     + (1 - g["copy_share"]) * (g["t0_other"] or 0.0)) for g in groups)
        assert accepted == pytest.approx(b["t0"] * b["share"] * len(top1), abs=1e-6)
    assert sum(b["slot1"]["slots"] for b in bins) == int(per_slot[0])  # slot 1's cells hold slot 1's slots


def test_context_copies_finds_the_pairs_the_context_holds_before_the_anchor():
    """A slot is a context copy when (its previous token, the target's token) occurred as tokens
    j, j + 1 with j before the block's anchor position, not at or after it."""
    import types

    import torch
    from draft_vocab_reach import context_copies

    tokens = torch.tensor([[1, 2, 3, 4, 5, 4, 5, 0]])
    batch = types.SimpleNamespace(tokens=tokens, block_positions=torch.tensor([[3, 4, 4, 5, 6, 7]]),  # anchors 3, 4, 6
                                  previous_tokens=torch.tensor([[[4, 5], [5, 4], [5, 0]]]))
    greedy = torch.tensor([[[5, 4], [4, 5], [4, 9]]])
    # (4, 5) first at j = 3: not before anchor 3, before anchor 4; (5, 4) first at j = 4: before anchor 6 only
    assert context_copies(batch, greedy).tolist() == [[[False, False], [False, True], [True, False]]]
