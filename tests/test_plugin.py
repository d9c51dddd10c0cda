"""The SequentialDraft op: its reference against the drafter's own head, the custom op, and the
export modules against the runtime (torch only; the ONNX faces are checked in test_builder.py)."""

import pytest
import torch

from dspark_trt.builder.export_drafter import ExportDrafter
from dspark_trt.builder.export_target import ExportTarget
from dspark_trt.builder.validate import runtime_greedy_drafts
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.drafter_io import build_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.plugins import sequential_draft as sd

FEATURE_LAYERS = (1, 2)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)


def make_drafter(target, head="markov", block_size=4, vocab_size=512, calibrated=False, context_norm=False,
                 prefix_layer=False):
    config = DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, kind="dspark" if head != "none" else "dflash",
                                      head=head, confidence=head != "none", num_layers=1, markov_rank=16,
                                      block_size=block_size, draft_vocab_size=vocab_size, context_norm=context_norm,
                                      confidence_temperatures=[0.5, 1.0, 2.0, 3.0][:block_size] if calibrated else [],
                                      prefix_layer=prefix_layer)
    torch.manual_seed(0)
    # a draft vocabulary that is not the identity, so id mapping bugs show
    drafter = build_drafter(config, torch.randperm(target.config.vocab_size)[:vocab_size]).attach_target(target.model)
    with torch.no_grad():  # non-zero head weights and mask embedding so that they matter
        if drafter.sequential is not None:
            drafter.sequential.w2.weight.normal_(std=1.0)
        drafter.mask_embedding.normal_(std=0.5)
        for layer in drafter.layers:  # per-channel scales unlike the fused context's (context_norm matters)
            layer.attn_norm.weight.uniform_(0.2, 3.0)
        if drafter.confidence is not None:
            drafter.confidence.weight.normal_(std=0.5)
        if drafter.prefix is not None:  # its output projection starts at zero, i.e. as the drafter without it
            drafter.prefix.out.weight.normal_(std=0.5)
            drafter.prefix.layer.attn_norm.weight.uniform_(0.2, 3.0)
    return drafter.eval().requires_grad_(False)


def copy_inputs(module):
    """The op's copy-bias inputs of an `ExportDrafter` (placeholders for a drafter without one)."""
    w = module.head_weights()
    return module.history_placeholder, w.draft_vocab, w.to_draft, w.copy_alpha, w.copy_beta, w.top_prob_w


def sample_feeds(target, drafter, seed=0, batch=4):
    generator = torch.Generator().manual_seed(seed)
    width = len(FEATURE_LAYERS) * target.config.hidden_size
    lengths = torch.tensor([9, 3, 12, 1][:batch])
    features = torch.randn(batch, 12, width, generator=generator) * 3
    anchors = torch.cat([drafter.draft_vocab[:1], torch.randint(0, target.config.vocab_size, (batch - 1,),
                                                                 generator=generator)])  # in and out of the draft vocab
    return {"context_features": features, "context_lengths": lengths, "anchor_tokens": anchors,
            "temperatures": torch.tensor([0.0, 1.0, 0.0, 0.6][:batch]),
            "uniforms": torch.rand(batch, drafter.config.block_size, generator=generator)}


@pytest.mark.parametrize("head, context_norm, prefix_layer",
                         [("markov", False, False), ("markov", True, False), ("rnn", False, False), ("none", True, False),
                          ("markov", True, True), ("rnn", False, True)])
def test_greedy_blocks_equal_the_runtime_proposer(target, head, context_norm, prefix_layer):
    """ExportDrafter (backbone + SequentialDraft op, or the prefix layer's slot-by-slot loop)
    drafts exactly what DSparkProposer drafts, with and without each layer's own norm of the context."""
    drafter = make_drafter(target, head, calibrated=True, context_norm=context_norm, prefix_layer=prefix_layer)
    feeds = sample_feeds(target, drafter)
    feeds["temperatures"] = torch.zeros(4)
    with torch.inference_mode():
        tokens, probs, confidences, distributions = ExportDrafter(drafter)(*feeds.values())
    runtime_tokens, runtime_conf = runtime_greedy_drafts(drafter, feeds)
    assert torch.equal(tokens, runtime_tokens)
    if head != "none":
        assert (confidences - runtime_conf).abs().max() < 1e-5
    else:
        assert torch.equal(confidences, torch.ones_like(confidences))
    assert torch.allclose(distributions.sum(-1), torch.ones(4, 4))
    assert torch.equal(probs, distributions.gather(-1, drafter.to_draft[tokens][..., None])[..., 0])


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_reference_is_the_drafters_head(target, head):
    """Slot by slot, the reference's distribution is softmax((U_k + B(x_{k-1})) / T) computed with the
    drafter's own `sequential_bias`, and its sampled token is the inverse-CDF pick of runtime `sample`."""
    drafter = make_drafter(target, head)
    generator = torch.Generator().manual_seed(1)
    batch, block, d = 3, 4, target.config.hidden_size
    hidden = torch.randn(batch, block, d, generator=generator)
    logits = drafter.backbone_logits(hidden)
    anchors = torch.tensor([0, 5, drafter.draft_vocab.numel()])  # the last one is out of vocabulary
    temperatures = torch.tensor([0.0, 0.8, 1.5])
    uniforms = torch.rand(batch, block, generator=generator)
    module = ExportDrafter(drafter)
    ids, probs, conf, dists = sd.reference(logits, hidden, anchors, module.w1, module.w2, *module.gru, module.conf_w,
                                           module.conf_b, module.conf_inv_temps, temperatures, uniforms,
                                           *copy_inputs(module), sd.HEAD_CODES[head], 1)
    for b in range(batch):
        previous, state = anchors[b], None
        for k in range(block):
            bias, state = drafter.sequential_bias(hidden[b, k], previous, state)
            row = logits[b, k] + bias
            t = float(temperatures[b])
            expected = torch.softmax(row / (t if t > 0 else 1.0), -1)
            assert (dists[b, k] - expected).abs().max() < 1e-6
            if t == 0:
                assert ids[b, k] == row.argmax()
            else:
                cdf = expected.cumsum(0)
                assert ids[b, k] == torch.searchsorted(cdf, uniforms[b, k] * cdf[-1], right=True).clamp(max=cdf.numel() - 1)
            assert probs[b, k] == dists[b, k, ids[b, k]]
            c = torch.sigmoid(drafter.confidence_logits(hidden[b, k], previous))
            assert abs(float(conf[b, k]) - float(c)) < 1e-6
            previous = ids[b, k]


def test_sampled_tokens_follow_the_draft_distribution(target):
    """Over many uniforms, slot-1 tokens are distributed as p_1 (the op samples exactly)."""
    drafter = make_drafter(target, "markov", vocab_size=8)
    n = 20000
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 4, target.config.hidden_size, generator=generator).expand(n, -1, -1)
    logits = drafter.backbone_logits(hidden[:1]).expand(n, -1, -1) * 0.3
    module = ExportDrafter(drafter)
    ids, _, _, dists = sd.reference(logits, hidden, torch.zeros(n, dtype=torch.long), module.w1, module.w2, *module.gru,
                                    module.conf_w, module.conf_b, module.conf_inv_temps, torch.ones(n),
                                    torch.rand(n, 4, generator=generator), *copy_inputs(module), sd.HEAD_MARKOV, 1)
    counts = torch.bincount(ids[:, 0], minlength=8).float()
    expected = dists[0, 0] * n
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    assert chi2 < 30.0  # 7 degrees of freedom: p < 1e-4 at 30


@pytest.mark.parametrize("copy_bias", [False, True])
def test_custom_op_matches_reference_and_passes_opcheck(target, copy_bias):
    drafter = make_drafter(target, "rnn")
    attributes = (sd.HEAD_RNN, 1, 0, 0, 0)
    if copy_bias:  # the copy inputs and attributes in use (a history whose tail repeats)
        drafter.config.copy_bias = [[2.0, 4.0]] * 4
        drafter.config.copy_confidence = [[0.5, -0.5]] * 4
        drafter.config.confidence_top_prob = [0.1, 0.2, 0.3, 0.4]
        attributes = (sd.HEAD_RNN, 1, 2, 1, 1)
    module = ExportDrafter(drafter)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 4, target.config.hidden_size, generator=generator)
    copy = copy_inputs(module)
    if copy_bias:
        vocab = drafter.draft_vocab[:3].tolist()
        copy = (torch.tensor([[-1, vocab[0], vocab[1], vocab[0]], [vocab[2], vocab[2], 5, vocab[2]]]),) + copy[1:]
    args = (drafter.backbone_logits(hidden), hidden, torch.tensor([1, 2]), module.w1, module.w2, *module.gru,
            module.conf_w.detach(), module.conf_b.detach(), module.conf_inv_temps, torch.tensor([0.0, 1.0]),
            torch.rand(2, 4, generator=generator), *copy)
    args = tuple(a.detach() for a in args) + attributes
    for got, want in zip(torch.ops.dspark.sequential_draft(*args), sd.reference(*args)):
        assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.dspark.sequential_draft.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_plugin_and_unrolled_forms_agree(target):
    drafter = make_drafter(target, "markov", calibrated=True)
    feeds = sample_feeds(target, drafter, seed=4)
    with torch.inference_mode():
        a = ExportDrafter(drafter, use_plugin=True)(*feeds.values())
        b = ExportDrafter(drafter, use_plugin=False)(*feeds.values())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_prefix_layer_corrects_each_slot_from_the_drawn_prefix(target):
    """With a prefix layer there is no plugin form (the loop is standard ops either way), slot 1
    differs from the drafter without the layer only by the layer's correction, and every sampled
    slot's distribution is softmax((U_k + B_k + U(PrefixLayer.step(h_k, x_{k-1}, slots < k))) / T)
    with x_{k-1} the token the export drew: the runtime's own modules, slot by slot."""
    drafter = make_drafter(target, "markov", calibrated=True, prefix_layer=True)
    feeds = sample_feeds(target, drafter, seed=5)
    module = ExportDrafter(drafter, use_plugin=True)
    assert not module.use_plugin
    with torch.inference_mode():
        tokens, probs, confidences, distributions = module(*feeds.values())
        assert all(torch.equal(x, y) for x, y in zip((tokens, probs, confidences, distributions),
                                                     ExportDrafter(drafter, use_plugin=False)(*feeds.values())))
        without = make_drafter(target, "markov", calibrated=True)  # the same weights but no prefix layer
        without.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("prefix.")})
        assert not torch.allclose(ExportDrafter(without)(*feeds.values())[3][:, 0], distributions[:, 0], atol=1e-3)

        hidden, logits, _, _ = module.backbone(*list(feeds.values())[:3])  # h_k, U_k before the sequential head
        gamma = drafter.config.block_size
        for b in range(tokens.shape[0]):
            length = int(feeds["context_lengths"][b])
            cos, sin = drafter.rope_table(length + gamma)
            previous_tokens, cache = feeds["anchor_tokens"][b : b + 1], None
            for k in range(gamma):
                previous = drafter.to_draft[previous_tokens]
                correction, cache = drafter.prefix.step(hidden[b : b + 1, k], drafter.embed[previous_tokens],
                                                        cos[length + k][None, None, None], sin[length + k][None, None, None],
                                                        cache)
                bias, _ = drafter.sequential_bias(hidden[b, k], previous[0], None)
                row = logits[b, k] + bias + drafter.lm_head_logits(correction)[0]
                t = float(feeds["temperatures"][b])
                expected = torch.softmax(row / (t if t > 0 else 1.0), -1)
                assert (distributions[b, k] - expected).abs().max() < 1e-5
                previous_tokens = tokens[b : b + 1, k]


def test_export_target_equals_the_runtime_forward(target):
    """The export-friendly step (plain torch ops, KV pool in/out) computes what TargetModel.forward does."""
    model = target.model
    pool = model.new_pool(3, 40)
    caches = [pool.allocate() for _ in range(3)]
    generator = torch.Generator().manual_seed(5)
    for cache, n in zip(caches, (6, 11, 2)):
        model(torch.randint(0, 1000, (n,), generator=generator), [n], [cache])
    before_k, before_v = pool.keys.clone(), pool.values.clone()
    counts = [5, 1, 8]
    ids = torch.randint(0, target.config.vocab_size, (14,), generator=generator)
    positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, counts)])
    slots = torch.cat([torch.full((n,), c.slot) for c, n in zip(caches, counts)])
    at = torch.tensor([4, 5, 13])
    with torch.inference_mode():
        logits, features, keys, values = ExportTarget(model, FEATURE_LAYERS)(ids, positions, slots, at, before_k, before_v)
    ref = model(ids, counts, caches, at, FEATURE_LAYERS)
    assert (logits - ref.logits).abs().max() < 1e-4
    assert (features - ref.features).abs().max() < 1e-5
    assert (keys - pool.keys).abs().max() < 1e-5 and (values - pool.values).abs().max() < 1e-5


def test_dynamo_exporter_writes_the_same_sequential_draft_node(target, tmp_path):
    """The torch.export path (exporter: dynamo) maps the custom op to the same ONNX node."""
    import onnx

    from dspark_trt.builder.onnx_export import export_drafter
    from dspark_trt.config import load_build_config

    drafter = make_drafter(target, "markov", calibrated=True)
    config = load_build_config("tiny", ["exporter=dynamo"])
    path = tmp_path / "drafter.onnx"
    export_drafter(drafter, config, sample_feeds(target, drafter), path, use_plugin=True)
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.domain == "dspark"]
    assert [n.op_type for n in nodes] == ["SequentialDraft"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"head": 1, "has_confidence": 1, "copy_ngram": 0, "copy_confidence": 0, "top_prob": 0,
                     "plugin_namespace": b"dspark", "plugin_version": b"1"}
    assert [i.name for i in model.graph.input] == ["context_features", "context_lengths", "anchor_tokens",
                                                   "temperatures", "uniforms"]
