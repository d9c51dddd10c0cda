"""The `tensorrt` backend: the target step runs in the TensorRT engine that `build` serialised.

`tensorrt_target(loaded, plan)` returns the same `LoadedTarget` with its `model` replaced by
`TensorRTTargetModel`, which has the interface the step loop and the profiler use
(`new_pool`, `forward(token_ids, num_new_tokens, caches, logits_indices, feature_layers, batch_invariant)`,
`config`), so `Engine`, `measure_latency_profile` and `LLM` run unchanged on it:

- the KV pool lives on the GPU in the engine's layout `[L, S, KVH, C, HD]` (runtime/kv_cache.py);
  the engine reads `past_*` and writes `present_*`, and the two buffers swap roles after each
  step (no copy; TensorRT cannot alias an input to an output);
- logits and features come back to the CPU, where verification and the drafter run;
- everything else (embedding and LM head for the drafter, tokenizer) stays the torch model's.

The drafter engine (`drafter.plan`, with the SequentialDraft plugin) is built and checked by
`ci/gpu.sh`; the step loop drafts with the torch proposer. `tensorrt` is imported lazily.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dspark_trt.errors import DsparkError
from dspark_trt.models.target import TargetOutput
from dspark_trt.models.kv_cache import KVCache, KVPool


class TensorRTUnavailable(DsparkError):
    """The engine directory needs TensorRT and a GPU that this machine does not have."""


class TensorRTTargetModel:
    def __init__(self, torch_model, plan_path: Path, feature_layers: tuple[int, ...]):
        try:
            import tensorrt as trt
        except ImportError:
            raise TensorRTUnavailable("this engine directory was built for the tensorrt backend, but tensorrt is not "
                                      "installed; rebuild it here with `dspark-trt build` to serve on CPU") from None
        if not torch.cuda.is_available():
            raise TensorRTUnavailable("this engine directory was built for the tensorrt backend, but no CUDA GPU is "
                                      "visible; rebuild it here with `dspark-trt build` to serve on CPU")
        self.torch_model = torch_model
        self.config = torch_model.config
        self.feature_layers = tuple(feature_layers)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise DsparkError(f"TensorRT could not load {plan_path} (built with another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.spare: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(pool) -> the other K/V buffers

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's type: the engine's (a strongly typed fp16/bf16 graph keeps its pool in fp16/bf16)."""
        import tensorrt as trt

        types = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16}
        return types[self.engine.get_tensor_dtype("past_keys")]

    @property
    def max_logit_rows(self) -> int:
        """The most logit rows one step may ask for (the engine's profile: target_shapes.num_logits)."""
        return int(self.engine.get_tensor_profile_shape("logits_indices", 0)[2][0])

    def __getattr__(self, name):  # embed, lm_head, final_norm, ...: the torch model's (the drafter borrows them)
        return getattr(self.torch_model, name)

    def prepare(self) -> None:
        """Nothing to pack: the engine was built with its weights (`TargetModel.prepare`'s twin)."""

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        c = self.config
        # The engine's optimization profile bounds the pool: [L, S, KVH, C, HD] at most `biggest`.
        biggest = tuple(self.engine.get_tensor_profile_shape("past_keys", 0)[2])
        if num_slots > biggest[1] or slot_capacity > biggest[3]:
            raise DsparkError(f"the target engine was built for at most {biggest[1]} KV slots of {biggest[3]} positions "
                              f"(target_shapes.num_slots / slot_capacity); asked for {num_slots} x {slot_capacity}: "
                              "lower max_batch_size / max_model_len or rebuild with larger shapes")
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 1, 1)  # bookkeeping; buffers replaced below
        shape = (c.num_layers, num_slots, c.num_kv_heads, slot_capacity, c.head_dim)
        kv_dtype = self.kv_dtype

        def buffer() -> torch.Tensor:
            return torch.zeros(shape, dtype=kv_dtype, device="cuda")

        pool.keys, pool.values = buffer(), buffer()
        pool.slot_capacity = slot_capacity
        pool._free = list(range(num_slots - 1, -1, -1))
        self.spare[id(pool)] = (buffer(), buffer())
        return pool

    def __call__(self, *args, **kwargs) -> TargetOutput:
        return self.forward(*args, **kwargs)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_new_tokens: list[int], caches: list[KVCache],
                logits_indices: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                batch_invariant: bool = False) -> TargetOutput:
        if batch_invariant:  # the engine's kernels pick their tiling by batch shape
            raise DsparkError("a TensorRT target engine cannot run batch invariant (use the PyTorch target)")
        if feature_layers and tuple(feature_layers) != self.feature_layers:
            raise DsparkError(f"the target engine returns feature layers {list(self.feature_layers)}, "
                              f"not {list(feature_layers)}")
        pool = caches[0].pool
        for cache, count in zip(caches, num_new_tokens):
            if cache.length + count > cache.capacity:
                raise ValueError(f"KV slot overflow: {cache.length} + {count} > capacity {cache.capacity}")
        positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, num_new_tokens)])
        slots = torch.cat([torch.full((n,), c.slot) for c, n in zip(caches, num_new_tokens)])
        if logits_indices is None:
            logits_indices = torch.arange(token_ids.shape[0])
        inputs = {"input_ids": token_ids, "positions": positions, "token_slots": slots,
                  "logits_indices": logits_indices}
        inputs = {k: v.to("cuda", torch.int64, non_blocking=True).contiguous() for k, v in inputs.items()}
        present_k, present_v = self.spare[id(pool)]
        inputs.update(past_keys=pool.keys, past_values=pool.values)
        for name, tensor in inputs.items():
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                low, _, high = self.engine.get_tensor_profile_shape(name, 0)
                raise DsparkError(f"{name} of shape {tuple(tensor.shape)} is outside the engine's optimization profile "
                                  f"[{tuple(low)}, {tuple(high)}] (target_shapes in the build config)")
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {"logits": torch.empty(logits_indices.shape[0], self.config.vocab_size, device="cuda"),
                   "features": torch.empty(token_ids.shape[0], len(self.feature_layers) * self.config.hidden_size,
                                           device="cuda"),
                   "present_keys": present_k, "present_values": present_v}
        for name, tensor in outputs.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise DsparkError("TensorRT failed to run the target engine")
        self.stream.synchronize()
        # The engine wrote the whole pool with this step's keys/values: swap buffers, no copy.
        self.spare[id(pool)] = (pool.keys, pool.values)
        pool.keys, pool.values = present_k, present_v
        for cache, count in zip(caches, num_new_tokens):
            cache.advance(count)
        features = outputs["features"] if feature_layers else None  # stays on the GPU (model_runner.py)
        return TargetOutput(logits=outputs["logits"].cpu(), features=features)


def tensorrt_target(loaded, plan_path: Path, feature_layers: tuple[int, ...] | None = None):
    """`loaded` (a LoadedTarget) with its step running in the TensorRT engine at `plan_path`."""
    if feature_layers is None:
        import json

        manifest = json.loads((Path(plan_path).parent.parent / "manifest.json").read_text()) \
            if (Path(plan_path).parent.parent / "manifest.json").is_file() else {}
        feature_layers = tuple(manifest.get("feature_layers", ()))
    return dataclasses.replace(loaded, model=TensorRTTargetModel(loaded.model, plan_path, feature_layers))
