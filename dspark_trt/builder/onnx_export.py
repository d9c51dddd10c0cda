"""Export the target step and the drafter to ONNX files (torch.onnx, dynamo exporter).

Three graphs, all fp32 with dynamic shapes bounded by the build config:

    target.onnx            ExportTarget: ragged tokens + positions + slots, KV pool in and out,
                           logits and feature-layer hidden states out
    drafter.onnx           ExportDrafter with the sequential head as one `dspark::SequentialDraft`
                           node (for TensorRT, which resolves it to our plugin)
    drafter_unrolled.onnx  the same drafter with the head traced into standard ops (ONNX Runtime, CPU)

The drafter graphs include the copy bias and confidence offsets; with a copy bias they take
`context_tokens` too (`export_drafter.input_names`, module docstring there).

Example inputs come from `sample_*_inputs` (also what validation feeds). Each exported model
is checked with `onnx.checker` before it is kept. `exporter` picks torch.export (`dynamo`, the
supported path) or the legacy TorchScript tracer (`torchscript`: same graphs and the same
SequentialDraft node, ~4x faster to export, deprecated by PyTorch). This module does not run
or compare models.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim

from dspark_trt.builder.export_drafter import OUTPUT_NAMES as DRAFTER_OUTPUTS
from dspark_trt.builder.export_drafter import ExportDrafter, input_names
from dspark_trt.builder.export_target import INPUT_NAMES as TARGET_INPUTS
from dspark_trt.builder.export_target import OUTPUT_NAMES as TARGET_OUTPUTS
from dspark_trt.builder.export_target import ExportTarget
from dspark_trt.config import BuildConfig
from dspark_trt.errors import DsparkError
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.plugins import sequential_draft as sd


class ExportError(DsparkError):
    """torch.onnx could not export a model (a bug or an unsupported architecture)."""


def sample_target_inputs(target: LoadedTarget, config: BuildConfig, feature_layers: tuple[int, ...]):
    """A realistic ragged step: requests with prompts in their slots, then a mix of a decode
    token, a verification block and a prefill chunk. Returns (feeds, runtime outputs) where the
    runtime outputs come from our own forward (`TargetModel.forward`), the golden reference."""
    v = config.validation
    model = target.model
    generator = torch.Generator().manual_seed(v.seed)
    n = v.num_requests
    capacity = max(config.target_shapes.slot_capacity.min, 2 * v.context_tokens + 16)
    pool = model.new_pool(max(n, 2), capacity)
    caches = [pool.allocate() for _ in range(n)]
    for i, cache in enumerate(caches):  # prompts of different lengths
        length = max(1, v.context_tokens - 3 * i)
        model(torch.randint(0, target.config.vocab_size, (length,), generator=generator), [length], [cache],
              torch.tensor([length - 1]), ())
    counts = [(1, 8, 5)[i % 3] for i in range(n)]  # decode token, verify block, prefill chunk
    ids = torch.randint(0, target.config.vocab_size, (sum(counts),), generator=generator)
    positions = torch.cat([torch.arange(c.length, c.length + k) for c, k in zip(caches, counts)])
    slots = torch.cat([torch.full((k,), c.slot) for c, k in zip(caches, counts)])
    logits_at = torch.arange(sum(counts))
    feeds = {"input_ids": ids, "positions": positions, "token_slots": slots, "logits_indices": logits_at,
             "past_keys": pool.keys.clone(), "past_values": pool.values.clone()}
    out = model(ids, counts, caches, logits_at, feature_layers)
    features = out.features if out.features is not None else torch.zeros(len(ids), 0)  # no drafter: [T, 0]
    golden = {"logits": out.logits, "features": features, "present_keys": pool.keys.clone(),
              "present_values": pool.values.clone()}
    return feeds, golden


def sample_token_ids(drafter, count: int, target_vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """`count` target ids that repeat themselves, as requests that copy do: drawn from a small pool
    (mostly draft-vocabulary tokens, a few outside it, so some followers have no draft id), with a
    motif of draft-vocabulary tokens at the start whose beginning the sequence ends on. The last token is the anchor, so
    slot 1's lookup finds n-gram matches of several lengths, and a block that drafts the motif's
    continuation makes matches inside the block too: the copy bias's path is exercised."""
    inside = drafter.draft_vocab[torch.randperm(drafter.draft_vocab.numel(), generator=generator)[:12]]
    outside = torch.randperm(target_vocab_size, generator=generator)
    outside = outside[drafter.to_draft[outside] == drafter.draft_vocab.numel()][:4]  # outside the draft vocabulary
    pool = torch.cat([inside, outside])
    ids = pool[torch.randint(0, pool.numel(), (count,), generator=generator)]
    motif_length = max(2, min(drafter.config.copy_ngram + 2, count // 3))
    if count >= 2 * motif_length - 1:
        motif = inside[torch.randint(0, inside.numel(), (motif_length,), generator=generator)]  # followers with draft ids
        ids[:motif_length] = motif
        ids[count - (motif_length - 1) :] = motif[: motif_length - 1]  # ends on the motif's start: the anchor copies
    return ids


def sample_drafter_inputs(target: LoadedTarget, drafter, config: BuildConfig) -> dict[str, torch.Tensor]:
    """The drafter graph's inputs (`export_drafter.input_names`): context features from the real
    target (prompts through the target's feature layers), anchors, temperatures mixing greedy and
    sampled rows, uniforms, and for a drafter with a copy bias the prompts' token ids. The
    prompts repeat n-grams (`sample_token_ids`) so that the copy bias has candidates to add."""
    v = config.validation
    generator = torch.Generator().manual_seed(v.seed + 1)
    layers = tuple(drafter.config.feature_layers)
    n = v.num_requests
    lengths = [max(1, v.context_tokens - 2 * i) for i in range(n)]
    pool = target.model.new_pool(n, v.context_tokens + 1)
    width = len(layers) * target.config.hidden_size
    features = torch.zeros(n, max(lengths), width)
    tokens = torch.zeros(n, max(lengths), dtype=torch.long)  # left-aligned, zero padding
    anchors = []
    for i, length in enumerate(lengths):
        ids = sample_token_ids(drafter, length + 1, target.config.vocab_size, generator)
        out = target.model(ids[:length], [length], [pool.allocate()], torch.tensor([length - 1]), layers)
        features[i, :length] = out.features
        tokens[i, :length] = ids[:length]
        anchors.append(int(ids[length]))
    temperatures = torch.tensor([(0.0, 1.0, 0.0, 0.7)[i % 4] for i in range(n)])  # greedy and sampled rows
    feeds = {"context_features": features, "context_lengths": torch.tensor(lengths),
             "anchor_tokens": torch.tensor(anchors), "temperatures": temperatures,
             "uniforms": torch.rand(n, drafter.config.block_size, generator=generator), "context_tokens": tokens}
    return {name: feeds[name] for name in input_names(drafter.config)}


def _dim(name: str, shape_range) -> Dim:
    return Dim(name, min=shape_range.min, max=shape_range.max)


def _export(module, feeds: dict, input_names, output_names, dynamic_shapes, path: Path, config: BuildConfig,
            plugin: bool = False, output_axes: dict | None = None) -> None:
    """Export with the configured exporter: `dynamo` (torch.export, the supported path) or
    `torchscript` (the legacy tracer: ~4x faster here, deprecated by PyTorch)."""
    import onnx

    args = tuple(feeds[name] for name in input_names)
    log = io.StringIO()
    try:  # torch.onnx prints progress lines and warnings of its own; keep them out of the build log
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            if config.exporter == "dynamo":
                program = torch.onnx.export(module, args, dynamo=True, input_names=list(input_names),
                                            output_names=list(output_names), dynamic_shapes=dynamic_shapes,
                                            opset_version=config.opset, external_data=False,
                                            custom_translation_table=sd.onnx_translation() if plugin else None)
                program.save(str(path))
            else:
                if plugin:
                    sd.register_torchscript_symbolic(config.opset)
                axes = {name: {axis: dim.__name__ for axis, dim in dims.items()} for name, dims in dynamic_shapes.items()}
                axes.update(output_axes or {})  # named output dims (else the tracer invents names)
                torch.onnx.export(module, args, str(path), dynamo=False, input_names=list(input_names),
                                  output_names=list(output_names), dynamic_axes=axes, opset_version=config.opset,
                                  custom_opsets={sd.ONNX_DOMAIN: 1} if plugin else None)
    except Exception as exc:
        raise ExportError(f"exporting {path.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    onnx.checker.check_model(str(path))


PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def reduced_precision_feeds(feeds: dict, dtype: torch.dtype) -> dict:
    """The target graph's feeds for a graph in `dtype`: its KV pool in that dtype."""
    return {name: value.to(dtype) if name in ("past_keys", "past_values") else value for name, value in feeds.items()}


def export_target(target: LoadedTarget, feature_layers: tuple[int, ...], config: BuildConfig, feeds: dict,
                  path: Path, dtype: torch.dtype = torch.float32) -> None:
    """The target step (`ExportTarget`) in `dtype`; `feeds` as `sample_target_inputs` makes them
    (in float32: the KV pool is cast here)."""
    s = config.target_shapes
    tokens, logits, slots, capacity = (_dim("batch_tokens", s.batch_tokens), _dim("num_logits", s.num_logits),
                                       _dim("num_slots", s.num_slots), _dim("slot_capacity", s.slot_capacity))
    dynamic = {"input_ids": {0: tokens}, "positions": {0: tokens}, "token_slots": {0: tokens},
               "logits_indices": {0: logits}, "past_keys": {1: slots, 3: capacity}, "past_values": {1: slots, 3: capacity}}
    outputs = {"logits": {0: "num_logits"}, "features": {0: "batch_tokens"},
               "present_keys": {1: "num_slots", 3: "slot_capacity"}, "present_values": {1: "num_slots", 3: "slot_capacity"}}
    _export(ExportTarget(target.model, feature_layers, dtype), reduced_precision_feeds(feeds, dtype), TARGET_INPUTS,
            TARGET_OUTPUTS, dynamic, path, config, output_axes=outputs)


def export_drafter(drafter, config: BuildConfig, feeds: dict, path: Path, use_plugin: bool) -> None:
    """Export `ExportDrafter`; its inputs are `input_names(drafter.config)` (`context_tokens` with
    a copy bias), each taken from `feeds` by name."""
    s = config.drafter_shapes
    batch, context = _dim("num_requests", s.num_requests), _dim("context", s.context)
    module = ExportDrafter(drafter, use_plugin=use_plugin)
    dynamic = {"context_features": {0: batch, 1: context}, "context_lengths": {0: batch},
               "anchor_tokens": {0: batch}, "temperatures": {0: batch}, "uniforms": {0: batch},
               "context_tokens": {0: batch, 1: context}}
    dynamic = {name: dynamic[name] for name in module.input_names}
    _export(module, feeds, module.input_names, DRAFTER_OUTPUTS, dynamic, path, config,
            plugin=use_plugin, output_axes={name: {0: "num_requests"} for name in DRAFTER_OUTPUTS})
