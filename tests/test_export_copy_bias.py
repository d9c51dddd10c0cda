"""The exported drafter graph with a copy bias and calibrated confidence offsets: it drafts what
the runtime's `DSparkProposer` drafts (which adds both), in torch, through both forms of the
sequential head, and in ONNX Runtime; and the build's validation fails on a graph that leaves
them out (so the checks that pass here could fail)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dspark_trt.builder.export_drafter import OUTPUT_NAMES, ExportDrafter, input_names
from dspark_trt.builder.onnx_export import export_drafter, sample_drafter_inputs
from dspark_trt.builder.validate import count_copy_candidates, runtime_greedy_drafts, validate_drafter
from dspark_trt.config import load_build_config
from dspark_trt.models.loading import load_target
from tiny_drafters import make_drafter

GAMMA, NGRAM = 4, 3
ALPHA, BETA, TOP_PROB = (4.0, 7.0, 10.0), (0.6, -0.4, 0.9), (0.3, 0.5, 0.7, 0.9)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)


def copy_drafter(target, head="markov", prefix_layer=False, alpha=ALPHA, beta=BETA, top_prob=TOP_PROB, copy=True):
    """A tiny calibrated drafter (shuffled draft vocabulary: id mix-ups show) with a copy bias over
    n-grams up to 3, copy_confidence and confidence_top_prob (what `dspark-trt calibrate` fits),
    large enough to change what is drafted. The same weights whatever the copy options."""
    options = dict(copy_bias=[list(alpha)] * GAMMA, copy_confidence=[list(beta)] * GAMMA,
                   confidence_top_prob=list(top_prob)) if copy else {}
    drafter = make_drafter(target, head=head, block_size=GAMMA, shuffled_vocab=True, prefix_layer=prefix_layer,
                           confidence_temperatures=[0.5, 1.0, 2.0, 3.0], **options)
    return drafter.eval().requires_grad_(False)


def dropped_copy_drafter(target):
    """The same drafter with alpha, beta and the top-probability weights zeroed: what a graph that
    leaves the copy bias and the offsets out computes, with the same inputs."""
    return copy_drafter(target, alpha=(0.0,) * NGRAM, beta=(0.0,) * NGRAM, top_prob=(0.0,) * GAMMA)


def greedy_feeds(target, drafter, seed):
    config = load_build_config("tiny", [f"validation.seed={seed}", "validation.num_requests=4",
                                        f"validation.context_tokens={12 + 4 * seed}"])
    feeds = sample_drafter_inputs(target, drafter, config)
    feeds["temperatures"] = torch.zeros(4)
    return feeds


@pytest.mark.parametrize("head, prefix_layer", [("markov", False), ("rnn", False), ("markov", True)])
def test_export_module_drafts_what_the_runtime_proposer_drafts(target, head, prefix_layer):
    """Greedy blocks identical and confidences within 1e-4, on histories that copy (candidates
    from the history and from the block's own tokens), with the op and with its unrolled form."""
    drafter = copy_drafter(target, head, prefix_layer)
    assert input_names(drafter.config)[-1] == "context_tokens"
    from_block = 0
    for seed in range(2):
        feeds = greedy_feeds(target, drafter, seed)
        with torch.inference_mode():
            plugin = ExportDrafter(drafter, use_plugin=True)(**feeds)
            unrolled = ExportDrafter(drafter, use_plugin=False)(**feeds)
        assert all(torch.equal(a, b) for a, b in zip(plugin, unrolled))
        tokens, confidences = runtime_greedy_drafts(drafter, feeds)
        assert torch.equal(plugin[0], tokens)
        assert (plugin[2] - confidences).abs().max() <= 1e-4
        counted = count_copy_candidates(drafter, feeds, tokens)
        assert counted["total"] > 0 and all(n > 0 for n in counted["per_row"])
        from_block += counted["from_block_pairs"]
    assert from_block > 0  # the in-block pairs were exercised too


def test_copy_bias_changes_the_drafts(target):
    """Not vacuous: the same drafter without the copy bias and offsets drafts other blocks and
    confidences on the same feeds."""
    drafter, plain = copy_drafter(target), copy_drafter(target, copy=False)  # same weights
    feeds = greedy_feeds(target, drafter, 0)
    with torch.inference_mode():
        with_bias = ExportDrafter(drafter)(**feeds)
        without = ExportDrafter(plain)(**{k: v for k, v in feeds.items() if k != "context_tokens"})
    assert not torch.equal(with_bias[0], without[0])
    assert (with_bias[2] - without[2]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """A copy-bias drafter exported (TorchScript, unrolled: what the build runs in ONNX Runtime),
    and `dropped_copy_drafter` exported the same way."""
    folder = tmp_path_factory.mktemp("copy-bias-graphs")
    drafter, dropped = copy_drafter(target), dropped_copy_drafter(target)
    config = load_build_config("tiny")
    feeds = sample_drafter_inputs(target, drafter, config)
    paths = {}
    for name, model in (("with", drafter), ("dropped", dropped)):
        paths[name] = folder / f"{name}.onnx"
        export_drafter(model, config, feeds, paths[name], use_plugin=False)
    return drafter, config, feeds, paths, folder


def test_onnxruntime_runs_the_copy_bias_graph_as_the_runtime_proposer_drafts(target, exported):
    drafter, _, _, paths, _ = exported
    model = onnx.load(str(paths["with"]))
    assert [i.name for i in model.graph.input][-1] == "context_tokens"
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    session = ort.InferenceSession(str(paths["with"]), providers=["CPUExecutionProvider"])
    for seed in (3, 4):  # fresh inputs, longer contexts than the export's
        feeds = greedy_feeds(target, drafter, seed)
        got = dict(zip(OUTPUT_NAMES, session.run(None, {k: v.numpy() for k, v in feeds.items()})))
        tokens, confidences = runtime_greedy_drafts(drafter, feeds)
        assert np.array_equal(got["draft_tokens"], tokens.numpy())
        assert np.abs(got["confidences"] - confidences.numpy()).max() <= 1e-4
        assert count_copy_candidates(drafter, feeds, tokens)["total"] > 0


def test_validation_passes_with_the_copy_bias_and_fails_without_it(exported):
    drafter, config, feeds, paths, folder = exported
    report = validate_drafter(drafter, config, feeds, paths["with"], folder / "report-with")
    assert report["ok"] and report["greedy_tokens_identical_runtime_proposer"]
    assert report["runtime_proposer_confidence_max_abs"] <= 1e-4
    assert report["copy_candidates"]["exercised"] and report["copy_candidates"]["in_greedy_rows"] > 0
    assert report["graph_inputs"][-1] == "context_tokens"
    failed = validate_drafter(drafter, config, feeds, paths["dropped"], folder / "report-dropped")
    assert not failed["ok"] and not failed["polygraphy_ok"]
    assert (not failed["greedy_tokens_identical_onnxruntime"]
            or failed["onnxruntime_vs_torch_max_abs"]["confidences"] > config.validation.probs_atol)


def test_the_runtime_comparison_fails_when_the_export_module_drops_the_copy_bias(target, exported):
    """The check that failed before this change (graph without the copy bias against the runtime
    proposer with it) still fails: it compares what the graph drafts with what the runtime drafts."""
    drafter, _, feeds, _, _ = exported
    dropped = dropped_copy_drafter(target)
    greedy = feeds["temperatures"] == 0
    with torch.inference_mode():
        tokens, _, confidences, _ = ExportDrafter(dropped)(**feeds)
    runtime_tokens, runtime_confidences = runtime_greedy_drafts(drafter, feeds)
    assert (not torch.equal(tokens[greedy], runtime_tokens[greedy])
            or (confidences[greedy] - runtime_confidences[greedy]).abs().max() > 1e-4)


def test_dynamo_exports_the_copy_bias_into_the_sequential_draft_node(target, tmp_path):
    """torch.export (exporter: dynamo) maps the op, with its copy inputs and attributes, to one node."""
    drafter = copy_drafter(target)
    config = load_build_config("tiny", ["exporter=dynamo"])
    path = tmp_path / "drafter.onnx"
    export_drafter(drafter, config, sample_drafter_inputs(target, drafter, config), path, use_plugin=True)
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.domain == "dspark"]
    assert [n.op_type for n in nodes] == ["SequentialDraft"] and len(nodes[0].input) == 20
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"head": 1, "has_confidence": 1, "copy_ngram": NGRAM, "copy_confidence": 1, "top_prob": 1,
                     "plugin_namespace": b"dspark", "plugin_version": b"1"}
    assert [i.name for i in model.graph.input] == input_names(drafter.config)
