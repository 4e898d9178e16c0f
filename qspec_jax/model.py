"""A Flax (linen) Llama: a pure function of (params, token ids, positions, KV cache).

Layers are stacked and run with ``nn.scan`` (one traced layer, short compiles). Every decoder
linear goes through :func:`qspec_jax.linear.linear` with the module's ``mode``, so one packed
INT4 params pytree serves ``w16a16``, ``w4a16``, ``w4a8`` and ``w4a4``. Embeddings, attention
and the lm_head always run in the float compute dtype. With ``online_rotation_seed`` set
(rotated checkpoints), the o_proj input (per head) and the down_proj input pass through the
orthogonal transform of :mod:`qspec_jax.rotation` in every mode.

The KV cache is a pair ``(k, v)`` of ``[L, B, S, num_kv_heads, head_dim]`` arrays whose slot
``s`` holds position ``s``; a query at position ``p`` attends to slots ``0..p``. Without a cache
the tokens attend causally (by position) to each other. Callers size the cache: a position at or
beyond its length is not stored (checked by the decoding API before anything is traced).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax.config import LlamaConfig
from qspec_jax.linear import check_mode, linear
from pallas_kernels.rows import map_row_tiles
from qspec_jax.rotation import apply_transform

KVCache = tuple[jax.Array, jax.Array]


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float64), with Llama-3 ``rope_scaling``."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_scaling is None:
        return inv
    sc = dict(config.rope_scaling)
    if sc.get("rope_type", sc.get("type")) == "default":
        return inv
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(is_mid, mid, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x[B, T, heads, head_dim]`` by ``positions[B, T]`` (the rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              row_tile: int | None = None) -> jax.Array:
    """Grouped-query attention: ``q[B,T,H,d]``, ``k, v[B,S,KV,d]``, key ``s`` visible iff ``k_pos <= q_pos``.

    With ``row_tile``, each sequence's queries are padded to a multiple of ``row_tile`` and
    processed one sequence and tile at a time, so a query's result does not depend on T or B.
    """
    if row_tile is None:
        return _attention(q, k, v, q_pos, k_pos)
    b, t = q.shape[:2]
    pad = (-t) % row_tile
    n = (t + pad) // row_tile
    qt = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * n, row_tile, *q.shape[2:])
    pt = jnp.pad(q_pos, ((0, 0), (0, pad))).reshape(b * n, row_tile)

    def one(i):
        seq = i // n
        return _attention(qt[i][None], k[seq][None], v[seq][None], pt[i][None], k_pos[seq][None])[0]

    out = jax.lax.map(one, jnp.arange(b * n))
    return out.reshape(b, t + pad, *q.shape[2:])[:, :t]


def _attention(q, k, v, q_pos, k_pos):
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(d).astype(np.float32)
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _dense_init(key, shape, dtype=jnp.float32):
    return 0.02 * jax.random.normal(key, shape, dtype)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` over a float or packed-INT4 weight ``[features, in]``."""

    features: int
    mode: str
    use_bias: bool = False
    row_tile: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "w"):  # packed weights: linen's shape check knows dense only
            w = self.get_variable("params", "w")
        else:
            w = self.param("w", _dense_init, (self.features, x.shape[-1]))
        y = linear(x, w, self.mode, self.row_tile)
        if self.use_bias:
            y = y + self.param("b", nn.initializers.zeros, (self.features,)).astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    row_tile: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],)).astype(x.dtype)

        def norm(r):
            rf = r.astype(jnp.float32)
            rf = rf * jax.lax.rsqrt(jnp.mean(rf * rf, axis=-1, keepdims=True) + self.eps)
            return scale * rf.astype(r.dtype)

        return map_row_tiles(norm, x, self.row_tile)


class Attention(nn.Module):
    config: LlamaConfig
    mode: str
    online_rotation_seed: int | None = None
    row_tile: int | None = None

    @nn.compact
    def __call__(self, x, positions, cache: KVCache | None):
        c = self.config
        b, t, _ = x.shape
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = Linear((hq + 2 * hk) * d, self.mode, c.attention_bias, self.row_tile, name="qkv")(x)
        q, k, v = jnp.split(qkv, [hq * d, (hq + hk) * d], axis=-1)
        inv_freq = rope_frequencies(c)
        q = apply_rope(q.reshape(b, t, hq, d), positions, inv_freq)
        k = apply_rope(k.reshape(b, t, hk, d), positions, inv_freq)
        v = v.reshape(b, t, hk, d)
        if cache is None:
            keys, values, k_pos = k, v, positions
        else:
            rows = jnp.arange(b)[:, None]
            keys = cache[0].at[rows, positions].set(k.astype(cache[0].dtype), mode="drop")
            values = cache[1].at[rows, positions].set(v.astype(cache[1].dtype), mode="drop")
            cache = (keys, values)
            k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1]), (b, keys.shape[1]))
        out = attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, k_pos, self.row_tile)
        out = out.reshape(b, t, hq * d)
        if self.online_rotation_seed is not None:  # per head: [.., hq*d] -> [.., hq, d] rows
            per_head = lambda r: apply_transform(r.reshape(r.shape[0], hq, d), self.online_rotation_seed)  # noqa: E731
            out = map_row_tiles(lambda r: per_head(r).reshape(r.shape), out, self.row_tile)
        out = Linear(c.hidden_size, self.mode, row_tile=self.row_tile, name="o")(out)
        return out, cache


class MLP(nn.Module):
    config: LlamaConfig
    mode: str
    online_rotation_seed: int | None = None
    row_tile: int | None = None

    @nn.compact
    def __call__(self, x):
        f = self.config.intermediate_size
        gate, up = jnp.split(Linear(2 * f, self.mode, row_tile=self.row_tile, name="gate_up")(x), 2, axis=-1)
        h = nn.silu(gate) * up
        if self.online_rotation_seed is not None:
            h = map_row_tiles(lambda r: apply_transform(r, self.online_rotation_seed), h, self.row_tile)
        return Linear(self.config.hidden_size, self.mode, row_tile=self.row_tile, name="down")(h)


class DecoderLayer(nn.Module):
    config: LlamaConfig
    mode: str
    online_rotation_seed: int | None = None
    row_tile: int | None = None

    @nn.compact
    def __call__(self, x, cache: KVCache | None, positions):
        c, tile = self.config, self.row_tile
        h, cache = Attention(c, self.mode, self.online_rotation_seed, tile, name="attn")(
            RMSNorm(c.rms_norm_eps, tile, name="attn_norm")(x), positions, cache)
        x = x + h
        x = x + MLP(c, self.mode, self.online_rotation_seed, tile, name="mlp")(
            RMSNorm(c.rms_norm_eps, tile, name="mlp_norm")(x))
        return x, cache


class Llama(nn.Module):
    """The decoder: ``(tokens[B,T], positions[B,T], cache) -> (float32 logits[B,T,V], cache)``.

    ``row_tile`` (decode steps and verify passes) makes every token's logits independent of how
    many tokens the call has; prefill and evaluation leave it ``None`` for speed.
    """

    config: LlamaConfig
    mode: str = "w4a16"
    dtype: Any = jnp.float32
    online_rotation_seed: int | None = None
    row_tile: int | None = None

    def setup(self):
        check_mode(self.mode)

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None):
        c = self.config
        embed = self.param("embed", _dense_init, (c.vocab_size, c.hidden_size))
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)
        layers = nn.scan(
            DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, nn.broadcast), length=c.num_layers,
        )(c, self.mode, self.online_rotation_seed, self.row_tile, name="layers")
        x, cache = layers(x, cache, positions)
        x = RMSNorm(c.rms_norm_eps, self.row_tile, name="final_norm")(x)
        head = embed if c.tie_word_embeddings else self.param(
            "lm_head", _dense_init, (c.vocab_size, c.hidden_size))
        return linear(x, head.astype(self.dtype), "w16a16", self.row_tile), cache


def init_cache(config: LlamaConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    """A zero KV cache of ``length`` slots per sequence."""
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def forward(params: dict[str, Any], config: LlamaConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, mode: str, dtype: Any = jnp.float32,
            online_rotation_seed: int | None = None, row_tile: int | None = None,
            ) -> tuple[jax.Array, KVCache | None]:
    """Apply the model to a params pytree: ``(float32 logits [B, T, V], updated cache)``."""
    model = Llama(config, mode, dtype, online_rotation_seed, row_tile)
    return model.apply({"params": params}, tokens, positions, cache)
