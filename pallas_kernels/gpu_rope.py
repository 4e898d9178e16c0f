"""RoPE of the new tokens and their KV-cache write as one Pallas GPU kernel (Triton lowering).

After the fused qkv projection a decode step rotates the new queries and keys by their positions
and stores the keys and values in the cache at those positions. As XLA ops that is a convert, a
rotation fusion and a scatter per cache, four launches of about 2 µs each per layer
(bench/results/profile_llama2-7b_b16_session16.md). Here one program per (token, KV head) rotates
the head's G query heads and its key (:func:`pallas_kernels.reference.rope`, the same bits) and
writes the key and value into the cache in place: the cache is aliased to the output, and nothing
else of it is touched. A position at or past the cache's end is dropped, as the model's scatter
does (``mode="drop"``). Each token is computed on its own, so the result is row-count invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels.launch import LAYER_SPEC, at_layer, call_kernel, int32_offsets_wrap, pl_triton, stacked_input

NUM_WARPS = 1  # a program moves (G + 2) head vectors: one warp holds a 128-wide head in 4 values per thread


def supported(head_dim: int, cache: jax.Array, dtype) -> bool:
    """Whether :func:`rope_store` takes this head size (its halves a power of two >= 16) and cache
    (of the compute dtype, and a stack the kernel can index in place)."""
    half = head_dim // 2
    return (head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0 and cache.dtype == dtype
            and not int32_offsets_wrap(cache))


def _rope_kernel(layer_ref, pos_ref, qkv_ref, cos_ref, sin_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
                 heads: int, kv_heads: int, slots: int, interpret: bool):
    """Token ``program_id(0)``, KV head ``program_id(1)``: its query heads into ``q``, its key and
    value into the cache (``k_ref, v_ref [L, S, d]``: this sequence's slots of this KV head). The
    qkv row is the sum of ``qkv_ref[P, ...]``'s parts, left to right, rounded to the cache's dtype."""
    row, head = pl.program_id(0), pl.program_id(1)
    group, width = heads // kv_heads, heads + 2 * kv_heads  # q heads per KV head; heads in a qkv row
    d = q_ref.shape[-1]
    lo, hi = pl.ds(0, d // 2), pl.ds(d // 2, d // 2)
    c, s = cos_ref[row, :], sin_ref[row, :]
    # float32 -> float32 at the output's precision: a cast pair on the GPU (Triton keeps it); in
    # interpret mode the reference's reduce_precision (XLA may drop a cast pair)
    rounded = reference.round_to(q_ref.dtype) if interpret else lambda v: v.astype(q_ref.dtype).astype(jnp.float32)

    def load(at: int | jax.Array, cols) -> jax.Array:
        v = qkv_ref[0, at, cols].astype(jnp.float32)
        for p in range(1, qkv_ref.shape[0]):
            v = v + qkv_ref[p, at, cols]
        return rounded(v).astype(q_ref.dtype)

    def rotate(src: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        at = row * width + src
        return reference.rope(load(at, lo), load(at, hi), c, s, rounded)

    for g in range(group):
        h = head * group + g
        q_lo, q_hi = rotate(h)
        q_ref[row * heads + h, lo] = q_lo
        q_ref[row * heads + h, hi] = q_hi
    pos = pos_ref[row]
    slot = jnp.minimum(pos, slots - 1)
    keep = jnp.full((d // 2,), pos < slots)
    k_lo, k_hi = rotate(heads + head)
    value = row * width + heads + kv_heads + head
    layer = layer_ref[0]
    for ref, cols, val in ((k_ref, lo, k_lo), (k_ref, hi, k_hi), (v_ref, lo, load(value, lo)),
                           (v_ref, hi, load(value, hi))):
        at = at_layer(ref, layer, (slot, cols), interpret)
        if interpret:  # the interpreter takes no mask on a view of a view: keep the old value instead
            at[...] = jnp.where(keep, val, at[...])
        else:
            pl_triton.store(at, val, mask=keep)


def rope_store(qkv: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, *, heads: int, layer: jax.Array | None = None,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``qkv [B, T, (H + 2 KV) d]`` (the fused projection: queries, keys, values) of tokens at
    ``positions [B, T]`` -> ``(q [B, T, H, d] rotated, k_cache, v_cache)`` with the rotated keys and
    the values stored at ``[b, positions[b, t]]`` of the caches ``[B, S, KV, d]`` (or, with ``layer``,
    of layer ``layer`` of their stacks ``[L, B, S, KV, d]``), updated in place (donate them where the
    caller keeps no other reference). ``qkv`` is in the caches' dtype, or float32 partial sums
    ``[P, B, T, N]`` (a matmul's K splits) that the kernel adds left to right and rounds to it.
    ``cos, sin [B, T, d / 2]``: the angles' tables in the caches' dtype
    (:func:`qspec_jax.model.rope_tables`)."""
    stacked = 4 if layer is None else 5
    partial = qkv.ndim == 4
    if partial and qkv.dtype != jnp.float32:
        raise ValueError(f"partial sums [P, B, T, N] must be float32, got {qkv.dtype}")
    parts = qkv if partial else qkv[None]
    if parts.ndim != 4 or k_cache.ndim != stacked or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected qkv [B, T, N] (or [P, B, T, N] partial sums) and caches "
                         f"{'[B, S, KV, d]' if layer is None else '[L, B, S, KV, d]'}, got {qkv.shape}, "
                         f"{k_cache.shape}, {v_cache.shape}")
    b, t, n = parts.shape[1:]
    _, s, kv_heads, d = k_cache.shape[-4:]
    if k_cache.shape[-4] != b or n != (heads + 2 * kv_heads) * d or heads % kv_heads:
        raise ValueError(f"qkv {qkv.shape} does not hold {heads} query heads and the cache's {kv_heads} KV heads "
                         f"of {d} for its batch {k_cache.shape[-4]}")
    if positions.shape != (b, t) or cos.shape != (b, t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"expected positions [B, T] = {(b, t)} and cos, sin {(b, t, d // 2)}, got "
                         f"{positions.shape}, {cos.shape}, {sin.shape}")
    dtype = k_cache.dtype
    if not supported(d, k_cache, dtype) or v_cache.dtype != dtype or cos.dtype != dtype or (
            not partial and qkv.dtype != dtype):
        raise ValueError(f"rope_store needs head_dim / 2 a power of two >= 16 (got {d}) and qkv (unless partial "
                         f"sums), cos, sin and the caches of one dtype (got {qkv.dtype}, {cos.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype})")
    (k_cache, v_cache), lidx = stacked_input((k_cache, v_cache), layer)
    m, nl = b * t, k_cache.shape[0]
    cache_spec = pl.BlockSpec((nl, None, s, None, d), lambda r, h: (0, r // t, 0, h, 0))
    kernel = functools.partial(_rope_kernel, heads=heads, kv_heads=kv_heads, slots=s, interpret=interpret)
    table = pl.BlockSpec((m, d // 2), lambda r, h: (0, 0))
    q, k_cache, v_cache = call_kernel(
        kernel, (jax.ShapeDtypeStruct((m * heads, d), dtype), *(jax.ShapeDtypeStruct(c.shape, c.dtype)
                                                                     for c in (k_cache, v_cache))), (m, kv_heads),
        [LAYER_SPEC, pl.BlockSpec((m,), lambda r, h: (0,)),
         pl.BlockSpec((parts.shape[0], m * n // d, d), lambda r, h: (0, 0, 0)),
         table, table, cache_spec, cache_spec],
        (pl.BlockSpec((m * heads, d), lambda r, h: (0, 0)), cache_spec, cache_spec), interpret, NUM_WARPS, 1,
        lidx, positions.astype(jnp.int32).reshape(m), parts.reshape(parts.shape[0], m * n // d, d),
        cos.reshape(m, d // 2), sin.reshape(m, d // 2), k_cache, v_cache, aliases={5: 1, 6: 2})
    if layer is None:
        k_cache, v_cache = k_cache[0], v_cache[0]
    return q.reshape(b, t, heads, d), k_cache, v_cache
