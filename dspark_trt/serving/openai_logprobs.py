"""Logprobs as OpenAI's JSON: token ids and numbers (`runtime/logprobs.py`) -> the `logprobs`
object of a completions choice or of a chat choice.

    completions  {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
                  "text_offset": [int]}
    chat         {"content": [{"token": str, "logprob": float, "bytes": [int],
                               "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Conventions, where OpenAI's API leaves room:
- A token's string is the text of its own bytes: byte-level BPE pieces (GPT-2, Llama 3, Qwen,
  SmolLM) map through GPT-2's byte alphabet, SentencePiece pieces (Llama 2, Mistral) turn `▁`
  into a space and `<0x0A>` into its byte, other vocabularies use their decoded text. A token
  that is part of a multi-byte character has no text of its own and is written `bytes:\\xe4\\xb8`
  (OpenAI's form); chat's `bytes` are always the token's raw bytes.
- A completions `top_logprobs` entry holds the N most likely tokens plus the chosen one (so it has
  N or N + 1 entries: lm-eval's greedy check needs the chosen token there); chat's holds the N
  most likely.
- A logprob of -inf (a token that top-k or top-p leaves out) is written -9999.0: JSON has no
  infinity (vLLM writes the same).
- `text_offset` counts characters from the start of the choice's text (its echoed prompt
  included), across a stream's chunks: the characters the tokens' bytes decode to so far, so a
  character split over two tokens is counted once, where it completes (`TextOffsets`).
- The first prompt token follows nothing: null logprob and null alternatives (echo).

It shapes JSON and nothing else.
"""

from __future__ import annotations

import codecs
import json
import math
import re
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


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextOffsets:
    """Where each token starts in a choice's text: characters decoded from the tokens' bytes so far
    (an incremental UTF-8 decoder, so a partial character waits for the token that completes it)."""

    def __init__(self):
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset where a token with bytes `raw` starts; moves past it."""
        start = self.offset
        self.offset += len(self._decoder.decode(raw))
        return start


class LogprobFormatter:
    """Token strings and bytes of one tokenizer (cached), and the two JSON shapes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocabulary_kind = _vocabulary_kind(tokenizer)  # byte-level | sentencepiece | text
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
        if isinstance(piece, str) and piece:
            if self.vocabulary_kind == "byte-level":
                alphabet = _byte_level_alphabet()
                if all(ch in alphabet for ch in piece):
                    return bytes(alphabet[ch] for ch in piece)
            elif self.vocabulary_kind == "sentencepiece":
                byte = _SENTENCEPIECE_BYTE.fullmatch(piece)
                return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")  # special or unknown pieces: their text

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None],
                   offsets: TextOffsets) -> dict:
        """A completions `logprobs` object for tokens `token_ids` with logprobs `entries` (None: the
        first prompt token); `offsets` carries the choice's text position from chunk to chunk."""
        tokens, values, tops, starts = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text, raw = self.token(token_id)
            tokens.append(text)
            starts.append(offsets.advance(bytes(raw)))
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(json_logprob(entry.logprob))
            top = {self.token(top_id)[0]: json_logprob(value) for top_id, value in entry.top}
            top.setdefault(text, json_logprob(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}

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


def _vocabulary_kind(tokenizer) -> str:
    """How a tokenizer's pieces spell bytes, from its decoder: byte-level BPE, SentencePiece
    (Metaspace / ByteFallback), or neither (pieces are decoded one by one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"), ensure_ascii=False) if backend is not None else ""
    if "ByteLevel" in decoder:
        return "byte-level"
    if "ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder:
        return "sentencepiece"
    return "text"
