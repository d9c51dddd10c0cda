"""The copy bias: a nudge, in the draft logits, toward the token that followed the same n-gram
earlier in the request (prompt lookup, as a bias on a learned drafter rather than a drafter).

DSpark's backbone sees the target's features of the context, not its tokens, and it loses to
EAGLE-3-style drafters on exactly the slots where the target repeats the context ("context
copies", `benchmarks/experiments/draft_vocab_reach.py`). So slot k's logits get

    z_k(y) = U_k(y) + B_k(y) + sum_n alpha[k, n] * [y == c_n]        n = 1 .. max_ngram

where c_n is the token that followed the most recent earlier occurrence of the last n tokens
before slot k (the request's tokens up to the anchor, then the block's tokens before k). alpha
`[gamma, max_ngram]` is fitted by `dspark-trt calibrate` (`fit_copy_bias`, the training loss's
total variation to the target) and stored in the drafter's config.

Why it stays lossless: c_n is a function of tokens before slot k only, and the bias is added
before the softmax, so p_k is still an exact distribution the draft token is drawn from, and
rejection sampling against the target stays exact (the same argument as the Markov head's B_k).

This module owns the lookup (`copy_candidates` for teacher-forced batches, `CopyIndex` for a
request in the step loop; tests check they agree) and turning candidates into a bias. It does
not own where the bias is added (`training.losses.draft_logits`, `runtime.dspark_proposer`) or
the fit (`training.calibrate`).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy
import torch

NO_CANDIDATE = -1


def copy_candidates(tokens: list[int], queries: list[int], max_ngram: int) -> list[list[int]]:
    """For each query position q: `[c_1 .. c_N]`, c_n the token after the most recent j < q whose
    n tokens ending at j equal the n tokens ending at q (NO_CANDIDATE where there is none)."""
    ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_ngram)]  # per n: n-gram -> its end positions
    for j in range(len(tokens)):
        for n in range(1, min(max_ngram, j + 1) + 1):
            ends[n - 1].setdefault(tuple(tokens[j - n + 1 : j + 1]), []).append(j)
    found = []
    for q in queries:
        row = []
        for n in range(1, max_ngram + 1):
            positions = ends[n - 1].get(tuple(tokens[q - n + 1 : q + 1])) if q - n + 1 >= 0 else None
            before = bisect_left(positions, q) - 1 if positions else -1
            row.append(tokens[positions[before] + 1] if before >= 0 else NO_CANDIDATE)
        found.append(row)
    return found


def batch_copy_candidates(tokens: torch.Tensor, previous_positions: torch.Tensor, to_draft: torch.Tensor,
                          max_ngram: int) -> torch.Tensor:
    """Teacher-forced candidates of a training batch, in draft-vocabulary ids.

    tokens `[S, L]` (each row's tokens), previous_positions `[S, A, gamma]` (where slot k's previous
    token sits: p + k - 1 for anchor p) -> `[S, A, gamma, max_ngram]`, NO_CANDIDATE where there is
    none or it lies outside the draft vocabulary (which `to_draft` maps to its size).
    """
    S, A, G = previous_positions.shape
    vocab_size = int(to_draft.max())
    out = torch.full((S, A, G, max_ngram), NO_CANDIDATE, dtype=torch.long)
    for s in range(S):
        queries = previous_positions[s].reshape(-1).tolist()
        found = torch.tensor(copy_candidates(tokens[s].tolist(), queries, max_ngram)).view(A, G, max_ngram)
        draft = to_draft[found.clamp(min=0)]
        out[s] = torch.where((found != NO_CANDIDATE) & (draft < vocab_size), draft, NO_CANDIDATE)
    return out


def dense_copy_bias(alpha: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """alpha `[gamma, N]`, candidates `[..., gamma, N]` -> the bias `[..., gamma, vocab_size]`
    (two n-grams naming the same token add up)."""
    present = candidates != NO_CANDIDATE
    weights = alpha.expand(candidates.shape) * present
    bias = torch.zeros(*candidates.shape[:-1], vocab_size + 1, dtype=weights.dtype, device=weights.device)
    bias.scatter_add_(-1, torch.where(present, candidates, vocab_size), weights)  # absent ones land in a spare column
    return bias[..., :vocab_size]


def confidence_offset(beta: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """beta `[gamma, N]`, candidates `[..., gamma, N]` -> the confidence-logit offset `[..., gamma]`:
    beta[k, n] for each n-gram length with a candidate at slot k (known before x_k is drawn, so
    the scheduler's admission still does not depend on x_k)."""
    return ((candidates != NO_CANDIDATE).to(beta.dtype) * beta).sum(-1)


class CopyIndex:
    """One request's lookup in the step loop: for every n-gram of its committed tokens, the token
    that followed its latest occurrence, kept up to date as tokens are committed (`extend`).

    `candidates(tail, block)` answers what `copy_candidates` answers at the position of the last
    token of `tail`, where `tail` is the committed tokens followed by the block's draft tokens so
    far (only its last `max_ngram` tokens are read) and `block` holds the pairs the draft tokens
    made (`block_pairs`): they are newer than any committed occurrence, so they win.
    """

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.followers: list[dict[tuple, int]] = [{} for _ in range(max_ngram)]
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens: each one is the follower of the n-grams ending just before it."""
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.followers[n - 1][tuple(self.tokens[end - n : end])] = token
            self.tokens.append(token)

    def candidates(self, tail: list[int], block: list[dict[tuple, int]] | None = None) -> list[int]:
        found = []
        for n in range(1, self.max_ngram + 1):
            if len(tail) < n:
                found.append(NO_CANDIDATE)
                continue
            key = tuple(tail[-n:])
            newer = block[n - 1].get(key) if block else None
            found.append(newer if newer is not None else self.followers[n - 1].get(key, NO_CANDIDATE))
        return found

    def block_pairs(self) -> list[dict[tuple, int]]:
        """An empty record of the pairs one block's draft tokens make (`add_block_pair`)."""
        return [{} for _ in range(self.max_ngram)]

    def add_block_pair(self, block: list[dict[tuple, int]], tail: list[int], token: int) -> None:
        """Record that `token` followed the n-grams ending `tail` (inside this block only)."""
        for n in range(1, min(self.max_ngram, len(tail)) + 1):
            block[n - 1][tuple(tail[-n:])] = token


class BlockCopyBias:
    """The copy bias of one batched block draft (the proposer's loop over slots k):
    `add_to(logits, k)` (or `terms(k)`, to add elsewhere) before slot k is drawn, `advance(tokens)` after."""

    def __init__(self, alpha: list[list[float]], indexes: list[CopyIndex], to_draft: list[int], vocab_size: int):
        self.alpha, self.indexes, self.to_draft, self.vocab_size = alpha, indexes, to_draft, vocab_size
        self.tails = [index.tokens[-index.max_ngram :] for index in indexes]  # target ids up to x_{k-1}
        self.blocks = [index.block_pairs() for index in indexes]
        self.found: list[list[int]] = []  # per slot drafted so far: [N * max_ngram] draft ids or NO_CANDIDATE

    def add_to(self, logits: torch.Tensor, k: int) -> None:
        """logits `[N, V_d]` of slot k (0-based), in place."""
        rows, columns, weights = self.terms(k)
        if not rows:
            return
        if logits.is_cpu and logits.dtype == torch.float32:
            # A few scalars per request: numpy adds them in place for ~1 us where three small tensors
            # and an index_put_ cost ~11 us, seven times a block. Each weight rounded to fp32 first, so
            # every add is the fp32 add index_put_ makes, in the same order.
            values = logits.numpy()
            for row, column, weight in zip(rows, columns, weights):
                values[row, column] += numpy.float32(weight)
        else:
            logits.index_put_((torch.tensor(rows), torch.tensor(columns)),
                              torch.tensor(weights, dtype=logits.dtype), accumulate=True)

    def terms(self, k: int) -> tuple[list[int], list[int], list[float]]:
        """Slot k's bias as (rows, columns, weights): add weights[i] to logits[rows[i], columns[i]], in
        order (`add_to` does; the proposer's C slot call takes them as they are)."""
        rows, columns, weights, found = [], [], [], []
        for row, (index, tail, block) in enumerate(zip(self.indexes, self.tails, self.blocks)):
            for n, token in enumerate(index.candidates(tail, block)):
                column = self.to_draft[token] if token != NO_CANDIDATE else self.vocab_size
                if column < self.vocab_size:
                    rows.append(row)
                    columns.append(column)
                    weights.append(self.alpha[k][n])
                found.append(column if column < self.vocab_size else NO_CANDIDATE)
        self.found.append(found)
        return rows, columns, weights

    def candidates(self) -> torch.Tensor:
        """`[N, slots drafted, max_ngram]`: what `batch_copy_candidates` gives teacher-forced on the drafted tokens."""
        found = torch.tensor(self.found)  # [slots, N * max_ngram]
        return found.view(len(self.found), len(self.indexes), -1).transpose(0, 1)

    def advance(self, tokens: list[int]) -> None:
        """Slot k drew `tokens` (target ids, one per request): later slots may copy after them."""
        for i, (index, token) in enumerate(zip(self.indexes, tokens)):
            index.add_block_pair(self.blocks[i], self.tails[i], token)
            self.tails[i] = (self.tails[i] + [token])[-index.max_ngram :]


# ---- the same lookup in tensor ops (the exported drafter graph) ------------------------------------


def right_aligned_history(tokens: torch.Tensor, lengths: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Left-aligned, padded token rows -> the layout `sequence_copy_candidates` reads.

    tokens `[B, C]` (row b's first `lengths[b]` entries are real, the rest any value), lengths
    `[B]`, last `[B]` (the token after them: the request's pending/anchor token) -> `[B, C + 1]`:
    each row's `lengths[b]` tokens then `last[b]`, right-aligned, NO_CANDIDATE to their left.
    Standard ops only (gather, compare, where), so it traces into an ONNX graph."""
    extended = torch.cat([tokens, last[:, None]], dim=1)  # [B, C + 1]; the anchor is put in place below
    columns = torch.arange(extended.shape[1], device=tokens.device)[None]  # [1, C + 1]: 0 .. C (traced as dynamic)
    extended = torch.where(columns == lengths[:, None], last[:, None], extended)  # anchor at index lengths[b]
    source = columns - (columns[:, -1:] - lengths[:, None])  # output column t reads index t - (C - lengths[b])
    gathered = extended.gather(1, source.clamp(min=0))
    return torch.where(source >= 0, gathered, torch.full_like(gathered, NO_CANDIDATE))


def sequence_copy_candidates(sequence: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """`copy_candidates` at the last position, for a batch of rows, in tensor ops (no Python
    loop over positions, no data-dependent shapes: it traces into standard ONNX ops).

    sequence `[B, P]` target ids, each row's tokens right-aligned with NO_CANDIDATE to their
    left (`right_aligned_history`, then the block's drafted tokens appended) -> `[B, max_ngram]`:
    c_n is the token after the last j < P - 1 whose n tokens ending at j equal the n tokens
    ending at P - 1, or NO_CANDIDATE when there is none or the row has fewer than n tokens.
    This is what `CopyIndex.candidates` answers with a block's pairs (the drafted tokens are the
    latest positions, so a match among them is the newest); tests check it against both."""
    # One more pad column than the longest n-gram: windows j = -1 .. P-2, so there is always one
    # (j = -1 reads padding and never matches), and a window's tokens before the row are padding.
    padded = torch.nn.functional.pad(sequence, (max_ngram + 1, 0), value=NO_CANDIDATE)  # [B, N + 1 + P]
    followers = torch.arange(sequence.shape[1], device=sequence.device, dtype=torch.float32)[None]  # [1, P]: j + 1
    match, found = None, []
    for i in range(max_ngram):  # n = i + 1: the n-gram's i-th token from its end
        window = padded[:, max_ngram - i : -1 - i]  # [B, P]: the token i before each window's end j
        query = padded[:, -1 - i :][:, :1]  # [B, 1]: the token i before the last position
        equal = window == query
        match = equal if match is None else match & equal  # windows whose last i + 1 tokens equal the query's
        last = torch.where(match, followers, torch.full_like(followers, -1.0)).amax(-1)  # [B]: newest match's j + 1
        follower = sequence.gather(1, last.clamp(min=0).long()[:, None])[:, 0]
        real = (last >= 0) & (query[:, 0] != NO_CANDIDATE)  # a match, and the row has n tokens (padding never matches)
        found.append(torch.where(real, follower, torch.full_like(follower, NO_CANDIDATE)))
    return torch.stack(found, dim=-1)


def draft_copy_candidates(candidates: torch.Tensor, to_draft: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target-id candidates `[..., N]` -> draft-vocabulary ids, NO_CANDIDATE where there is none or
    it lies outside the draft vocabulary (`to_draft` maps those to `vocab_size`), as `BlockCopyBias`."""
    columns = to_draft[candidates.clamp(min=0)]
    present = (candidates != NO_CANDIDATE) & (columns < vocab_size)
    return torch.where(present, columns, torch.full_like(columns, NO_CANDIDATE))


def add_copy_bias(logits: torch.Tensor, alpha_k: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """logits `[B, V_d]` of one slot plus alpha_k[n] `[N]` on each row's draft-id candidate `[B, N]`,
    n by n in order (the additions `BlockCopyBias.add_to` makes, in its order); out of place."""
    columns = torch.arange(logits.shape[-1], device=logits.device)[None]  # [1, V_d]
    for n in range(candidates.shape[-1]):
        hit = columns == candidates[:, n : n + 1]  # [B, V_d]; NO_CANDIDATE hits nothing
        logits = logits + torch.where(hit, alpha_k[n], torch.zeros_like(logits))
    return logits
