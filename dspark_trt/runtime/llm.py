"""`LLM`: the offline Python API (the shape vLLM and TensorRT-LLM users know).

    llm = LLM(target="default")
    outs = llm.generate(["prompt", ...], SamplingParams(max_tokens=64, temperature=0.0, seed=0))
    outs[0].text, outs[0].token_ids, outs[0].metrics

All prompts of one `generate` call are batched together in the engine's step loop. This module
only turns prompts into token ids and engine requests back into outputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.linear import DEFAULT_DTYPE, dtype_name, resolve_dtype
from dspark_trt.models.loading import LoadedTarget, load_target
from dspark_trt.runtime.chat import Messages, encode_chat, render_chat
from dspark_trt.runtime.engine import Engine
from dspark_trt.runtime.in_flight import Job, run_in_flight
from dspark_trt.runtime.logprobs import TokenLogprob
from dspark_trt.runtime.profile import LatencyProfile, torch_backend_name
from dspark_trt.runtime.proposer import Proposer
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.sampling import SamplingParams
from dspark_trt.runtime.verify_policy import DEFAULT_POLICY



@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict = field(default_factory=dict)  # num_steps, num_draft_tokens, num_accepted_tokens, accept_length, ...
    logprobs: list[TokenLogprob] | None = None  # per output token, with SamplingParams.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, with SamplingParams.prompt_logprobs

    @classmethod
    def from_request(cls, request: Request) -> "RequestOutput":
        params = request.params
        return cls(request.request_id, request.prompt_token_ids, request.output_text,
                   list(request.output_token_ids), request.finish_reason.value, request.metrics(),
                   request.output_logprobs if params.logprobs is not None else None,
                   request.prompt_logprobs if params.prompt_logprobs is not None else None)


class LLM:
    def __init__(self, target: str | os.PathLike = "default", drafter: Proposer | str | None = None,
                 engine_dir: str | os.PathLike | None = None, dtype: str = DEFAULT_DTYPE,
                 max_batch_size: int = 32, max_batch_tokens: int = 2048, max_model_len: int = 2048,
                 policy: str = DEFAULT_POLICY, profile: LatencyProfile | str | os.PathLike | None = None,
                 batch_invariant: bool = False, device: str | torch.device = "cpu", drafter_graph: bool | None = None):
        """`policy`: how many draft tokens each step verifies (`auto`, `none`, `all`, `fixed:K`,
        `threshold:H`, `dspark`, `dspark-lagged`; `verify_policy.resolve_policy`). The default,
        `auto`, is `dspark` for a drafter with a confidence head (with a quick latency profile
        measured at start-up when none is given), the whole block for one without, else `none`.
        `profile`: a `profile.json` (or `LatencyProfile`) for the confidence policies; without
        one they measure a quick profile at start-up.
        `batch_invariant`: every request's output is what it would be alone (same tokens at
        temperature 0 whatever else runs; same samples per seed with a per-request policy).
        Row-by-row matmuls (and, on a GPU, norms) make it several times slower: for tests and
        reproducibility.
        `dtype`: `float32`, `bfloat16` (bf16 weight matrices, fp32 activations, each matmul's input
        rounded to bf16 on AMX: faster on CPU and, where our CPU kernels run (AMX, AVX-512 or
        AVX2+FMA), batch invariant by construction), `int4` (the target's layer matrices in their
        GGUF 4-bit blocks and its LM head in 8-bit ones, each matmul's input quantized to int8; CPUs
        with AMX-INT8 only; the drafter in bf16), or `auto` (bfloat16 where those kernels run, else
        float32; see `models/linear.py`). The drafter uses the same (bf16 under int4).
        With `engine_dir`, `auto` is the dtype the directory was built and profiled in.
        `device`: where the PyTorch target runs (`cpu`, `cuda`, `cuda:N`, `auto`). The drafter,
        sampling and verification stay on the CPU, as they do beside a TensorRT engine (which
        runs on its GPU whatever this says).
        `drafter_graph` (with `engine_dir`): draft with the directory's exported drafter graph
        (`runtime/graph_proposer.py`) instead of the PyTorch drafter: its TensorRT engine on the
        GPU, or its ONNX graph in ONNX Runtime on the CPU. Default: for a TensorRT directory."""
        from dspark_trt.runtime.device import resolve_device

        if drafter_graph and engine_dir is None:
            raise InvalidRequestError("drafter_graph serves an engine directory's drafter graph: give engine_dir",
                                      "drafter_graph")
        device = resolve_device(device)  # before loading anything: a missing GPU fails fast
        built = None
        if engine_dir is not None:  # target, drafter and latency profile come from what `dspark-trt build` wrote
            from dspark_trt.runtime.engine_dir import open_engine_dir

            if drafter is not None:
                raise InvalidRequestError("give engine_dir or drafter, not both (the engine directory has its drafter)",
                                          "drafter")
            built = open_engine_dir(engine_dir)
            if built.backend != "tensorrt" and device.type != "cpu":
                raise InvalidRequestError(f"{engine_dir} was built for the CPU (its latency profile was measured "
                                          "there); use device cpu, or build one on this GPU", "device")
            target, drafter = built.target_spec, built.drafter_path
            built_dtype = built.manifest.get("dtype", "float32")
            if dtype == "auto":  # what the directory was built (and profiled) with
                dtype = built_dtype
            elif dtype != built_dtype and built.backend != "tensorrt" and profile is None:
                raise InvalidRequestError(f"{engine_dir} was built and profiled for dtype {built_dtype}; give that "
                                          f"(or auto), or rebuild it with dtype: {dtype}", "dtype")
            profile = profile if profile is not None else built.profile_path
        try:
            weight_dtype = resolve_dtype(dtype, device)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "dtype") from None
        self.dtype = dtype_name(weight_dtype)  # what `auto` became
        self.target: LoadedTarget = load_target(target, weight_dtype)
        if built is not None:
            built.check_target(self.target.name, self.target.config)
        self.tokenizer = self.target.tokenizer
        proposer = drafter
        if isinstance(drafter, (str, os.PathLike)):
            from dspark_trt.models.drafter_io import load_drafter
            from dspark_trt.models.eagle import EagleDrafter
            from dspark_trt.runtime.dspark_proposer import DSparkProposer
            from dspark_trt.runtime.eagle_proposer import EagleProposer

            model = load_drafter(drafter, self.target)
            if weight_dtype in (torch.bfloat16, torch.int4):  # an int4 target's drafter: bf16
                model.use_bf16_weights()
            proposer = EagleProposer(model) if isinstance(model, EagleDrafter) else DSparkProposer(model)
            if built is not None and (drafter_graph if drafter_graph is not None else built.backend == "tensorrt"):
                from dspark_trt.runtime.graph_proposer import graph_proposer

                proposer = graph_proposer(built, model)
        if isinstance(profile, (str, os.PathLike)):
            profile = LatencyProfile.load(profile)
        if built is not None and built.backend == "tensorrt":  # the engine holds the GPU's copy
            from dspark_trt.runtime.trt_backend import tensorrt_target

            self.target = tensorrt_target(self.target, built.file("target_engine"))
        else:
            # Only now, with the drafter holding the CPU embedding and LM head it borrowed: it
            # drafts on the CPU whatever the target's device (`Module.to` gives the target new tensors).
            self.target.model.to(device)
            expected = torch_backend_name(device, weight_dtype)
            if profile is not None and profile.backend != expected:
                raise InvalidRequestError(f"the latency profile was measured for {profile.backend} ({profile.device}) "
                                          f"but this target runs as {expected}; measure one here "
                                          "(dspark-trt profile, with the same --dtype) or give none", "profile")
        self.engine = Engine(self.target, proposer, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                             max_model_len=max_model_len, policy=policy, profile=profile,
                             batch_invariant=batch_invariant)

    # ---- prompts ----------------------------------------------------------------------------

    def encode(self, prompt: str | list[int] | Messages, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text, already-tokenised ids, or chat messages."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list):  # chat messages
            return self.encode_chat(prompt)
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt must be a string, token ids or chat messages, got {type(prompt).__name__}",
                                      "prompt")
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: Messages) -> list[int]:
        return encode_chat(self.tokenizer, messages, self.target.name)

    def render_chat(self, messages: Messages) -> str:
        """The target's chat template applied to `messages`, ready for the assistant's reply."""
        return render_chat(self.tokenizer, messages, self.target.name)

    # ---- generation -------------------------------------------------------------------------

    def generate(self, prompts: str | list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (batched); outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError("give one SamplingParams, or one per prompt", "sampling_params")
        token_lists = [self.encode(p, chat) for p in prompts]
        for ids in token_lists:  # validate all before starting any
            self.engine.check_prompt(ids)
        jobs = [Job(ids, params) for ids, params in zip(token_lists, sampling_params)]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(jobs), desc="generating", unit="req")
        try:  # every prompt in flight at once: the engine admits them as KV slots free
            requests = run_in_flight(self.engine, jobs, max_in_flight=len(jobs), progress=progress)
        finally:
            if progress is not None:
                progress.close()
        return [RequestOutput.from_request(r) for r in requests]

    def chat(self, messages: Messages | list[Messages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(list(conversations), sampling_params, use_tqdm=use_tqdm)
