"""The model shapes every benchmark measures (random weights of these shapes: only the sizes matter)."""

from __future__ import annotations

from qspec_jax.config import LlamaConfig

# max_position_embeddings: room for a 4096-token context plus the new tokens (RoPE does not care)
MODELS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32, 128, max_position_embeddings=8192),
    "llama3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0, max_position_embeddings=8192),
    "llama2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 128, max_position_embeddings=8192),
    "llama2-70b": LlamaConfig(32000, 8192, 28672, 80, 64, 8, 128, max_position_embeddings=8192),
    "smoke": LlamaConfig(256, 128, 256, 2, 4, 2, 32, max_position_embeddings=1024),  # the CPU tests' tiny model
}


def linear_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """A decoder layer's linears (fused qkv, o, fused gate/up, down) and the lm_head, as (N, K) =
    (out_features, in_features)."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}
