"""`SequentialDraft`: DSpark's sequential head over one block, as one operator with four faces.

Semantics (the same in every face). Per row b of a batch, left to right over the block k = 1..G:

    bias_k  = W1[x_{k-1}] @ W2                          (head = MARKOV)
            = s_k @ W2,  s_k = GRU([W1[x_{k-1}]; h_k], s_{k-1}),  s_0 = 0   (head = RNN)
            = 0                                           (head = NONE: DFlash)
    l_k     = U_k + bias_k                                logits over the draft vocabulary
    p_k     = softmax(l_k / T_b)   (T_b = 1 when T_b == 0, i.e. greedy)
    x_k     = argmax l_k                      if T_b == 0
            = first i with cdf_k[i] > u_{b,k} * cdf_k[-1]   otherwise (inverse CDF, as runtime/sampling.sample)
    c_k     = sigmoid((w . [h_k; W1[x_{k-1}]] + b0 + o_k) / tau_k)   (ones when there is no confidence head)

`x_0` is the anchor's draft-vocabulary id (the out-of-vocabulary id V maps to W1's extra row).

The copy bias and the calibrated confidence offsets (`models/copy_bias.py`, `DSparkDrafter.confidence_offsets`;
what `runtime/dspark_proposer.py` adds), each off unless its attribute is set:

    (copy_ngram = N > 0) before slot k draws, c_{k,n} (n = 1..N) is the draft id of the token
            that followed the last earlier occurrence of the last n tokens of history + x_1..x_{k-1}
            (`copy_bias.sequence_copy_candidates`: a match among the drafted tokens is the newest;
            none when there is no match or the follower is outside the draft vocabulary), and
            l_k += alpha[k, n] on c_{k,n}, n by n, after bias_k
    o_k     = sum_n beta[k, n] [c_{k,n} exists]              (copy_confidence = 1)
            + w_k logit(max softmax(l_k))                    (top_prob = 1; `top_probability_logit`)

The lookup reads the request's tokens: `history` `[B, H]` target ids, each row's committed
tokens (the anchor last) right-aligned with -1 to their left (`copy_bias.right_aligned_history`);
`draft_vocab` `[V]` (draft id -> target id, for the drawn tokens) and `to_draft` `[V_target]`
(target id -> draft id, V outside) map between the two vocabularies. Every copy input is a
`[1]`/`[1, 1]` placeholder when its attribute is off.
Inputs: logits U `[B, G, V]`, hidden h `[B, G, D]`, anchor_ids `[B]` int64, w1 `[V + 1, R]`,
w2 `[R, V]`, GRU weights (`w_ih [3R, R + D]`, `w_hh [3R, R]`, `b_ih [3R]`, `b_hh [3R]`; any
`[1]`-shaped placeholder when head != RNN), confidence weight `[D + R]` and bias `[1]`,
inverse STS temperatures `[G]`, sampling temperatures `[B]` and uniforms `[B, G]` in [0, 1), then
`history`, `draft_vocab`, `to_draft`, `copy_alpha [G, N]`, `copy_beta [G, N]`, `top_prob_w [G]` (above);
attributes `head`, `has_confidence`, `copy_ngram`, `copy_confidence`, `top_prob`.
Outputs: draft ids `[B, G]` int64, probability of each drafted token `[B, G]`, confidences
`[B, G]`, and the full draft distributions `[B, G, V]` (what exact rejection sampling needs).

Faces:
1. `reference(...)`: plain torch, a static loop over the block; every op in it is a standard
   ONNX op, so tracing it gives the *unrolled* all-standard-ops form that ONNX Runtime runs
   on CPU (our CPU implementation of the op).
2. `torch.ops.dspark.sequential_draft`: a `torch.library` custom op wrapping the reference, so
   the exporter sees one node; `onnx_translation` maps it to one ONNX node `SequentialDraft`
   in domain `dspark` with `plugin_namespace`/`plugin_version` attributes, which TensorRT's
   ONNX parser resolves through its plugin registry.
3. the TensorRT plugin (`tensorrt.plugin`, TensorRT >= 10.7): `sequential_draft_trt.py`'s
   `register_tensorrt_plugin()`, kept apart so that this module imports without TensorRT.

It does not know about drafters: the caller passes weights (see `builder/export_drafter.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dspark_trt.models.copy_bias import (
    add_copy_bias,
    confidence_offset,
    draft_copy_candidates,
    sequence_copy_candidates,
)
from dspark_trt.models.drafter import top_probability_logit

HEAD_NONE, HEAD_MARKOV, HEAD_RNN = 0, 1, 2
HEAD_CODES = {"none": HEAD_NONE, "markov": HEAD_MARKOV, "rnn": HEAD_RNN}
ONNX_DOMAIN = "dspark"
ONNX_OP_TYPE = "SequentialDraft"
PLUGIN_NAMESPACE = "dspark"
PLUGIN_VERSION = "1"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{ONNX_OP_TYPE}"  # tensorrt.plugin id: "{namespace}::{name}"
INPUT_NAMES = ("logits", "hidden", "anchor_ids", "w1", "w2", "gru_w_ih", "gru_w_hh", "gru_b_ih", "gru_b_hh",
               "conf_w", "conf_b", "conf_inv_temps", "temperatures", "uniforms",
               "history", "draft_vocab", "to_draft", "copy_alpha", "copy_beta", "top_prob_w")
ATTRIBUTES = ("head", "has_confidence", "copy_ngram", "copy_confidence", "top_prob")
OUTPUT_NAMES = ("draft_ids", "token_probs", "confidences", "distributions")


def _gru(x: torch.Tensor, state: torch.Tensor, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """torch.nn.GRUCell written out (gate order r, z, n) so that it traces to MatMul/Sigmoid/Tanh."""
    gi = x @ w_ih.t() + b_ih  # [B, 3R]
    gh = state @ w_hh.t() + b_hh
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * state


class HeadWeights(NamedTuple):
    """What the operator reads besides the block: the head's weights and how it is configured."""

    w1: torch.Tensor  # [V + 1, R]
    w2: torch.Tensor  # [R, V]
    gru: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w_ih, w_hh, b_ih, b_hh
    conf_w: torch.Tensor  # [D + R]
    conf_b: torch.Tensor  # [1]
    conf_inv_temps: torch.Tensor  # [G]
    head: int
    has_confidence: int
    # the copy bias and confidence offsets (module docstring); placeholders while their attribute is 0
    draft_vocab: torch.Tensor | None = None  # [V] draft id -> target id
    to_draft: torch.Tensor | None = None  # [V_target] target id -> draft id (V outside)
    copy_alpha: torch.Tensor | None = None  # [G, N]
    copy_beta: torch.Tensor | None = None  # [G, N]
    top_prob_w: torch.Tensor | None = None  # [G]
    copy_ngram: int = 0
    copy_confidence: int = 0
    top_prob: int = 0


class SlotDraw(NamedTuple):
    """One slot k of a block for every row: what `draft_slot` returns."""

    ids: torch.Tensor  # [B] draft-vocabulary ids x_k
    token_probs: torch.Tensor  # [B] p_k(x_k)
    confidences: torch.Tensor  # [B] c_k
    distributions: torch.Tensor  # [B, V] p_k
    state: torch.Tensor  # [B, R] the RNN state s_k (unchanged for other heads)


def draft_slot(logits_k, hidden_k, previous, state, k: int, weights: HeadWeights, temperatures, uniforms_k,
               sequence=None) -> SlotDraw:
    """Slot k of the operator (module docstring) for every row: logits U_k `[B, V]`, hidden h_k
    `[B, D]`, x_{k-1} `[B]` draft ids, the RNN state s_{k-1} `[B, R]`, uniforms u_k `[B]`, and
    with a copy bias the target ids up to x_{k-1} `[B, H + k]` (history, then x_1..x_{k-1},
    right-aligned). `draft_block` loops over it."""
    w, vocab = weights, logits_k.shape[-1]
    greedy = temperatures <= 0  # [B]
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]  # [B, 1]
    # [B, R]; a DFlash drafter (no head, no confidence) has no W1, only a placeholder
    prev_embedding = w.w1[previous] if w.head != HEAD_NONE or w.has_confidence else None
    if w.head == HEAD_MARKOV:
        logits_k = logits_k + prev_embedding @ w.w2
    elif w.head == HEAD_RNN:
        state = _gru(torch.cat([prev_embedding, hidden_k], dim=-1), state, *w.gru)
        logits_k = logits_k + state @ w.w2
    candidates = None
    if w.copy_ngram:  # known before x_k is drawn: a function of the tokens before slot k only
        candidates = draft_copy_candidates(sequence_copy_candidates(sequence, w.copy_ngram), w.to_draft, vocab)
        logits_k = add_copy_bias(logits_k, w.copy_alpha[k], candidates)
    p_k = torch.softmax(logits_k / scale, dim=-1)  # [B, V]
    cdf = p_k.cumsum(-1)
    threshold = uniforms_k[:, None] * cdf[:, -1:]
    sampled = (cdf <= threshold).sum(-1).clamp(max=vocab - 1)  # searchsorted(right=True), as runtime `sample`
    choice = torch.where(greedy, logits_k.argmax(-1), sampled)  # [B]
    if w.has_confidence:
        z = torch.cat([hidden_k, prev_embedding], dim=-1) @ w.conf_w + w.conf_b
        # the calibrated offsets, in `DSparkDrafter.confidence_offsets`' order
        if w.copy_ngram and w.copy_confidence:
            z = z + confidence_offset(w.copy_beta[k], candidates)
        if w.top_prob:  # the logits with every bias added, before the sampling temperature
            z = z + w.top_prob_w[k] * top_probability_logit(logits_k)
        confidence = torch.sigmoid(z * w.conf_inv_temps[k])
    else:
        confidence = torch.ones_like(temperatures)
    return SlotDraw(choice, p_k.gather(-1, choice[:, None])[:, 0], confidence, p_k, state)


def stack_slots(slots: list[SlotDraw]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot draws -> the operator's outputs (draft_ids, token_probs, confidences, distributions)."""
    return tuple(torch.stack([getattr(s, name) for s in slots], 1)
                 for name in ("ids", "token_probs", "confidences", "distributions"))


def draft_block(logits, hidden, anchor_ids, weights: HeadWeights, temperatures, uniforms, correct_logits=None,
                history=None):
    """The operator's slot loop: logits `[B, G, V]`, hidden `[B, G, D]`, anchor draft ids `[B]`,
    uniforms `[B, G]`, with a copy bias the right-aligned `history` `[B, H]` -> (draft_ids,
    token_probs, confidences, distributions). `correct_logits(k, previous, logits_k)`, when given,
    replaces U_k before slot k draws, knowing x_{k-1} (`previous`, draft ids): the exported
    prefix-layer drafter's hook (builder/export_drafter.py)."""
    previous = anchor_ids  # [B] draft-vocabulary ids (V = out of vocabulary)
    state = logits.new_zeros(logits.shape[0], weights.w1.shape[1])  # RNN state s_0
    sequence = history if weights.copy_ngram else None  # target ids up to x_{k-1}, right-aligned
    slots = []
    for k in range(logits.shape[1]):  # a static loop: the block size is fixed per drafter
        logits_k = logits[:, k] if correct_logits is None else correct_logits(k, previous, logits[:, k])
        slots.append(draft_slot(logits_k, hidden[:, k], previous, state, k, weights, temperatures, uniforms[:, k],
                                sequence))
        previous, state = slots[-1].ids, slots[-1].state
        if sequence is not None and k + 1 < logits.shape[1]:  # later slots may copy after x_k
            sequence = torch.cat([sequence, weights.draft_vocab[previous][:, None]], dim=1)
    return stack_slots(slots)


def reference(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
              conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta, top_prob_w,
              head: int, has_confidence: int, copy_ngram: int = 0, copy_confidence: int = 0, top_prob: int = 0):
    """The operator's semantics (module docstring); returns (draft_ids, token_probs, confidences, distributions)."""
    weights = HeadWeights(w1, w2, (gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh), conf_w, conf_b, conf_inv_temps, head,
                          has_confidence, draft_vocab, to_draft, copy_alpha, copy_beta, top_prob_w, copy_ngram,
                          copy_confidence, top_prob)
    return draft_block(logits, hidden, anchor_ids, weights, temperatures, uniforms, history=history)


# ---- face 2: the torch custom op and its ONNX node ------------------------------------------------


@torch.library.custom_op("dspark::sequential_draft", mutates_args=())
def sequential_draft(logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor, w1: torch.Tensor,
                     w2: torch.Tensor, gru_w_ih: torch.Tensor, gru_w_hh: torch.Tensor, gru_b_ih: torch.Tensor,
                     gru_b_hh: torch.Tensor, conf_w: torch.Tensor, conf_b: torch.Tensor,
                     conf_inv_temps: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                     history: torch.Tensor, draft_vocab: torch.Tensor, to_draft: torch.Tensor, copy_alpha: torch.Tensor,
                     copy_beta: torch.Tensor, top_prob_w: torch.Tensor, head: int, has_confidence: int,
                     copy_ngram: int, copy_confidence: int,
                     top_prob: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = reference(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                     conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                     top_prob_w, head, has_confidence, copy_ngram, copy_confidence, top_prob)
    return tuple(t.contiguous() for t in outs)


@sequential_draft.register_fake
def _(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b, conf_inv_temps,
      temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta, top_prob_w, head, has_confidence,
      copy_ngram, copy_confidence, top_prob):
    batch, block, vocab = logits.shape
    return (logits.new_empty(batch, block, dtype=torch.int64), logits.new_empty(batch, block),
            logits.new_empty(batch, block), logits.new_empty(batch, block, vocab))


def onnx_schema():
    """The `dspark::SequentialDraft` ONNX schema, registered with onnx once (so that the checker
    and shape inference know the node's inputs, outputs and attributes)."""
    import onnx
    from onnx.defs import OpSchema

    try:
        return onnx.defs.get_schema(ONNX_OP_TYPE, 1, ONNX_DOMAIN)
    except onnx.defs.SchemaError:
        pass
    types = {"anchor_ids": "I", "draft_ids": "I", "history": "I", "draft_vocab": "I", "to_draft": "I"}
    attr = OpSchema.AttrType
    schema = OpSchema(
        ONNX_OP_TYPE, ONNX_DOMAIN, 1,
        doc="DSpark sequential head over one block (dspark_trt/plugins/sequential_draft.py).",
        inputs=[OpSchema.FormalParameter(n, types.get(n, "T")) for n in INPUT_NAMES],
        outputs=[OpSchema.FormalParameter(n, types.get(n, "T")) for n in OUTPUT_NAMES],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "floating point"),
                          ("I", ["tensor(int64)"], "token ids")],
        attributes=[OpSchema.Attribute("head", attr.INT, "0 none, 1 markov, 2 rnn"),
                    OpSchema.Attribute("has_confidence", attr.INT, "1 when the drafter has a confidence head"),
                    OpSchema.Attribute("copy_ngram", attr.INT, "longest n-gram of the copy bias, 0 without one"),
                    OpSchema.Attribute("copy_confidence", attr.INT, "1: confidence offset per copy candidate"),
                    OpSchema.Attribute("top_prob", attr.INT, "1: confidence offset from the top probability"),
                    OpSchema.Attribute("plugin_namespace", attr.STRING, "TensorRT plugin namespace"),
                    OpSchema.Attribute("plugin_version", attr.STRING, "TensorRT plugin version")],
    )
    onnx.defs.register_schema(schema)
    return schema


def onnx_translation():
    """{torch op: onnxscript function} for `torch.onnx.export(custom_translation_table=...)`:
    one `dspark::SequentialDraft` node with the attributes TensorRT's ONNX parser reads."""
    import onnxscript

    node = onnxscript.values.Op(onnxscript.values.Opset(ONNX_DOMAIN, 1), ONNX_OP_TYPE, onnx_schema())

    def translate(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                  conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                  top_prob_w, head: int, has_confidence: int, copy_ngram: int, copy_confidence: int, top_prob: int):
        return node(logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                    conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                    top_prob_w, head=head, has_confidence=has_confidence, copy_ngram=copy_ngram,
                    copy_confidence=copy_confidence, top_prob=top_prob, plugin_namespace=PLUGIN_NAMESPACE,
                    plugin_version=PLUGIN_VERSION)

    return {torch.ops.dspark.sequential_draft.default: translate}


def register_torchscript_symbolic(opset: int) -> None:
    """The same ONNX node for the legacy TorchScript exporter (`torch.onnx.export(dynamo=False)`)."""
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx.symbolic_helper import parse_args

    @parse_args(*("v" * len(INPUT_NAMES)), *("i" * len(ATTRIBUTES)))
    def symbolic(g, logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                 conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                 top_prob_w, head, has_confidence, copy_ngram, copy_confidence, top_prob):
        tensors = (logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,
                   conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,
                   top_prob_w)
        outs = g.op(f"{ONNX_DOMAIN}::{ONNX_OP_TYPE}", *tensors, head_i=head, has_confidence_i=has_confidence,
                    copy_ngram_i=copy_ngram, copy_confidence_i=copy_confidence, top_prob_i=top_prob,
                    plugin_namespace_s=PLUGIN_NAMESPACE, plugin_version_s=PLUGIN_VERSION, outputs=len(OUTPUT_NAMES))
        # output types for the exporter's shape inference: ids/probs/confidences like uniforms [B, G]
        outs[0].setType(uniforms.type().with_dtype(torch.int64))
        outs[1].setType(uniforms.type())
        outs[2].setType(uniforms.type())
        outs[3].setType(logits.type())
        return outs

    register_custom_op_symbolic("dspark::sequential_draft", symbolic, opset)
