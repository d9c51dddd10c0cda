"""The Triton model's inputs and outputs: names, types, and their mapping to our runtime.

Names, data types and dims follow TensorRT-LLM's `tensorrt_llm_bls` / `ensemble` models, so a
client written for those works unchanged (`text_input`, `max_tokens`, `stream`, `temperature`,
`top_p`, `top_k`, `random_seed`, `stop_words`, `bad_words`, `end_id`, `pad_id`, `beam_width`,
`return_log_probs` in; `text_output`, `cum_log_probs`, `output_log_probs` out). `end_id` is a
token that ends generation (beside the model's EOS), `pad_id` changes nothing (no output is
padded), `beam_width` must be 1 (no beam search), `return_log_probs` fills the two log-prob
outputs (the target's logprob of each generated token, `runtime/logprobs.py`; zeros and empty
without it, as TensorRT-LLM sends). Additions: `seed` (an alias of `random_seed`),
`ignore_eos`, `apply_chat_template`, and outputs with token counts and acceptance statistics.

This module is plain numpy: it turns a request's input arrays into a prompt and
`SamplingParams` (raising `InvalidRequestError` naming the bad input) and a stream delta into
output arrays. It never imports Triton, so it is tested without a server; `model.py` does the
Triton side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # a Triton ModelConfig DataType name
    dims: tuple[int, ...]  # without the batch dimension (the model has max_batch_size 1)
    optional: bool = True
    doc: str = ""


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=False, doc="the prompt (raw text)"),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), doc="most tokens to generate (>= 1)"),
    TensorSpec("stream", "TYPE_BOOL", (1,), doc="true: one response per new piece of text; false: one response"),
    TensorSpec("temperature", "TYPE_FP32", (1,), doc="0 = greedy"),
    TensorSpec("top_p", "TYPE_FP32", (1,), doc="nucleus mass in (0, 1]"),
    TensorSpec("top_k", "TYPE_INT32", (1,), doc="sample among the k likeliest tokens (0 = off)"),
    TensorSpec("seed", "TYPE_UINT64", (1,), doc="sampling seed (reproducible output)"),
    TensorSpec("random_seed", "TYPE_UINT64", (1,), doc="TensorRT-LLM's name for seed"),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), doc="strings that end generation (empty strings are ignored)"),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), doc="accepted for TensorRT-LLM clients; must be empty"),
    TensorSpec("ignore_eos", "TYPE_BOOL", (1,), doc="keep generating past end-of-sequence tokens"),
    TensorSpec("apply_chat_template", "TYPE_BOOL", (1,), doc="wrap text_input as a user turn in the chat template"),
    TensorSpec("end_id", "TYPE_INT32", (1,), doc="a token id that ends generation (beside the model's EOS)"),
    TensorSpec("pad_id", "TYPE_INT32", (1,), doc="accepted for TensorRT-LLM clients (nothing is padded)"),
    TensorSpec("beam_width", "TYPE_INT32", (1,), doc="accepted for TensorRT-LLM clients; must be 1"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), doc="fill cum_log_probs and output_log_probs"),
)

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,), doc="new text (streaming) or the whole completion"),
    TensorSpec("output_ids", "TYPE_INT32", (-1,), doc="the token ids of text_output"),
    TensorSpec("finish_reason", "TYPE_STRING", (1,), doc="empty until the last response: stop | length | abort"),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,), doc="prompt tokens"),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,), doc="tokens generated so far"),
    TensorSpec("num_steps", "TYPE_INT32", (1,), doc="target steps (last response)"),
    TensorSpec("num_draft_tokens", "TYPE_INT32", (1,), doc="draft tokens verified (last response)"),
    TensorSpec("num_accepted_tokens", "TYPE_INT32", (1,), doc="draft tokens accepted (last response)"),
    TensorSpec("accept_length", "TYPE_FP32", (1,), doc="tau: tokens committed per target step (last response)"),
    TensorSpec("peak_running_requests", "TYPE_INT32", (1,),
               doc="most requests in one engine step while this one ran (> 1: it was batched with others)"),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,),
               doc="[beam]: the sum of output_log_probs so far (with return_log_probs; else 0)"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1),
               doc="[beam, tokens]: the logprob of each token of output_ids (with return_log_probs; else empty)"),
)

INPUT_NAMES = tuple(spec.name for spec in INPUTS)


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    chat: bool

    @property
    def return_log_probs(self) -> bool:
        return self.params.logprobs is not None


def _scalar(inputs: dict[str, np.ndarray], name: str):
    """The single value of a `[1, 1]` (or `[1]`) input, or None when absent."""
    array = inputs.get(name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequestError(f"{name} must hold one value, got shape {list(array.shape)}", name)
    return array.reshape(-1)[0]


def _decimal(value) -> float:
    """An FP32 input as the decimal the client wrote: 0.8 arrives as 0.800000011920929 and would
    sample (slightly) differently from `LLM` given 0.8; the shortest decimal that rounds to the
    same float32 is what was meant."""
    return float(str(np.float32(value)))


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8", name) from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name} must be a string (TYPE_STRING), got {type(value).__name__}", name)


def _strings(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    array = inputs.get(name)
    if array is None:
        return []
    return [s for s in (_text(v, name) for v in array.reshape(-1)) if s]


def parse_request(inputs: dict[str, np.ndarray], default_max_tokens: int = 64) -> ParsedRequest:
    """Input arrays (as Triton hands them, with the batch dimension) -> what to run.

    Triton has already checked names, data types and that `text_input` is present; this checks
    values, and raises `InvalidRequestError` naming the input at fault.
    """
    for name, array in inputs.items():
        if array.ndim >= 1 and array.shape[0] != 1:
            raise InvalidRequestError(f"{name}: send one prompt per request (batch size 1), got batch size "
                                      f"{array.shape[0]}; concurrent requests are batched in flight", name)
    prompt = _scalar(inputs, "text_input")
    if prompt is None:
        raise InvalidRequestError("the input text_input is missing", "text_input")
    prompt = _text(prompt, "text_input")
    if not prompt:
        raise InvalidRequestError("text_input is empty", "text_input")
    if _strings(inputs, "bad_words"):
        raise InvalidRequestError("bad_words is not supported by this model (send it empty or leave it out)",
                                  "bad_words")

    max_tokens = _scalar(inputs, "max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else int(max_tokens)  # SamplingParams checks its range
    seed, random_seed = _scalar(inputs, "seed"), _scalar(inputs, "random_seed")
    if seed is not None and random_seed is not None and int(seed) != int(random_seed):
        raise InvalidRequestError("seed and random_seed differ; send one of them", "seed")
    seed = seed if seed is not None else random_seed
    options = {}
    for name in ("temperature", "top_p"):
        value = _scalar(inputs, name)
        if value is not None:
            options[name] = _decimal(value)
    top_k = _scalar(inputs, "top_k")
    if top_k is not None:
        options["top_k"] = int(top_k)
    beam_width = _scalar(inputs, "beam_width")
    if beam_width is not None and int(beam_width) != 1:
        raise InvalidRequestError(f"beam_width must be 1 (this model does not run beam search), got {int(beam_width)}",
                                  "beam_width")
    end_id = _scalar(inputs, "end_id")
    if end_id is not None and int(end_id) < 0:
        raise InvalidRequestError(f"end_id must be a token id (>= 0), got {int(end_id)}", "end_id")
    params = SamplingParams(max_tokens=max_tokens, seed=None if seed is None else int(seed),
                            stop=_strings(inputs, "stop_words"), ignore_eos=bool(_scalar(inputs, "ignore_eos")),
                            stop_token_ids=[] if end_id is None else [int(end_id)],
                            logprobs=0 if _scalar(inputs, "return_log_probs") else None, **options)
    return ParsedRequest(prompt, params, stream=bool(_scalar(inputs, "stream")),
                         chat=bool(_scalar(inputs, "apply_chat_template")))


def response_arrays(text: str, token_ids: list[int], num_input_tokens: int, num_output_tokens: int,
                    peak_running: int, finish_reason: str | None = None, metrics: dict | None = None,
                    log_probs: list[float] | None = None, cum_log_prob: float = 0.0) -> dict[str, np.ndarray]:
    """One response's output arrays, each with the batch dimension first; `log_probs` those of
    `token_ids` (None: not asked for)."""
    metrics = metrics or {}

    def one(value, dtype) -> np.ndarray:
        return np.array([[value]], dtype=dtype)

    return {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array([token_ids], dtype=np.int32).reshape(1, -1),
        "finish_reason": np.array([[(finish_reason or "").encode()]], dtype=np.object_),
        "num_input_tokens": one(num_input_tokens, np.int32),
        "num_output_tokens": one(num_output_tokens, np.int32),
        "num_steps": one(metrics.get("num_steps", 0), np.int32),
        "num_draft_tokens": one(metrics.get("num_draft_tokens", 0), np.int32),
        "num_accepted_tokens": one(metrics.get("num_accepted_tokens", 0), np.int32),
        "accept_length": one(metrics.get("accept_length", 0.0), np.float32),
        "peak_running_requests": one(peak_running, np.int32),
        "cum_log_probs": one(cum_log_prob, np.float32),  # [batch, beam]
        "output_log_probs": np.array([log_probs or []], dtype=np.float32).reshape(1, 1, -1),  # [batch, beam, tokens]
    }
