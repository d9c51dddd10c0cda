"""The output processor: committing tokens to a request, its text, its logprobs, and when it stops.

`commit(request, tokens, rows)` appends tokens one at a time and stops at EOS, a stop token, a stop string,
`max_tokens` or the end of the context, checked token by token so that a speculative step that
commits several tokens ends exactly where plain decoding would have. A request that asked for
logprobs gets those of the tokens it kept, from the rows that produced them (`logprobs.py`);
`score_prompt` does the same for a prompt chunk's tokens (prompt logprobs, OpenAI's `echo`).

Text is detokenised incrementally (vLLM's two-offset scheme): each request keeps a
`prefix_offset` and a `read_offset` into its output ids; a step decodes only
`ids[prefix_offset:]`, and the part past `decode(ids[prefix_offset:read_offset])` is new text.
Text is only taken up to a complete character (a token may end inside a multi-byte one: the
decode then ends in U+FFFD and waits for the next token); a finished request flushes the rest.
Offsets only move to where the text so far ended cleanly, so every window starts on a
character boundary and `output_text` equals decoding the whole output at once
(`tests/test_output_processor.py` checks it on the real tokenizer). The old way, decoding the
whole output on every commit, cost O(length) per token.

It owns the tokenizer's use in the step loop and nothing else: it never touches the KV cache
or the counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.runtime.logprobs import token_logprobs
from dspark_trt.runtime.request import FinishReason, Request


@dataclass
class _TextOffsets:
    prefix: int = 0  # output ids before this are already text and need not be decoded again
    read: int = 0  # output ids before this have been turned into `output_text`


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self._offsets: dict[str, _TextOffsets] = {}

    def commit(self, request: Request, tokens: list[int], rows: torch.Tensor | None = None) -> int:
        """Append `tokens` (or the part before the request finishes); return how many were appended.
        `rows[i]`: the target logits that produced `tokens[i]` (needed only with logprobs)."""
        params = request.params
        appended = 0
        for token in tokens:
            request.output_token_ids.append(token)
            appended += 1
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                request.finish_reason = FinishReason.STOP
            elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.context_length:
                request.finish_reason = FinishReason.LENGTH
            if params.stop:
                self._update_text(request)
            if request.finished:
                break
        if not params.stop:
            self._update_text(request)
        if params.logprobs is not None and appended:
            request.output_logprobs.extend(token_logprobs(rows, tokens[:appended], params, params.logprobs))
        if not request.finished and not request.in_prefill and len(request.output_token_ids) >= params.max_tokens:
            request.finish_reason = FinishReason.LENGTH  # max_tokens 0: the prompt was only scored
        return appended

    def score_prompt(self, request: Request, start: int, rows: torch.Tensor) -> None:
        """Prompt logprobs of a chunk that began at prompt position `start`; `rows` `[chunk, vocab]`:
        row j follows prompt token start + j, so it scores token start + j + 1 (the last row of the
        final chunk scores the first output token instead: `commit`'s)."""
        if start == 0:
            request.prompt_logprobs.append(None)  # the first prompt token follows nothing
        scored = request.prompt_token_ids[start + 1 : start + len(rows) + 1]
        request.prompt_logprobs.extend(token_logprobs(rows, scored, None, request.params.prompt_logprobs))  # the model's own

    def release(self, request: Request) -> None:
        self._offsets.pop(request.request_id, None)

    def _update_text(self, request: Request) -> None:
        offsets = self._offsets.setdefault(request.request_id, _TextOffsets())
        ids = request.output_token_ids
        decode = self.tokenizer.decode
        known = decode(ids[offsets.prefix : offsets.read], skip_special_tokens=True)
        window = decode(ids[offsets.prefix :], skip_special_tokens=True)
        if len(window) > len(known) and (request.finished or not window.endswith("\ufffd")):
            text = request.output_text + window[len(known) :]
            offsets.prefix, offsets.read = offsets.read, len(ids)
        else:
            text = request.output_text
        stops = request.params.stop
        if stops:
            # A stop string that was not in the old text must end in the new part of it.
            window_start = max(0, len(request.output_text) - max(map(len, stops)))
            hits = [i for i in (text.find(s, window_start) for s in stops) if i >= 0]
            if hits:
                text = text[: min(hits)]
                request.finish_reason = FinishReason.STOP
        request.output_text = text
