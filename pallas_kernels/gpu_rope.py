"""RoPE of the new tokens and their KV-cache write as one Pallas GPU kernel (Triton lowering).

After the fused qkv projection a decode step rotates the new queries and keys by their positions
and stores the keys and values in the cache at those positions. As XLA ops that is the K-split sum
and convert, a rotation fusion and a scatter per cache array (a draft's INT8 / INT4 shadow write adds an
absmax reduction and four scatters).
Here one program per (token, KV head) adds the qkv partial sums, rotates the head's G query heads
and its key (:func:`pallas_kernels.reference.rope`, the same bits) and writes the key and value into
the cache in place: the float pair, or the draft's shadow (codes and scales as
:func:`pallas_kernels.reference.quantize_kv` makes them, of the values the pair would hold). The cache
is aliased to the output and nothing else of it is touched. A position at or past the cache's end is
dropped, as the model's scatter does (``mode="drop"``). Each token is computed on its own, so the
result is row-count invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels.gpu_activations import quant_scale, round_half_even
from pallas_kernels.gpu_norm import rounder
from pallas_kernels.launch import (LAYER_SPEC, at_layer, call_kernel, check_float, check_positions, int32_offsets_wrap,
                                   pl_triton, stacked_input)

NUM_WARPS = 1  # a program moves (G + 2) head vectors: one warp holds a 128-wide head in 4 values per thread


def supported(head_dim: int, cache: jax.Array, dtype) -> bool:
    """Whether :func:`rope_store` takes this head size (a power of two >= 64, so that a 4-bit shadow
    plane is 16 wide) and cache array (the float pair in the compute dtype, or shadow words; a stack
    the kernel can index in place)."""
    return (head_dim >= 64 and head_dim & (head_dim - 1) == 0 and cache.dtype in (dtype, jnp.int16)
            and not int32_offsets_wrap(cache))


def _store(ref, layer, idx: tuple, val: jax.Array, keep: jax.Array, interpret: bool) -> None:
    """``ref[layer][idx] = val`` where ``keep`` (the position is inside the cache)."""
    at = at_layer(ref, layer, idx, interpret)
    if interpret:  # the interpreter takes no mask on a view of a view: keep the old value instead
        at[...] = jnp.where(keep, val, at[...])
    else:
        pl_triton.store(at, val, mask=jnp.full(val.shape, keep))


def _quantized(planes: list[jax.Array], bits: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.reference.quantize_kv` of a vector given as its ``16 // bits`` contiguous
    planes: ``(int16 words, float32 scale [1])``."""
    amax = jnp.float32(0)
    for p in planes:
        amax = jnp.maximum(amax, jnp.max(jnp.abs(p.astype(jnp.float32))))
    scale, inv = quant_scale(amax, bits, interpret)
    qmax = 2 ** (bits - 1) - 1
    word = None
    for j, p in enumerate(planes):
        code = jnp.clip(round_half_even(p.astype(jnp.float32) * inv, interpret), -qmax - 1, qmax) + (qmax + 1)
        word = code << (bits * j) if word is None else word | (code << (bits * j))
    word = jnp.where(word >= 1 << 15, word - (1 << 16), word)  # the uint16 pattern as int16
    return word.astype(jnp.int16), jnp.full((1,), scale, jnp.float32)


def _rope_kernel(layer_ref, pos_ref, qkv_ref, cos_ref, sin_ref, *refs, heads: int, kv_heads: int, slots: int,
                 bits: int | None, scaled: bool, interpret: bool):
    """Token ``program_id(0)``, KV head ``program_id(1)``: its query heads into ``q``, its key and
    value into the cache (``refs``: with ``scaled`` the row scales ``[M]``, then the inputs aliased to
    the outputs, then ``q`` and the outputs: the pair ``k, v [L, S, d]`` or the shadow's words
    ``[L, S, d * bits / 16]`` and scales ``[L, S]``, this sequence's slots of this KV head). The qkv
    row is :func:`pallas_kernels.reference.split_sum` of ``qkv_ref[P, ...]``'s parts (and the row's
    scale), rounded to the compute dtype. The head is handled in ``planes`` contiguous pieces (the
    shadow's code planes; 2 for the pair), the rotation pairing piece ``j`` of each half."""
    sc_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
    q_ref, *cache = refs[len(refs) // 2:]
    row, head = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    group, width = heads // kv_heads, heads + 2 * kv_heads  # q heads per KV head; heads in a qkv row
    dtype = q_ref.dtype
    d = q_ref.shape[-1]
    planes = 2 if bits is None else 16 // bits
    w = d // planes
    pieces = [pl.ds(j * w, w) for j in range(planes)]
    rounded = rounder(dtype, interpret)

    def load(at: int | jax.Array, cols) -> jax.Array:
        parts = [qkv_ref[p, at, cols].astype(jnp.float32) for p in range(qkv_ref.shape[0])]
        return rounded(reference.split_sum(parts, sc_ref[row] if scaled else None)).astype(dtype)

    def rotate(src: int | jax.Array) -> list[jax.Array]:
        """Head ``src`` of the row rotated, as its pieces."""
        at, half = row * width + src, planes // 2
        out = [None] * planes
        for j in range(half):
            tables = pl.ds(j * w, w)
            out[j], out[half + j] = reference.rope(load(at, pieces[j]), load(at, pieces[half + j]),
                                                   cos_ref[row, tables], sin_ref[row, tables], rounded)
        return out

    for g in range(group):
        h = head * group + g
        for cols, piece in zip(pieces, rotate(h)):
            q_ref[row * heads + h, cols] = piece
    pos = pos_ref[row]
    slot, keep = jnp.minimum(pos, slots - 1), pos < slots
    value = row * width + heads + kv_heads + head
    k, v = rotate(heads + head), [load(value, cols) for cols in pieces]
    if bits is None:
        for ref, vec in zip(cache, (k, v)):
            for cols, piece in zip(pieces, vec):
                _store(ref, layer, (slot, cols), piece, keep, interpret)
        return
    for words_ref, scales_ref, vec in zip(cache[:2], cache[2:], (k, v)):
        words, scale = _quantized(vec, bits, interpret)
        _store(words_ref, layer, (slot, slice(None)), words, keep, interpret)
        _store(scales_ref, layer, (pl.ds(slot, 1),), scale, keep, interpret)


def rope_store(qkv: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array, cache: tuple[jax.Array, ...],
               *, heads: int, layer: jax.Array | None = None, scale: jax.Array | None = None,
               interpret: bool = False) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``qkv [B, T, (H + 2 KV) d]`` (the fused projection: queries, keys, values) of tokens at
    ``positions [B, T]`` -> ``(q [B, T, H, d] rotated, cache)`` with the rotated keys and the values
    stored at ``[b, positions[b, t]]`` of ``cache``, updated in place (donate it where the caller keeps
    no other reference). ``cache``: the float pair ``k, v [B, S, KV, d]``, or a draft's shadow (its int16
    words ``[B, S, KV, d * bits / 16]`` for keys and values, then their float32 scales ``[B, KV, S]``:
    :func:`pallas_kernels.reference.quantize_kv` of the values the pair would hold); with ``layer``,
    layer ``layer`` of their stacks ``[L, ...]``. ``qkv`` is in the compute dtype, or float32 partial
    sums ``[P, B, T, N]`` (a matmul's K splits) that the kernel adds left to right, multiplies by the
    float32 row ``scale [B, T, 1]`` where one is given (a W4AX matmul's) and rounds to it.
    ``cos, sin [B, T, d / 2]``: the angles' tables in the compute dtype
    (:func:`qspec_jax.model.rope_tables`), which is also q's and the pair's."""
    dtype, lead = cos.dtype, 0 if layer is None else 1
    partial = qkv.ndim == 4
    if partial and qkv.dtype != jnp.float32:
        raise ValueError(f"partial sums [P, B, T, N] must be float32, got {qkv.dtype}")
    parts = qkv if partial else qkv[None]
    shadow = len(cache) == 4
    if parts.ndim != 4 or len(cache) not in (2, 4) or any(c.ndim != lead + 4 for c in cache[:2]) or (
            cache[1].shape != cache[0].shape):
        raise ValueError(f"expected qkv [B, T, N] (or [P, B, T, N] partial sums) and a cache pair (or shadow) of "
                         f"{'[B, S, KV, d]' if layer is None else '[L, B, S, KV, d]'}, got {qkv.shape} and "
                         f"{[c.shape for c in cache]}")
    b, t, n = parts.shape[1:]
    if scale is not None and (not partial or scale.shape != (b, t, 1) or scale.dtype != jnp.float32):
        raise ValueError(f"a row scale goes with partial sums and must be float32 [B, T, 1] = {(b, t, 1)}, got "
                         f"{scale.dtype}{scale.shape}")
    _, s, kv_heads, width = cache[0].shape[lead:]
    d = n // (heads + 2 * kv_heads)
    bits = reference.kv_shadow_bits(width, d) if shadow else None
    if cache[0].shape[lead] != b or n != (heads + 2 * kv_heads) * d or heads % kv_heads or (not shadow and width != d):
        raise ValueError(f"qkv {qkv.shape} does not hold {heads} query heads and the cache's {kv_heads} KV heads "
                         f"for its batch {cache[0].shape[lead]}")
    want_scales = (*cache[0].shape[:lead + 1], kv_heads, s)
    if shadow and any(c.shape != want_scales or c.dtype != jnp.float32 for c in cache[2:]):
        raise ValueError(f"the shadow's scales must be float32 {want_scales}, got "
                         f"{[(c.shape, c.dtype) for c in cache[2:]]}")
    if positions.shape != (b, t) or cos.shape != (b, t, d // 2) or sin.shape != cos.shape or sin.dtype != dtype:
        raise ValueError(f"expected positions [B, T] = {(b, t)} and cos, sin {(b, t, d // 2)} of one dtype, got "
                         f"{positions.shape}, {cos.shape} {cos.dtype}, {sin.shape} {sin.dtype}")
    check_float(cos=cos)
    check_positions("positions", positions)  # one at or past the end is dropped
    want = jnp.int16 if shadow else dtype
    if not supported(d, cache[0], dtype) or any(c.dtype != want for c in cache[:2]) or (
            not partial and qkv.dtype != dtype):
        raise ValueError(f"rope_store needs head_dim a power of two >= 64 (got {d}), qkv (unless partial sums) "
                         f"and the pair in cos' dtype {dtype} or int16 shadow words; got {qkv.dtype}, "
                         f"{[c.dtype for c in cache[:2]]}")
    cache, lidx = stacked_input(tuple(cache), layer)
    m, nl = b * t, cache[0].shape[0]
    slots_spec = pl.BlockSpec((nl, None, s, None, width), lambda r, h: (0, r // t, 0, h, 0))
    scales_spec = pl.BlockSpec((nl, None, None, s), lambda r, h: (0, r // t, h, 0))
    cache_specs = [slots_spec, slots_spec] + [scales_spec] * (len(cache) - 2)
    table = pl.BlockSpec((m, d // 2), lambda r, h: (0, 0))
    kernel = functools.partial(_rope_kernel, heads=heads, kv_heads=kv_heads, slots=s, bits=bits,
                               scaled=scale is not None, interpret=interpret)
    rows = pl.BlockSpec((m,), lambda r, h: (0,))
    scales = [] if scale is None else [scale.reshape(m)]
    q, *cache = call_kernel(
        kernel, (jax.ShapeDtypeStruct((m * heads, d), dtype), *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in cache)),
        (m, kv_heads),
        [LAYER_SPEC, rows, pl.BlockSpec((parts.shape[0], m * n // d, d), lambda r, h: (0, 0, 0)), table, table,
         *[rows] * len(scales), *cache_specs],
        (pl.BlockSpec((m * heads, d), lambda r, h: (0, 0)), *cache_specs), interpret, NUM_WARPS, 1,
        lidx, positions.astype(jnp.int32).reshape(m), parts.reshape(parts.shape[0], m * n // d, d),
        cos.reshape(m, d // 2), sin.reshape(m, d // 2), *scales, *cache,
        aliases={5 + len(scales) + i: 1 + i for i in range(len(cache))})
    if layer is None:
        cache = [c[0] for c in cache]
    return q.reshape(b, t, heads, d), tuple(cache)
