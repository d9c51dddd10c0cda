"""Compare the TensorRT engines of an engine directory to the torch golden outputs, with polygraphy.

    python -m dspark_trt.builder.trt_check DIR

Loads `DIR/engines/{target,drafter}.plan` (the SequentialDraft plugin registered first), runs
them with polygraphy's `TrtRunner` on the inputs the build's validation saved
(`DIR/validation/*_inputs.json`), and compares to the saved torch outputs (`*_golden.json`)
with the build config's tolerances (fp16 engines get 1e-2: they are not meant to match fp32
bit for bit; greedy draft tokens must still be identical). Exit status 1 on any mismatch.
Needs TensorRT and a GPU (run by ci/gpu.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def compare(engine_dir: Path) -> dict:
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc
    from polygraphy.json import load_json

    from dspark_trt.plugins.sequential_draft import register_tensorrt_plugin

    register_tensorrt_plugin()
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    v = manifest["config"]["validation"]
    loose = manifest["engines"].get("precision") != "fp32"
    results = {}
    for name in ("target", "drafter"):
        plan = engine_dir / "engines" / f"{name}.plan"
        if not plan.is_file():
            continue
        feeds = load_json(str(engine_dir / "validation" / f"{name}_inputs.json"))
        golden = RunResults.load(str(engine_dir / "validation" / f"{name}_golden.json"))
        runner = TrtRunner(EngineFromBytes(BytesFromPath(str(plan))), name=f"tensorrt-{name}")
        run = Comparator.run([runner], data_loader=feeds)
        run.extend(golden)
        if name == "target":
            atol = {"logits": 1e-2 if loose else v["logits_atol"], "features": 1e-2 if loose else v["features_atol"],
                    "present_keys": 1e-2 if loose else v["features_atol"],
                    "present_values": 1e-2 if loose else v["features_atol"]}
            rtol = {k: (1e-2 if loose else v["features_rtol"]) if k != "logits" else 0.0 for k in atol}
        else:
            atol = {"draft_tokens": 0.0, "token_probs": 1e-2 if loose else v["probs_atol"],
                    "confidences": 1e-2 if loose else v["probs_atol"], "distributions": 1e-2 if loose else v["probs_atol"]}
            rtol = {k: 0.0 for k in atol}
        accuracy = Comparator.compare_accuracy(run, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol))
        trt_out, torch_out = run[0][1][0], run[1][1][0]
        results[name] = {"ok": bool(accuracy), "max_abs": {k: float(np.abs(np.asarray(trt_out[k], np.float64)
                                                                         - np.asarray(torch_out[k], np.float64)).max())
                                                          for k in atol}}
    return results


def main() -> int:
    engine_dir = Path(sys.argv[1])
    results = compare(engine_dir)
    print(json.dumps(results, indent=2))
    return 0 if results and all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
