"""The DSpark drafter: masks, losses, training, checkpoints, and exact speculative decoding."""

import json
import math

import pytest
import torch

from dspark_trt import LLM, DsparkError, ModelLoadError, SamplingParams
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.drafter_io import load_drafter, save_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.models.rope import inverse_frequencies, rope_cos_sin
from dspark_trt.models.target import rms_norm
from dspark_trt.training.data import ensure_features, load_sequences, make_batch, read_rows
from dspark_trt.training.run_state import run_progress
from dspark_trt.training.datagen import DatagenConfig, generate_dataset
from dspark_trt.training.losses import drafter_loss, draft_logits, slot_weights
from dspark_trt.training.prompts import load_prompts
from dspark_trt.training.trainer import TrainConfig, build_draft_vocab, train_drafter

from tiny_drafters import FEATURE_LAYERS, make_dataset, make_drafter


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    """Self-distilled rows and cached features from the tiny target."""
    rows, features_dir = make_dataset(target, tmp_path_factory.mktemp("data"))
    return rows, load_sequences(rows, features_dir)




def test_datagen_features_equal_a_fresh_target_pass(target, dataset, tmp_path):
    rows, sequences = dataset
    ensure_features(target, rows[:2], tmp_path, FEATURE_LAYERS)
    fresh = load_sequences(rows[:2], tmp_path)
    for a, b in zip(sequences[:2], fresh):
        assert a.features.shape == b.features.shape == (a.token_ids.numel() - 1, 3 * target.config.hidden_size)
        assert (a.features.float() - b.features.float()).abs().max() < 2e-2
        assert (a.logsumexp - b.logsumexp).abs().max() < 1e-3


def test_training_reads_datagen_rows_compressed_as_committed(dataset, tmp_path):
    """Datagen appends to plain JSONL (resumable); the repository keeps it gzip-compressed."""
    import gzip

    rows, _ = dataset
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    assert read_rows(path) == rows
    with pytest.raises(DsparkError, match="plain JSONL"):
        generate_dataset(None, [], path, DatagenConfig())


def test_sharded_datagen_writes_what_one_run_writes(target, tmp_path):
    """Shards 0/2 and 1/2 together: the same rows, greedy and sampled alike (seeds follow a prompt's
    place in the whole list). One request at a time, so batching cannot round a token differently."""
    prompts = load_prompts("gsm8k-train", 5)

    def run(name, shard):
        config = DatagenConfig(max_tokens=10, batch_size=1, temperatures=(0.0, 1.0), shard=shard)
        generate_dataset(target, prompts, tmp_path / name, config)
        return {row["id"]: row for row in read_rows(tmp_path / name)}

    whole = run("whole.jsonl", (0, 1))
    first, second = run("first.jsonl", (0, 2)), run("second.jsonl", (1, 2))
    assert sorted(first) == [p.prompt_id for p in prompts[0::2]]
    assert sorted(second) == [p.prompt_id for p in prompts[1::2]]
    assert {**first, **second} == whole
    assert {row["temperature"] for row in whole.values()} == {0.0, 1.0}


def test_datagen_refuses_a_bad_shard(tmp_path):
    from click.testing import CliRunner

    from dspark_trt.cli import main

    for shard in ("2/2", "a/b", "1"):
        result = CliRunner().invoke(main, ["datagen", "--output", str(tmp_path / "rows.jsonl"), "--shard", shard])
        assert result.exit_code == 2 and "--shard" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "rows.jsonl").exists()


def test_mask_block_sees_only_earlier_context_and_its_own_block(dataset):
    _, sequences = dataset
    batch = make_batch(sequences[:2], num_anchors=3, block_size=4, num_feature_layers=2, hidden_size=64,
                       generator=torch.Generator().manual_seed(0))
    C = batch.context_features.shape[1]
    for s in range(2):
        for a in range(3):
            anchor = int(batch.block_positions[s, a * 4])
            rows = batch.mask[s, a * 4 : (a + 1) * 4]
            assert rows[:, :anchor].all() and not rows[:, anchor:C].any()
            own = torch.zeros(12, dtype=torch.bool)
            own[a * 4 : (a + 1) * 4] = True
            assert torch.equal(rows[:, C:], own.expand(4, 12))


def test_a_block_ignores_later_context_and_other_blocks(target, dataset):
    """Changing features at or after the anchor, or another block's anchor, leaves a block's
    logits unchanged; changing an earlier feature changes them."""
    _, sequences = dataset
    drafter = make_drafter(target).eval()
    batch = make_batch(sequences[:1], num_anchors=2, block_size=4, num_feature_layers=2, hidden_size=64,
                       generator=torch.Generator().manual_seed(1))
    first_anchor, second_anchor = int(batch.block_positions[0, 0]), int(batch.block_positions[0, 4])
    with torch.no_grad():
        base, _ = draft_logits(drafter, batch)
        batch.context_features[0, first_anchor:] += 5.0
        batch.anchor_tokens[0, 1] = (batch.anchor_tokens[0, 1] + 1) % 2048
        changed, _ = draft_logits(drafter, batch)
        assert torch.allclose(base[0, 0], changed[0, 0], atol=1e-5)
        assert not torch.allclose(base[0, 1], changed[0, 1], atol=1e-3)
        batch.context_features[0, first_anchor - 1] += 5.0
        earlier, _ = draft_logits(drafter, batch)
        assert not torch.allclose(base[0, 0], earlier[0, 0], atol=1e-3)
    assert second_anchor > first_anchor


def test_context_norm_puts_each_layers_input_norm_on_the_context(target):
    """With `context_norm`, layer l's context keys/values are those of `attn_norm_l(context)` (each
    layer its own weights), which the training loss sees; without it, those of the context as is."""
    normed, plain = (make_drafter(target, num_layers=2, context_norm=flag).eval() for flag in (True, False))
    with torch.no_grad():
        for layer in normed.layers:  # two different per-channel scales, neither the identity
            layer.attn_norm.weight.uniform_(0.2, 3.0)
        plain.load_state_dict(normed.state_dict())
        context = torch.randn(2, 5, target.config.hidden_size)
        positions = torch.arange(5).expand(2, 5)
        cos, sin = (t.unsqueeze(-2) for t in rope_cos_sin(positions, inverse_frequencies(normed.config.head_dim,
                                                                                         normed.config.rope_theta)))
        per_layer = zip(normed.layers, normed.context_keys_values(context, positions),
                        plain.context_keys_values(context, positions))
        eps = normed.config.rms_norm_eps
        for layer, (keys, values), (plain_keys, plain_values) in per_layer:
            expected_keys, expected_values = layer.keys_values(rms_norm(context, layer.attn_norm.weight, eps), cos, sin)
            assert torch.allclose(keys, expected_keys, atol=1e-5) and torch.allclose(values, expected_values, atol=1e-5)
            unnormed_keys, unnormed_values = layer.keys_values(context, cos, sin)
            assert torch.allclose(plain_keys, unnormed_keys, atol=1e-5)
            assert torch.allclose(plain_values, unnormed_values, atol=1e-5)
            assert not torch.allclose(keys, plain_keys, atol=1e-2)


def test_loss_terms_on_a_hand_checked_case(target):
    """One block, gamma 2, a 4-token draft vocabulary: compare every term with hand arithmetic."""
    drafter = make_drafter(target, block_size=2, vocab_size=4)
    # Draft logits: slot 1 uniform over D; slot 2 all mass on token 1 (logit 30).
    draft = torch.tensor([[[[0.0, 0.0, 0.0, 0.0], [0.0, 30.0, 0.0, 0.0]]]])
    p_target = torch.tensor([[[[0.4, 0.2, 0.2, 0.0], [0.0, 0.5, 0.0, 0.0]]]])  # 0.2 and 0.5 outside D
    confidence_logits = torch.tensor([[[0.0, 2.0]]])
    labels = torch.tensor([[[0, 1]]])
    from dspark_trt.training import losses

    class FakeBatch:  # only what drafter_loss reads after draft_logits / target logits
        valid = torch.ones(1, 1, 2, dtype=torch.bool)
        target_logsumexp = torch.zeros(1, 1, 2)  # target logits log(p_target): exp(logits - 0) = p_target

    FakeBatch.labels = labels
    original_logits, original_target = losses.draft_logits, losses.target_logits_on_draft_vocab
    losses.draft_logits = lambda d, b: (draft, confidence_logits)
    losses.target_logits_on_draft_vocab = lambda d, b, n, e: p_target.log()
    try:
        terms = drafter_loss(drafter, FakeBatch(), None, 0.0)
        front_loaded = drafter_loss(drafter, FakeBatch(), None, 0.0, slot_decay=0.5)  # `--slot-decay 0.5`
        greedy = drafter_loss(drafter, FakeBatch(), None, 0.0, greedy_weight=2.0)  # `--greedy-weight 2`
        p_target[0, 0, 1, 1] = 0.4  # slot 2's best in-vocabulary token (0.4) may lose to the 0.6 outside it
        unsure = drafter_loss(drafter, FakeBatch(), None, 0.0, greedy_weight=2.0)
    finally:
        losses.draft_logits, losses.target_logits_on_draft_vocab = original_logits, original_target
    l1_1 = abs(0.25 - 0.4) + abs(0.25 - 0.2) + abs(0.25 - 0.2) + abs(0.25 - 0.0) + 0.2  # = 0.7
    l1_2 = abs(1.0 - 0.5) + 0.5  # draft puts 1.0 on token 1; target 0.5 there and 0.5 outside D
    assert math.isclose(terms.l1, l1_1 * 1.0 + l1_2 * math.exp(-1 / 4), rel_tol=1e-4)
    assert math.isclose(front_loaded.l1, l1_1 * 1.0 + l1_2 * math.exp(-1 / 0.5), rel_tol=1e-4)
    ce = (-math.log(0.25) + 0.0) / 2
    assert math.isclose(terms.ce, ce, abs_tol=1e-4)
    c1, c2 = 1 - 0.5 * l1_1, 1 - 0.5 * l1_2
    def bce(z, y):
        return -(y * math.log(1 / (1 + math.exp(-z))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-z))))
    assert math.isclose(terms.bce, (bce(0.0, c1) + bce(2.0, c2)) / 2, rel_tol=1e-4)
    assert terms.acceptance_per_position == pytest.approx([c1, c2], rel=1e-4)
    assert math.isclose(float(terms.total), 0.1 * terms.ce + 0.9 * terms.l1 + terms.bce, rel_tol=1e-5)
    # Greedy CE: slot 1's argmax is token 0 (0.4 >= the 0.2 outside D), drafted at 0.25; slot 2's is
    # token 1 (0.5 >= 0.5 outside), drafted at ~1. With 0.4 against 0.6 outside, slot 2 is skipped.
    assert math.isclose(greedy.greedy_ce, -math.log(0.25) / 2, abs_tol=1e-4)
    assert math.isclose(float(greedy.total), float(terms.total) + 2.0 * greedy.greedy_ce, rel_tol=1e-5)
    assert math.isclose(unsure.greedy_ce, -math.log(0.25), abs_tol=1e-4)
    assert slot_weights(3).tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])


ALL_KINDS = [("dspark", "markov"), ("dspark", "rnn"), ("dflash", "none"), ("eagle3", "none"), ("mtp1", "none")]
PREFIX = {"prefix_layer": True, "shuffled_vocab": True}  # DSpark with the prefix layer (`PrefixLayer`)


@pytest.mark.parametrize("kind, head", ALL_KINDS)
def test_short_training_run_lowers_the_loss(target, dataset, tmp_path, kind, head):
    rows, sequences = dataset
    config = DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, kind=kind, head=head,
                                      confidence=kind == "dspark", num_layers=1, markov_rank=16,
                                      block_size=1 if kind == "mtp1" else 4, draft_vocab_size=1024)
    vocab = build_draft_vocab(rows, 1024, target.config.vocab_size, set(target.eos_token_ids))
    fixed = sequences[:2]  # overfit two sequences: the loss must fall far
    train = TrainConfig(steps=60, sequences_per_batch=2, anchors_per_sequence=8, learning_rate=3e-3,
                        checkpoint_every=30, log_every=1)
    train_drafter(target, fixed, config, vocab, train, tmp_path / "run", progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    loaded = load_drafter(tmp_path / "run" / "drafter", target)
    assert loaded.config.kind == kind


def test_training_resumes_from_its_checkpoint(target, dataset, tmp_path):
    rows, sequences = dataset
    config = DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, num_layers=1, markov_rank=16,
                                      block_size=4, draft_vocab_size=1024)
    vocab = build_draft_vocab(rows, 1024, target.config.vocab_size, set())
    train_drafter(target, sequences, config, vocab, TrainConfig(steps=20, checkpoint_every=10, sequences_per_batch=2,
                                                                anchors_per_sequence=4), tmp_path / "a", progress=False,
                  stop_at=10)  # "interrupted" half way
    assert run_progress(tmp_path / "a")["step"] == 10
    train_drafter(target, sequences, config, vocab, TrainConfig(steps=20, checkpoint_every=10, sequences_per_batch=2,
                                                                anchors_per_sequence=4), tmp_path / "a", progress=False)
    straight = train_drafter(target, sequences, config, vocab,
                             TrainConfig(steps=20, checkpoint_every=10, sequences_per_batch=2, anchors_per_sequence=4),
                             tmp_path / "b", progress=False)
    resumed = load_drafter(tmp_path / "a" / "drafter", target)
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name
    # Extending the schedule resumes quietly; changing the recipe on resume is said out loud.
    with pytest.warns(UserWarning, match=r"slot_decay 4.0 -> 2.0"):
        train_drafter(target, sequences, config, vocab, TrainConfig(steps=22, checkpoint_every=10, sequences_per_batch=2,
                                                                    anchors_per_sequence=4, slot_decay=2.0),
                      tmp_path / "b", progress=False)


@pytest.mark.parametrize("kind, head, options", [(k, h, {}) for k, h in ALL_KINDS] + [("dspark", "markov", PREFIX)])
def test_greedy_speculative_decoding_with_a_drafter_equals_plain(tiny_llama, target, tmp_path, kind, head, options):
    drafter = make_drafter(target, kind=kind, head=head, **options)
    save_drafter(drafter, tmp_path / "drafter")
    prompts = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(target=tiny_llama).generate(prompts, params)
    speculative = LLM(target=tiny_llama, drafter=tmp_path / "drafter", policy="all").generate(prompts, params)
    for a, b in zip(plain, speculative):
        assert a.token_ids == b.token_ids
        assert b.metrics["num_draft_tokens"] > 0


def test_drafter_for_another_target_is_refused(tiny_factory, target, tmp_path):
    save_drafter(make_drafter(target), tmp_path / "drafter")
    other = load_target(tiny_factory("llama", seed=0, hidden_size=32, intermediate_size=64))
    with pytest.raises(ModelLoadError, match="hidden size 64"):
        load_drafter(tmp_path / "drafter", other)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    config["surprise"] = 1
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unknown drafter config keys"):
        load_drafter(tmp_path / "drafter", target)
    with pytest.raises(ModelLoadError, match="not found"):
        load_drafter(tmp_path / "nowhere", target)


def test_proposer_context_follows_the_target_cache(tiny_llama, target, tmp_path):
    """After every step the drafter's context covers exactly the positions in the target's cache."""
    save_drafter(make_drafter(target), tmp_path / "drafter")
    llm = LLM(target=tiny_llama, drafter=tmp_path / "drafter", max_batch_tokens=16, policy="all")  # chunked prefill
    proposer = llm.engine.proposer
    last_drafts = {}  # request id -> its latest full block
    propose = proposer.propose

    def recording_propose(requests):
        drafts = propose(requests)
        last_drafts.update((r.request_id, d) for r, d in zip(requests, drafts))
        return drafts

    proposer.propose = recording_propose
    request = llm.engine.add_request(llm.encode("A prompt long enough to need two prefill chunks here"),
                                     SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while not request.finished:
        llm.engine.step()
        if not request.finished:
            assert proposer.context_length(request.request_id) == request.cache.length
            if request.stats.num_steps:
                assert last_drafts[request.request_id].confidences.shape == (4,)
    assert proposer.context_length(request.request_id) == 0  # released with the request
    assert request.request_id not in proposer.pool.slot_of


@pytest.mark.parametrize("options", [{}, PREFIX])
def test_batched_drafting_equals_drafting_alone(target, tmp_path, options):
    """Requests of different context lengths drafted in one batch get the blocks (and confidences)
    they get when drafted one at a time: padding and masks leak nothing between requests."""
    from dspark_trt.runtime.dspark_proposer import DSparkProposer
    from dspark_trt.runtime.request import Request

    drafter = make_drafter(target, **options).eval()
    width = len(drafter.config.feature_layers) * target.config.hidden_size
    generator = torch.Generator().manual_seed(3)

    def make_requests():
        requests = []
        for i, length in enumerate((5, 70, 9)):  # 70 > 64: the pool grows
            request = Request(f"r{i}", list(range(3, 3 + length)), SamplingParams(temperature=0.0), torch.Generator())
            request.output_token_ids = [40 + i]
            requests.append(request)
        return requests

    features = [torch.randn(n, width, generator=generator) for n in (5, 70, 9)]
    together = DSparkProposer(drafter)
    batch = make_requests()
    for request, f in zip(batch, features):
        together.observe(request, f)
    drafts = together.propose(batch[::-1])[::-1]  # order of the call must not matter either
    for request, f, draft in zip(make_requests(), features, drafts):
        alone = DSparkProposer(drafter)
        alone.observe(request, f)
        alone_draft = alone.propose([request])[0]
        assert alone_draft.tokens == draft.tokens
        assert torch.allclose(alone_draft.confidences, draft.confidences, atol=1e-5)


def test_markov_rows_equal_the_heads_bias_and_do_not_depend_on_the_batch(target):
    """The proposer's table of Markov-head rows gives the head's own bias for warm, cold and
    out-of-vocabulary previous tokens, computes only rows it has not seen, and a lazily computed
    row has the same bits whichever other rows were computed with it."""
    from dspark_trt.runtime.dspark_proposer import MarkovRows

    drafter = make_drafter(target, vocab_size=512).eval()
    ids = torch.tensor([0, 3, 300, 511, 512, 300])  # warm (< 4), cold, the OOV row (= vocab size), a repeat
    with torch.inference_mode():
        table = MarkovRows(drafter, warm_rows=4)
        assert table.known == {0, 1, 2, 3}
        bias = table.ensure(ids.tolist())[ids]  # [6, 512]
        head, _ = drafter.sequential_bias(torch.zeros(len(ids), drafter.config.hidden_size), ids)
        assert bias.shape == (6, 512)
        assert torch.allclose(bias, head, atol=1e-5)
        assert table.known == {0, 1, 2, 3, 300, 511, 512}
        other = MarkovRows(drafter, warm_rows=4)
        assert torch.equal(other.ensure([300])[300], bias[2])  # alone vs with 511 and 512
    assert not torch.equal(bias[2], bias[3])  # rows differ: the lookup is by token


def test_draft_linear_inference_path_equals_the_training_path():
    """DraftLinear multiplies through numpy's BLAS at inference and through autograd in training;
    both compute x @ W^T, for 2-d and 3-d inputs, and gradients still reach the weight."""
    from dspark_trt.models.linear import DraftLinear

    torch.manual_seed(0)
    layer = DraftLinear(16, 24, bias=False)
    x = torch.randn(2, 5, 16)
    expected = x @ layer.weight.detach().t()
    with torch.inference_mode():
        assert torch.allclose(layer(x), expected, atol=1e-5)
        assert torch.allclose(layer(x[0]), expected[0], atol=1e-5)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


COPY = {"copy_bias": [[2.5, 1.0, 4.0]] * 4, "copy_confidence": [[0.5, -1.0, 2.0]] * 4,  # a row per slot (4)
        "confidence_top_prob": [0.7, -0.3, 1.2, 0.5], "vocab_size": 8192}


@pytest.mark.parametrize("head, options", [("markov", {}), ("rnn", {}), ("markov", PREFIX), ("markov", COPY),
                                           ("markov", {"prefix_layer": True, **COPY})])
def test_dspark_proposer_drafts_what_training_trains(target, dataset, head, options):
    """The proposer's block (every slot's distribution and confidence) equals the training
    forward's at the same anchor, teacher-forced on the tokens the proposer drew: context
    positions, RoPE, masks and the sequential head's state (and the prefix layer's, slot by slot
    against all slots at once) agree between the two paths, so what the loss optimises is what
    decoding gets. With a copy bias, the proposer's lookup (a `CopyIndex` grown token by token,
    the block's own draft tokens included) must add what the training path's batch lookup adds,
    and the confidence offsets (copy candidates, the draft's top probability) must agree too."""
    from dspark_trt.runtime.dspark_proposer import DSparkProposer
    from dspark_trt.runtime.request import Request
    from dspark_trt.training.data import Sequence
    from dspark_trt.training.losses import copy_candidates_of

    _, sequences = dataset
    seq = next(s for s in sequences if s.token_ids.numel() >= s.prompt_length + 12)
    drafter = make_drafter(target, head=head, **options).eval()
    gamma, width = drafter.config.block_size, len(FEATURE_LAYERS) * target.config.hidden_size
    p = seq.prompt_length + 3  # the pending token's position: the block's anchor
    if "copy_bias" in options:  # an anchor the context continued before with a draft-vocabulary token: slot 1 copies
        from dspark_trt.models.copy_bias import copy_candidates

        ids = seq.token_ids.tolist()
        in_vocab = [q for q in range(p, len(ids) - gamma - 1) if copy_candidates(ids, [q], 1)[0][0] >= 0]
        p = next(q for q in in_vocab if drafter.to_draft[copy_candidates(ids, [q], 1)[0][0]] < 8192)
    request = Request("r", seq.token_ids[: seq.prompt_length].tolist(), SamplingParams(temperature=1.0),
                      torch.Generator().manual_seed(0))
    request.output_token_ids = seq.token_ids[seq.prompt_length : p + 1].tolist()
    proposer = DSparkProposer(drafter)
    proposer.observe(request, seq.features[:p, :width].float())
    draft = proposer.propose([request])[0]

    tokens = seq.token_ids.clone()
    tokens[p + 1 : p + 1 + gamma] = torch.tensor(draft.tokens)  # teacher-force the drawn block
    forced = Sequence(seq.row_id, tokens, seq.prompt_length, seq.features, seq.logsumexp)
    batch = make_batch([forced], tokens.numel(), gamma, len(FEATURE_LAYERS), target.config.hidden_size,
                       torch.Generator())  # more anchors than candidates: every position is one, in order
    with torch.no_grad():
        logits, confidence = draft_logits(drafter, batch)
    a = p - (seq.prompt_length - 1)
    assert batch.anchor_tokens[0, a] == tokens[p] and batch.valid[0, a].all()
    trained = torch.softmax(logits[0, a], dim=-1)  # [gamma, V_d]
    drafted = draft.probs[:, drafter.draft_vocab]  # [gamma, V_d]
    assert torch.allclose(drafted, trained, atol=1e-5)
    assert torch.allclose(draft.confidences, torch.sigmoid(confidence[0, a]), atol=1e-5)
    if "copy_bias" in options:  # the bias was there to be matched: some slot of the block has a candidate
        assert (copy_candidates_of(drafter, batch, 3)[0, a] >= 0).any()


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("head, options", [("markov", COPY), ("rnn", COPY), ("markov", PREFIX)])
def test_the_slot_loop_in_c_drafts_what_its_pytorch_ops_draft(target, monkeypatch, head, options):
    """Each slot's Markov row, copy bias, argmax and top probability as one C call
    (`cpu_kernels.draft_slot`) against the PyTorch ops it replaces (our kernels turned off): the
    same tokens and distributions bit for bit, greedy and sampling requests in one batch, and
    confidences within fp32 rounding (the top probability's PyTorch definition rounds apart)."""
    from dspark_trt.runtime.dspark_proposer import DSparkProposer
    from dspark_trt.runtime.request import Request

    drafter = make_drafter(target, head=head, **options).eval()
    width = len(drafter.config.feature_layers) * target.config.hidden_size
    features = [torch.randn(n, width, generator=torch.Generator().manual_seed(n)) for n in (12, 30, 7)]

    def draft(kernels: bool):
        monkeypatch.setattr(cpu_kernels, "available", lambda: kernels)
        proposer, requests = DSparkProposer(drafter), []
        for i, (f, temperature) in enumerate(zip(features, (0.0, 1.0, 0.0))):
            prompt = [(7 * j + i) % 200 + 3 for j in range(len(f))]  # repeats: the copy bias finds candidates
            request = Request(f"r{i}", prompt, SamplingParams(temperature=temperature), torch.Generator().manual_seed(i))
            request.output_token_ids = [prompt[3]]
            proposer.observe(request, f)
            requests.append(request)
        return proposer.propose(requests)

    in_c, in_torch = draft(True), draft(False)
    monkeypatch.undo()
    for a, b in zip(in_c, in_torch):
        assert a.tokens == b.tokens
        assert (a.probs is None) == (b.probs is None) and (a.probs is None or torch.equal(a.probs, b.probs))
        torch.testing.assert_close(a.confidences, b.confidences, rtol=1e-5, atol=1e-5)
    assert in_c[1].probs is not None and in_c[0].probs is None  # both kinds of request were drafted


def test_eagle_proposer_matches_the_teacher_forced_unroll(target, dataset, tmp_path):
    """The cached, incremental drafting at inference equals training-time test on the same tokens:
    the first draft token's logits at the pending position agree."""
    _, sequences = dataset
    drafter = make_drafter(target, kind="eagle3").eval()
    from dspark_trt.runtime.eagle_proposer import EagleProposer
    from dspark_trt.runtime.request import Request
    from dspark_trt.runtime.sampling import SamplingParams as SP

    seq = sequences[0]
    p = seq.prompt_length + 3  # pending position
    request = Request("r", seq.token_ids[: seq.prompt_length].tolist(), SP(temperature=0.0), torch.Generator())
    request.output_token_ids = seq.token_ids[seq.prompt_length : p + 1].tolist()
    proposer = EagleProposer(drafter)
    proposer.observe(request, seq.features[:p, : 2 * 64])
    with torch.no_grad():
        fused = drafter.fuse_features(seq.features[None, :, : 2 * 64].float())
        fused = torch.cat([fused, torch.zeros_like(fused[:, :1])], dim=1)
        unrolled = drafter.training_time_test(seq.token_ids[None], fused, torch.tensor([[p]]), 1)
        incremental = drafter.logits(proposer.states["r"].last_output)
    assert torch.allclose(unrolled[0, 0, 0], incremental[0, 0], atol=1e-4)


def test_eagle_proposer_drafts_what_training_time_test_trains(target, dataset):
    """Every step of an EAGLE-3-style block drawn at T=1 (its chain of own outputs, RoPE
    positions and the context it may see) has the distribution that training-time test computes
    when teacher-forced on the drawn tokens, for two anchors of one batch at once (the training
    path shares a sequence's context keys between its anchors; neither may see the other's chain)."""
    from dspark_trt.runtime.eagle_proposer import EagleProposer
    from dspark_trt.runtime.request import Request
    from dspark_trt.runtime.sampling import SamplingParams as SP

    _, sequences = dataset
    drafter = make_drafter(target, kind="eagle3").eval()
    gamma, width = drafter.config.block_size, len(FEATURE_LAYERS) * target.config.hidden_size
    seq = next(s for s in sequences if s.token_ids.numel() >= s.prompt_length + 2 * gamma + 3)
    tokens = seq.token_ids.clone()
    anchors = [seq.prompt_length + 1, seq.prompt_length + gamma + 2]  # the second block starts after the first
    drafts = []
    for p in anchors:  # draft each block on the tokens so far (the first block's drawn tokens included)
        request = Request("r", tokens[: seq.prompt_length].tolist(), SP(temperature=1.0), torch.Generator().manual_seed(p))
        request.output_token_ids = tokens[seq.prompt_length : p + 1].tolist()
        proposer = EagleProposer(drafter)
        proposer.observe(request, seq.features[:p, :width].float())
        drafts.append(proposer.propose([request])[0])
        tokens[p + 1 : p + gamma] = torch.tensor(drafts[-1].tokens[: gamma - 1])  # teacher-force the drawn block
    with torch.no_grad():
        fused = drafter.fuse_features(seq.features[None, :, :width].float())
        fused = torch.cat([fused, torch.zeros_like(fused[:, :1])], dim=1)
        unrolled = drafter.training_time_test(tokens[None], fused, torch.tensor([anchors]), gamma)  # [1, 2, G, V_d]
    trained = torch.softmax(unrolled[0], dim=-1)
    for draft, steps in zip(drafts, trained):
        assert torch.allclose(draft.probs[:, drafter.draft_vocab], steps, atol=1e-5)


def test_cli_generate_with_a_drafter(tiny_llama, target, tmp_path):
    import subprocess
    import sys

    save_drafter(make_drafter(target), tmp_path / "drafter")
    result = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", "--prompt", "Hello", "--target",
                             str(tiny_llama), "--drafter", str(tmp_path / "drafter"), "--max-tokens", "12", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["num_draft_tokens"] > 0 and metrics["num_steps"] >= 1


def test_cli_eval_writes_the_documented_json(tiny_llama, target, tmp_path):
    """`dspark-trt eval` on a JSONL file: the JSON holds what issue 3 names (tau, conditional
    per-position acceptance, both speeds, identical greedy text); `--policy fixed:2` verifies at
    most two tokens a step; a bad policy is a one-line error, not a traceback."""
    import subprocess
    import sys

    save_drafter(make_drafter(target), tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello there", "Count to five", "Why?")))

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "dspark_trt.cli", "eval", "--target", str(tiny_llama),
                               "--drafter", str(tmp_path / "drafter"), "--dataset", str(prompts), "--num-prompts", "2",
                               "--max-tokens", "10", *extra], capture_output=True, text=True, timeout=300)

    result = run("--output", str(tmp_path / "eval.json"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["dataset"] == str(prompts) and report["policy"] == "all"
    assert report["drafter"] == str(tmp_path / "drafter") and report["temperature"] == 0.0
    assert report["accept_length"] == 1 + report["num_accepted_tokens"] / report["num_steps"]
    assert len(report["per_position_acceptance"]) == 4  # the tiny drafter's block
    assert all(0.0 <= a <= 1.0 for a in report["per_position_acceptance"])
    assert report["speculative_tok_s"] > 0 and report["plain_tok_s"] > 0
    assert report["identical_outputs"] == 2  # greedy speculative text is the plain text

    fixed = run("--policy", "fixed:2", "--no-plain")
    assert fixed.returncode == 0, fixed.stderr
    fixed_report = json.loads(fixed.stdout)
    assert 0 < fixed_report["num_draft_tokens"] <= 2 * fixed_report["num_steps"]
    assert "plain_tok_s" not in fixed_report

    bad = run("--policy", "fixed:-1", "--no-plain")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "fixed:K" in bad.stderr


@pytest.mark.parametrize("command", ["train", "datagen", "eval"])
@pytest.mark.parametrize("device, message", [("cuda:99", "GPU"), ("tpu", "not a device"), ("meta", "only cpu and cuda")])
def test_commands_refuse_a_device_they_cannot_use(tmp_path, command, device, message):
    from click.testing import CliRunner

    from dspark_trt.cli import main

    args = {"train": ["--data", str(tmp_path / "rows.jsonl"), "--features-dir", str(tmp_path / "features"),
                      "--output", str(tmp_path / "run")],
            "datagen": ["--output", str(tmp_path / "run" / "rows.jsonl")],
            "eval": ["--output", str(tmp_path / "run" / "eval.json")]}[command]
    result = CliRunner().invoke(main, [command, *args, "--device", device])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert "--device" in result.output
    assert not (tmp_path / "run").exists()  # refused before anything was loaded or written


def test_prefix_layer_is_dspark_only(target):
    """The prefix layer corrects a DSpark block's slots; any other kind refuses it, naming the field
    (the export of a DSpark drafter with one: tests/test_plugin.py and tests/test_builder.py)."""
    with pytest.raises(ModelLoadError, match="prefix_layer"):
        DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, kind="dflash", head="none", prefix_layer=True)
