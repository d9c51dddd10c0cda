"""The shape of a Llama-family target, read from a Hugging Face `config.json`.

One dataclass for Llama, SmolLM2, Mistral, Qwen2 and Qwen3: they differ only in a few switches
(bias on q/k/v, RMSNorm on q/k, rope scaling). Anything we do not implement is refused here with
a clear error rather than producing silently wrong logits later.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_trt.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def read_config_json(folder: Path, what: str) -> dict:
    """The `config.json` of a checkpoint folder, or a ModelLoadError saying what is wrong."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json: not {what}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from None


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias) add a bias to q, k, v
    o_bias: bool
    qk_norm: bool  # Qwen3 normalises each head of q and k with RMSNorm
    rope_scaling: dict | None = None  # None or a llama3-style scaling dict
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "TargetConfig":
        arch = raw.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported target architecture {arch!r}; dspark-trt supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise ModelLoadError(f"unsupported rope scaling {rope_type!r} (supported: default, llama3)")
            rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            attention_bias = bool(raw.get("attention_bias", False))
            context = int(raw.get("max_position_embeddings", 2048))
            window = raw.get("sliding_window")
            if window and raw.get("use_sliding_window", arch == "mistral") and int(window) < context:
                # We implement full attention only; up to the window length the two agree, so
                # cap the context there rather than give wrong logits past it.
                context = int(window)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=context,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or attention_bias,
                o_bias=attention_bias,
                qk_norm=arch == "qwen3",
                rope_scaling=dict(rope) if rope_type == "llama3" else None,
                eos_token_ids=eos_ids,
            )
        except KeyError as missing:
            raise ModelLoadError(f"target config.json lacks the field {missing}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> "TargetConfig":
        return cls.from_hf_dict(read_config_json(folder, "a Hugging Face model folder"))

    def to_dict(self) -> dict:
        return asdict(self)
