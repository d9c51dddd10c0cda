"""The shape of a drafter and the identity of the target it belongs to.

Stored as `config.json` beside the drafter's `model.safetensors`. A drafter only works with
the target it was trained on (it reads that target's hidden states and shares its embedding
and LM head), so loading checks the target's architecture, hidden size, vocabulary and layer
count, and names the first mismatch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspark_trt.errors import ModelLoadError
from dspark_trt.models.target_config import TargetConfig, read_config_json

DRAFTER_KINDS = ("dspark", "dflash", "eagle3", "mtp1")
HEAD_TYPES = ("markov", "rnn", "none")


@dataclass
class DrafterConfig:
    kind: str = "dspark"  # dspark | dflash (no sequential/confidence head) | eagle3 | mtp1
    # identity of the target (checked at load time)
    target_name: str = ""
    target_architecture: str = ""
    target_hidden_size: int = 0
    target_vocab_size: int = 0
    target_num_layers: int = 0
    feature_layers: tuple[int, ...] = ()  # 0-based target layers whose outputs condition the drafter
    # backbone
    block_size: int = 7  # gamma: tokens drafted per block
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    # Each layer's context keys/values read its own `attn_norm` of the fused context, as its block
    # tokens' do (the layers start as copies of target layers, whose k/v projections expect that
    # norm's per-channel scale). Drafters trained before it existed have False in effect.
    context_norm: bool = False
    # heads
    head: str = "markov"  # sequential head: markov | rnn | none
    # DSpark: a causal layer over the drafted prefix corrects each slot's state before the LM head
    # (`PrefixLayer`); False for drafters trained before it existed.
    prefix_layer: bool = False
    markov_rank: int = 256
    confidence: bool = True
    draft_vocab_size: int = 8192  # most frequent target tokens the drafter can propose (0 = all)
    # calibration (STS): one temperature per block position for the confidence logit
    confidence_temperatures: list[float] = field(default_factory=list)
    # copy bias (`models/copy_bias.py`): alpha[k][n - 1] added to slot k's logit of the token that
    # followed the last n tokens earlier in the request; empty = off. Fitted by `calibrate`.
    copy_bias: list[list[float]] = field(default_factory=list)
    # beta[k][n - 1] added to slot k's confidence logit (before its STS temperature) when the copy
    # lookup has an n-gram candidate there: whether one exists is known before x_k is drawn.
    copy_confidence: list[list[float]] = field(default_factory=list)
    # w[k]: slot k's confidence logit also gets w[k] * logit(max_y p_k(y)), the draft distribution's
    # own top probability (known before x_k is drawn); fitted by `calibrate` with copy_confidence.
    confidence_top_prob: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.feature_layers = tuple(self.feature_layers)
        if self.kind not in DRAFTER_KINDS:
            raise ModelLoadError(f"drafter kind must be one of {', '.join(DRAFTER_KINDS)}, got {self.kind!r}")
        if self.head not in HEAD_TYPES:
            raise ModelLoadError(f"drafter head must be one of {', '.join(HEAD_TYPES)}, got {self.head!r}")
        if self.prefix_layer and self.kind != "dspark":
            raise ModelLoadError(f"prefix_layer is a DSpark drafter's part, not a {self.kind} drafter's")
        if self.block_size < 1:
            raise ModelLoadError(f"block_size must be >= 1, got {self.block_size}")
        if self.copy_bias:
            if self.kind not in ("dspark", "dflash"):
                raise ModelLoadError(f"copy_bias is drafted with by the DSpark/DFlash proposer, not a {self.kind} drafter")
            widths = {len(row) for row in self.copy_bias}
            if len(self.copy_bias) != self.block_size or len(widths) != 1 or 0 in widths:
                raise ModelLoadError(f"copy_bias must be {self.block_size} rows (one per slot) of one equal, "
                                     f"non-zero length (one weight per n-gram length), got {self.copy_bias}")
        if self.copy_confidence and (not self.copy_bias or [len(r) for r in self.copy_confidence]
                                     != [len(r) for r in self.copy_bias]):
            raise ModelLoadError(f"copy_confidence must have copy_bias's shape ({len(self.copy_bias)} rows of "
                                 f"{self.copy_ngram}), got {self.copy_confidence}")

        if self.confidence_top_prob and len(self.confidence_top_prob) != self.block_size:
            raise ModelLoadError(f"confidence_top_prob must hold one weight per slot ({self.block_size}), "
                                 f"got {self.confidence_top_prob}")

    @property
    def copy_ngram(self) -> int:
        """The longest n-gram the copy bias looks up (0: no copy bias)."""
        return len(self.copy_bias[0]) if self.copy_bias else 0

    @property
    def hidden_size(self) -> int:
        return self.target_hidden_size

    @classmethod
    def for_target(cls, target_name: str, target: TargetConfig, feature_layers: tuple[int, ...], **options):
        """A drafter shaped after its target (attention shapes and widths are the target's)."""
        return cls(target_name=target_name, target_architecture=target.architecture,
                   target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
                   target_num_layers=target.num_layers, feature_layers=tuple(feature_layers),
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, **options)

    def check_target(self, target_name: str, target: TargetConfig) -> None:
        """Raise naming the first way this drafter does not fit the target."""
        checks = [("architecture", self.target_architecture, target.architecture),
                  ("hidden size", self.target_hidden_size, target.hidden_size),
                  ("vocabulary size", self.target_vocab_size, target.vocab_size),
                  ("number of layers", self.target_num_layers, target.num_layers)]
        for what, ours, theirs in checks:
            if ours != theirs:
                raise ModelLoadError(f"drafter was trained for a target with {what} {ours} "
                                     f"({self.target_name}), but {target_name} has {what} {theirs}")
        if self.feature_layers and max(self.feature_layers) >= target.num_layers:
            raise ModelLoadError(f"drafter feature layers {list(self.feature_layers)} do not exist in {target_name} "
                                 f"({target.num_layers} layers)")

    def save(self, folder: Path) -> None:
        data = asdict(self)
        data["feature_layers"] = list(self.feature_layers)
        (Path(folder) / "config.json").write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "DrafterConfig":
        data = read_config_json(folder, "a drafter checkpoint")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelLoadError(f"{Path(folder) / 'config.json'}: unknown drafter config keys {unknown}")
        return cls(**data)
