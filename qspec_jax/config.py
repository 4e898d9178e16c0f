"""Model configuration: the Llama-family subset of a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face config dict; unknown architectures raise ``ValueError``."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: qspec-jax handles "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            scaling = hf.get("rope_scaling")
            rope_theta = hf.get("rope_theta")
            if rope_theta is None:  # transformers 5 nests it under rope_parameters
                params = hf.get("rope_parameters") or {}
                rope_theta = params.get("rope_theta", 10000.0)
                if params.get("rope_type", "default") != "default":
                    scaling = params
            eos = hf.get("eos_token_id")
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta),
                rope_scaling=None if not scaling else tuple(sorted(scaling.items())),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The equivalent Hugging Face ``LlamaForCausalLM`` config dict."""
        return {
            "architectures": ["Qwen2ForCausalLM" if self.attention_bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.attention_bias else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
