"""Sequential temperature scaling (STS) of the confidence head.

The scheduler multiplies confidences into prefix survival probabilities `a_k = prod_{i<=k} c_i`,
so they must be calibrated as *absolute* probabilities. STS fits one temperature per block
position, in order k = 1..gamma: with T_1..T_{k-1} fixed, grid-search T_k to minimise the
expected calibration error (ECE) of the cumulative product `a_k` against the observed prefix
survival. Labels may be soft (expected acceptance, exact under rejection sampling) or 0/1.

Also reports AUC per position (how well c_k ranks accepted above rejected slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TEMPERATURE_GRID = torch.cat([torch.linspace(0.25, 1.0, 16), torch.linspace(1.1, 6.0, 50)])


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 15) -> float:
    """Weighted mean |mean predicted - mean observed| over equal-width probability bins."""
    predicted, observed = predicted.flatten().double(), observed.flatten().double()
    index = (predicted * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        chosen = index == b
        if chosen.any():
            total += chosen.sum().item() * abs(predicted[chosen].mean().item() - observed[chosen].mean().item())
    return total / max(1, predicted.numel())


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    positives, negatives = scores[labels > 0.5], scores[labels <= 0.5]
    if not len(positives) or not len(negatives):
        return float("nan")
    ranks = torch.cat([positives, negatives]).argsort().argsort().double() + 1
    # average ranks of ties
    values = torch.cat([positives, negatives])
    for value in values.unique():
        tied = values == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    positive_rank_sum = ranks[: len(positives)].sum().item()
    return (positive_rank_sum - len(positives) * (len(positives) + 1) / 2) / (len(positives) * len(negatives))


@dataclass
class CalibrationReport:
    temperatures: list[float]
    ece_before: list[float]  # per position, of the cumulative product a_k
    ece_after: list[float]
    auc: list[float]  # per position, of c_k against the slot's own acceptance


def fit_sts(logits: torch.Tensor, accepted: torch.Tensor) -> CalibrationReport:
    """logits `[blocks, gamma]` confidence logits; accepted `[blocks, gamma]` per-slot acceptance
    (probability or 0/1) given the prefix. Prefix survival is the running product of `accepted`."""
    survival = accepted.double().cumprod(-1)
    gamma = logits.shape[1]
    temperatures: list[float] = []
    ece_before, ece_after, aucs = [], [], []
    running = torch.ones(logits.shape[0], dtype=torch.float64)
    for k in range(gamma):
        uncalibrated = torch.sigmoid(logits[:, : k + 1].double()).prod(-1)
        ece_before.append(expected_calibration_error(uncalibrated, survival[:, k]))
        errors = [expected_calibration_error(running * torch.sigmoid(logits[:, k].double() / t), survival[:, k])
                  for t in TEMPERATURE_GRID.tolist()]
        best = int(torch.tensor(errors).argmin())
        temperatures.append(float(TEMPERATURE_GRID[best]))
        running = running * torch.sigmoid(logits[:, k].double() / temperatures[-1])
        ece_after.append(errors[best])
        reached = survival[:, k - 1] > 0.5 if k else torch.ones_like(running, dtype=torch.bool)
        aucs.append(auc(logits[reached, k].double(), accepted[reached, k].double()))
    return CalibrationReport(temperatures, ece_before, ece_after, aucs)


@dataclass
class ConfidenceData:
    logits: torch.Tensor  # [blocks, gamma] the confidence head's logits, no offsets
    accepted: torch.Tensor  # [blocks, gamma] exact acceptance probability of each slot given its prefix
    top_prob_logits: torch.Tensor  # [blocks, gamma] logit of each slot's draft top probability
    candidates: torch.Tensor | None  # [blocks, gamma, N] copy candidates (draft ids), with a copy bias


@torch.no_grad()
def collect_confidences(drafter, sequences, target_final_norm: torch.Tensor, eps: float, anchors: int = 32,
                        batch_size: int = 4, seed: int = 0) -> ConfidenceData:
    """Teacher-forced confidence logits, exact acceptance probabilities and what the confidence's
    calibrated offsets read, of every full block of held-out sequences."""
    import torch.nn.functional as F

    from dspark_trt.training.data import make_batch
    from dspark_trt.models.drafter import top_probability_logit
    from dspark_trt.training.losses import copy_candidates_of, draft_logits, l1_to_target, target_probs_on_draft_vocab

    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    all_logits, all_accepted, all_candidates, all_top = [], [], [], []
    for start in range(0, len(sequences), batch_size):
        batch = make_batch(sequences[start : start + batch_size], anchors, config.block_size,
                           len(config.feature_layers), config.hidden_size, generator)
        candidates = copy_candidates_of(drafter, batch, config.copy_ngram) if config.copy_ngram else None
        logits, confidence = draft_logits(drafter, batch, candidates)
        if confidence is None:
            raise ValueError("this drafter has no confidence head to calibrate")
        p_target = target_probs_on_draft_vocab(drafter, batch, target_final_norm, eps)
        accepted = (1.0 - 0.5 * l1_to_target(F.log_softmax(logits.float(), -1), p_target)).clamp(0.0, 1.0)
        full = batch.valid.all(-1)  # blocks whose every slot lies inside the sequence
        all_logits.append(confidence[full])
        all_accepted.append(accepted[full])
        all_top.append(top_probability_logit(logits)[full])
        if candidates is not None:
            all_candidates.append(candidates[full])
    return ConfidenceData(torch.cat(all_logits), torch.cat(all_accepted), torch.cat(all_top),
                          torch.cat(all_candidates) if all_candidates else None)


def fit_confidence_offsets(data: ConfidenceData, steps: int = 300) -> tuple[list[float], list[list[float]] | None]:
    """The offsets `DrafterBase.confidence_offsets` adds to the head's logits, fitted to each slot's
    acceptance (BCE, soft labels) with the head's logits held as they are: w `[gamma]`
    (`confidence_top_prob`) and, with copy candidates, beta `[gamma, N]` (`copy_confidence`).
    STS then scales the sum."""
    from dspark_trt.models.copy_bias import confidence_offset

    weights = torch.zeros(data.logits.shape[1], requires_grad=True)
    beta = torch.zeros(data.candidates.shape[1:] if data.candidates is not None else (0,), requires_grad=True)
    optimizer = torch.optim.Adam([weights, beta], lr=0.05)
    for _ in range(steps):  # full batch: a few thousand blocks x gamma, milliseconds a step
        offset = weights * data.top_prob_logits
        if data.candidates is not None:
            offset = offset + confidence_offset(beta, data.candidates)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(data.logits.float() + offset, data.accepted.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rounded = [round(w, 4) for w in weights.detach().tolist()]
    return rounded, [[round(b, 4) for b in row] for row in beta.detach().tolist()] if data.candidates is not None else None


@dataclass
class CopyBiasReport:
    alpha: list[list[float]]  # [gamma][max_ngram]: the fitted copy bias
    num_blocks: int
    acceptance_before: list[float]  # per slot, mean exact acceptance (1 - L1 / 2) on the fit rows, no copy bias
    acceptance_after: list[float]  # the same with the fitted one


def fit_copy_bias(drafter, sequences, target_final_norm: torch.Tensor, eps: float, max_ngram: int,
                  anchors: int = 32, batch_size: int = 8, epochs: int = 6, seed: int = 0) -> CopyBiasReport:
    """Fit the copy bias alpha `[gamma, max_ngram]` (`models/copy_bias.py`) by Adam on the training
    loss's total variation to the target, teacher-forced on `sequences`, the drafter itself frozen.

    The drafter's logits are computed once without any copy bias and held (fp16) with the target's
    probabilities: ~2 x 3.7 MB per row at 32 anchors, so pass a few hundred rows, not thousands.
    """
    import dataclasses

    import torch.nn.functional as F

    from dspark_trt.models.copy_bias import dense_copy_bias
    from dspark_trt.training.data import make_batch
    from dspark_trt.training.losses import copy_candidates_of, draft_logits, l1_to_target, target_probs_on_draft_vocab

    config = drafter.config
    plain = dataclasses.replace(config, copy_bias=[])
    generator = torch.Generator().manual_seed(seed)
    held = []
    saved, drafter.config = drafter.config, plain  # the drafter's own logits, without a copy bias
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                batch = make_batch(sequences[start : start + batch_size], anchors, config.block_size,
                                   len(config.feature_layers), config.hidden_size, generator)
                logits, _ = draft_logits(drafter, batch)
                p_target = target_probs_on_draft_vocab(drafter, batch, target_final_norm, eps)
                held.append((logits.half(), p_target.half(), copy_candidates_of(drafter, batch, max_ngram),
                             batch.valid))
    finally:
        drafter.config = saved
    vocab_size = drafter.draft_vocab.numel()

    def acceptance(logits, p_target, candidates, alpha):
        z = logits.float() + dense_copy_bias(alpha, candidates, vocab_size)
        return (1.0 - 0.5 * l1_to_target(F.log_softmax(z, -1), p_target.float())).clamp(0.0, 1.0)

    def per_slot(alpha) -> list[float]:
        with torch.no_grad():
            sums = sum((acceptance(lg, pt, c, alpha) * v).sum((0, 1)) for lg, pt, c, v in held)
        return (sums / sum(v.sum((0, 1)) for *_, v in held)).tolist()

    alpha = torch.zeros(config.block_size, max_ngram, requires_grad=True)
    optimizer = torch.optim.Adam([alpha], lr=0.3)  # 28 weights of order 1-10: a large step converges in a few epochs
    before = per_slot(alpha.detach())
    for _ in range(epochs):
        for logits, p_target, candidates, valid in held:
            loss = -((acceptance(logits, p_target, candidates, alpha) * valid).sum() / valid.sum())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    fitted = alpha.detach()
    return CopyBiasReport([[round(a, 4) for a in row] for row in fitted.tolist()],
                          int(sum(v.any(-1).sum() for *_, v in held)), before, per_slot(fitted))
