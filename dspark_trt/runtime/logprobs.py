"""Logprobs a request reports: for each committed (or prompt) token, its log probability under the
target and the most likely alternatives at that position.

    token_logprobs(rows, token_ids, params, num_top) -> [TokenLogprob]   rows[i] produced token_ids[i]

A generated token's distribution is `sampling.target_logprobs`: the target's logits processed by
the request's own sampling parameters (temperature, top-k, top-p), the one its tokens are drawn
from; greedy requests report the model's own distribution. A prompt token was drawn from nothing,
so it reports the model's own distribution (`params` None; what loglikelihood scoring needs,
and vLLM's prompt logprobs too). Never the drafter's.

Why speculation cannot change them: a committed token's row is the target's logits at that
position given the committed tokens before it. Verification computes the rows of the anchor and
of every draft token in one forward, and keeps only the rows up to the first rejection, which
are exactly the positions whose preceding tokens were all committed. So an accepted draft token,
a recovered token and a bonus token each report the row plain decoding would compute at that
position (equal up to the float rounding of a wider matmul; our bf16 CPU kernels give the same
bits). The engine hands this module only kept rows (`Engine._postprocess`).

It computes numbers and nothing else: token strings and JSON shapes are the server's
(`serving/openai_logprobs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.runtime.sampling import SamplingParams, target_logprobs

ROWS_AT_A_TIME = 64  # rows whose [rows, vocab] logprobs exist at once (~12 MB at a 49k vocabulary)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # -inf where top-k / top-p leaves the token out
    top: list[tuple[int, float]]  # the `num_top` most likely (token id, logprob), most likely first


def token_logprobs(rows: torch.Tensor, token_ids: list[int], params: SamplingParams | None,
                   num_top: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per token; `rows` `[len(token_ids), vocab]` are the target logits that
    produced them (row i: the logits after the tokens before token i); `params` None: the model's
    own distribution (prompt tokens)."""
    entries = []
    for start in range(0, len(token_ids), ROWS_AT_A_TIME):  # bounded temporaries for a long scored prompt
        ids = token_ids[start : start + ROWS_AT_A_TIME]
        chunk = rows[start : start + len(ids)].float()
        logprobs = torch.log_softmax(chunk, dim=-1) if params is None else target_logprobs(chunk, params)  # [n, V]
        chosen = logprobs.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
        if num_top:
            values, top_ids = torch.topk(logprobs, num_top, dim=-1)  # [n, num_top], most likely first
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in ids]
        entries += [TokenLogprob(token, value, top) for token, value, top in zip(ids, chosen, tops)]
    return entries
