"""The rejection sampler: the step's feeds and the target's logits -> what each request emits.

For a decode feed (anchor + draft `x_1..x_l`, logits at all `l + 1` positions) it runs the
lossless rule of `sampling.verify_draft`: the accepted draft tokens, then either the
*recovered* token (resampled from the residual at the first rejection) or, when all `l`
survive, the *bonus* token (sampled from the target after `x_l`); for a seeded sampled request,
the coupled rule (`sampling.verify_draft_coupled`). For the prompt chunk that
completes a prompt it samples the first output token from the chunk's last row (none for
`max_tokens` 0: the prompt was only to be scored). A mid-prompt chunk emits nothing.

It decides tokens and nothing else: committing, rolling the KV cache back and stop
conditions are the engine's postprocess. Each request's own `torch.Generator` drives every
random choice, so a seeded request samples alike whatever shares its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.runtime.sampling import (coupled_inputs, next_token, target_probs, verify_draft,
                                         verify_draft_coupled)
from dspark_trt.runtime.scheduler import Feed


@dataclass
class Verdict:
    token_ids: list[int]  # to commit, in order: the accepted drafts, then the recovered or bonus token
    num_accepted: int  # draft tokens accepted (0 for a prompt chunk)


def rejection_sample(feeds: list[Feed], logits: list[torch.Tensor]) -> list[Verdict]:
    """One `Verdict` per feed; `logits[i]` `[feeds[i].num_logit_rows, vocab]`."""
    verdicts = []
    for feed, rows in zip(feeds, logits):
        request = feed.request
        if feed.is_prefill:
            emits = feed.completes_prompt and request.params.max_tokens > 0
            tokens = [next_token(rows[-1], request.params, request.generator, request.noise_key(0))] if emits else []
            verdicts.append(Verdict(tokens, 0))
            continue
        draft, params = feed.draft, request.params
        if request.noise is not None:  # seeded: the same tokens whether drafted or not
            keys = [request.noise_key(k) for k in range(len(rows))]
            scores, scale = coupled_inputs(rows, params)
            num_accepted, final_token = verify_draft_coupled(draft.tokens, scores, keys, scale)
        else:  # greedy verification reads the argmax only: the logits will do, no point masses built
            num_accepted, final_token = verify_draft(draft.tokens, draft.probs,
                                                     rows if params.greedy else target_probs(rows, params),
                                                     request.generator, params.greedy)
        verdicts.append(Verdict(draft.tokens[:num_accepted] + [final_token], num_accepted))
    return verdicts
