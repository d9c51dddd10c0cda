"""Compare the TensorRT engines of an engine directory to the torch golden outputs, with polygraphy.

    python -m dspark_trt.builder.trt_check DIR

Loads `DIR/engines/{target,drafter}.plan` (the SequentialDraft plugin registered first), runs
them with polygraphy's `TrtRunner` on the inputs the build's validation saved
(`DIR/validation/*_inputs.json`), and compares to the saved torch outputs (`*_golden.json`)
with the build config's tolerances. A reduced-precision target engine (fp16/bf16, built from
`onnx/target.{precision}.onnx`) takes its KV pool in that type and is held to the relative bound
the build's CPU check uses (`validate.REDUCED_PRECISION_RTOL` of each output's largest
magnitude): it is not meant to match fp32 bit for bit; the fp32 drafter engine keeps the fp32
tolerances (greedy draft tokens identical). Exit status 1 on any mismatch. Needs TensorRT and a
GPU (run by ci/gpu.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _float64(array) -> np.ndarray:
    """numpy or torch (a bf16 engine's outputs come back as torch tensors: numpy has no bfloat16)."""
    import torch

    return torch.as_tensor(array).double().cpu().numpy() if isinstance(array, torch.Tensor) else \
        np.asarray(array, np.float64)


def typed_feeds(feed: dict, precision: str) -> dict:
    """A target feed for an engine of `precision`: its KV pool in that type (bf16 as a torch tensor,
    which polygraphy hands to TensorRT as it is: numpy has no bfloat16)."""
    if precision == "fp32":
        return feed
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    typed = dict(feed)
    for name in ("past_keys", "past_values"):
        tensor = torch.as_tensor(np.asarray(feed[name])).to(dtype)
        typed[name] = tensor.numpy() if dtype == torch.float16 else tensor
    return typed


def compare(engine_dir: Path) -> dict:
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import load_json

    from dspark_trt.builder.validate import REDUCED_PRECISION_RTOL, simple_compare_func
    from dspark_trt.plugins.sequential_draft_trt import register_tensorrt_plugin

    register_tensorrt_plugin()
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    v = manifest["config"]["validation"]
    precision = manifest["engines"].get("precision", "fp32")
    results = {}
    for name in ("target", "drafter"):
        plan = engine_dir / "engines" / f"{name}.plan"
        if not plan.is_file():
            continue
        feeds = load_json(str(engine_dir / "validation" / f"{name}_inputs.json"))
        golden = RunResults.load(str(engine_dir / "validation" / f"{name}_golden.json"))
        if name == "target":
            feeds = [typed_feeds(feed, precision) for feed in feeds]
        runner = TrtRunner(EngineFromBytes(BytesFromPath(str(plan))), name=f"tensorrt-{name}")
        run = Comparator.run([runner], data_loader=feeds)
        run.extend(golden)
        if name == "target" and precision != "fp32":
            expected = golden[0][1][0]
            atol = {k: REDUCED_PRECISION_RTOL * max(float(np.abs(np.asarray(expected[k], np.float64)).max(initial=0.0)),
                                                    1.0)
                    for k in ("logits", "features", "present_keys", "present_values")}
            rtol = {k: 0.0 for k in atol}
        elif name == "target":
            atol = {"logits": v["logits_atol"], "features": v["features_atol"], "present_keys": v["features_atol"],
                    "present_values": v["features_atol"]}
            rtol = {k: v["features_rtol"] if k != "logits" else 0.0 for k in atol}
        else:
            atol = {"draft_tokens": 0.0, "token_probs": v["probs_atol"], "confidences": v["probs_atol"],
                    "distributions": v["probs_atol"]}
            rtol = {k: 0.0 for k in atol}
        accuracy = Comparator.compare_accuracy(run, compare_func=simple_compare_func()(atol=atol, rtol=rtol))
        trt_out, torch_out = run[0][1][0], run[1][1][0]
        results[name] = {"ok": bool(accuracy), "max_abs": {k: float(np.abs(_float64(trt_out[k]) - _float64(torch_out[k]))
                                                                       .max(initial=0.0)) for k in atol}}
    return results


def main() -> int:
    engine_dir = Path(sys.argv[1])
    results = compare(engine_dir)
    print(json.dumps(results, indent=2))
    return 0 if results and all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
