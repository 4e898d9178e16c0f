"""Autoregressive greedy decoding with a KV cache in one jitted ``lax.fori_loop``."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax.config import LlamaConfig
from qspec_jax.model import forward, init_cache


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``(int32[B, P], lengths int32[B])``; empty prompts raise."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "mode", "dtype", "online_rotation_seed"))
def _greedy(params, tokens, lengths, eos_id, *, config: LlamaConfig, max_new_tokens: int, mode: str,
            dtype: Any, online_rotation_seed: int | None):
    b, p = tokens.shape
    run = functools.partial(forward, params, config, mode=mode, dtype=dtype,
                            online_rotation_seed=online_rotation_seed)
    cache = init_cache(config, b, p + max_new_tokens, dtype)
    logits, cache = run(tokens, jnp.broadcast_to(jnp.arange(p), (b, p)), cache)
    first = jnp.argmax(logits[jnp.arange(b), lengths - 1], axis=-1).astype(jnp.int32)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = first == eos_id

    def step(i, carry):
        out, cache, done = carry
        prev = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, cache = run(prev, (lengths + i - 1)[:, None], cache)
        nxt = jnp.where(done, eos_id, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
        return out.at[:, i].set(nxt), cache, done | (nxt == eos_id)

    out, _, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out, cache, done))
    return out


def greedy_generate(params: dict, config: LlamaConfig, prompts: list[list[int]], max_new_tokens: int, *,
                    mode: str, eos_id: int, dtype: Any = jnp.float32,
                    online_rotation_seed: int | None = None) -> list[list[int]]:
    """Greedy continuations (up to and including the first ``eos_id``) of each prompt."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokens, lengths = pad_prompts(prompts)
    out = np.asarray(_greedy(params, tokens, lengths, eos_id, config=config, max_new_tokens=max_new_tokens,
                             mode=mode, dtype=dtype, online_rotation_seed=online_rotation_seed))
    result = []
    for row in out.tolist():
        result.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return result
