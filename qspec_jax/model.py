"""A Flax (linen) Llama: a pure function of (params, token ids, positions, KV cache).

Layers are stacked and run with ``jax.lax.scan`` over the layer index (one traced layer, short
compiles); each layer sees :class:`~qspec_jax.kernels.Layer` views of the stacked weights and KV
cache, which the kernels read in place. Per-layer trees (a list of layers) run as an unrolled loop
instead, for plain-XLA baselines. Every decoder linear goes through
:func:`qspec_jax.kernels.linear` with the model's :class:`~pallas_kernels.precision.Precision`, so
one packed INT4 params pytree serves W16A16, W4A16, W4A8 and W4A4, and every op runs as the model's
:class:`~qspec_jax.kernels.Execution` says. Embeddings, attention and the lm_head always run in the
float compute dtype. With ``online_rotation_seed`` set (rotated checkpoints), the o_proj input (per
head) and the down_proj input pass through the orthogonal transform of :mod:`qspec_jax.rotation`
in every precision.

The KV cache is a :class:`KVCache`: keys and values ``[L, B, S, num_kv_heads, head_dim]`` whose
slot ``s`` holds position ``s``; a query at position ``p`` attends to slots ``0..p``. It may carry
the draft's quantized shadow of itself (:class:`KVShadow`, :func:`init_cache`): a forward with
``read_shadow`` attends over the shadow and writes only it, so the float pair stays the verifier's
alone; :func:`sync_shadow` re-quantizes the shadow from the pair after any other forward. Without
a cache the tokens attend causally (by position) to each other. Callers size the cache: a position
at or beyond its length is not stored (checked by the decoding API before anything is traced).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax.config import LlamaConfig
from qspec_jax.kernels import (Execution, Layer, SplitSum, attention, fuses_rope_store, layer_view, linear,
                               materialize, merge_heads, rms_norm, rope_store, stacked_of, swiglu, unstack)
from pallas_kernels import reference
from pallas_kernels.launch import check_positions
from pallas_kernels.layout import QuantizedWeight, rtn
from pallas_kernels.precision import W4A16, W16A16, Precision
from pallas_kernels.rows import map_row_tiles
from qspec_jax.rotation import apply_transform
from qspec_jax.sampling import check_token_ids

# The decoder linears (module paths within a layer), whose weights a quantized checkpoint packs as INT4;
# embeddings, norms, biases and the lm_head stay float
LINEAR_PATHS = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVShadow:
    """The draft's quantized copy of the KV cache: int16 words of ``bits``-bit codes
    ``[L, B, S, KV, d * bits / 16]`` and float32 scales, head-major ``[L, B, KV, S]``, for keys and
    values (:func:`pallas_kernels.reference.quantize_kv`). Its leaves may be :class:`Layer` views."""

    k_words: Any
    v_words: Any
    k_scales: Any
    v_scales: Any
    bits: int = dataclasses.field(metadata=dict(static=True))

    @property
    def arrays(self) -> tuple[Any, Any, Any, Any]:
        """``(k_words, v_words, k_scales, v_scales)``: the order the fused RoPE / store kernel takes."""
        return self.k_words, self.v_words, self.k_scales, self.v_scales

    def with_arrays(self, arrays) -> KVShadow:
        return KVShadow(*arrays, bits=self.bits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values ``[L, B, S, KV, d]`` (the verifier's, in the compute dtype) and, with
    ``Runtime.draft_kv``, the draft's :class:`KVShadow`. Inside the layer scan its leaves are
    :class:`Layer` views of one layer (:func:`qspec_jax.kernels.layer_view`)."""

    k: Any
    v: Any
    draft: KVShadow | None = None

    def written(self, read_shadow: bool) -> tuple[Any, ...] | None:
        """What a forward writes: the shadow's arrays for a draft over the shadow (None without
        one), else the pair ``(k, v)``."""
        if read_shadow:
            return None if self.draft is None else self.draft.arrays
        return self.k, self.v

    def with_written(self, read_shadow: bool, arrays) -> KVCache:
        """The cache with :meth:`written`'s arrays replaced by ``arrays``."""
        if read_shadow:
            return dataclasses.replace(self, draft=self.draft.with_arrays(arrays))
        k, v = arrays
        return dataclasses.replace(self, k=k, v=v)


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
    """``y = x @ W.T (+ b)`` over a float or packed-INT4 weight ``[features, in]`` in ``precision``;
    ``parts``: the float32 result as a :class:`~qspec_jax.kernels.SplitSum` instead, for a consumer
    kernel that adds and rounds it itself; ``reduce_axis``: ``W`` is this shard's slice of the input
    features, the float32 results summed over that mesh axis before the rounding."""

    features: int
    precision: Precision
    execution: Execution = Execution()
    use_bias: bool = False
    parts: bool = False
    reduce_axis: str | None = None

    @nn.compact
    def __call__(self, x) -> jax.Array | SplitSum:
        w = _param(self, "w", _dense_init, (self.features, x.shape[-1]))
        if self.parts:
            if self.use_bias:
                raise ValueError("a layer with a bias cannot hand out its partial sums")
            return linear(x, w, self.precision, self.execution, parts=True)
        y = linear(x, w, self.precision, self.execution,
                   jnp.float32 if self.use_bias or self.reduce_axis else x.dtype)
        if self.reduce_axis is not None:
            y = jax.lax.psum(y, self.reduce_axis)
        if self.use_bias:
            y = y + unstack(_param(self, "b", nn.initializers.zeros, (self.features,))).astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    """May return a lazy :class:`~qspec_jax.kernels.PendingNorm` (see :func:`qspec_jax.kernels.rms_norm`)."""

    eps: float
    execution: Execution = Execution()

    @nn.compact
    def __call__(self, x: jax.Array):
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],))
        return rms_norm(x, scale, self.eps, self.execution)


class _Block(nn.Module):
    """What every part of a decoder layer is configured with (the model's settings)."""

    config: LlamaConfig
    precision: Precision
    execution: Execution = Execution()
    online_rotation_seed: int | None = None
    tp_axis: str | None = None  # the mesh axis the heads and MLP features are split over (config: one shard's)


class Attention(_Block):
    """Fused qkv projection, RoPE, the KV cache write and grouped-query attention, then o
    (``window``: over the cache's slots in that window only)."""

    read_shadow: bool = False
    window: reference.AttentionWindow | None = None

    @nn.compact
    def __call__(self, x, positions, rope: tuple[jax.Array, jax.Array], cache: KVCache | None):
        """``rope``: the positions' :func:`rope_tables`; ``cache``: this layer's views of the stacked
        cache; returned as views of the updated stack."""
        c, ex = self.config, self.execution
        b, t, _ = x.shape
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        # on the kernel path one kernel rotates q and k and writes the cache, adding qkv's K splits itself
        # (a draft over the shadow writes only the shadow, as _write_kv does)
        target = None if cache is None else cache.written(self.read_shadow)
        fused = (target is not None and not c.attention_bias
                 and fuses_rope_store(x.dtype, cache.k, target[0], d, ex))
        qkv = Linear((hq + 2 * hk) * d, self.precision, ex, c.attention_bias, fused, name="qkv")(x)
        if fused:
            q, written = rope_store(qkv, *rope, positions, target, hq, ex)
            cache = cache.with_written(self.read_shadow, written)
        else:
            q, k, v = jnp.split(qkv, [hq * d, (hq + hk) * d], axis=-1)
            q, k = apply_rope(q.reshape(b, t, hq, d), *rope), apply_rope(k.reshape(b, t, hk, d), *rope)
            v = v.reshape(b, t, hk, d)
            if cache is not None:  # write this layer's slots in place
                cache = _write_kv(cache, k, v, positions, self.read_shadow)
        if cache is None:
            out = reference.attention(q, k, v, positions, positions, self.window)
        elif self.read_shadow:  # attend over the layer's shadow
            s = cache.draft
            out = attention(q, s.k_words, s.v_words, positions, ex, scales=(s.k_scales, s.v_scales),
                            window=self.window)
        else:  # a prompt's forward may attend over the new keys alone, as the cache holds them
            new = tuple(a.astype(cache.k.stacked.dtype) for a in (k, v)) if ex.causal_prompt else None
            out = attention(q, cache.k, cache.v, positions, ex, window=self.window, new=new)
        out = merge_heads(out)
        if self.online_rotation_seed is not None:  # per head: [.., hq*d] -> [.., hq, d] rows
            per_head = lambda r: apply_transform(r.reshape(r.shape[0], hq, d), self.online_rotation_seed)  # noqa: E731
            out = map_row_tiles(lambda r: per_head(r).reshape(r.shape), materialize(out), ex.row_tile)
        out = Linear(c.hidden_size, self.precision, ex, reduce_axis=self.tp_axis, name="o")(out)
        return out, cache


def _write_kv(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array, read_shadow: bool) -> KVCache:
    """Store new keys and values ``[B, T, KV, d]`` at their positions in ``cache`` (one layer's
    views): quantized in the shadow if the forward reads the shadow (a draft), else in the float pair
    (the caller re-quantizes the shadow from the pair afterwards, :func:`sync_shadow`, leaving this
    forward's computation as it is without a shadow)."""
    if read_shadow and cache.draft is None:
        raise ValueError("read_shadow needs a KV cache with the draft's shadow (init_cache(shadow_bits=...))")
    rows = jnp.arange(k.shape[0])[:, None]

    def put(kv: Layer, new: jax.Array) -> Layer:
        return Layer(kv.stacked.at[kv.index, rows, positions].set(new.astype(kv.stacked.dtype), mode="drop"),
                     kv.index)

    if not read_shadow:
        return dataclasses.replace(cache, k=put(cache.k, k), v=put(cache.v, v))
    k, v = (new.astype(c.stacked.dtype) for c, new in zip((cache.k, cache.v), (k, v)))  # the values the pair would hold
    index = cache.draft.k_words.index
    stored = _store_shadow(stacked_of(cache.draft), index, rows, positions, k, v)
    return dataclasses.replace(cache, draft=layer_view(stored, index))


def _store_shadow(shadow: KVShadow, layer, rows: jax.Array, positions: jax.Array, k: jax.Array,
                  v: jax.Array) -> KVShadow:
    """Quantize keys and values and store them in the shadow's stacks at ``[layer, rows, positions]``:
    ``k, v [B, T, KV, d]`` of one layer (``layer`` an index), or ``[L, B, T, KV, d]`` of all layers
    (``layer`` None). Positions past the cache are dropped. The one place the shadow is written."""
    (kw, ks), (vw, vs) = reference.quantize_kv(k, shadow.bits), reference.quantize_kv(v, shadow.bits)
    if layer is None:  # the indexed dims (B, T) lead a scatter's update when a slice splits them
        words_at, scales_at = (slice(None), rows, positions), (slice(None), rows, slice(None), positions)
        ks, vs = (jnp.transpose(sc, (1, 2, 0, 3)) for sc in (ks, vs))  # [L, B, T, KV] -> [B, T, L, KV]
    else:
        words_at, scales_at = (layer, rows, positions), (layer, rows, slice(None), positions)
    put = lambda a, at, n: a.at[at].set(n, mode="drop")  # noqa: E731
    return KVShadow(put(shadow.k_words, words_at, kw), put(shadow.v_words, words_at, vw),
                    put(shadow.k_scales, scales_at, ks), put(shadow.v_scales, scales_at, vs), bits=shadow.bits)


class MLP(_Block):
    """SwiGLU: fused gate/up projection, ``silu(gate) * up``, then down (on the kernel path the
    SwiGLU runs in down's activation prologue, unless a rotation comes between)."""

    @nn.compact
    def __call__(self, x):
        f, ex = self.config.intermediate_size, self.execution
        gate_up = Linear(2 * f, self.precision, ex, name="gate_up")(x)
        h = swiglu(gate_up, ex)
        if self.online_rotation_seed is not None:
            h = map_row_tiles(lambda r: apply_transform(r, self.online_rotation_seed), materialize(h), ex.row_tile)
        return Linear(self.config.hidden_size, self.precision, ex, reduce_axis=self.tp_axis, name="down")(h)


class DecoderLayer(_Block):
    """Pre-norm residual block: attention, then the MLP."""

    read_shadow: bool = False
    window: reference.AttentionWindow | None = None

    @nn.compact
    def __call__(self, x, cache: KVCache | None, positions, rope: tuple[jax.Array, jax.Array]):
        c, p, ex, seed, tp = self.config, self.precision, self.execution, self.online_rotation_seed, self.tp_axis
        h, cache = Attention(c, p, ex, seed, tp, self.read_shadow, self.window, name="attn")(
            RMSNorm(c.rms_norm_eps, ex, name="attn_norm")(x), positions, rope, cache)
        x = x + h
        x = x + MLP(c, p, ex, seed, tp, name="mlp")(RMSNorm(c.rms_norm_eps, ex, name="mlp_norm")(x))
        return x, cache


class Llama(nn.Module):
    """The decoder: ``(tokens[B,T], positions[B,T], cache) -> (float32 logits[B,T,V], cache)``.

    ``precision``: the decoder linears' (the lm_head is always W16A16). ``execution``: a row tile
    (decode steps and verify passes) makes every token's logits independent of how many tokens the
    call has, prefill and evaluation leave it ``None`` for speed; its backend picks the references or
    the Pallas kernels. ``read_shadow``: attend over the cache's quantized shadow and write only it
    (QSPEC's drafts); ``window``: attend only over each query's sliding window of the cache (drafts);
    ``draft_head``: logits from the params' ``draft_head`` rows only (:func:`with_draft_head`), the
    other tokens' ``-inf``. ``logits_at`` (``int32[B, K]``, a call argument): logits only at
    those of the T positions (``[B, K, V]``; a prefill needs each prompt's last), the others never computed. ``tp_axis``: run as one shard of a tensor-parallel mesh axis
    (:mod:`qspec_jax.sharding`): ``config`` is that shard's, its ``lm_head`` a slice of the (padded)
    vocabulary whose logits are gathered over the axis.
    """

    config: LlamaConfig
    precision: Precision = W4A16
    dtype: Any = jnp.float32
    online_rotation_seed: int | None = None
    execution: Execution = Execution()
    read_shadow: bool = False
    window: reference.AttentionWindow | None = None
    draft_head: bool = False
    tp_axis: str | None = None

    def setup(self):
        if not isinstance(self.precision, Precision):
            raise TypeError(f"precision must be a Precision (parse_precision), got {self.precision!r}")

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None,
                 logits_at: jax.Array | None = None):
        c = self.config
        embed = self.param("embed", _dense_init, (c.vocab_size, c.hidden_size))
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)
        rope = rope_tables(positions, rope_frequencies(c), self.dtype)
        layer = DecoderLayer(c, self.precision, self.execution, self.online_rotation_seed, self.tp_axis,
                             self.read_shadow, self.window, parent=None)

        def init_layers(rng):
            init_one = lambda key: layer.init(key, x, None, positions, rope)["params"]  # noqa: E731
            return jax.vmap(init_one)(jax.random.split(rng, c.num_layers))

        def body(carry, i, layer_params=None):
            h, kv = carry
            if layer_params is None:
                layer_params = layer_view(stacked, i)
            h, kv = layer.apply({"params": layer_params}, h, layer_view(kv, i), positions, rope)
            return (h, stacked_of(kv)), None

        stacked = _param(self, "layers", init_layers)
        _check_layer_counts(c, stacked, cache)
        if cache is not None:
            _check_cache_layout(c, cache, tokens.shape[0])
        if isinstance(stacked, (list, tuple)):  # per-layer trees: an unrolled loop (plain-XLA baselines)
            for i, layer_params in enumerate(stacked):
                (x, cache), _ = body((x, cache), i, layer_params)
        else:
            # a plain lax.scan over the layer index (flax's nn.scan cannot hold a pallas_call); each
            # layer sees Layer views of the stacked weights and cache, which the kernels read in place
            (x, cache), _ = jax.lax.scan(body, (x, cache), jnp.arange(c.num_layers))
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        x = RMSNorm(c.rms_norm_eps, self.execution, name="final_norm")(x)
        if self.draft_head:
            rows = self.get_variable("params", "draft_head")
            w = rows["w"]  # a float copy (W16A16) or an INT4 one (W4A16: a quarter of the bytes)
            logits = (linear(x, w, W4A16, self.execution) if isinstance(w, QuantizedWeight)
                      else linear(x, w.astype(self.dtype), W16A16, self.execution))
            every = jnp.full((*logits.shape[:-1], c.vocab_size), -jnp.inf, logits.dtype)
            return every.at[..., rows["ids"]].set(logits), cache
        if self.tp_axis is not None:  # this shard's rows of the padded vocabulary; the logits gathered in order
            head = self.get_variable("params", "lm_head")
            logits = linear(x, head.astype(self.dtype), W16A16, self.execution)
            return jax.lax.all_gather(logits, self.tp_axis, axis=logits.ndim - 1, tiled=True)[..., :c.vocab_size], cache
        head = embed if c.tie_word_embeddings else self.param(
            "lm_head", _dense_init, (c.vocab_size, c.hidden_size))
        return linear(x, head.astype(self.dtype), W16A16, self.execution), cache


def _check_layer_counts(config: LlamaConfig, layers: Any, cache: KVCache | None) -> None:
    """The params' layers and the cache must hold ``config.num_layers`` layers: the layer scan
    indexes them and would otherwise read clamped layers and drop cache writes without an error."""
    n = len(layers) if isinstance(layers, (list, tuple)) else jax.tree.leaves(layers)[0].shape[0]
    counts = {"config": config.num_layers, "params": n}
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"a KV cache is a KVCache (init_cache), got {type(cache).__name__}")
        counts["cache"] = tuple(a.shape[0] for a in jax.tree.leaves(cache))
    if n != config.num_layers or (cache is not None and set(counts["cache"]) != {n}):
        raise ValueError(f"layer counts differ: {counts}")


def _check_cache_layout(config: LlamaConfig, cache: KVCache, batch: int) -> None:
    """The cache must have :func:`init_cache`'s layout for this batch and config: the reference path
    would otherwise drop the writes of rows past the cache's batch and read another row's keys."""
    slots = cache.k.shape[2]
    bits = None if cache.draft is None else cache.draft.bits
    try:
        want = [tuple(a.shape) for a in
                jax.tree.leaves(jax.eval_shape(lambda: init_cache(config, batch, slots, shadow_bits=bits)))]
    except ValueError:  # shadow words that pack head_dim in no supported width
        want = None
    got = [tuple(a.shape) for a in jax.tree.leaves(cache)]
    if got != want:
        raise ValueError(f"the KV cache's shapes {got} do not match init_cache's layout for a batch of {batch} "
                         f"sequences with {config.num_kv_heads} KV heads of size {config.head_dim}: {want}")


def init_cache(config: LlamaConfig, batch: int, length: int, dtype=jnp.float32,
               shadow_bits: int | None = None) -> KVCache:
    """A zero KV cache of ``length`` slots per sequence; with ``shadow_bits`` (8 or 4) the draft's
    quantized shadow too: int16 words of codes ``[L, B, S, KV, d * bits / 16]`` and float32 scales
    for keys and values, head-major ``[L, B, KV, S]`` so that the attention kernel reads a KV block's
    scales as one contiguous run."""
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if shadow_bits is None:
        return KVCache(k, v)
    if shadow_bits not in reference.KV_BITS or config.head_dim * shadow_bits % 16:
        raise ValueError(f"shadow_bits must be one of {reference.KV_BITS} and pack head_dim {config.head_dim} "
                         f"into 16-bit words, got {shadow_bits!r}")
    words = (*shape[:-1], config.head_dim * shadow_bits // 16)
    scales = (*shape[:2], shape[3], shape[2])
    return KVCache(k, v, KVShadow(jnp.zeros(words, jnp.int16), jnp.zeros(words, jnp.int16),
                                  jnp.zeros(scales, jnp.float32), jnp.zeros(scales, jnp.float32), bits=shadow_bits))


SYNC_LAYERS_AT_ONCE = 4096  # sync_shadow re-quantizes all layers at once up to this many (row, position) slots


def sync_shadow(cache: KVCache, positions: jax.Array) -> KVCache:
    """Re-quantize the shadow's slots ``positions[B, T]`` from the float pair (positions past the
    cache are skipped; a cache without a shadow is returned as it is): afterwards those slots hold
    ``quantize_kv`` of what the pair holds, whatever a draft wrote there before. Decode-time calls
    (few slots) do all layers in one step; a prefill goes layer by layer, so its float32 temporaries
    stay one layer's."""
    if cache.draft is None:
        return cache
    k, v = cache.k, cache.v
    rows = jnp.arange(k.shape[1])[:, None]
    if positions.size <= SYNC_LAYERS_AT_ONCE:  # gathers clip past the cache; those writes drop
        draft = _store_shadow(cache.draft, None, rows, positions, k[:, rows, positions], v[:, rows, positions])
        return dataclasses.replace(cache, draft=draft)

    def one_layer(i, shadow):
        kl, vl = (jax.lax.dynamic_index_in_dim(a, i, keepdims=False)[rows, positions] for a in (k, v))
        return _store_shadow(shadow, i, rows, positions, kl, vl)

    return dataclasses.replace(cache, draft=jax.lax.fori_loop(0, k.shape[0], one_layer, cache.draft))


def forward(params: dict[str, Any], config: LlamaConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, precision: Precision, execution: Execution | None = None,
            dtype: Any = jnp.float32, online_rotation_seed: int | None = None, read_shadow: bool = False,
            window: reference.AttentionWindow | None = None, draft_head: bool = False,
            tp_axis: str | None = None, logits_at: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """Apply the model to a params pytree: ``(float32 logits [B, T, V], updated cache)``; ``logits_at``
    (``int32[B, K]``): only those positions' logits, ``[B, K, V]``.
    ``execution`` None: :meth:`Execution.prefill` (no row tile, the kernels switch on ``"auto"``);
    ``tp_axis``: as one shard of that mesh axis (inside ``shard_map``, :mod:`qspec_jax.sharding`)."""
    _check_inputs(config, tokens, positions)
    execution = Execution.prefill() if execution is None else execution
    if execution.causal_prompt and not isinstance(positions, jax.core.Tracer) and not np.array_equal(
            np.asarray(positions), np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)):
        raise ValueError("a causal_prompt forward (Execution.for_prompt) needs positions 0..T-1 in every row")
    if logits_at is not None:
        _check_logits_at(logits_at, tokens.shape)
    if draft_head and "draft_head" not in params:
        raise ValueError("draft_head needs params with a 'draft_head' entry (with_draft_head)")
    model = Llama(config, precision, dtype, online_rotation_seed, execution, read_shadow, window, draft_head, tp_axis)
    return model.apply({"params": params}, tokens, positions, cache, logits_at)


DRAFT_HEAD_BITS = (16, 4)  # a draft head's copy: the lm_head's float rows, or INT4 (RTN) of them
DRAFT_HEAD_GROUP = 32  # the INT4 copy's group size, or the largest even divisor of the hidden size below it


def with_draft_head(params: dict[str, Any], config: LlamaConfig, ranking: np.ndarray | jax.Array | None,
                    rows: int | None = None, bits: int = 16) -> dict[str, Any]:
    """``params`` plus a draft head: the lm_head's rows of the ``rows`` first tokens of ``ranking``
    (most frequent first; None: every token in id order), copied once into one contiguous block that a
    draft step reads instead of the whole head (the verifier keeps reading the full head). ``bits`` 4:
    the copy is round-to-nearest INT4 (asymmetric, groups of :data:`DRAFT_HEAD_GROUP`)."""
    v = config.vocab_size
    rows = v if rows is None else rows
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or not 1 <= rows <= v:
        raise ValueError(f"a draft head keeps between 1 and {v} rows, got {rows!r}")
    if bits not in DRAFT_HEAD_BITS:
        raise ValueError(f"a draft head's bits must be one of {DRAFT_HEAD_BITS}, got {bits!r}")
    groups = [g for g in range(2, DRAFT_HEAD_GROUP + 1, 2) if config.hidden_size % g == 0]
    if bits == 4 and not groups:
        raise ValueError(f"an INT4 draft head needs an even hidden size, got {config.hidden_size}")
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    ids = jnp.arange(v, dtype=jnp.int32) if ranking is None else jnp.asarray(ranking, jnp.int32)
    ids = ids[: int(rows)]
    w = jnp.take(head, ids, axis=0)
    if bits == 4:
        q = rtn(np.asarray(w, np.float32), groups[-1], symmetric=False)
        w = QuantizedWeight(jnp.asarray(q.packed), jnp.asarray(q.scales), jnp.asarray(q.mins), q.group_size)
    return {**params, "draft_head": {"w": w, "ids": ids}}


def _check_logits_at(logits_at: jax.Array, shape: tuple[int, int]) -> None:
    """Integer ``[B, K]`` indices into the T positions of ``shape`` (values checked where known: an
    index out of range would gather NaN, no error)."""
    if not jnp.issubdtype(logits_at.dtype, jnp.integer) or logits_at.ndim != 2 or logits_at.shape[0] != shape[0]:
        raise ValueError(f"logits_at must be integers [batch, K] with batch {shape[0]}, got {logits_at.dtype} "
                         f"{logits_at.shape}")
    if not isinstance(logits_at, jax.core.Tracer):
        at = np.asarray(logits_at)
        if at.size and (at.min() < 0 or at.max() >= shape[1]):
            raise ValueError(f"logits_at must index the {shape[1]} positions, got values in "
                             f"[{at.min()}, {at.max()}]")


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
