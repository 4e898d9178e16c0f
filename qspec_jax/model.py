"""A Flax (linen) Llama: a pure function of (params, token ids, positions, KV cache).

Layers are stacked and run with ``jax.lax.scan`` over the layer index (one traced layer, short
compiles); each layer sees :class:`~qspec_jax.kernels.Layer` views of the stacked weights and KV
cache, which the kernels read in place. Per-layer trees (:func:`unstack_layers`) run as an unrolled
loop instead, for plain-XLA baselines. Every decoder
linear goes through :func:`qspec_jax.kernels.linear` with the module's ``mode``, so one packed
INT4 params pytree serves ``w16a16``, ``w4a16``, ``w4a8`` and ``w4a4``. Embeddings, attention
and the lm_head always run in the float compute dtype. With ``online_rotation_seed`` set
(rotated checkpoints), the o_proj input (per head) and the down_proj input pass through the
orthogonal transform of :mod:`qspec_jax.rotation` in every mode.

The KV cache is a pair ``(k, v)`` of ``[L, B, S, num_kv_heads, head_dim]`` arrays whose slot
``s`` holds position ``s``; a query at position ``p`` attends to slots ``0..p``. It may carry the
draft's quantized shadow of itself after the pair (:func:`init_cache`): a forward with
``read_shadow`` attends over the shadow and writes only it, so the float pair stays the verifier's
alone; :func:`sync_shadow` re-quantizes the shadow from the pair after any other forward. Without
a cache the tokens attend causally (by position) to each other. Callers size the cache: a position
at or beyond its length is not stored (checked by the decoding API before anything is traced).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax.config import LlamaConfig
from qspec_jax.kernels import (Layer, PendingNorm, SplitSum, attention, check_mode, fuses_rope_store, linear,
                               resolve_kernels, rms_norm, rope_store, swiglu, unstack)
from pallas_kernels import reference
from pallas_kernels.launch import check_positions
from pallas_kernels.layout import QuantizedWeight
from pallas_kernels.rows import map_row_tiles
from qspec_jax.rotation import apply_transform
from qspec_jax.sampling import check_token_ids

# The decoder linears (module paths within a layer), whose weights a quantized checkpoint packs as INT4;
# embeddings, norms, biases and the lm_head stay float
LINEAR_PATHS = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))
KVCache = tuple[jax.Array, ...]  # (k, v), or (k, v, k_words, v_words, k_scales, v_scales) with the shadow (init_cache)


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


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [B, T, head_dim // 2]`` of ``positions[B, T]`` in ``dtype``, once per forward (every
    layer rotates by the same angles)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x[B, T, heads, head_dim]`` by the :func:`rope_tables` of its positions (the
    rotate-half convention, :func:`pallas_kernels.reference.rope`)."""
    half = x.shape[-1] // 2
    lo, hi = reference.rope(x[..., :half], x[..., half:], cos[:, :, None], sin[:, :, None])
    return jnp.concatenate([lo, hi], axis=-1)


def _dense_init(key, shape, dtype=jnp.float32):
    return 0.02 * jax.random.normal(key, shape, dtype)


def _param(module: nn.Module, name: str, init, *init_args) -> Any:
    """The module's param ``name``. Packed weights, :class:`Layer` views and stacked trees are
    returned as stored (linen's ``param()`` would check them against the float init's shape); plain
    arrays go through ``param()`` and its shape check."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if not isinstance(value, (jax.Array, np.ndarray)):
            return value
    return module.param(name, init, *init_args)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` over a float or packed-INT4 weight ``[features, in]``; ``parts``: the float32
    result as a :class:`~qspec_jax.kernels.SplitSum` instead, for a consumer kernel that adds and
    rounds it itself."""

    features: int
    mode: str
    use_bias: bool = False
    row_tile: int | None = None
    kernels: str = "reference"
    parts: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array | SplitSum:
        w = _param(self, "w", _dense_init, (self.features, x.shape[-1]))
        if self.parts:
            if self.use_bias:
                raise ValueError("a layer with a bias cannot hand out its partial sums")
            return linear(x, w, self.mode, self.row_tile, self.kernels, parts=True)
        y = linear(x, w, self.mode, self.row_tile, self.kernels, jnp.float32 if self.use_bias else x.dtype)
        if self.use_bias:
            y = y + unstack(_param(self, "b", nn.initializers.zeros, (self.features,))).astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    """``defer``: the output feeds an INT4 linear layer, which may fuse the norm with its activation
    prologue (:class:`qspec_jax.kernels.PendingNorm`)."""

    eps: float
    row_tile: int | None = None
    kernels: str = "reference"
    defer: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array | PendingNorm:
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],))
        return rms_norm(x, scale, self.eps, self.row_tile, self.kernels, self.defer)


class _Block(nn.Module):
    """What every part of a decoder layer is configured with (the model's settings)."""

    config: LlamaConfig
    mode: str
    online_rotation_seed: int | None = None
    row_tile: int | None = None
    kernels: str = "reference"


class Attention(_Block):
    """Fused qkv projection, RoPE, the KV cache write and grouped-query attention, then o."""

    read_shadow: bool = False

    @nn.compact
    def __call__(self, x, positions, rope: tuple[jax.Array, jax.Array], cache: tuple[Layer, ...] | None):
        """``rope``: the positions' :func:`rope_tables`; ``cache``: views of this layer in the stacked
        cache (and shadow); returned as views of the updated stack."""
        c = self.config
        b, t, _ = x.shape
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        # on the kernel path one kernel rotates q and k and writes the cache, adding qkv's K splits itself
        # (a draft over the shadow writes only the shadow, as _write_kv does)
        target = () if cache is None else cache[2:] if self.read_shadow else cache[:2]
        fused = (len(target) in (2, 4) and not c.attention_bias
                 and fuses_rope_store(x.dtype, cache[0], target[0], d, self.row_tile, self.kernels))
        qkv = Linear((hq + 2 * hk) * d, self.mode, c.attention_bias, self.row_tile, self.kernels, fused, name="qkv")(x)
        fuse = self.mode != "w16a16" and self.online_rotation_seed is None  # o's prologue merges the splits
        if fused:
            q, written = rope_store(qkv, *rope, positions, target, hq, self.kernels)
            cache = (*cache[:2], *written) if self.read_shadow else (*written, *cache[2:])
        else:
            q, k, v = jnp.split(qkv, [hq * d, (hq + hk) * d], axis=-1)
            q, k = apply_rope(q.reshape(b, t, hq, d), *rope), apply_rope(k.reshape(b, t, hk, d), *rope)
            v = v.reshape(b, t, hk, d)
            if cache is not None:  # write this layer's slots in place
                cache = _write_kv(cache, k, v, positions, self.read_shadow)
        if cache is None:
            out = reference.attention(q, k, v, positions, positions)
        else:  # attend over the layer
            read = cache[2:] if self.read_shadow else cache[:2]
            out = attention(q, *read[:2], positions, self.row_tile, self.kernels, defer=fuse,
                            scales=tuple(read[2:]) or None)
        if isinstance(out, jax.Array):
            out = out.reshape(b, t, hq * d)
        if self.online_rotation_seed is not None:  # per head: [.., hq*d] -> [.., hq, d] rows
            per_head = lambda r: apply_transform(r.reshape(r.shape[0], hq, d), self.online_rotation_seed)  # noqa: E731
            out = map_row_tiles(lambda r: per_head(r).reshape(r.shape), out, self.row_tile)
        out = Linear(c.hidden_size, self.mode, row_tile=self.row_tile, kernels=self.kernels, name="o")(out)
        return out, cache


def _write_kv(cache: tuple[Layer, ...], k: jax.Array, v: jax.Array, positions: jax.Array,
              read_shadow: bool) -> tuple[Layer, ...]:
    """Store new keys and values ``[B, T, KV, d]`` at their positions: quantized in the shadow if the
    forward reads the shadow (a draft), else in the float pair (the caller re-quantizes the shadow
    from the pair afterwards, :func:`sync_shadow`, leaving this forward's computation as it is
    without a shadow)."""
    if read_shadow and len(cache) == 2:
        raise ValueError("read_shadow needs a KV cache with the draft's shadow (init_cache(shadow_bits=...))")
    rows = jnp.arange(k.shape[0])[:, None]
    full, shadow = cache[:2], cache[2:]

    def put(kv: Layer, new: jax.Array) -> Layer:
        return Layer(kv.stacked.at[kv.index, rows, positions].set(new.astype(kv.stacked.dtype), mode="drop"),
                     kv.index)

    if not read_shadow:
        return (*(put(c, new) for c, new in zip(full, (k, v))), *shadow)
    k, v = (new.astype(c.stacked.dtype) for c, new in zip(full, (k, v)))  # the values the pair would hold
    stored = _store_shadow(tuple(c.stacked for c in shadow), shadow[0].index, rows, positions, k, v)
    return (*full, *(Layer(a, shadow[0].index) for a in stored))


def _store_shadow(shadow: tuple[jax.Array, ...], layer, rows: jax.Array, positions: jax.Array, k: jax.Array,
                  v: jax.Array) -> tuple[jax.Array, ...]:
    """Quantize keys and values and store them in the shadow stacks at ``[layer, rows, positions]``:
    ``k, v [B, T, KV, d]`` of one layer (``layer`` an index), or ``[L, B, T, KV, d]`` of all layers
    (``layer`` None). Positions past the cache are dropped. The one place the shadow is written."""
    bits = reference.kv_shadow_bits(shadow[0].shape[-1], k.shape[-1])
    (kw, ks), (vw, vs) = reference.quantize_kv(k, bits), reference.quantize_kv(v, bits)
    if layer is None:  # the indexed dims (B, T) lead a scatter's update when a slice splits them
        words_at, scales_at = (slice(None), rows, positions), (slice(None), rows, slice(None), positions)
        ks, vs = (jnp.transpose(sc, (1, 2, 0, 3)) for sc in (ks, vs))  # [L, B, T, KV] -> [B, T, L, KV]
    else:
        words_at, scales_at = (layer, rows, positions), (layer, rows, slice(None), positions)
    return (*(a.at[words_at].set(n, mode="drop") for a, n in zip(shadow[:2], (kw, vw))),
            *(a.at[scales_at].set(n, mode="drop") for a, n in zip(shadow[2:], (ks, vs))))


class MLP(_Block):
    """SwiGLU: fused gate/up projection, ``silu(gate) * up``, then down (on the kernel path the
    SwiGLU runs in down's activation prologue, unless a rotation comes between)."""

    @nn.compact
    def __call__(self, x):
        f = self.config.intermediate_size
        gate_up = Linear(2 * f, self.mode, row_tile=self.row_tile, kernels=self.kernels, name="gate_up")(x)
        fuse = self.mode != "w16a16" and self.online_rotation_seed is None
        h = swiglu(gate_up, self.row_tile, self.kernels, defer=fuse)
        if self.online_rotation_seed is not None:
            h = map_row_tiles(lambda r: apply_transform(r, self.online_rotation_seed), h, self.row_tile)
        return Linear(self.config.hidden_size, self.mode, row_tile=self.row_tile, kernels=self.kernels,
                      name="down")(h)


class DecoderLayer(_Block):
    """Pre-norm residual block: attention, then the MLP."""

    read_shadow: bool = False

    @nn.compact
    def __call__(self, x, cache: tuple[Layer, ...] | None, positions, rope: tuple[jax.Array, jax.Array]):
        c, tile, kern = self.config, self.row_tile, self.kernels
        fuse = self.mode != "w16a16"  # the norms feed INT4 linears: their activation prologue in the norm kernel
        h, cache = Attention(c, self.mode, self.online_rotation_seed, tile, kern, self.read_shadow, name="attn")(
            RMSNorm(c.rms_norm_eps, tile, kern, fuse, name="attn_norm")(x), positions, rope, cache)
        x = x + h
        x = x + MLP(c, self.mode, self.online_rotation_seed, tile, kern, name="mlp")(
            RMSNorm(c.rms_norm_eps, tile, kern, fuse, name="mlp_norm")(x))
        return x, cache


class Llama(nn.Module):
    """The decoder: ``(tokens[B,T], positions[B,T], cache) -> (float32 logits[B,T,V], cache)``.

    ``row_tile`` (decode steps and verify passes) makes every token's logits independent of how
    many tokens the call has; prefill and evaluation leave it ``None`` for speed. ``kernels``
    (resolved, see :mod:`qspec_jax.kernels`) picks the references or the Pallas kernels.
    ``read_shadow``: attend over the cache's quantized shadow and write only it (QSPEC's drafts).
    """

    config: LlamaConfig
    mode: str = "w4a16"
    dtype: Any = jnp.float32
    online_rotation_seed: int | None = None
    row_tile: int | None = None
    kernels: str = "reference"
    read_shadow: bool = False

    def setup(self):
        check_mode(self.mode)

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None):
        c = self.config
        embed = self.param("embed", _dense_init, (c.vocab_size, c.hidden_size))
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)
        rope = rope_tables(positions, rope_frequencies(c), self.dtype)
        layer = DecoderLayer(c, self.mode, self.online_rotation_seed, self.row_tile, self.kernels, self.read_shadow,
                             parent=None)

        def init_layers(rng):
            init_one = lambda key: layer.init(key, x, None, positions, rope)["params"]  # noqa: E731
            return jax.vmap(init_one)(jax.random.split(rng, c.num_layers))

        def body(carry, i, layer_params=None):
            h, kv = carry
            if layer_params is None:
                layer_params = jax.tree.map(lambda a: Layer(a, i), stacked,
                                            is_leaf=lambda a: isinstance(a, QuantizedWeight))
            h, kv = layer.apply({"params": layer_params}, h,
                                None if kv is None else tuple(Layer(a, i) for a in kv), positions, rope)
            return (h, None if kv is None else tuple(a.stacked for a in kv)), None

        stacked = _param(self, "layers", init_layers)
        _check_layer_counts(c, stacked, cache)
        if cache is not None:
            _check_cache_layout(c, cache, tokens.shape[0])
        if isinstance(stacked, (list, tuple)):  # per-layer trees: an unrolled loop (see unstack_layers)
            for i, layer_params in enumerate(stacked):
                (x, cache), _ = body((x, cache), i, layer_params)
        else:
            # a plain lax.scan over the layer index (flax's nn.scan cannot hold a pallas_call); each
            # layer sees Layer views of the stacked weights and cache, which the kernels read in place
            (x, cache), _ = jax.lax.scan(body, (x, cache), jnp.arange(c.num_layers))
        x = RMSNorm(c.rms_norm_eps, self.row_tile, self.kernels, name="final_norm")(x)
        head = embed if c.tie_word_embeddings else self.param(
            "lm_head", _dense_init, (c.vocab_size, c.hidden_size))
        return linear(x, head.astype(self.dtype), "w16a16", self.row_tile, self.kernels), cache


def _check_layer_counts(config: LlamaConfig, layers: Any, cache: KVCache | None) -> None:
    """The params' layers and the cache must hold ``config.num_layers`` layers: the layer scan
    indexes them and would otherwise read clamped layers and drop cache writes without an error."""
    n = len(layers) if isinstance(layers, (list, tuple)) else jax.tree.leaves(layers)[0].shape[0]
    counts = {"config": config.num_layers, "params": n}
    if cache is not None:
        if len(cache) not in (2, 6):
            raise ValueError(f"a KV cache is (k, v) or (k, v) plus a 4-array shadow, got {len(cache)} arrays")
        counts["cache"] = tuple(a.shape[0] for a in cache)
    if n != config.num_layers or (cache is not None and set(counts["cache"]) != {n}):
        raise ValueError(f"layer counts differ: {counts}")


def _check_cache_layout(config: LlamaConfig, cache: KVCache, batch: int) -> None:
    """The cache must have :func:`init_cache`'s layout for this batch and config: the reference path
    would otherwise drop the writes of rows past the cache's batch and read another row's keys."""
    slots = cache[0].shape[2]
    bits = 16 * cache[2].shape[-1] // config.head_dim if len(cache) == 6 else None
    try:
        want = [tuple(a.shape) for a in jax.eval_shape(lambda: init_cache(config, batch, slots, shadow_bits=bits))]
    except ValueError:  # shadow words that pack head_dim in no supported width
        want = None
    got = [tuple(a.shape) for a in cache]
    if got != want:
        raise ValueError(f"the KV cache's shapes {got} do not match init_cache's layout for a batch of {batch} "
                         f"sequences with {config.num_kv_heads} KV heads of size {config.head_dim}: {want}")


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with its stacked ``layers`` split into a list of per-layer trees, which
    :class:`Llama` runs as an unrolled loop. For plain-XLA runs (the W16A16 benchmark baseline): XLA
    hands a library dot a layer sliced out of a stack only after copying it, which the kernels avoid
    by reading the stack in place. Longer compiles; the same math (XLA may fuse it differently)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        raise ValueError("params['layers'] is already a list of per-layer trees")
    n = jax.tree.leaves(layers)[0].shape[0]
    per = [jax.tree.map(lambda a: a[i], layers) for i in range(n)]
    return {**params, "layers": per}


def init_cache(config: LlamaConfig, batch: int, length: int, dtype=jnp.float32,
               shadow_bits: int | None = None) -> KVCache:
    """A zero KV cache of ``length`` slots per sequence; with ``shadow_bits`` (8 or 4) followed by the
    draft's quantized shadow: int16 words of codes ``[L, B, S, KV, d * bits / 16]`` and float32
    scales for keys and values, head-major ``[L, B, KV, S]`` so that the attention kernel reads a KV
    block's scales as one contiguous run."""
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    cache = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if shadow_bits is None:
        return cache
    if shadow_bits not in reference.KV_BITS or config.head_dim * shadow_bits % 16:
        raise ValueError(f"shadow_bits must be one of {reference.KV_BITS} and pack head_dim {config.head_dim} "
                         f"into 16-bit words, got {shadow_bits!r}")
    words = (*shape[:-1], config.head_dim * shadow_bits // 16)
    scales = (*shape[:2], shape[3], shape[2])
    return (*cache, jnp.zeros(words, jnp.int16), jnp.zeros(words, jnp.int16),
            jnp.zeros(scales, jnp.float32), jnp.zeros(scales, jnp.float32))


SYNC_LAYERS_AT_ONCE = 4096  # sync_shadow re-quantizes all layers at once up to this many (row, position) slots


def sync_shadow(cache: KVCache, positions: jax.Array) -> KVCache:
    """Re-quantize the shadow's slots ``positions[B, T]`` from the float pair (positions past the
    cache are skipped; a cache without a shadow is returned as it is): afterwards those slots hold
    ``quantize_kv`` of what the pair holds, whatever a draft wrote there before. Decode-time calls
    (few slots) do all layers in one step; a prefill goes layer by layer, so its float32 temporaries
    stay one layer's."""
    if len(cache) == 2:
        return cache
    k, v = cache[:2]
    rows = jnp.arange(k.shape[1])[:, None]
    if positions.size <= SYNC_LAYERS_AT_ONCE:  # gathers clip past the cache; those writes drop
        return (k, v, *_store_shadow(cache[2:], None, rows, positions, k[:, rows, positions], v[:, rows, positions]))

    def one_layer(i, shadow):
        kl, vl = (jax.lax.dynamic_index_in_dim(a, i, keepdims=False)[rows, positions] for a in (k, v))
        return _store_shadow(shadow, i, rows, positions, kl, vl)

    return (k, v, *jax.lax.fori_loop(0, k.shape[0], one_layer, tuple(cache[2:])))


def forward(params: dict[str, Any], config: LlamaConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, mode: str, dtype: Any = jnp.float32,
            online_rotation_seed: int | None = None, row_tile: int | None = None,
            kernels: str = "auto", read_shadow: bool = False,
            ) -> tuple[jax.Array, KVCache | None]:
    """Apply the model to a params pytree: ``(float32 logits [B, T, V], updated cache)``."""
    _check_inputs(config, tokens, positions)
    model = Llama(config, mode, dtype, online_rotation_seed, row_tile, resolve_kernels(kernels), read_shadow)
    return model.apply({"params": params}, tokens, positions, cache)


def _check_inputs(config: LlamaConfig, tokens: jax.Array, positions: jax.Array) -> None:
    """Integer ``tokens`` and ``positions`` of one shape ``[B, T]``; where their values are known (not
    traced), ids in ``[0, vocab)`` and positions >= 0: the embedding gathers NaN for an id out of
    range, and a negative position's cache write wraps to the last slots (no error either way)."""
    for name, a in (("tokens", tokens), ("positions", positions)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {a.dtype}")
    if tokens.ndim != 2 or positions.shape != tokens.shape or not tokens.size:
        raise ValueError(f"tokens and positions must both be [batch, time], at least one token, got shapes "
                         f"{tokens.shape} and {positions.shape}")
    if not isinstance(tokens, jax.core.Tracer):
        check_token_ids(np.asarray(tokens), config.vocab_size)
    check_positions("positions", positions)
