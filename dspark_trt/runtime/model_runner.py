"""The model runner: the step's feeds -> one target forward -> each feed's logits and features.

It packs the feeds into one ragged batch (tokens in feed order), passes the logit rows the
scheduler chose (`Feed.num_logit_rows`: the last rows of each feed), runs the backend (our
PyTorch/C target or a TensorRT engine: `forward(token_ids, num_new_tokens, caches,
logits_indices, feature_layers, batch_invariant)`, see DESIGN.md section 3) and hands the rows
back per feed: the logits on the CPU (sampling and verification run there, so a GPU target hands
its rows over once per step), the features where the target computed them (a drafter moves them
where it drafts: a drafter engine beside a GPU target takes them without a round trip).

`batch_invariant` is the runner's property, fixed at construction: each request's logits then
do not depend on what else shares the step (slow; only the PyTorch target offers it).
It runs the model and nothing else: no sampling, no commits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.models.target import TargetModel
from dspark_trt.runtime.scheduler import Feed


@dataclass
class RunnerOutput:
    logits: list[torch.Tensor]  # per feed: [num_logit_rows, vocab]
    features: list[torch.Tensor | None]  # per feed: [len(token_ids), num_feature_layers * hidden]; None: no feature layers


class ModelRunner:
    def __init__(self, target: LoadedTarget, feature_layers: tuple[int, ...] = (), batch_invariant: bool = False):
        if batch_invariant and not isinstance(target.model, TargetModel):
            raise InvalidRequestError("batch_invariant needs the built-in PyTorch target, not a "
                                      f"{type(target.model).__name__} backend", "batch_invariant")
        self.target = target
        self.feature_layers = tuple(feature_layers)  # target layers whose outputs every step returns
        self.batch_invariant = batch_invariant

    def run(self, feeds: list[Feed]) -> RunnerOutput:
        logits_indices, offset = [], 0
        for feed in feeds:  # a feed's logit rows are its last ones
            end = offset + len(feed.token_ids)
            logits_indices.extend(range(end - feed.num_logit_rows, end))
            offset = end
        output = self.target.model(
            torch.tensor([token for feed in feeds for token in feed.token_ids]),  # [total_tokens]
            [len(feed.token_ids) for feed in feeds],
            [feed.request.cache for feed in feeds],
            torch.tensor(logits_indices, dtype=torch.long),  # may be empty: mid-prompt chunks only
            self.feature_layers,
            batch_invariant=self.batch_invariant,
        )
        logits_rows = output.logits.cpu()  # [num_logits, vocab]
        feature_rows = output.features  # [tokens, m * hidden], on the target's device
        # One split per step, not a slice per feed: under a server each small PyTorch call may hand
        # the interpreter lock to the HTTP thread (measured: with a slice and a queueing call per
        # request, a 32-request server that drafted nothing ran 0.968x plain; without them 1.013x).
        logits = list(logits_rows.split([feed.num_logit_rows for feed in feeds]))
        features = ([None] * len(feeds) if feature_rows is None
                    else list(feature_rows.split([len(feed.token_ids) for feed in feeds])))
        return RunnerOutput(logits, features)
