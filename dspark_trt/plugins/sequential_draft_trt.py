"""Face 3 of `SequentialDraft` (see `sequential_draft.py`): its TensorRT plugin, registered with
`tensorrt.plugin` (TensorRT >= 10.7) when `register_tensorrt_plugin()` is first called.

This module must not use `from __future__ import annotations`. TensorRT reads the registered
functions' annotations as classes (`issubclass(param.annotation, TensorDesc)` for every
parameter); postponed annotations are strings, and the registration raises TypeError, so no
engine holding the plugin could be built. `tests/test_plugin_registration.py` applies TensorRT's
checks to these functions on CPU, and registers them for real where `tensorrt` is installed.
"""

import torch

from dspark_trt.plugins.sequential_draft import PLUGIN_ID, reference

_registered = False


def register_tensorrt_plugin() -> None:
    """Register `dspark::SequentialDraft` with TensorRT's plugin registry (idempotent).

    Shapes/types come from `@trtp.register`; the implementation (`@trtp.impl`) runs the torch
    reference on the plugin's CUDA stream, on the device tensors TensorRT hands over (no copies).
    It is a JIT plugin: an engine that contains it needs this registration (so Python) at load
    time. An ahead-of-time (`@trtp.aot_impl`) kernel needs a compiled (Triton/CUDA) kernel of
    the sampling loop; it is not written yet, and `builder/trt_engines.py` records that.
    """
    global _registered
    if _registered:
        return
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

    _registered = True
