"""Validate the exported graphs against torch, with polygraphy, and write a report.

Checks, each with the maximum absolute differences it measured:
- target: ExportTarget in torch and `target.onnx` in ONNX Runtime against our own runtime
  forward (`TargetModel.forward`) on a ragged step (decode token, verify block, prefill chunk):
  logits, features and the updated KV pool;
- drafter: `drafter_unrolled.onnx` (with a prefix layer: `drafter.onnx`, which has no plugin
  node) in ONNX Runtime against ExportDrafter in torch (the SequentialDraft custom op), and
  ExportDrafter against the runtime's `DSparkProposer` on the greedy rows (identical draft
  tokens, confidences within `probs_atol`): the whole drafter, copy bias and calibrated
  confidence offsets included, so the graphs and the runtime are the same model. The sample
  prompts repeat n-grams (`onnx_export.sample_token_ids`) and the proposer is given them as the
  requests' tokens; the report counts the copy candidates the runtime's own lookup
  (`CopyIndex`/`BlockCopyBias`) found on the drafted blocks, and a drafter with a copy bias
  fails validation when the sample had none (the comparison would not have covered it);
- `drafter.onnx` holds exactly one `dspark::SequentialDraft` node with the TensorRT plugin
  attributes (none with a prefix layer), and `polygraphy inspect model` reads every graph;
  `polygraphy check lint` runs on the graphs ONNX Runtime can execute (a plugin graph needs
  TensorRT to run).

The golden inputs and outputs are saved in polygraphy's JSON format, so that on a GPU machine
`polygraphy run DIR/onnx/target.onnx --trt --load-inputs ... --load-outputs ...` compares
TensorRT to the same torch outputs (see ci/gpu.sh). This module does not build engines.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from dspark_trt.config import BuildConfig
from dspark_trt.errors import DsparkError


class ValidationFailed(DsparkError):
    """The exported graphs do not reproduce torch within the configured tolerances."""


def _np(feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in feeds.items()}


def _max_diffs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) if a[k].size else 0.0 for k in b}


def _largest(array: np.ndarray) -> float:
    """The largest magnitude in `array` (0 for an empty one: a target built without a drafter has no features)."""
    return float(np.abs(array).max()) if array.size else 0.0


def run_onnxruntime(path: Path, feeds: dict[str, np.ndarray], golden: dict[str, np.ndarray], atol: dict[str, float],
                    golden_dir: Path, name: str) -> tuple[dict[str, np.ndarray], bool]:
    """Run `path` in ONNX Runtime through polygraphy's Comparator and compare to `golden` with
    per-output absolute tolerances. Saves inputs and golden outputs as polygraphy JSON."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # the report carries the numbers
    runner = OnnxrtRunner(SessionFromOnnx(str(path), providers=["cpu"]))
    results = Comparator.run([runner], data_loader=[feeds])
    torch_results = RunResults([("torch", [IterationResult(golden, runner_name="torch")])])
    golden_dir.mkdir(parents=True, exist_ok=True)
    save_json([feeds], golden_dir / f"{name}_inputs.json")
    torch_results.save(str(golden_dir / f"{name}_golden.json"))
    results.extend(torch_results)
    rtol = {k: 0.0 for k in atol}
    with warnings.catch_warnings():  # its statistics of an empty output (no features) warn "mean of empty slice"
        warnings.simplefilter("ignore", RuntimeWarning)
        accuracy = Comparator.compare_accuracy(results, compare_func=simple_compare_func()(atol=atol, rtol=rtol))
    ort_outputs = {k: np.asarray(v) for k, v in results[0][1][0].items()}
    return ort_outputs, bool(accuracy)


def simple_compare_func():
    """polygraphy's element-wise comparison: `SimpleCompareFunc` from 0.50 on, `CompareFunc.simple`
    before (0.49.x has no `SimpleCompareFunc`; later ones deprecate `CompareFunc.simple`)."""
    try:
        from polygraphy.comparator import SimpleCompareFunc
    except ImportError:
        from polygraphy.comparator import CompareFunc

        return CompareFunc.simple
    return SimpleCompareFunc


def polygraphy_cli(*args: str) -> tuple[int, str]:
    """Run the `polygraphy` command line (its own process, as users run it)."""
    script = Path(sys.executable).with_name("polygraphy")  # the package has no __main__
    cmd = [sys.executable, str(script)] if script.is_file() else [shutil.which("polygraphy") or "polygraphy"]
    cmd += list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)  # the caller reads the status
    return done.returncode, (done.stdout + done.stderr)


def inspect_and_lint(onnx_dir: Path, report_dir: Path, plugin_graphs: frozenset[str] = frozenset()) -> dict:
    """`polygraphy inspect model` on every graph, `polygraphy check lint` on the ORT-runnable ones:
    all but `plugin_graphs` (file names), which need TensorRT to run (the node check is theirs)."""
    out = {}
    for path in sorted(onnx_dir.glob("*.onnx")):
        code, text = polygraphy_cli("inspect", "model", str(path), "--show", "layers")
        (report_dir / f"inspect_{path.stem}.txt").write_text(text)
        entry = {"inspect_ok": code == 0}
        if path.name not in plugin_graphs:
            lint_json = report_dir / f"lint_{path.stem}.json"
            inputs = report_dir / f"{'target' if path.stem == 'target' else 'drafter'}_inputs.json"
            # Our golden inputs, not random ones: random slot/position ids would index out of range.
            code, text = polygraphy_cli("check", "lint", str(path), "-o", str(lint_json), "--load-inputs", str(inputs))
            lint = json.loads(lint_json.read_text()) if lint_json.is_file() else {}
            entry["lint_ok"] = code == 0 and not lint.get("summary", {}).get("failing")
            entry["lint_summary"] = lint.get("summary", text[-500:])
        out[path.name] = entry
    return out


def check_plugin_node(path: Path, expected: int = 1) -> dict:
    """`expected` (1, or 0 for a drafter with a prefix layer) `dspark::SequentialDraft` nodes,
    each with the plugin attributes TensorRT's ONNX parser reads."""
    import onnx

    from dspark_trt.plugins import sequential_draft as sd

    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == sd.ONNX_DOMAIN and n.op_type == sd.ONNX_OP_TYPE]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute} if nodes else {}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    plugin_attrs_ok = (attrs.get("plugin_namespace"), attrs.get("plugin_version")) == (sd.PLUGIN_NAMESPACE,
                                                                                       sd.PLUGIN_VERSION)
    return {"count": len(nodes), "expected": expected, "attributes": attrs,
            "ok": len(nodes) == expected and (expected == 0 or plugin_attrs_ok)}


def history_of(feeds: dict[str, torch.Tensor], row: int) -> list[int]:
    """Row `row`'s committed tokens before the anchor (`context_tokens`; zeros for a graph without
    that input, whose drafter does not read tokens)."""
    length = int(feeds["context_lengths"][row])
    if "context_tokens" in feeds:
        return feeds["context_tokens"][row, :length].tolist()
    return [0] * length


@torch.inference_mode()
def runtime_greedy_drafts(drafter, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy blocks and confidences from the runtime's own `DSparkProposer` for every row (its
    prompt is the row's `context_tokens`, its pending token the anchor)."""
    from dspark_trt.runtime.dspark_proposer import DSparkProposer
    from dspark_trt.runtime.request import Request
    from dspark_trt.runtime.sampling import SamplingParams

    proposer = DSparkProposer(drafter)
    tokens, confidences = [], []
    for i in range(feeds["anchor_tokens"].shape[0]):
        length = int(feeds["context_lengths"][i])
        request = Request(f"validate-{i}", history_of(feeds, i), SamplingParams(temperature=0.0), torch.Generator())
        request.output_token_ids = [int(feeds["anchor_tokens"][i])]
        proposer.observe(request, feeds["context_features"][i, :length])
        draft = proposer.propose([request])[0]
        tokens.append(torch.tensor(draft.tokens))
        confidences.append(draft.confidences if draft.confidences is not None else torch.ones(len(draft.tokens)))
        proposer.release(request)
    return torch.stack(tokens), torch.stack(confidences)


def count_copy_candidates(drafter, feeds: dict[str, torch.Tensor], draft_tokens: torch.Tensor) -> dict:
    """How many copy candidates (slot, n-gram length, in the draft vocabulary) the runtime's own
    lookup (`CopyIndex`, `BlockCopyBias`) finds for each row's history and drafted block
    `draft_tokens` `[B, G]` (target ids): per row, the (row, slot)s with at least one, and how many
    came from pairs the block's own tokens made (newer than any in the history)."""
    from dspark_trt.models.copy_bias import NO_CANDIDATE, BlockCopyBias, CopyIndex

    config = drafter.config
    if not config.copy_ngram:
        return {"copy_ngram": 0, "total": 0, "per_row": [], "slots_with_one": 0, "from_block_pairs": 0}
    to_draft, vocab_size = drafter.to_draft.tolist(), drafter.draft_vocab.numel()
    per_row, slots, from_block = [], 0, 0
    for i in range(draft_tokens.shape[0]):
        index = CopyIndex(config.copy_ngram)
        index.extend(history_of(feeds, i) + [int(feeds["anchor_tokens"][i])])
        copy = BlockCopyBias(config.copy_bias, [index], to_draft, vocab_size)
        for k, token in enumerate(draft_tokens[i].tolist()):
            tail, block = copy.tails[0], copy.blocks[0]  # before slot k: pairs the block made so far
            in_block = [block[n - 1].get(tuple(tail[-n:])) if len(tail) >= n else None
                        for n in range(1, config.copy_ngram + 1)]
            copy.add_to(torch.zeros(1, vocab_size), k)
            from_block += sum(1 for newer, found in zip(in_block, copy.found[-1])
                              if newer is not None and found != NO_CANDIDATE)
            copy.advance([token])
        found = copy.candidates()[0]  # [G, N]
        per_row.append(int((found != NO_CANDIDATE).sum()))
        slots += int((found != NO_CANDIDATE).any(-1).sum())
    return {"copy_ngram": config.copy_ngram, "total": sum(per_row), "per_row": per_row, "slots_with_one": slots,
            "from_block_pairs": from_block}


def validate_target(target, feature_layers, config: BuildConfig, feeds, runtime_golden, onnx_path: Path,
                    report_dir: Path) -> dict:
    from dspark_trt.builder.export_target import ExportTarget

    v = config.validation
    with torch.inference_mode():
        exported = ExportTarget(target.model, feature_layers)(*feeds.values())
    names = ["logits", "features", "present_keys", "present_values"]
    torch_out = dict(zip(names, (t.numpy() for t in exported)))
    golden = _np(runtime_golden)
    atol = {"logits": v.logits_atol, "features": v.features_atol, "present_keys": v.features_atol,
            "present_values": v.features_atol}
    # Hidden states reach |x| ~ 10^2..10^3 in real targets, and 30 layers of fp32 accumulate
    # differences of ~10^-4 in them: features and KV get a term relative to the tensor's largest
    # magnitude; logits are held to the absolute tolerance alone.
    for k in names[1:]:
        atol[k] = atol[k] + v.features_rtol * _largest(golden[k])
    ort_out, polygraphy_ok = run_onnxruntime(onnx_path, _np(feeds), golden, atol, report_dir, "target")
    ort_diff, export_diff = _max_diffs(ort_out, golden), _max_diffs(torch_out, golden)
    ok = polygraphy_ok and all(ort_diff[k] <= atol[k] for k in names)
    return {"ok": ok, "polygraphy_ok": polygraphy_ok, "tolerances": atol,
            "onnxruntime_vs_torch_max_abs": ort_diff,
            "feature_max_abs_value": _largest(golden["features"]),
            "export_module_vs_runtime_max_abs": export_diff, "num_tokens": int(feeds["input_ids"].shape[0])}


# A float16 graph against the same module run by torch in float16: two float16 computations in
# different orders, so a relative bound (of each output's largest magnitude), not fp32's 1e-4.
REDUCED_PRECISION_RTOL = 2e-2


def validate_reduced_precision_target(target, feature_layers, precision: str, feeds, runtime_golden,
                                      onnx_path: Path) -> dict:
    """The target graph TensorRT builds for `engines.precision` fp16 / bf16: ONNX Runtime runs a
    float16 graph on the CPU and is compared with `ExportTarget` in float16 run by torch; its
    distance from the float32 runtime is reported beside (what the precision itself costs). ONNX
    Runtime's CPU provider has no bfloat16 MatMul, so a bf16 graph is only checked to load
    (`ci/gpu.sh` compares the engine with `polygraphy run --trt`)."""
    import onnx

    from dspark_trt.builder.export_target import ExportTarget
    from dspark_trt.builder.onnx_export import PRECISION_DTYPES, reduced_precision_feeds

    onnx.checker.check_model(str(onnx_path))
    dtype = PRECISION_DTYPES[precision]
    typed_feeds = reduced_precision_feeds(feeds, dtype)
    names = ["logits", "features", "present_keys", "present_values"]
    with torch.inference_mode():
        reference = {k: t.float().numpy() for k, t in zip(names, ExportTarget(target.model, feature_layers, dtype)(
            *typed_feeds.values()))}
    report = {"precision": precision, "module_vs_float32_runtime_max_abs": _max_diffs(reference, _np(runtime_golden))}
    if dtype == torch.bfloat16:
        return {**report, "ok": True, "onnxruntime": "skipped: ONNX Runtime's CPU provider has no bfloat16 MatMul"}
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ort_out = dict(zip(names, (np.asarray(a, np.float32) for a in session.run(names, _np(typed_feeds)))))
    diffs = _max_diffs(ort_out, reference)
    tolerances = {k: REDUCED_PRECISION_RTOL * max(_largest(reference[k]), 1.0) for k in names}
    return {**report, "ok": all(diffs[k] <= tolerances[k] for k in names), "tolerances": tolerances,
            "onnxruntime_vs_torch_max_abs": diffs}


def validate_drafter(drafter, config: BuildConfig, feeds, onnx_path: Path, report_dir: Path) -> dict:
    """`feeds`: the graph's inputs (`onnx_export.sample_drafter_inputs`)."""
    from dspark_trt.builder.export_drafter import OUTPUT_NAMES, ExportDrafter

    v = config.validation
    with torch.inference_mode():
        exported = ExportDrafter(drafter, use_plugin=True)(**feeds)
    golden = dict(zip(OUTPUT_NAMES, (t.numpy() for t in exported)))
    atol = {"draft_tokens": 0.0, "token_probs": v.probs_atol, "confidences": v.probs_atol,
            "distributions": v.probs_atol}
    ort_out, polygraphy_ok = run_onnxruntime(onnx_path, _np(feeds), golden, atol, report_dir, "drafter")
    greedy = (feeds["temperatures"] <= 0).numpy()
    runtime_tokens, runtime_conf = runtime_greedy_drafts(drafter, feeds)
    greedy_ort_equal = bool((ort_out["draft_tokens"][greedy] == golden["draft_tokens"][greedy]).all())
    greedy_runtime_equal = bool((runtime_tokens.numpy()[greedy] == golden["draft_tokens"][greedy]).all())
    conf_diff = float(np.abs(runtime_conf.numpy()[greedy] - golden["confidences"][greedy]).max()) if greedy.any() else 0.0
    diffs = _max_diffs(ort_out, golden)
    # the runtime's own lookup on the blocks it drafted (greedy rows) and the graph drafted (the others)
    drafted = torch.where(torch.from_numpy(greedy)[:, None], runtime_tokens, torch.from_numpy(golden["draft_tokens"]))
    candidates = count_copy_candidates(drafter, feeds, drafted)
    greedy_candidates = sum(n for n, g in zip(candidates["per_row"], greedy) if g)
    copy_exercised = not drafter.config.copy_ngram or greedy_candidates > 0
    ok = (polygraphy_ok and greedy_ort_equal and greedy_runtime_equal and conf_diff <= v.probs_atol
          and all(diffs[k] <= atol[k] for k in atol) and copy_exercised)
    return {"ok": ok, "polygraphy_ok": polygraphy_ok, "tolerances": atol, "onnxruntime_vs_torch_max_abs": diffs,
            "greedy_rows": int(greedy.sum()), "greedy_tokens_identical_onnxruntime": greedy_ort_equal,
            "greedy_tokens_identical_runtime_proposer": greedy_runtime_equal,
            "sampled_tokens_identical_onnxruntime": bool((ort_out["draft_tokens"] == golden["draft_tokens"]).all()),
            "runtime_proposer_confidence_max_abs": conf_diff,
            "copy_candidates": {**candidates, "in_greedy_rows": greedy_candidates, "exercised": copy_exercised},
            "graph_inputs": list(feeds)}
