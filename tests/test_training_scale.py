"""Training at scale on the CPU: bf16 autocast learns, checkpoints come in commit-sized shards and
resume exactly, features are read lazily from their cache, and a cache refuses features of
another dtype."""

import json
import shutil

import pytest
import torch
from tiny_drafters import FEATURE_LAYERS, make_dataset

from dspark_trt import DsparkError
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.drafter_io import load_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.training import run_state
from dspark_trt.training.data import (FeatureSource, check_feature_cache, ensure_features, lazy_sequences,
                                      load_sequences, make_batch)
from dspark_trt.training.datagen import feature_file
from dspark_trt.training.trainer import TrainConfig, build_draft_vocab, resolve_precision, train_drafter


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    return make_dataset(target, tmp_path_factory.mktemp("data"), num_prompts=6)


def drafter_config(target):
    return DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, num_layers=1, markov_rank=16,
                                    block_size=4, draft_vocab_size=1024)


def test_bf16_autocast_training_learns_and_reports_blocks_per_second(target, dataset, tmp_path):
    rows, features_dir = dataset
    sequences = load_sequences(rows[:2], features_dir)
    vocab = build_draft_vocab(rows, 1024, target.config.vocab_size, set(target.eos_token_ids))
    config = TrainConfig(steps=60, sequences_per_batch=2, anchors_per_sequence=8, learning_rate=3e-3,
                         checkpoint_every=30, log_every=1, precision="bf16")
    train_drafter(target, sequences, drafter_config(target), vocab, config, tmp_path / "run", progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert all(r["precision"] == "bf16" for r in log)
    assert log[-1]["num_blocks"] == sum(int(min(8, len(s.token_ids) - s.prompt_length)) for s in sequences) * 60
    assert log[-1]["blocks_per_s"] > 0
    # The master weights stay fp32 (autocast only rounds the matmuls' inputs).
    assert all(p.dtype == torch.float32 for p in load_drafter(tmp_path / "run" / "drafter", target).parameters())


def test_checkpoints_are_shards_under_the_limit_and_resume_exactly(target, dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(run_state, "MAX_SHARD_BYTES", 256 * 1024)  # force many shards on a tiny drafter
    rows, features_dir = dataset
    sequences = load_sequences(rows, features_dir)
    vocab = build_draft_vocab(rows, 1024, target.config.vocab_size, set())

    def recipe():
        return TrainConfig(steps=12, checkpoint_every=4, sequences_per_batch=2, anchors_per_sequence=4,
                           precision="bf16")

    train_drafter(target, sequences, drafter_config(target), vocab, recipe(), tmp_path / "a", progress=False,
                  stop_at=8)
    shards = sorted((tmp_path / "a" / "state").glob("tensors-*.safetensors"))
    assert len(shards) > 1
    meta, tensors = run_state.load_run_state(tmp_path / "a")
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert all(s.stat().st_size <= max(256 * 1024, largest) + 64 * 1024 for s in shards)  # + the header
    assert meta["step"] == 8 and run_state.run_progress(tmp_path / "a")["num_blocks"] > 0
    assert not (tmp_path / "a" / "state.old").exists()
    train_drafter(target, sequences, drafter_config(target), vocab, recipe(), tmp_path / "a", progress=False)
    straight = train_drafter(target, sequences, drafter_config(target), vocab, recipe(), tmp_path / "b",
                             progress=False)
    resumed = load_drafter(tmp_path / "a" / "drafter", target)
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        assert torch.equal(a, b), name


def _folder_bytes(folder):
    return sum(f.stat().st_size for f in folder.glob("tensors-*.safetensors"))


def test_the_compact_state_is_a_third_of_the_exact_one_and_a_run_resumes_from_it(target, dataset, tmp_path):
    """What the repository keeps (state-compact/) holds the exact weights and samplers in about a
    third of the exact state's bytes, and a fresh machine (no state/) continues the run from it."""
    rows, features_dir = dataset
    sequences = load_sequences(rows, features_dir)
    vocab = build_draft_vocab(rows, 1024, target.config.vocab_size, set())
    config = TrainConfig(steps=12, checkpoint_every=4, sequences_per_batch=2, anchors_per_sequence=4,
                         precision="bf16", log_every=1)
    run = tmp_path / "run"
    train_drafter(target, sequences, drafter_config(target), vocab, config, run, progress=False, stop_at=8)
    exact_bytes, compact_bytes = _folder_bytes(run / "state"), _folder_bytes(run / "state-compact")
    assert compact_bytes < 0.4 * exact_bytes, (compact_bytes, exact_bytes)
    _, exact = run_state.load_run_state(run)
    shutil.rmtree(run / "state")  # what a fresh clone has
    meta, compact = run_state.load_run_state(run)
    assert meta["resumed_from"] == "state-compact" and meta["step"] == 8
    for name, value in exact.items():  # weights and samplers exact; moments the same shapes
        if not name.startswith("optimizer."):
            assert torch.equal(compact[name], value), name
        else:
            assert compact[name].shape == value.shape, name
    train_drafter(target, sequences, drafter_config(target), vocab, config, run, progress=False)
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert run_state.run_progress(run)["step"] == 12 and (run / "state").is_dir()


def test_compact_moments_keep_row_and_column_sums_and_a_rank_one_moment_exactly():
    generator = torch.Generator().manual_seed(0)
    rank_one = torch.outer(torch.rand(6, generator=generator), torch.rand(4, generator=generator))
    full_rank = torch.rand(6, 4, generator=generator)
    tensors = {"optimizer.0.exp_avg_sq": rank_one, "optimizer.0.exp_avg": torch.randn(6, 4),
               "optimizer.1.exp_avg_sq": full_rank, "optimizer.1.exp_avg": torch.randn(6, 4),
               "optimizer.2.exp_avg_sq": torch.rand(5), "optimizer.2.exp_avg": torch.randn(5),
               "optimizer.0.step": torch.tensor(7.0), "drafter.w": torch.randn(6, 4)}
    compact = run_state.compact_moments(tensors)
    assert "optimizer.0.exp_avg" not in compact and "optimizer.0.exp_avg_sq" not in compact
    assert compact["optimizer.0.exp_avg_sq_rows"].shape == (6,) and compact["optimizer.0.exp_avg_sq_cols"].shape == (4,)
    expanded = run_state.expand_moments(compact)
    assert expanded.keys() == tensors.keys()
    assert torch.allclose(expanded["optimizer.0.exp_avg_sq"], rank_one, rtol=1e-5)
    assert torch.allclose(expanded["optimizer.1.exp_avg_sq"].sum(0), full_rank.sum(0), rtol=1e-5)
    assert torch.allclose(expanded["optimizer.1.exp_avg_sq"].sum(1), full_rank.sum(1), rtol=1e-5)
    assert not torch.allclose(expanded["optimizer.1.exp_avg_sq"], full_rank)  # an estimate, not a copy
    assert not expanded["optimizer.1.exp_avg"].any()
    for name in ("optimizer.2.exp_avg_sq", "optimizer.2.exp_avg", "optimizer.0.step", "drafter.w"):
        assert torch.equal(expanded[name], tensors[name]), name  # vectors and the rest kept whole


def test_a_resume_reads_the_latest_state_whichever_kind(tmp_path):
    """A stale exact state left on a machine loses to a newer compact one from the repository;
    at the same step the exact one wins."""
    weights = {"drafter.w": torch.ones(2, 2), "optimizer.0.exp_avg_sq": torch.ones(2, 2),
               "optimizer.0.exp_avg": torch.ones(2, 2)}
    run_state.save_run_state(tmp_path, {"step": 4}, weights)
    run_state.save_compact_run_state(tmp_path, {"step": 8}, weights)
    meta, _ = run_state.load_run_state(tmp_path)
    assert (meta["step"], meta["resumed_from"]) == (8, "state-compact")
    run_state.save_run_state(tmp_path, {"step": 8}, weights)
    meta, tensors = run_state.load_run_state(tmp_path)
    assert (meta["step"], meta["resumed_from"]) == (8, "state") and tensors["optimizer.0.exp_avg"].any()
    assert run_state.run_progress(tmp_path)["step"] == 8


def test_lazy_sequences_give_the_same_batches(target, dataset):
    rows, features_dir = dataset
    eager = load_sequences(rows, features_dir)
    lazy = lazy_sequences(rows, FeatureSource(target, features_dir, FEATURE_LAYERS))
    a = make_batch(eager, 6, 4, len(FEATURE_LAYERS), 64, torch.Generator().manual_seed(1))
    b = make_batch(lazy, 6, 4, len(FEATURE_LAYERS), 64, torch.Generator().manual_seed(1))
    for name in a.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_missing_features_are_computed_when_a_row_is_first_sampled(target, dataset, tmp_path):
    """On a fresh machine training starts at once: a row's features are computed (and cached)
    the first time a batch needs them, equal to computing them all up front."""
    rows, _ = dataset
    ensure_features(target, rows, tmp_path / "upfront", FEATURE_LAYERS)
    on_demand = lazy_sequences(rows, FeatureSource(target, tmp_path / "on-demand", FEATURE_LAYERS))
    assert not feature_file(tmp_path / "on-demand", rows[0]["id"]).exists()
    a = make_batch(load_sequences(rows, tmp_path / "upfront"), 6, 4, len(FEATURE_LAYERS), 64,
                   torch.Generator().manual_seed(2))
    b = make_batch(on_demand, 6, 4, len(FEATURE_LAYERS), 64, torch.Generator().manual_seed(2))
    assert all(feature_file(tmp_path / "on-demand", r["id"]).is_file() for r in rows)
    for name in a.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_feature_cache_refuses_another_dtype_or_layer_set(tiny_llama, dataset, tmp_path):
    _, features_dir = dataset  # written by datagen with the fp32 target
    bf16 = load_target(tiny_llama, torch.bfloat16)
    with pytest.raises(DsparkError, match="bfloat16"):
        check_feature_cache(features_dir, bf16, FEATURE_LAYERS)
    with pytest.raises(DsparkError, match="another --features-dir"):
        check_feature_cache(features_dir, load_target(tiny_llama), (0,))
    check_feature_cache(tmp_path / "fresh", bf16, FEATURE_LAYERS)  # a new cache takes any, then keeps to it
    assert json.loads((tmp_path / "fresh" / "manifest.json").read_text())["dtype"] == "bfloat16"


def test_precision_names(monkeypatch):
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cpu")) in ("bf16", "fp32")
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("fp8", torch.device("cpu"))


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_equals_the_dense_mask(target, dataset, causal):
    """Training's block-structured attention gives what the dense-mask attention gives on every
    real block (padding anchors differ, and no loss reads them); with `causal` (a probe's
    pattern), what the dense mask gives once each slot's later slots are hidden."""
    from tiny_drafters import make_drafter

    from dspark_trt.models.drafter import BlockVisibility

    rows, features_dir = dataset
    drafter = make_drafter(target, num_layers=2).train()
    G = drafter.config.block_size
    batch = make_batch(load_sequences(rows, features_dir), 40, G, len(FEATURE_LAYERS), target.config.hidden_size,
                       torch.Generator().manual_seed(0))  # 40 anchors: more than short rows have, so some pad
    S, A = batch.anchor_tokens.shape
    assert not batch.valid[..., 0].all()  # there are padding anchors
    with torch.no_grad():
        context = drafter.fuse_features(batch.context_features)
        C = context.shape[1]
        context_kv = drafter.context_keys_values(context, torch.arange(C).expand(S, C))
        block = drafter.block_inputs(batch.anchor_tokens, (S, A)).reshape(S, A * G, -1)
        mask = batch.mask
        if causal:  # within the block part, hide key slot j > query slot i (other blocks are hidden already)
            Q = A * G
            mask = mask & torch.cat([torch.ones(Q, C, dtype=torch.bool), torch.ones(Q, Q, dtype=torch.bool).tril()], 1)
        dense = drafter.backbone(block, batch.block_positions, context_kv, mask).view(S, A, G, -1)
        visibility = BlockVisibility(batch.block_positions[:, ::G], G, causal=causal)
        structured = drafter.backbone(block, batch.block_positions, context_kv, visibility).view(S, A, G, -1)
    real = batch.valid[..., 0]
    assert torch.allclose(dense[real], structured[real], atol=1e-5)


def test_the_compiled_loss_equals_the_eager_one_and_trains(target, dataset, tmp_path):
    """`--compile-loss` (torch.compile of the slot terms) gives the eager terms and gradients."""
    from dspark_trt.training import losses

    generator = torch.Generator().manual_seed(0)
    S, A, G, V = 2, 3, 4, 64
    logits = torch.randn(S, A, G, V, generator=generator, requires_grad=True)
    confidence = torch.randn(S, A, G, generator=generator, requires_grad=True)
    target_logits = torch.randn(S, A, G, V, generator=generator)
    lse = torch.logsumexp(target_logits, -1) + 0.1  # some target mass outside the draft vocabulary
    labels = torch.randint(0, V + 5, (S, A, G), generator=generator)  # some labels outside it
    valid = torch.rand(S, A, G, generator=generator) > 0.2
    weights = losses.slot_weights(G)
    eager = losses.slot_terms(logits, confidence, target_logits, lse, labels, valid, weights)
    eager_grads = torch.autograd.grad(sum(t.sum() for t in (*eager[:3], eager[4])), (logits, confidence))
    compiled = losses.compiled_slot_terms(logits, confidence, target_logits, lse, labels, valid, weights)
    compiled_grads = torch.autograd.grad(sum(t.sum() for t in (*compiled[:3], compiled[4])), (logits, confidence))
    for a, b in zip((*eager, *eager_grads), (*compiled, *compiled_grads)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    rows, features_dir = dataset
    config = TrainConfig(steps=3, sequences_per_batch=2, anchors_per_sequence=4, precision="bf16", compile_loss=True)
    train_drafter(target, load_sequences(rows, features_dir), drafter_config(target),
                  build_draft_vocab(rows, 1024, target.config.vocab_size, set()), config, tmp_path / "run",
                  progress=False)
    assert run_state.run_progress(tmp_path / "run")["step"] == 3


def test_calibrate_computes_features_in_the_serving_dtype_and_names_a_mismatched_cache(tiny_llama, target, dataset,
                                                                                      tmp_path):
    """`dspark-trt calibrate` fills a fresh cache with the dtype `--features-dtype` names (auto:
    the serving one, as `train`), so it reads the cache a bf16 run trained from; a cache of
    another dtype is refused with a one-line error that names the option, not a traceback."""
    from click.testing import CliRunner
    from tiny_drafters import make_drafter

    from dspark_trt.cli import main
    from dspark_trt.models.drafter_io import save_drafter
    from dspark_trt.training.trainer import is_held_out

    rows, _ = dataset
    held_out_ids = [f"held/{i}" for i in range(400) if is_held_out(f"held/{i}")][: len(rows)]
    training_ids = [f"train/{i}" for i in range(len(rows))]  # the copy bias is fitted on these
    assert not any(is_held_out(i) for i in training_ids)
    data, held_out_only = tmp_path / "rows.jsonl", tmp_path / "held_out.jsonl"
    held_out_lines = [json.dumps({**row, "id": row_id}) + "\n" for row, row_id in zip(rows, held_out_ids)]
    data.write_text("".join(held_out_lines + [json.dumps({**row, "id": i}) + "\n" for row, i in zip(rows, training_ids)]))
    held_out_only.write_text("".join(held_out_lines))
    save_drafter(make_drafter(target), tmp_path / "drafter")

    def calibrate(features_dtype, *more, data=data):
        return CliRunner().invoke(main, ["calibrate", "--drafter", str(tmp_path / "drafter"), "--data", str(data),
                                         "--features-dir", str(tmp_path / "features"), "--target", str(tiny_llama),
                                         "--features-dtype", features_dtype, *more])

    result = calibrate("bfloat16")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "features" / "manifest.json").read_text())["dtype"] == "bfloat16"
    assert len(list((tmp_path / "features").glob("*.npz"))) == 2 * len(rows)  # held-out and copy-fit rows
    report = json.loads((tmp_path / "drafter" / "calibration.json").read_text())
    assert report["num_rows"] == len(rows) and report["num_blocks"] > 0
    calibrated = load_drafter(tmp_path / "drafter", target).config
    assert len(calibrated.confidence_temperatures) == 4  # one per slot
    # The copy bias is fitted first, on the training rows (one weight per slot and n-gram length, 4 by
    # default), then the confidence's offsets (its copy candidates, the draft's top probability), all reported.
    assert calibrated.copy_ngram == 4 and len(calibrated.copy_bias) == 4
    assert report["copy_bias"]["alpha"] == calibrated.copy_bias and report["copy_bias"]["num_blocks"] > 0
    assert report["confidence_offsets"]["copy"] == calibrated.copy_confidence and len(calibrated.copy_confidence) == 4
    assert report["confidence_offsets"]["top_prob"] == calibrated.confidence_top_prob
    assert len(calibrated.confidence_top_prob) == 4

    no_training_rows = calibrate("bfloat16", data=held_out_only)  # nothing to fit the copy bias on: said, not guessed
    assert no_training_rows.exit_code != 0 and "--copy-ngram 0" in no_training_rows.output
    assert "Traceback" not in no_training_rows.output
    dropped = calibrate("bfloat16", "--copy-ngram", "0", data=held_out_only)
    assert dropped.exit_code == 0, dropped.output
    dropped_config = load_drafter(tmp_path / "drafter", target).config
    assert dropped_config.copy_bias == [] == dropped_config.copy_confidence  # 0: none, and the old ones dropped
    assert len(dropped_config.confidence_top_prob) == 4  # the top-probability offset does not need a copy bias

    refused = calibrate("float32")
    assert refused.exit_code != 0 and "--features-dtype" in refused.output
    assert "Traceback" not in refused.output


def test_train_reads_several_data_files_and_refuses_a_row_id_given_twice(tiny_llama, dataset, tmp_path):
    """`train --data A --data B` trains on the rows of both (the model card names both files and
    counts every training row); a row id present in two files is refused before anything is
    loaded or written, naming both files: its cached features would be the other row's."""
    from click.testing import CliRunner

    from dspark_trt.cli import main
    from dspark_trt.training.trainer import is_held_out

    rows, features_dir = dataset
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    second.write_text("".join(json.dumps(row) + "\n" for row in rows[3:]))

    def train(*data, output):
        data_args = [arg for path in data for arg in ("--data", str(path))]
        return CliRunner().invoke(main, ["train", *data_args, "--features-dir", str(features_dir),
                                         "--target", str(tiny_llama), "--output", str(tmp_path / output),
                                         "--num-layers", "1", "--block-size", "4", "--draft-vocab", "1024",
                                         "--feature-layers", ",".join(map(str, FEATURE_LAYERS)),
                                         "--steps", "2", "--batch-size", "2", "--anchors", "4", "--no-compile-loss",
                                         "--features-dtype", "float32",
                                         "--export", str(tmp_path / output / "export")])

    result = train(first, second, output="both")
    assert result.exit_code == 0, result.output
    num_training = sum(not is_held_out(row["id"]) for row in rows)
    assert f"({num_training} training sequences)" in result.output
    card = (tmp_path / "both" / "export" / "MODEL_CARD.md").read_text()
    assert f"`{first}`, `{second}`: {num_training} training sequences" in card

    refused = train(first, first, output="twice")
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert f"in both {first} and {first}" in refused.output and rows[0]["id"] in refused.output
    assert not (tmp_path / "twice").exists()


def test_a_new_run_norms_its_context_and_a_resume_keeps_what_it_started_with(tiny_llama, dataset, tmp_path):
    """`train` without --context-norm starts a DSpark run with `context_norm` on and records the
    drafter's config with its checkpoints; resuming keeps it, a run checkpointed before the option
    existed (no drafter config in its meta) resumes with it off, and asking a run to resume with
    the other setting is refused naming the field, before any step changes its checkpoint."""
    from click.testing import CliRunner

    from dspark_trt.cli import main
    from dspark_trt.training.trainer import saved_drafter_flag

    rows, features_dir = dataset
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def train(output, *options, steps=2):
        return CliRunner().invoke(main, ["train", "--data", str(data), "--features-dir", str(features_dir),
                                         "--target", str(tiny_llama), "--output", str(tmp_path / output),
                                         "--num-layers", "1", "--block-size", "4", "--draft-vocab", "1024",
                                         "--feature-layers", ",".join(map(str, FEATURE_LAYERS)), "--steps", "4",
                                         "--stop-at", str(steps), "--checkpoint-every", "2", "--batch-size", "2",
                                         "--anchors", "4", "--no-compile-loss", "--features-dtype", "float32", *options])

    assert saved_drafter_flag(tmp_path / "new", "context_norm") is None
    result = train("new")
    assert result.exit_code == 0, result.output
    assert saved_drafter_flag(tmp_path / "new", "context_norm") is True
    assert json.loads((tmp_path / "new" / "drafter" / "config.json").read_text())["context_norm"] is True

    refused = train("new", "--no-context-norm", steps=4)
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "context_norm = True" in refused.output
    assert run_state.run_progress(tmp_path / "new")["step"] == 2  # nothing trained, nothing overwritten

    result = train("old", "--no-context-norm")
    assert result.exit_code == 0, result.output
    for folder in ("state", "state-compact"):  # as a run checkpointed before the option existed
        meta_path = tmp_path / "old" / folder / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["drafter_config"]
        meta_path.write_text(json.dumps(meta))
    assert saved_drafter_flag(tmp_path / "old", "context_norm") is False
    result = train("old", steps=4)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "old" / "drafter" / "config.json").read_text())["context_norm"] is False

    # --prefix-layer: off for a new run unless asked; a resumed run keeps what it started with
    assert json.loads((tmp_path / "new" / "drafter" / "config.json").read_text())["prefix_layer"] is False
    result = train("prefix", "--prefix-layer")
    assert result.exit_code == 0, result.output
    assert saved_drafter_flag(tmp_path / "prefix", "prefix_layer") is True
    result = train("prefix", steps=4)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "prefix" / "drafter" / "config.json").read_text())["prefix_layer"] is True
    refused = train("prefix", "--no-prefix-layer", steps=4)
    assert refused.exit_code != 0 and "Traceback" not in refused.output and "prefix_layer = True" in refused.output


def test_init_from_fine_tunes_a_trained_drafter_on_one_domain(tiny_llama, target, dataset, tmp_path):
    """`train --init-from DRAFTER --domain D` starts a new run from the checkpoint's weights, with its
    architecture, draft vocabulary and feature layers (none given here), on the rows of domain D
    only, and drops its confidence calibration but keeps its copy bias: at lr 0 the fine-tuned
    export is the checkpoint bit for bit (a run that started from the target's layers would
    differ); the model card says where it started and which rows it saw. An architecture option
    that disagrees with the checkpoint is refused naming the field, one that agrees is accepted,
    and a domain without rows is refused."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dspark_trt.cli import main
    from dspark_trt.training.trainer import is_held_out

    rows, features_dir = dataset
    relabelled = [{**row, "domain": "chat" if i % 2 else row["domain"]} for i, row in enumerate(rows)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in relabelled))
    common = ["--data", str(data), "--features-dir", str(features_dir), "--target", str(tiny_llama),
              "--batch-size", "2", "--anchors", "4", "--no-compile-loss", "--features-dtype", "float32"]
    architecture = ["--num-layers", "1", "--block-size", "4", "--draft-vocab", "8", "--prefix-layer",
                    "--feature-layers", ",".join(map(str, FEATURE_LAYERS))]

    def train(output, *options, steps=2):
        return CliRunner().invoke(main, ["train", *common, "--steps", str(steps), "--output", str(tmp_path / output),
                                         "--export", str(tmp_path / output / "export"), *options])

    result = train("base", *architecture)
    assert result.exit_code == 0, result.output
    base = tmp_path / "base" / "export"
    config = json.loads((base / "config.json").read_text())
    calibration = {"confidence_temperatures": [0.9, 0.8, 0.7, 0.6], "copy_confidence": [[0.1, 0.2]] * 4,
                   "confidence_top_prob": [0.3, 0.2, 0.1, 0.0]}
    config = {**config, "copy_bias": [[1.0, 2.0]] * 4}  # what is drafted: kept, trained beside
    (base / "config.json").write_text(json.dumps({**config, **calibration}))

    result = train("tuned", "--init-from", str(base), "--domain", "chat", "--lr", "0")
    assert result.exit_code == 0, result.output
    num_chat = sum(row["domain"] == "chat" and not is_held_out(row["id"]) for row in relabelled)
    assert 0 < num_chat < sum(not is_held_out(row["id"]) for row in rows)
    assert f"({num_chat} training sequences)" in result.output
    tuned = tmp_path / "tuned" / "export"
    before, after = load_file(base / "model.safetensors"), load_file(tuned / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    tuned_config = json.loads((tuned / "config.json").read_text())
    assert all(tuned_config[name] == [] for name in calibration)
    assert {k: v for k, v in tuned_config.items() if k not in calibration} == {
        k: v for k, v in config.items() if k not in calibration}
    card = (tuned / "MODEL_CARD.md").read_text()
    assert f"anchors, fine-tuning the drafter `{base}`" in card and "(only their chat rows)" in card

    # resumed without --init-from (the same architecture spelled out) on data whose chat responses
    # would choose another vocabulary (the same lengths, so the cached features still fit), the run
    # keeps the checkpoint's vocabulary, and its card still says where it started
    other = [{**row, "response_ids": [500] * len(row["response_ids"])} if row["domain"] == "chat" else row
             for row in relabelled]
    data.write_text("".join(json.dumps(row) + "\n" for row in other))
    chat_rows = [row for row in other if row["domain"] == "chat" and not is_held_out(row["id"])]
    chosen_now = build_draft_vocab(chat_rows, 8, target.config.vocab_size, set(target.eos_token_ids))
    assert 500 in chosen_now and 500 not in before["draft_vocab"]
    resumed = train("tuned", "--domain", "chat", "--lr", "0", *architecture, steps=4)
    assert resumed.exit_code == 0, resumed.output
    after = load_file(tuned / "model.safetensors")
    assert run_state.run_progress(tmp_path / "tuned")["step"] == 4
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert f"fine-tuning the drafter `{base}`" in (tuned / "MODEL_CARD.md").read_text()
    # ... and builds its id maps and LM-head rows from that vocabulary, not from the one passed in
    resumed_drafter = train_drafter(target, load_sequences(rows[:2], features_dir),
                                    DrafterConfig.load(tmp_path / "tuned" / "drafter"), chosen_now,
                                    TrainConfig(steps=4, sequences_per_batch=2, anchors_per_sequence=4),
                                    tmp_path / "tuned", progress=False)
    kept = before["draft_vocab"]
    assert torch.equal(resumed_drafter.draft_vocab, kept)
    assert torch.equal(resumed_drafter.to_draft[kept], torch.arange(kept.numel()))
    assert torch.equal(resumed_drafter.lm_head_t, target.model.lm_head.weight_t[:, kept].float())

    data.write_text("".join(json.dumps(row) + "\n" for row in relabelled))
    moved = train("moved", "--init-from", str(base), "--domain", "chat", *architecture, "--lr", "1e-2")
    assert moved.exit_code == 0, moved.output  # architecture options that agree are accepted; it trains
    after = load_file(tmp_path / "moved" / "export" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())

    refused = train("refused", "--init-from", str(base), "--num-layers", "2")
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "num_layers = 1" in refused.output and not (tmp_path / "refused").exists()
    empty = train("empty", "--init-from", str(base), "--domain", "code")
    assert empty.exit_code != 0 and "Traceback" not in empty.output and "of domain code" in empty.output


def test_train_greedy_weight_reaches_the_loss_the_log_the_state_and_the_card(tiny_llama, dataset, tmp_path):
    """`train --greedy-weight W`: the log reports the greedy CE, the run's state keeps W (a resume
    compares recipes by it), the model card names it, and a negative weight is refused by name."""
    from click.testing import CliRunner

    from dspark_trt.cli import main

    rows, features_dir = dataset
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["train", "--data", str(data), "--features-dir", str(features_dir), "--target", str(tiny_llama),
              "--batch-size", "2", "--anchors", "4", "--no-compile-loss", "--features-dtype", "float32",
              "--num-layers", "1", "--block-size", "4", "--draft-vocab", "64",
              "--feature-layers", ",".join(map(str, FEATURE_LAYERS)), "--steps", "2"]
    run = tmp_path / "run"
    result = CliRunner().invoke(main, [*common, "--greedy-weight", "1.5", "--output", str(run),
                                       "--export", str(run / "export")])
    assert result.exit_code == 0, result.output
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert log and all(entry["greedy_ce"] > 0 for entry in log)
    assert run_state.run_progress(run)["train_config"]["greedy_weight"] == 1.5
    assert "plus 1.5 x CE to the target's argmax (`--greedy-weight`)" in (run / "export" / "MODEL_CARD.md").read_text()
    refused = CliRunner().invoke(main, [*common, "--greedy-weight", "-1", "--output", str(tmp_path / "other")])
    assert refused.exit_code != 0 and "--greedy-weight" in refused.output
