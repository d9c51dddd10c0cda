"""The training rows the CPU fine-tunes of the gpu-data DSpark train on (never a held-out one),
one definition for `copy_fine_tune.sh`, `resample_fine_tune.sh` and `chat_heavy_fine_tune.sh`:

    python benchmarks/experiments/fine_tune_rows.py copy|resample-chat|resample-all|chat-heavy OUT.jsonl.gz

- copy: every 5th training row of the three files the gpu-data pair was trained on (3,212 rows);
- resample-chat: those plus every chat second response (`bf16-resample`) of a training prompt;
- resample-all: those plus every 2nd code and math second response;
- chat-heavy: every chat training row of the four files (first and second responses, follow-ups)
  plus every 4th code and math one, so that chat is ~2/3 of the rows and the other domains stay in view.

Written atomically (OUT.part, then renamed), so a stopped run leaves no half-written subset.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

GPU_DATA_FILES = ("data/train/smollm2-135m-instruct.bf16.jsonl.gz",
                  "data/train/smollm2-135m-instruct.bf16-code-extra.jsonl.gz",
                  "data/train/smollm2-135m-instruct.bf16-followup.jsonl.gz")
SECOND_RESPONSES = "data/train/smollm2-135m-instruct.bf16-resample.jsonl.gz"
SUBSETS = ("copy", "resample-chat", "resample-all", "chat-heavy")


def training_rows(path: str) -> list[tuple[str, str]]:
    """(line, domain) of each training row of `path`, held-out rows dropped; each line parsed once."""
    from dspark_trt.training.trainer import is_held_out

    rows = []
    for line in gzip.open(path, "rt"):
        row = json.loads(line)
        if not is_held_out(row["id"]):
            rows.append((line, row["domain"]))
    return rows


def subset(name: str) -> list[str]:
    if name == "chat-heavy":
        rows = [pair for path in (*GPU_DATA_FILES, SECOND_RESPONSES) for pair in training_rows(path)]
        chat = [line for line, domain in rows if domain == "chat"]
        return chat + [line for line, domain in rows if domain != "chat"][::4]
    lines = [line for path in GPU_DATA_FILES for line, _ in training_rows(path)[::5]]
    if name == "copy":
        return lines
    second = training_rows(SECOND_RESPONSES)
    lines += [line for line, domain in second if domain == "chat"]
    if name == "resample-chat":
        return lines
    return lines + [line for line, domain in second if domain in ("code", "math")][::2]


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in SUBSETS:
        print(__doc__, file=sys.stderr)
        return 2
    name, output = sys.argv[1:]
    lines = subset(name)
    with gzip.open(output + ".part", "wt") as out:
        out.writelines(lines)
    os.replace(output + ".part", output)
    print(f"{name}: {len(lines)} training rows -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
