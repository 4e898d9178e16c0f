"""Model configuration: the Llama-family subset of a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import math
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
    eos_token_id: int | tuple[int, ...] | None = None  # a tuple: generation stops at any of them

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"config rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"config rope_theta must be a finite number > 0, got {self.rope_theta}")
        for name, i in [("eos_token_id", i) for i in self.eos_ids] + [("bos_token_id", self.bos_token_id)]:
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"config {name} {i} is outside the vocabulary [0, {self.vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
            if kind == "llama3":
                _check_llama3_scaling(dict(self.rope_scaling))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token ids (none, one, or several as in Llama-3-Instruct's config)."""
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, tuple) else (eos,)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face config dict; unknown architectures, and fields of the wrong JSON
        type (a string for a number, ``"false"`` for false), raise ``ValueError``."""
        archs = _hf_value(hf, "architectures", list, [])
        model_type = _hf_value(hf, "model_type", str, None)
        if not all(isinstance(a, str) for a in archs):
            raise ValueError(f"config.json field 'architectures' must be a list of names, got {archs!r}")
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: qspec-jax handles "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        # each field that is given must name the same supported model: a contradiction is refused
        types = {dict(zip(SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES)).get(a) for a in archs}
        if None in types or (model_type is not None and archs and types != {model_type}) or len(types) > 1:
            raise ValueError(f"config.json contradicts itself: 'architectures' {archs!r} and 'model_type' "
                             f"{model_type!r} must name one supported model ({', '.join(SUPPORTED_ARCHITECTURES)}, "
                             f"model_type {', '.join(SUPPORTED_MODEL_TYPES)})")
        _check_hf_features(hf, model_type)
        hidden, heads = _hf_value(hf, "hidden_size", int), _hf_value(hf, "num_attention_heads", int)
        if heads < 1:
            raise ValueError(f"config num_heads must be positive, got {heads}")
        rope_theta, scaling = _hf_rope(hf)
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids (Llama-3-Instruct); [] means none
            if None in eos:
                raise ValueError(f"config.json field 'eos_token_id' must list integers, got {eos!r}")
            ids = tuple(_hf_value({"eos_token_id": i}, "eos_token_id", int) for i in eos)
            eos = ids if len(ids) > 1 else ids[0] if ids else None
        elif eos is not None:
            eos = _hf_value(hf, "eos_token_id", int)
        return cls(
            vocab_size=_hf_value(hf, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_hf_value(hf, "intermediate_size", int),
            num_layers=_hf_value(hf, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_hf_value(hf, "num_key_value_heads", int, heads),
            head_dim=_hf_value(hf, "head_dim", int, hidden // heads),
            rms_norm_eps=_hf_value(hf, "rms_norm_eps", float, 1e-5),
            rope_theta=rope_theta,
            rope_scaling=None if not scaling else tuple(sorted(scaling.items())),
            max_position_embeddings=_hf_value(hf, "max_position_embeddings", int, 4096),
            tie_word_embeddings=_hf_value(hf, "tie_word_embeddings", bool, False),
            attention_bias=_hf_value(hf, "attention_bias", bool, model_type == "qwen2"),
            bos_token_id=_hf_value(hf, "bos_token_id", int, None),
            eos_token_id=eos,
        )

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
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
          dict: "an object"}


def _hf_value(hf: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED, prefix: str = "") -> Any:
    """``hf[key]`` as ``kind``, checked to be that JSON type (an integer may be written 4096.0, a number
    may be an integer; a bool is neither); absent or null gives ``default``, or names the missing field."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json lacks required field {prefix + key!r}")
        return default
    if kind is bool or kind not in (int, float):
        ok = isinstance(value, kind)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or isinstance(value, int) or value.is_integer())
    if not ok:
        raise ValueError(f"config.json field {prefix + key!r} must be {_KINDS[kind]}, got {value!r}")
    return kind(value) if kind in (int, float) else value


def _hf_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling or None)`` from transformers 4's top-level ``rope_theta`` / ``rope_scaling``
    or transformers 5's ``rope_parameters`` (a scaling type under ``rope_type`` or the older ``type``,
    with ``rope_theta`` inside). A config may hold both forms; where they disagree, transformers reads
    one by precedence, which a hand-merged config may not intend, so it is refused."""
    thetas, scalings = {}, {}
    for key in ("rope_scaling", "rope_parameters"):
        entry = _hf_value(hf, key, dict, None)
        if entry is None:
            continue
        if (theta := _hf_value(entry, "rope_theta", float, None, key + ".")) is not None:
            thetas[key + ".rope_theta"] = theta
        kind = entry.get("rope_type", entry.get("type", "default"))
        scalings[key] = None if kind == "default" else {
            "rope_type": kind, **{k: v for k, v in entry.items() if k not in ("rope_theta", "type", "rope_type")}}
    if (theta := _hf_value(hf, "rope_theta", float, None)) is not None:
        thetas["rope_theta"] = theta
    if len(set(thetas.values())) > 1:
        raise ValueError(f"config.json gives RoPE's base twice, differently: {thetas}")
    if len({repr(sorted(v.items())) if v else None for v in scalings.values()}) > 1:
        raise ValueError(f"config.json gives RoPE's scaling twice, differently: {scalings}")
    return next(iter(thetas.values()), 10000.0), next(iter(scalings.values()), None)


def _check_hf_features(hf: dict[str, Any], model_type: str | None) -> None:
    """Refuse HF config features the model does not implement, rather than convert them wrongly."""
    if hf.get("quantization_config"):
        q = hf["quantization_config"]
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ValueError(f"the checkpoint is already quantized (quantization_config: {method}); qspec-jax "
                         "converts float (or GGUF Q4_0 / Q4_1) checkpoints: use the float original")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: the model's MLP is SwiGLU (silu)")
    if _hf_value(hf, "partial_rotary_factor", float, 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported: the model "
                         "rotates every dimension of a head")
    if _hf_value(hf, "mlp_bias", bool, False):
        raise ValueError("mlp_bias is not supported: the model's MLP linears have no bias")
    if _hf_value(hf, "attention_bias", bool, False) and model_type != "qwen2":
        raise ValueError("attention_bias on a Llama config adds an o_proj bias, which the model does not "
                         "implement (only Qwen2's q/k/v biases are)")
    window = _hf_value(hf, "sliding_window", float, None)
    active = _hf_value(hf, "use_sliding_window", bool, model_type == "mistral")
    if active and window is not None and window < _hf_value(hf, "max_position_embeddings", float, 4096):
        raise ValueError(f"sliding-window attention (window {window} < max_position_embeddings "
                         f"{hf.get('max_position_embeddings')}) is not supported: the model attends to "
                         "every earlier position")


def _check_llama3_scaling(sc: dict[str, Any]) -> None:
    """Llama-3 rope_scaling needs factor >= 1 and 0 < low_freq_factor < high_freq_factor, all numbers."""
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    values = [sc.get(n) for n in names]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"llama3 rope_scaling needs numbers {', '.join(names)}; got {sc}")
    factor, low, high, old = values
    if not (factor >= 1 and 0 < low < high and old > 0):
        raise ValueError(f"llama3 rope_scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                         f"original_max_position_embeddings > 0; got {sc}")
