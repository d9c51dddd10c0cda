"""The drafter training loss (DESIGN.md section 1):

    loss = 0.1 * CE + 0.9 * sum_k w_k * ||p_draft_k - p_target_k||_1 + 1.0 * BCE(c_k, c*_k)
    w_k = exp(-(k-1)/4) (the 4: `--slot-decay`),   c*_k = 1 - 0.5 * ||p_draft_k - p_target_k||_1

`c*_k` is the exact probability that rejection sampling accepts draft slot k given its prefix.
The draft distribution lives on the draft vocabulary D; the target's on the full vocabulary,
so the L1 distance is `sum_{v in D} |p_d(v) - p_t(v)| + (1 - sum_{v in D} p_t(v))`, with
`p_t(v) = exp(logit_v - logsumexp)` from the cached target hidden state and normaliser.
DFlash baselines train on CE alone (their paper's recipe); drafters without a confidence head
(EAGLE-3-style, MTP-1) drop the BCE term; every term is still reported.

`--greedy-weight W` adds `W * CE(draft, argmax p_target)`: at T=0 a slot is accepted exactly when
the draft's argmax is the target's, which the L1 term only reaches through the whole
distribution; this term spends capacity on that one token. It is skipped on slots where the
draft vocabulary's best token may not be the target's best overall (its probability below the
mass outside the vocabulary), so it never trains toward a token the target would not pick.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_trt.models.copy_bias import batch_copy_candidates, dense_copy_bias
from dspark_trt.models.drafter import BlockVisibility, DrafterBase, rope_tables, top_probability_logit
from dspark_trt.models.eagle import EagleDrafter
from dspark_trt.models.target import rms_norm
from dspark_trt.training.data import Batch

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0
SLOT_DECAY = 4.0  # w_k = exp(-(k-1)/SLOT_DECAY)


@dataclass
class LossTerms:
    total: torch.Tensor
    ce: float
    l1: float
    bce: float
    greedy_ce: float  # CE to the target's argmax (weighted by `greedy_weight`; reported whatever its weight)
    acceptance_per_position: list[float]  # mean c*_k per slot: teacher-forced acceptance rate


def slot_weights(block_size: int, decay: float = SLOT_DECAY, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/decay), k = 1..gamma: a smaller decay puts more of the loss on early slots."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def draft_logits(drafter, batch: Batch,
                 copy_candidates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced draft logits `[S, A, gamma, V_d]` and confidence logits `[S, A, gamma]` (or None).
    `copy_candidates`: the batch's `copy_candidates_of`, when the caller has them already (with a
    copy bias they are looked up here otherwise)."""
    S, A, G = batch.labels.shape
    if isinstance(drafter, EagleDrafter):  # autoregressive: training-time test over gamma steps
        fused = drafter.fuse_features(batch.context_features)  # [S, C, d]
        fused = torch.cat([fused, torch.zeros_like(fused[:, :1])], dim=1)  # positions 0..C
        return drafter.training_time_test(batch.tokens, fused, batch.block_positions[:, ::G], G), None
    context = drafter.fuse_features(batch.context_features)  # [S, C, d]
    C = context.shape[1]
    context_kv = drafter.context_keys_values(context, torch.arange(C, device=context.device).expand(S, C))
    block = drafter.block_inputs(batch.anchor_tokens, (S, A)).reshape(S, A * G, -1)
    visibility = BlockVisibility(batch.block_positions[:, ::G], G)  # each block's anchor position
    hidden = drafter.backbone(block, batch.block_positions, context_kv, visibility)  # [S, A * G, d]
    corrected = hidden
    if drafter.prefix is not None:  # slot k reads the true tokens before it: those it is judged after
        previous = drafter.embed[batch.previous_tokens].reshape(S, A * G, -1)
        cos, sin = rope_tables(batch.block_positions, drafter.config.head_dim, drafter.config.rope_theta)
        corrected = hidden + drafter.prefix.teacher_forced(hidden, previous, cos, sin, visibility.anchor_positions, G)
    logits = drafter.backbone_logits(corrected.view(S, A, G, -1))
    bias, confidence = drafter.teacher_forced_heads(hidden.view(S, A, G, -1), drafter.to_draft[batch.previous_tokens])
    logits = logits if bias is None else logits + bias
    config, candidates = drafter.config, None
    if config.copy_bias:
        candidates = copy_candidates if copy_candidates is not None else \
            copy_candidates_of(drafter, batch, config.copy_ngram)
        alpha = torch.tensor(config.copy_bias, dtype=logits.dtype, device=logits.device)
        logits = logits + dense_copy_bias(alpha, candidates, logits.shape[-1])
    if confidence is not None:
        top = top_probability_logit(logits) if config.confidence_top_prob else None
        confidence = drafter.confidence_offsets(confidence, top, candidates)
    return logits, confidence


def copy_candidates_of(drafter: DrafterBase, batch: Batch, max_ngram: int) -> torch.Tensor:
    """Teacher-forced copy candidates `[S, A, gamma, max_ngram]` (draft ids) of the batch's slots, on its device."""
    S, A, G = batch.labels.shape
    previous_positions = batch.block_positions.view(S, A, G).cpu()  # slot k's previous token sits at p + k - 1
    found = batch_copy_candidates(batch.tokens.cpu(), previous_positions, drafter.to_draft.cpu(), max_ngram)
    return found.to(batch.tokens.device)


def target_probs_on_draft_vocab(drafter: DrafterBase, batch: Batch, target_final_norm: torch.Tensor,
                                eps: float) -> torch.Tensor:
    """p_target restricted to the draft vocabulary, `[S, A, gamma, V_d]` (rows sum to <= 1)."""
    return target_probs(target_logits_on_draft_vocab(drafter, batch, target_final_norm, eps), batch.target_logsumexp)


def target_logits_on_draft_vocab(drafter: DrafterBase, batch: Batch, target_final_norm: torch.Tensor,
                                 eps: float) -> torch.Tensor:
    """The target's logits over the draft vocabulary, `[S, A, gamma, V_d]`, from its cached hidden states."""
    with torch.no_grad():
        return rms_norm(batch.target_hidden, target_final_norm, eps) @ drafter.lm_head_t


def target_probs(target_logits: torch.Tensor, target_logsumexp: torch.Tensor) -> torch.Tensor:
    return torch.exp(target_logits - target_logsumexp[..., None]).clamp(max=1.0)


def mass_outside_draft_vocab(p_target: torch.Tensor) -> torch.Tensor:
    """The target's probability on tokens outside the draft vocabulary, per slot `[...]`."""
    return (1.0 - p_target.sum(-1)).clamp(min=0.0)


def l1_to_target(log_p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """||p_draft - p_target||_1 per slot, `[...]`, with p_draft on D and p_target's mass outside D."""
    return (log_p_draft.exp() - p_target).abs().sum(-1) + mass_outside_draft_vocab(p_target)


def slot_terms(logits: torch.Tensor, confidence: torch.Tensor | None, target_logits: torch.Tensor,
               target_logsumexp: torch.Tensor, label_ids: torch.Tensor, valid: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE, weighted L1, BCE, mean c*_k per slot, greedy CE) from the draft logits `[S, A, gamma, V_d]`: tensors
    only, and every op over the `[S, A, gamma, V_d]` tensors is elementwise or a reduction, which is
    what `torch.compile` fuses (`compiled_slot_terms`)."""
    p_target = target_probs(target_logits, target_logsumexp)
    log_p_draft = F.log_softmax(logits.float(), dim=-1)
    l1 = l1_to_target(log_p_draft, p_target)  # [S, A, gamma]
    valid_f = valid.float()
    num_slots = valid_f.sum().clamp(min=1)
    num_blocks = valid[..., 0].float().sum().clamp(min=1)
    vocab = logits.shape[-1]
    in_vocab = (label_ids < vocab) & valid
    ce_all = -log_p_draft.gather(-1, label_ids.clamp(max=vocab - 1)[..., None]).squeeze(-1)
    ce = (ce_all * in_vocab).sum() / in_vocab.sum().clamp(min=1)
    l1_term = (l1 * weights * valid_f).sum() / num_blocks
    soft_label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    if confidence is None:
        bce = torch.zeros((), device=logits.device)
    else:
        bce = (F.binary_cross_entropy_with_logits(confidence, soft_label, reduction="none") * valid_f).sum() / num_slots
    per_position = (soft_label * valid_f).sum((0, 1)) / valid_f.sum((0, 1)).clamp(min=1)
    top_p, greedy_ids = p_target.max(-1)  # the draft vocabulary's best token and its probability
    sure = (top_p >= mass_outside_draft_vocab(p_target)) & valid  # no token outside the vocabulary can beat it
    greedy_all = -log_p_draft.gather(-1, greedy_ids[..., None]).squeeze(-1)
    greedy_ce = (greedy_all * sure).sum() / sure.sum().clamp(min=1)
    return ce, l1_term, bce, per_position, greedy_ce


_compiled = None


def compiled_slot_terms(*args):
    """`slot_terms` through `torch.compile` (inductor fuses its elementwise chains into a few C++
    loops: forward + backward of these terms 3.2 -> 1.3 s on a 16 x 64-anchor step here). Falls back
    to `slot_terms` if compiling fails (no compiler, an unsupported platform), with a warning."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(slot_terms, dynamic=False)
    try:
        return _compiled(*args)
    except Exception as exc:  # inductor's failures are many kinds of exception
        warnings.warn(f"torch.compile of the loss failed ({type(exc).__name__}: {exc}); using it uncompiled",
                      RuntimeWarning, stacklevel=2)
        _compiled = slot_terms
        return slot_terms(*args)


def drafter_loss(drafter: DrafterBase, batch: Batch, target_final_norm: torch.Tensor, eps: float,
                 slot_decay: float = SLOT_DECAY, compile_loss: bool = False, greedy_weight: float = 0.0) -> LossTerms:
    logits, confidence = draft_logits(drafter, batch)
    target_logits = target_logits_on_draft_vocab(drafter, batch, target_final_norm, eps)
    terms = compiled_slot_terms if compile_loss else slot_terms
    ce, l1_term, bce, per_position, greedy_ce = terms(logits, confidence, target_logits, batch.target_logsumexp,
                                                      drafter.to_draft[batch.labels], batch.valid,
                                                      slot_weights(logits.shape[2], slot_decay, logits.device))

    if drafter.config.kind == "dflash":  # DFlash's own recipe
        total = ce
    elif confidence is None:  # EAGLE-3-style and MTP-1: no confidence head to train
        total = CE_WEIGHT * ce + L1_WEIGHT * l1_term
    else:
        total = CE_WEIGHT * ce + L1_WEIGHT * l1_term + BCE_WEIGHT * bce
    if greedy_weight:
        total = total + greedy_weight * greedy_ce
    return LossTerms(total, float(ce.detach()), float(l1_term.detach()), float(bce.detach()),
                     float(greedy_ce.detach()), per_position.tolist())
