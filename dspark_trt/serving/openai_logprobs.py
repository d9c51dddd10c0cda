"""Logprobs as OpenAI's JSON: token ids and numbers (`runtime/logprobs.py`) -> the `logprobs`
object of a completions choice or of a chat choice.

    completions  {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
                  "text_offset": [int]}
    chat         {"content": [{"token": str, "logprob": float, "bytes": [int],
                               "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Conventions, where OpenAI's API leaves room:
- A token's string is its own decoded text. A token that ends inside a multi-byte character has
  no text of its own and is written `bytes:\\xe4\\xb8` (OpenAI's form); chat's `bytes` are always
  the token's raw bytes.
- A completions `top_logprobs` entry holds the N most likely tokens plus the chosen one (so it has
  N or N + 1 entries: lm-eval's greedy check needs the chosen token there); chat's holds the N
  most likely.
- A logprob of -inf (a token that top-k or top-p leaves out) is written -9999.0: JSON has no
  infinity (vLLM writes the same).
- `text_offset` counts characters from the start of the choice's text (its echoed prompt
  included), across a stream's chunks.
- The first prompt token follows nothing: null logprob and null alternatives (echo).

It shapes JSON and nothing else.
"""

from __future__ import annotations

import math
from functools import lru_cache

from dspark_trt.runtime.logprobs import TokenLogprob

LOWEST_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOWEST_LOGPROB


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> the byte it stands for. Printable bytes stand for
    themselves; the other 68 are shifted to code points 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


class LogprobFormatter:
    """Token strings and bytes of one tokenizer (cached), and the two JSON shapes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._strings: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(the token's string, its bytes)."""
        known = self._strings.get(token_id)
        if known is None:
            raw = self._token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # a piece of a character
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            known = self._strings[token_id] = (text, list(raw))
        return known

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        alphabet = _byte_level_alphabet()
        if isinstance(piece, str) and piece and all(ch in alphabet for ch in piece):  # byte-level BPE
            return bytes(alphabet[ch] for ch in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")  # other vocabularies: its decoded text

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None],
                   text_offset: int) -> tuple[dict, int]:
        """A completions `logprobs` object for tokens `token_ids` with logprobs `entries` (None: the
        first prompt token), their text starting at character `text_offset` of the choice; returns
        it and the offset after them."""
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self.token(token_id)[0]
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(json_logprob(entry.logprob))
            top = {self.token(top_id)[0]: json_logprob(value) for top_id, value in entry.top}
            top.setdefault(text, json_logprob(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, text_offset

    def chat(self, entries: list[TokenLogprob]) -> dict:
        """A chat `logprobs` object for `entries`."""
        content = []
        for entry in entries:
            text, raw = self.token(entry.token_id)
            top = []
            for token_id, value in entry.top:
                top_text, top_raw = self.token(token_id)
                top.append({"token": top_text, "logprob": json_logprob(value), "bytes": top_raw})
            content.append({"token": text, "logprob": json_logprob(entry.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content}
