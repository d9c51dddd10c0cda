"""A drafter served from its exported graph: the engine directory's drafter ONNX run by ONNX
Runtime on the CPU, or its TensorRT engine (`engines/drafter.plan`) on the GPU beside the target
engine. The same `Proposer` contract as `DSparkProposer`, from the graph's inputs and outputs
(`builder/export_drafter.py`):

    observe(request, features)   keep the target features of the kept positions (the context
                                 rows), and the tokens at them, per request
    propose(requests)            one call for the batch: context_features [B, C, m*D] padded,
                                 context_lengths, anchor_tokens (the pending tokens),
                                 temperatures, one uniform per slot from each request's own
                                 generator (and context_tokens with a copy bias) -> draft tokens,
                                 their distributions over the draft vocabulary, confidences

The graph is stateless (it re-projects the context each call), so a request's state is only its
context rows. A seeded sampled request's tokens do not depend on the drafts at all
(`sampling.verify_draft_coupled`), so the graph's inverse-CDF draws serve it too, but they are
not coupled to the target's per-position noise as `DSparkProposer`'s are, so its drafts are
accepted less often (the graph has no noise input yet). The runners
(`OnnxRuntimeDrafter`, `TensorRTDrafter`) only run the graph: numpy in and out for ONNX Runtime,
torch tensors on the GPU for TensorRT. The GPU path has not run yet (no GPU here); the CPU path is
tested against `DSparkProposer` (tests/test_graph_proposer.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_trt.builder.export_drafter import OUTPUT_NAMES, input_names
from dspark_trt.errors import DsparkError
from dspark_trt.runtime.proposer import Draft, Proposer, reads_draft_probs, to_target_vocab
from dspark_trt.runtime.request import Request


class OnnxRuntimeDrafter:
    """The drafter graph in ONNX Runtime on the CPU (an all-standard-ops graph: `drafter_unrolled.onnx`,
    or `drafter.onnx` for a drafter without a plugin form)."""

    device = torch.device("cpu")

    def __init__(self, path: Path):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = self.session.run(OUTPUT_NAMES, {name: value.numpy() for name, value in feeds.items()})
        return {name: torch.from_numpy(value) for name, value in zip(OUTPUT_NAMES, outputs)}


class TensorRTDrafter:
    """The drafter engine (`engines/drafter.plan`) on the GPU: feeds and outputs stay torch CUDA tensors."""

    device = torch.device("cuda")

    def __init__(self, plan_path: Path):
        import tensorrt as trt

        from dspark_trt.plugins.sequential_draft_trt import register_tensorrt_plugin

        register_tensorrt_plugin()  # a JIT engine needs it to load; an AOT one carries its kernel
        self.trt = trt
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise DsparkError(f"TensorRT could not load {plan_path} (built with another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch, block = feeds["uniforms"].shape
        for name, value in feeds.items():
            value = value.to(self.device).contiguous()
            feeds[name] = value
            if not self.context.set_input_shape(name, tuple(value.shape)):
                low, _, high = self.engine.get_tensor_profile_shape(name, 0)
                raise DsparkError(f"drafter input {name} of shape {tuple(value.shape)} is outside the engine's "
                                  f"profile [{tuple(low)}, {tuple(high)}] (drafter_shapes in the build config)")
            self.context.set_tensor_address(name, value.data_ptr())
        outputs = {}
        for name in OUTPUT_NAMES:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = torch.long if name == "draft_tokens" else torch.float32
            outputs[name] = torch.empty(shape, dtype=dtype, device=self.device)
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise DsparkError("TensorRT failed to run the drafter engine")
        self.stream.synchronize()
        return outputs


class GraphProposer(Proposer):
    def __init__(self, runner, config, draft_vocab: torch.Tensor):
        """`runner(feeds) -> outputs` runs the drafter graph; `config` is the drafter's `DrafterConfig`,
        `draft_vocab` `[V_d]` its draft-id -> target-id map."""
        self.runner = runner
        self.config = config
        self.draft_vocab = draft_vocab.cpu()
        self.feature_layers = tuple(config.feature_layers)
        self.has_confidence = bool(config.confidence)
        self.block_size = config.block_size
        self.input_names = input_names(config)
        self.contexts: dict[str, list[torch.Tensor]] = {}  # request id -> feature rows, in order

    def observe(self, request: Request, features: torch.Tensor) -> None:
        # A copy: `features` is a view of the whole step's output, which would otherwise live on.
        self.contexts.setdefault(request.request_id, []).append(features.to(self.runner.device).clone())

    def release(self, request: Request) -> None:
        self.contexts.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        if not requests:
            return []
        contexts = [torch.cat(self.contexts[r.request_id]) for r in requests]  # [L_b, m*D] each
        longest = max(len(c) for c in contexts)
        device = self.runner.device
        features = torch.zeros(len(requests), longest, contexts[0].shape[-1], device=device)
        tokens = torch.zeros(len(requests), longest, dtype=torch.long)
        for i, (request, context) in enumerate(zip(requests, contexts)):
            features[i, : len(context)] = context
            committed = (request.prompt_token_ids + request.output_token_ids)[: len(context)]  # the rows' tokens
            tokens[i, : len(committed)] = torch.tensor(committed)
        temperatures = torch.tensor([0.0 if r.params.greedy else float(r.params.temperature) for r in requests])
        uniforms = torch.stack([torch.rand(self.block_size, generator=r.generator) for r in requests])
        feeds = {"context_features": features, "context_lengths": torch.tensor([len(c) for c in contexts]),
                 "anchor_tokens": torch.tensor([r.pending_token for r in requests]), "temperatures": temperatures,
                 "uniforms": uniforms, "context_tokens": tokens}
        outputs = {name: value.cpu() for name, value in self.runner({k: feeds[k] for k in self.input_names}).items()}
        drafts = []
        for i, request in enumerate(requests):
            probs = None
            if reads_draft_probs(request):
                probs = to_target_vocab(outputs["distributions"][i], self.draft_vocab, self.config.target_vocab_size)
            confidences = outputs["confidences"][i] if self.has_confidence else None
            drafts.append(Draft(outputs["draft_tokens"][i].tolist(), probs, confidences))
        return drafts


def graph_proposer(engine_dir, drafter) -> GraphProposer:
    """The engine directory's drafter graph: its TensorRT engine where the directory has one (the
    GPU), else its ONNX Runtime graph (the CPU). `drafter`: the directory's loaded drafter (its
    config and draft vocabulary)."""
    plan = engine_dir.file("drafter_engine")
    if engine_dir.backend == "tensorrt" and plan is not None:
        return GraphProposer(TensorRTDrafter(plan), drafter.config, drafter.draft_vocab)
    graph = engine_dir.file("drafter_unrolled_onnx") or engine_dir.file("drafter_onnx")
    if graph is None:
        raise DsparkError(f"{engine_dir.path} has no drafter graph to serve (it was built without a drafter)")
    if engine_dir.file("drafter_unrolled_onnx") is None and engine_dir.manifest["drafter"].get("sequential_head") \
            == "SequentialDraft plugin":
        raise DsparkError(f"{engine_dir.path}: drafter.onnx holds the SequentialDraft plugin, which ONNX Runtime "
                          "cannot run, and no drafter_unrolled.onnx")
    return GraphProposer(OnnxRuntimeDrafter(graph), drafter.config, drafter.draft_vocab)
