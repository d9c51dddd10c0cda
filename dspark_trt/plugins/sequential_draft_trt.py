"""Face 3 of `SequentialDraft` (see `sequential_draft.py`): its TensorRT plugin, registered with
`tensorrt.plugin` (TensorRT >= 10.7) when `register_tensorrt_plugin()` is first called (the builder
before parsing a graph that holds it, the runtime before loading such an engine).

This module must not use `from __future__ import annotations` (the `str | None` annotation of a
module variable is not inspected). TensorRT reads the registered
functions' annotations as classes (`issubclass(param.annotation, TensorDesc)` for every
parameter); postponed annotations are strings, and the registration raises TypeError, so no
engine holding the plugin could be built. `tests/test_plugin_registration.py` applies TensorRT's
checks to these functions on CPU, and registers them for real where `tensorrt` is installed.
"""

import torch

from dspark_trt.plugins import sequential_draft_kernel as kernel
from dspark_trt.plugins.sequential_draft import PLUGIN_ID, reference

_registered: str | None = None  # the implementation registered: "aot" or "jit"


def register_tensorrt_plugin() -> str:
    """Register `dspark::SequentialDraft` with TensorRT's plugin registry (idempotent); returns
    which implementation a build should ask for: "aot" or "jit".

    Shapes/types come from `@trtp.register`. Two implementations:
    - ahead of time (`@trtp.aot_impl`, TensorRT >= 10.9): the CUDA kernel of
      `sequential_draft_kernel.cu`, built by nvcc to PTX that the engine embeds, so the engine
      loads without Python (trtexec, Triton's TensorRT backend, TensorRT-LLM's C++ runtime).
      A build then creates its network with `PREFER_AOT_PYTHON_PLUGINS` (`trt_engines.py`);
    - just in time (`@trtp.impl`): the torch reference on the plugin's CUDA stream, on the
      device tensors TensorRT hands over; an engine built with it needs this registration (so
      Python) at load time. Used where the kernel cannot be built (no nvcc) or TensorRT has no
      `aot_impl`.
    """
    global _registered
    if _registered:
        return _registered
    import tensorrt as trt
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _describe(logits: trtp.TensorDesc, hidden: trtp.TensorDesc, anchor_ids: trtp.TensorDesc,
                  w1: trtp.TensorDesc, w2: trtp.TensorDesc, gru_w_ih: trtp.TensorDesc, gru_w_hh: trtp.TensorDesc,
                  gru_b_ih: trtp.TensorDesc, gru_b_hh: trtp.TensorDesc, conf_w: trtp.TensorDesc,
                  conf_b: trtp.TensorDesc, conf_inv_temps: trtp.TensorDesc, temperatures: trtp.TensorDesc,
                  uniforms: trtp.TensorDesc, history: trtp.TensorDesc, draft_vocab: trtp.TensorDesc,
                  to_draft: trtp.TensorDesc, copy_alpha: trtp.TensorDesc, copy_beta: trtp.TensorDesc,
                  top_prob_w: trtp.TensorDesc, head: int, has_confidence: int, copy_ngram: int, copy_confidence: int,
                  top_prob: int) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        ids = uniforms.like()  # [B, G], int64 draft ids
        ids.dtype = trt.int64
        return ids, uniforms.like(), uniforms.like(), logits.like()

    @trtp.impl(PLUGIN_ID)
    def _run(logits: trtp.Tensor, hidden: trtp.Tensor, anchor_ids: trtp.Tensor, w1: trtp.Tensor, w2: trtp.Tensor,
             gru_w_ih: trtp.Tensor, gru_w_hh: trtp.Tensor, gru_b_ih: trtp.Tensor, gru_b_hh: trtp.Tensor,
             conf_w: trtp.Tensor, conf_b: trtp.Tensor, conf_inv_temps: trtp.Tensor, temperatures: trtp.Tensor,
             uniforms: trtp.Tensor, history: trtp.Tensor, draft_vocab: trtp.Tensor, to_draft: trtp.Tensor,
             copy_alpha: trtp.Tensor, copy_beta: trtp.Tensor, top_prob_w: trtp.Tensor, head: int, has_confidence: int,
             copy_ngram: int, copy_confidence: int, top_prob: int, outputs: tuple[trtp.Tensor], stream: int) -> None:
        inputs = [torch.as_tensor(t, device="cuda") for t in (logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh,
                                                             gru_b_ih, gru_b_hh, conf_w, conf_b, conf_inv_temps,
                                                             temperatures, uniforms, history, draft_vocab, to_draft,
                                                             copy_alpha, copy_beta, top_prob_w)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            results = reference(*inputs, head=head, has_confidence=has_confidence, copy_ngram=copy_ngram,
                                copy_confidence=copy_confidence, top_prob=top_prob)
            for out, value in zip(outputs, results):
                torch.as_tensor(out, device="cuda").copy_(value)

    _registered = "jit"
    if not hasattr(trtp, "aot_impl"):  # TensorRT < 10.9
        return _registered
    try:
        ptx = kernel.ptx()
    except (kernel.KernelBuildError, OSError):  # no nvcc, or no writable cache: the JIT plugin serves
        return _registered

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(logits: trtp.TensorDesc, hidden: trtp.TensorDesc, anchor_ids: trtp.TensorDesc, w1: trtp.TensorDesc,
             w2: trtp.TensorDesc, gru_w_ih: trtp.TensorDesc, gru_w_hh: trtp.TensorDesc, gru_b_ih: trtp.TensorDesc,
             gru_b_hh: trtp.TensorDesc, conf_w: trtp.TensorDesc, conf_b: trtp.TensorDesc,
             conf_inv_temps: trtp.TensorDesc, temperatures: trtp.TensorDesc, uniforms: trtp.TensorDesc,
             history: trtp.TensorDesc, draft_vocab: trtp.TensorDesc, to_draft: trtp.TensorDesc,
             copy_alpha: trtp.TensorDesc, copy_beta: trtp.TensorDesc, top_prob_w: trtp.TensorDesc, head: int,
             has_confidence: int, copy_ngram: int, copy_confidence: int, top_prob: int,
             outputs: tuple[trtp.TensorDesc], tactic: int
             ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        return aot_launch(trtp, ptx, logits, hidden, w1, history, to_draft, copy_alpha,
                          (head, has_confidence, copy_ngram, copy_confidence, top_prob))

    _registered = "aot"
    return _registered


def aot_launch(trtp, ptx: str, logits, hidden, w1, history, to_draft, copy_alpha, attributes: tuple[int, ...]):
    """What `aot_impl` returns: the kernel's name and PTX, one block per row, and the kernel's int32
    scalars in its order (B, G, V, D, R, H, N, V_target, then the five attributes, which an AOT
    plugin does not serialise: they are baked in as constants)."""
    rank = w1.shape_expr[1] if w1.ndim == 2 else 0  # a placeholder [1] without a head or confidence
    history_length = history.shape_expr[1] if history.ndim == 2 else 0
    ngram_columns = copy_alpha.shape_expr[1] if copy_alpha.ndim == 2 else 0
    dims = [logits.shape_expr[0], logits.shape_expr[1], logits.shape_expr[2], hidden.shape_expr[2], rank,
            history_length, ngram_columns, to_draft.shape_expr[0]]
    scalars = [*dims, *attributes]
    extra = trtp.SymIntExprs(len(scalars))
    for i, value in enumerate(scalars):
        extra[i] = trtp.SymInt32(value)
    threads, shared_bytes = kernel.launch_shape(constant(rank))  # w1 is a weight: its shape is known
    if shared_bytes > kernel.MAX_SHARED_BYTES:
        raise ValueError(f"a head of rank {constant(rank)} needs {shared_bytes} bytes of shared memory, more than "
                         f"the {kernel.MAX_SHARED_BYTES} a kernel gets without opting in")
    launch = trtp.KernelLaunchParams()
    launch.grid_x = logits.shape_expr[0]  # one block per row
    launch.block_x = threads
    launch.shared_mem = shared_bytes
    return kernel.KERNEL_NAME.encode(), ptx.encode(), launch, extra


def constant(value) -> int:
    """The value of a constant shape expression (TensorRT's `constant_value()` is a method) or an int."""
    if isinstance(value, int):
        return value
    if not value.is_constant:
        raise ValueError(f"{value} is not a build-time constant")
    return int(value.constant_value())
