"""Training data for drafters: token rows from `datagen` plus cached target features.

A `Sequence` is one datagen row with its features: `features` `[T-1, (m+1) * d]` fp16 (the m
drafter feature layers, then the target's last layer, for every position but the final
token) and `logsumexp` `[R]` (normaliser of the target logits that predicted each of the R
response tokens). A `FeatureSource` computes what the cache lacks with one prefill-style target
pass per row (all at once: `ensure_features`; or when a row is first sampled: `lazy_sequences`),
so a fresh machine can train from the committed JSONL alone.

`make_batch` samples anchors and builds the tensors one training step needs (see `Batch`).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark_trt.errors import DsparkError
from dspark_trt.models.linear import dtype_name, resolve_dtype
from dspark_trt.models.loading import LoadedTarget, load_target


# Above this many rows, training reads each row's features from the cache per batch (and computes
# a missing row's when it is first sampled) instead of loading all of them: ~6 KB a token, 11.7k
# rows of ~300 tokens would be ~19 GB.
LAZY_FEATURES_ABOVE = 4000


class Sequence:
    """One training row: tokens, prompt length, target features and logit normalisers.

    `features` `[T-1, (m+1) * d]` fp16 and `logsumexp` `[T-P]` fp32 are either tensors or read
    on each use through a `FeatureSource` (a training step reads its few sequences; the whole
    cache of a large dataset, ~6 KB per token, would not fit in memory)."""

    def __init__(self, row_id: str, token_ids: torch.Tensor, prompt_length: int, features: torch.Tensor | None,
                 logsumexp: torch.Tensor | None, source: FeatureSource | None = None, row: dict | None = None):
        self.row_id = row_id
        self.token_ids = token_ids  # [T] prompt + response
        self.prompt_length = prompt_length  # P
        self._features, self._logsumexp = features, logsumexp
        self._source, self._row = source, row

    @classmethod
    def lazy(cls, row: dict, source: FeatureSource) -> Sequence:
        return cls(row["id"], torch.tensor(row["prompt_ids"] + row["response_ids"]), len(row["prompt_ids"]), None,
                   None, source, row)

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logsumexp): held, or read (computed first if the cache lacks them)."""
        if self._source is not None:
            return self._source.load(self._row)
        return self._features, self._logsumexp

    @property
    def features(self) -> torch.Tensor:
        return self.load()[0]

    @property
    def logsumexp(self) -> torch.Tensor:  # normaliser of the target logits at positions P-1 .. T-2
        return self.load()[1]


def read_rows(path: Path) -> list[dict]:
    """The rows of a datagen JSONL file, plain or gzip-compressed (`.gz`, as committed)."""
    try:
        with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise DsparkError(f"training data {path} not found (make it with `dspark-trt datagen`)") from None
    except json.JSONDecodeError as exc:
        raise DsparkError(f"{path} is not valid JSONL: {exc}") from None
    return [r for r in rows if len(r["response_ids"]) >= 2]


def read_datasets(paths: list[Path]) -> list[dict]:
    """The rows of several datagen files, in order. Row ids must be unique across them: a
    feature cache and the held-out split are keyed by id, so two files sharing one would train on
    one row's features for the other's tokens."""
    rows, first_file = [], {}
    for path in paths:
        for row in read_rows(path):
            if row["id"] in first_file:
                raise DsparkError(f"row id {row['id']!r} is in both {first_file[row['id']]} and {path}: "
                                  "pass each file once, and only files made from different prompt sets")
            first_file[row["id"]] = path
            rows.append(row)
    return rows


def weight_dtype(target: LoadedTarget) -> torch.dtype:
    """The dtype of the target's weight matrices (what a feature cache records)."""
    return getattr(target.model, "weight_dtype", torch.float32)


def feature_file(features_dir: Path, row_id: str) -> Path:
    """Where a row's cached target features live (`datagen --features-dir` writes them, training reads them)."""
    return features_dir / (row_id.replace("/", "__") + ".npz")


def check_feature_cache(features_dir: Path, target: LoadedTarget, feature_layers: tuple[int, ...]) -> None:
    """A cache holds the features of one target, weight dtype and layer set (`manifest.json`):
    mixing two would train a drafter on features it never sees when serving."""
    features_dir.mkdir(parents=True, exist_ok=True)
    wanted = {"target": target.name, "dtype": dtype_name(weight_dtype(target)),
              "layers": list(feature_layers)}
    manifest = features_dir / "manifest.json"
    if manifest.is_file():
        found = json.loads(manifest.read_text())
        if found != wanted:
            raise DsparkError(f"feature cache {features_dir} holds {found}, not {wanted}: use another --features-dir "
                              "(or --features-dtype to match the cache)")
    elif any(features_dir.glob("*.npz")):  # a cache from before manifests: fp32 features of these layers
        manifest.write_text(json.dumps({**wanted, "dtype": "float32"}))
        check_feature_cache(features_dir, target, feature_layers)
    else:
        manifest.write_text(json.dumps(wanted))


def read_features(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(features `[T-1, (m+1) * d]` fp16, logsumexp `[T-P]` fp32) from a cache file."""
    data = np.load(path)
    return torch.from_numpy(data["features"]), torch.from_numpy(data["logsumexp"]).float()


class FeatureSource:
    """Target features of training rows: read from the cache, or computed by the target (in its
    weight dtype: the serving one, so the drafter learns the features it will be given) and
    cached the first time a row is needed. Thread-safe: the trainer's batch worker calls it."""

    def __init__(self, target: LoadedTarget, features_dir: Path, feature_layers: tuple[int, ...]):
        check_feature_cache(features_dir, target, feature_layers)
        self.target, self.features_dir = target, features_dir
        self.layers = (*feature_layers, target.config.num_layers - 1)  # the last layer: the logits' hidden state
        self._pool = None
        self._lock = threading.Lock()

    def has(self, row: dict) -> bool:
        return feature_file(self.features_dir, row["id"]).is_file()

    def load(self, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
        path = feature_file(self.features_dir, row["id"])
        if not path.is_file():
            self.compute(row)
        return read_features(path)

    @torch.inference_mode()
    def compute(self, row: dict) -> None:
        """One prefill-style target pass over the row; the file is written atomically."""
        tokens = row["prompt_ids"] + row["response_ids"][:-1]  # the final token is never fed
        with self._lock:
            model = self.target.model
            if self._pool is None or self._pool.slot_capacity < len(tokens):
                self._pool = model.new_pool(1, max(len(tokens), 1024))
            cache = self._pool.allocate()
            try:
                logits_at = torch.arange(len(row["prompt_ids"]) - 1, len(tokens))
                out = model(torch.tensor(tokens), [len(tokens)], [cache], logits_at, self.layers)
            finally:
                self._pool.free(cache)
            path = feature_file(self.features_dir, row["id"])
            staging = path.with_name(path.name + ".tmp.npz")
            np.savez(staging, features=out.features.to(torch.float16).cpu().numpy(),
                     logsumexp=torch.logsumexp(out.logits.float(), dim=-1).cpu().numpy())
            os.replace(staging, path)


def features_target(loaded: LoadedTarget, target_name: str, dtype_choice: str,
                    device: torch.device | str = "cpu") -> LoadedTarget:
    """The target that computes missing features, in the weight dtype `dtype_choice` names
    (`auto`: the serving default): `loaded` (fp32, whose embedding and LM head a drafter borrows)
    when that is fp32, else the same target loaded in that dtype, so that a drafter learns, and is
    calibrated on, the features the served target gives it."""
    dtype = resolve_dtype(dtype_choice, device)
    if dtype == weight_dtype(loaded):
        return loaded
    other = load_target(target_name, dtype)
    other.model.to(device)
    return other


def ensure_features(target: LoadedTarget, rows: list[dict], features_dir: Path, feature_layers: tuple[int, ...]) -> None:
    """Compute and cache the features of rows that have none, now (one target pass per row)."""
    source = FeatureSource(target, features_dir, feature_layers)
    for row in tqdm([r for r in rows if not source.has(r)], desc="target features", unit="row"):
        source.compute(row)


def load_sequences(rows: list[dict], features_dir: Path) -> list[Sequence]:
    """The rows with their cached features, held in memory."""
    sequences = []
    for row in rows:
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"])
        sequences.append(Sequence(row["id"], tokens, len(row["prompt_ids"]),
                                  *read_features(feature_file(features_dir, row["id"]))))
    return sequences


def lazy_sequences(rows: list[dict], source: FeatureSource) -> list[Sequence]:
    """The rows with features read through `source` on each use (computed on first use if missing)."""
    return [Sequence.lazy(row, source) for row in rows]


@dataclass
class Batch:
    """One step's worth of blocks: S sequences x A anchors x gamma slots (Q = A * gamma queries)."""

    context_features: torch.Tensor  # [S, C, m * d] drafter feature layers, padded
    anchor_tokens: torch.Tensor  # [S, A]
    block_positions: torch.Tensor  # [S, Q] position of each block input (p + j)
    mask: torch.Tensor  # [S, Q, C + Q] True where a query may attend
    labels: torch.Tensor  # [S, A, gamma] target token of slot k (token at p + k)
    previous_tokens: torch.Tensor  # [S, A, gamma] token before slot k (x_{k-1}; the anchor for k = 1)
    target_hidden: torch.Tensor  # [S, A, gamma, d] target's last-layer output at p + k - 1
    target_logsumexp: torch.Tensor  # [S, A, gamma]
    valid: torch.Tensor  # [S, A, gamma] slot is supervised (real anchor, inside the sequence)
    tokens: torch.Tensor  # [S, C + 1] every sequence's tokens, padded (autoregressive drafters read them)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))


def sample_anchors(sequence: Sequence, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Anchors p whose next token lies in the response: P-1 <= p <= T-2."""
    first, last = sequence.prompt_length - 1, sequence.token_ids.numel() - 2
    candidates = torch.arange(first, last + 1)
    if candidates.numel() > num_anchors:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:num_anchors]].sort().values
    return candidates


def make_batch(sequences: list[Sequence], num_anchors: int, block_size: int, num_feature_layers: int,
               hidden_size: int, generator: torch.Generator) -> Batch:
    """Sample anchors and gather one step's tensors (on the CPU; `Batch.to` moves them).

    Per sequence everything is gathered at once over its A x gamma slots: a step of 16 sequences
    x 64 anchors is ~1,000 blocks, and a Python loop per block would cost more than the GPU step.
    """
    S, A, G = len(sequences), num_anchors, block_size
    Q = A * G
    loaded = [s.load() for s in sequences]  # read once each (a lazy sequence reads its cache file)
    C = max(features.shape[0] for features, _ in loaded)
    feature_width = num_feature_layers * hidden_size
    context = torch.zeros(S, C, feature_width, dtype=torch.float16)
    anchor_tokens = torch.zeros(S, A, dtype=torch.long)
    block_positions = torch.zeros(S, Q, dtype=torch.long)
    mask = torch.zeros(S, Q, C + Q, dtype=torch.bool)
    labels = torch.zeros(S, A, G, dtype=torch.long)
    previous = torch.zeros(S, A, G, dtype=torch.long)
    target_hidden = torch.zeros(S, A, G, hidden_size)
    target_lse = torch.zeros(S, A, G)
    valid = torch.zeros(S, A, G, dtype=torch.bool)
    tokens = torch.zeros(S, C + 1, dtype=torch.long)
    slots = torch.arange(G)
    own_block = torch.block_diag(*[torch.ones(G, G, dtype=torch.bool)] * A)  # [Q, Q]: each block sees itself
    for s, (seq, (seq_features, seq_logsumexp)) in enumerate(zip(sequences, loaded)):
        T = seq.token_ids.numel()
        context[s, : seq_features.shape[0]] = seq_features[:, :feature_width]
        tokens[s, :T] = seq.token_ids
        anchors = sample_anchors(seq, A, generator)  # [n] (n < A for short responses)
        n = anchors.numel()
        block_positions[s, : n * G] = (anchors[:, None] + slots).flatten()
        # Context strictly before the anchor, for every query of its block.
        before_anchor = torch.arange(C)[None, :] < anchors[:, None]  # [n, C]
        mask[s, : n * G, :C] = before_anchor.repeat_interleave(G, dim=0)
        mask[s, : n * G, C : C + n * G] = own_block[: n * G, : n * G]
        targets = anchors[:, None] + 1 + slots  # [n, G]: token positions predicted by slots 1..gamma
        inside = targets <= T - 1
        valid[s, :n] = inside
        labels[s, :n] = torch.where(inside, seq.token_ids[targets.clamp(max=T - 1)], 0)
        previous[s, :n] = seq.token_ids[(targets - 1).clamp(max=T - 1)]
        anchor_tokens[s, :n] = seq.token_ids[anchors]
        logit_positions = (targets - 1).clamp(max=T - 2)  # logits at p + k - 1 predict p + k
        target_hidden[s, :n] = seq_features[logit_positions, feature_width:].float()
        target_lse[s, :n] = seq_logsumexp[logit_positions - (seq.prompt_length - 1)]
        # Padding anchors (short responses): attend to one context position so no row is empty.
        mask[s, n * G :, 0] = True
    return Batch(context, anchor_tokens, block_positions, mask, labels, previous, target_hidden, target_lse, valid,
                 tokens)
