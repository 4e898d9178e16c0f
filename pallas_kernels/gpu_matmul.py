"""Pallas GPU matmuls over packed INT4 weights (first version: ``pl.pallas_call`` lowered through Triton).

``y[M, N] = x[M, K] @ W[N, K].T`` with ``W`` a :class:`~pallas_kernels.layout.QuantizedWeight`, in
two modes that reproduce :mod:`pallas_kernels.reference`:

* :func:`w4a16_matmul`: the nibbles are unpacked and dequantized inside the kernel (``s*(u-8)`` or
  ``s*u + m`` in float32, cast to bfloat16), multiplied with bfloat16 activations on the bf16 MMA,
  float32 accumulation. Version 2 (see :func:`_w4a16_kernel`): the weight tile is the MMA's M side
  and a fixed token tile (``block_m``) its N side; the packed bytes are read as uint32 words and
  each of the 8 nibble positions feeds its own dot against the matching activation columns (the
  wrapper splits x into ``[8, M, K/8]``), so nibbles are never interleaved in registers.
* :func:`w4ax_matmul` (``bits`` 8 or 4): activations quantized per row by
  :func:`pallas_kernels.reference.quantize_activations` in a small jnp step *before* the kernel
  (int8 codes + float32 row scales are what the kernel reads; moving it into the kernel is a later
  step: Triton's default float32 division is not IEEE-rounded, the reference's is); in the kernel,
  int8 x int8 -> int32 dots, one per weight group (a group wider than ``block_k`` is accumulated
  over chunks in int32, exact), then the float32 epilogue in the reference's order:
  ``t = f32(acc_g) * s_g`` (``+ f32(qsum_g) * m_g`` for asymmetric weights), ``tot = tot + t`` for
  g = 0, 1, ... in order, and ``y = s_act * tot``.

Grid: ``(ceil(M / block_m), N / block_n, split_k)``, the M axis fastest so programs sharing a
weight tile run together (the tile comes from HBM once, then from L2). Each program loops over its
K range in chunks of ``block_k`` (a power of two >= 32 that is a multiple of the group size or
divides it). Tile defaults: :func:`default_config`, :func:`w4a16_launch` (``block_m`` = 16 for
W4A16, ``BLOCK_M`` = 16 for W4AX).

Row-count invariance by construction: every row runs in a row tile of one fixed shape (``block_m``)
whatever M is (the rows of the last tile beyond M are masked: never read, fed to the MMA as
zeros, never written; no pad or slice op outside the kernel), and each output element is reduced
over K in one fixed order (with ``split_k`` > 1, a fixed number of K ranges, each in order, their
float32 partial sums then added left to right by elementwise ops); ``block_n`` / ``block_k`` /
``split_k`` / warps are chosen from ``(N, K, group)`` only, never from M. The W4AX integer
accumulation is exact anyway, and its epilogue is elementwise per row.

Pallas' Triton backend is deprecated on jax 0.11; :mod:`pallas_kernels.launch` keeps its warning
from users.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.layout import SYMMETRIC_OFFSET, QuantizedWeight
from pallas_kernels.reference import quantize_activations

from pallas_kernels.launch import call_kernel, pl_triton

BLOCK_M = 16  # fixed row tile: every row runs in a tile of this shape whatever M is
MIN_BLOCK_K = 32  # Triton-lowered int8 dots were seen wrong with K blocks of 16 on the H200


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _split_ok(k: int, group: int, block_k: int, split_k: int) -> bool:
    return k % split_k == 0 and (k // split_k) % max(group, block_k) == 0


def default_config(n: int, k: int, group: int, kind: str, block_n: int | None = None,
                   block_k: int | None = None, split_k: int | None = None) -> tuple[int, int, int]:
    """``(block_n, block_k, split_k)`` for a weight shape; ``kind`` is "w4a16" or "w4ax".

    A function of ``(N, K, group)`` only, never of M (row-count invariance). From the H200 sweeps of
    2026-11-30 (bench/results/kernels_draft.md), at M=1 on Llama-3-8B shapes: W4A16 (version 2)
    with 64 x 512 tiles, K split in 2, 4 or 8 until N/64 * split >= 264 programs (2 per SM); W4AX with 32 x 512 tiles and K split
    in 4 for small N, 64 x 128 tiles unsplit for large N (gate/up). (down, N=4096 K=14336, was not
    in that sweep: it gets the small-N rule.) Missing values are filled in; given
    ones are kept.
    """
    if kind not in ("w4a16", "w4ax"):
        raise ValueError(f"kind must be 'w4a16' or 'w4ax', got {kind!r}")
    if kind == "w4a16":
        return _w4a16_config(n, k, group, block_n, block_k, split_k)
    large_n = n % 32 == 0 and n // 32 >= 512
    if block_n is None:
        block_n = 64 if kind == "w4ax" and large_n and n % 64 == 0 else (32 if n % 32 == 0 else 16)
    if block_k is None:
        want = 128 if kind == "w4ax" and large_n else 512
        block_k = want
        while block_k > MIN_BLOCK_K and (k % block_k or not (block_k % group == 0 or group % block_k == 0)
                                         or (split_k is not None and not _split_ok(k, group, block_k, split_k))):
            block_k //= 2
    if split_k is None:
        # split only when N alone gives < 256 programs (~2 per SM): to >= 512 programs
        target, max_split = 512, 4
        programs = max(1, n // block_n)
        split_k = 1
        for s in (2, 4):
            if programs >= 256 or s > max_split or programs * split_k >= target:
                break
            if _split_ok(k, group, block_k, s):
                split_k = s
    return block_n, block_k, split_k


W4A16_BLOCK_N = 64  # weight rows per program (the MMA's M side)
W4A16_BLOCK_K = 512  # K elements per loop step (256 packed bytes per weight row)
W4A16_BLOCK_M = 16  # token rows per program (the MMA's N side)
W4A16_WARPS, W4A16_STAGES = 4, 3
W4A16_PHASES = 8  # nibbles per packed word read by the kernel: 2 (uint8 bytes) or 8 (uint32 words)
W4A16_X_SPLIT = True  # activations split into K phases by the wrapper (else stride loads in kernel)
W4A16_MIN_PROGRAMS = 264  # split K until N / block_n * split_k reaches this (2 per H200 SM)


def _w4a16_config(n, k, group, block_n, block_k, split_k):
    if block_n is None:
        block_n = next((b for b in (W4A16_BLOCK_N, 32, 16) if n % b == 0), 16)
    if block_k is None:
        block_k = W4A16_BLOCK_K
        while block_k > MIN_BLOCK_K and (k % block_k or not (block_k % group == 0 or group % block_k == 0)
                                         or (split_k is not None and not _split_ok(k, group, block_k, split_k))):
            block_k //= 2
    if split_k is None:
        programs = max(1, n // block_n)
        split_k = 1
        for s in (2, 4, 8):
            if programs * split_k >= W4A16_MIN_PROGRAMS:
                break
            if _split_ok(k, group, block_k, s):
                split_k = s
    return block_n, block_k, split_k


def _phases_ok(phases: int, k: int, block_k: int, group: int) -> bool:
    return k % (8 * phases) == 0 and block_k >= 16 * phases and group >= 4 * phases


def _w4a16_phases(k: int, block_k: int, group: int) -> int:
    """Nibbles per packed word the kernel reads: :data:`W4A16_PHASES` where the shape allows, else 2
    (0: neither fits)."""
    return next((p for p in (W4A16_PHASES, 2) if _phases_ok(p, k, block_k, group)), 0)


def w4a16_launch(n: int, k: int, group: int) -> tuple[int, int, int]:
    """``(block_m, num_warps, num_stages)`` of the W4A16 kernel for a weight shape (never from M).

    block_m = 16 favours decode (M <= 16). Measured 2026-11-30 (H200, 64 x 256 tiles): block_m = 64
    makes M=64 1.7-2.2x faster (no re-dequantization per 16 rows) but M=1 1.25-1.3x slower."""
    return W4A16_BLOCK_M, W4A16_WARPS, W4A16_STAGES


def _check(x: jax.Array, w: QuantizedWeight, block_n: int, block_k: int,
           split_k: int = 1) -> tuple[int, int, int]:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if w.packed.ndim != 2:
        raise ValueError(f"stacked weights are not supported: packed shape {w.packed.shape}")
    w.validate()
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but the weight has in_features {k}")
    _check_tiles(n, k, w.group_size, block_n, block_k, split_k)
    return n, k, w.group_size


def _check_tiles(n: int, k: int, g: int, block_n: int, block_k: int, split_k: int) -> None:
    if not _is_pow2(block_k) or block_k < MIN_BLOCK_K:
        raise ValueError(f"block_k must be a power of two >= {MIN_BLOCK_K}, got {block_k}")
    if k % block_k:
        raise ValueError(f"K={k} is not a multiple of the K block {block_k}")
    if not (block_k % g == 0 or g % block_k == 0):
        raise ValueError(f"group size {g} must divide the K block {block_k} or be a multiple of it")
    if min(g, block_k) < MIN_BLOCK_K:
        raise ValueError(f"group size {g} < {MIN_BLOCK_K} is not supported (int8 dots need K >= 32)")
    if not _is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if n % block_n:
        raise ValueError(f"N={n} is not a multiple of the N block {block_n}")
    if split_k < 1 or not _split_ok(k, g, block_k, split_k):
        raise ValueError(f"split_k={split_k}: each of the K splits must hold whole groups and whole "
                         f"K blocks (K={k}, group {g}, block_k {block_k})")


def supported(kind: str, n: int, k: int, group: int) -> bool:
    """Whether the ``kind`` ("w4a16", "w4ax" or "dense") kernel can tile an ``[N, K]`` weight with
    its default tiles (the model falls back to the fixed-tile reference where it cannot)."""
    try:
        if kind == "dense":
            _dense_config(n, k)
            return True
        _check_tiles(n, k, group, *default_config(n, k, group, kind))
        return kind != "w4a16" or _w4a16_phases(k, default_config(n, k, group, kind)[1], group) > 0
    except ValueError:
        return False


def _unpack(p: jax.Array) -> jax.Array:
    """``uint8[R, B]`` packed bytes -> ``uint8[R, 2B]`` codes in k order (low nibble first)."""
    lo = p & np.uint8(0xF)
    hi = p >> np.uint8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(p.shape[0], 2 * p.shape[1])


# ----------------------------------------------------------------------------------------- W4A16

def _row_mask(m: int, bm: int) -> jax.Array:
    """``bool[bm, 1]``: which rows of this program's row tile exist (rows >= M are never read or
    written; they enter the MMA as zeros, so the tile computes the same values as a padded one)."""
    rows = pl.program_id(0) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    return rows < m


def _load_rows(ref, mask, cols):
    """Rows of ``ref[:, cols]`` that exist; zeros for the others."""
    view = ref.at[:, cols]
    return pl_triton.load(view, mask=jnp.broadcast_to(mask, view.shape), other=0)


def _load_weight(ref, cols):
    """A weight tile, read once per program: ask the cache to evict it first."""
    return pl_triton.load(ref.at[:, cols], eviction_policy="evict_first")


def _store_rows(ref, mask, value):
    pl_triton.store(ref, value, mask=jnp.broadcast_to(mask, value.shape))


_F32_MAGIC = 0x4B000000  # float32 bits of 2**23: (MAGIC | u) is the float 2**23 + u for u < 2**23


def _codes_f32(u: jax.Array, offset: float) -> jax.Array:
    """uint8 codes -> float32 ``u - offset`` with integer ops and one exact float subtract (no
    int->float conversion instruction): the bits ``0x4B000000 | u`` are the float ``2**23 + u``."""
    f = jax.lax.bitcast_convert_type(u.astype(jnp.uint32) | np.uint32(_F32_MAGIC), jnp.float32)
    return f - np.float32(2.0 ** 23 + offset)


def _w4a16_kernel(x_ref, p_ref, s_ref, *rest, m: int, k: int, group: int, block_k: int,
                  symmetric: bool, split_k: int, phases: int = 2, x_split: bool = False,
                  interpret: bool = False):
    """One program: weight rows ``[bn]`` x token rows ``[bm]``, over its K range in chunks.

    The weight tile is the MMA's M side, the token tile its N side: ``acc[bn, bm] += sum_t
    W_t[bn, bk/P] @ x_t[bm, bk/P].T`` over the ``P = phases`` nibble positions of one packed word
    (P=2: the packed bytes, W_0 / W_1 the low / high nibbles, k = 2j / 2j+1; P=8: the bytes read
    as uint32 words, nibble t of word j is k = 8j + t), x_t the matching activation columns
    (stride-P loads, or with ``x_split`` a ``[P, M, K/P]`` copy made by the wrapper), so nibbles
    are never interleaved. Dequantization per nibble: ``s*(u-8)`` (or ``s*u + m``) in float32,
    cast to bf16, as the reference does."""
    m_ref, o_ref = (None, rest[0]) if symmetric else rest
    bm, bn = x_ref.shape[-2], p_ref.shape[0]
    rows = _row_mask(m, bm)  # [bm, 1]
    hb = block_k // phases  # packed words per weight row per chunk
    steps = k // split_k // block_k  # K chunks of this program
    base = pl.program_id(2) * steps if split_k > 1 else 0
    per = max(1, block_k // group)  # groups in one K chunk (1 when the group spans several chunks)

    def scales(ref, i):  # float32, broadcastable to [bn, hb] (a group spans group/P words)
        if block_k >= group:
            v = ref[:, pl.ds(i * per, per)].astype(jnp.float32)  # [bn, per]
            if per == 1:
                return v
            return jnp.broadcast_to(v[:, :, None], (bn, per, group // phases)).reshape(bn, hb)
        return ref[:, pl.ds((i * block_k) // group, 1)].astype(jnp.float32)  # [bn, 1]

    def dequant(u, s, mn):
        if symmetric:
            wf = _codes_f32(u, float(SYMMETRIC_OFFSET)) * s
        else:
            wf = _codes_f32(u, 0.0) * s + mn
        return wf.astype(jnp.bfloat16)

    def nibble(p, t):
        if phases == 2:
            return p & np.uint8(0xF) if t == 0 else p >> np.uint8(4)
        return (p >> np.uint32(4 * t)) & np.uint32(0xF)

    dims = (((1,), (1,)), ((), ()))

    def body(i, acc):
        i = base + i
        p = _load_weight(p_ref, pl.ds(i * hb, hb))  # [bn, hb] uint8 / uint32
        s = scales(s_ref, i)
        mn = None if symmetric else scales(m_ref, i)
        for t in range(phases):
            w_t = dequant(nibble(p, t), s, mn)
            if x_split:
                if interpret:  # its loads take no integer index inside one indexer
                    x_t = _load_rows(x_ref.at[t], rows, pl.ds(i * hb, hb))
                else:  # the Triton lowering takes one indexer only
                    view = x_ref.at[t, :, pl.ds(i * hb, hb)]
                    x_t = pl_triton.load(view, mask=jnp.broadcast_to(rows, view.shape), other=0)
            else:
                x_t = _load_rows(x_ref, rows, pl.ds(i * block_k + t, hb, stride=phases))  # bf16 [bm, hb]
            acc = acc + jax.lax.dot_general(w_t, x_t, dims, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bm), jnp.float32))
    _store_rows(o_ref, rows, acc.T)


def _split_out(m: int, n: int, block_n: int, split_k: int, dtype=jnp.float32, block_m: int = BLOCK_M):
    """Output shape and spec: ``[M, N]``, or ``[split_k, M, N]`` partial sums when K is split."""
    if split_k == 1:
        return jax.ShapeDtypeStruct((m, n), dtype), pl.BlockSpec((block_m, block_n), lambda i, j, s: (i, j))
    return (jax.ShapeDtypeStruct((split_k, m, n), dtype),
            pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)))


def _sum_splits(parts: jax.Array) -> jax.Array:
    """``parts[0] + parts[1] + ...`` left to right: elementwise, so the same for any M."""
    out = parts[0]
    for p in range(1, parts.shape[0]):
        out = out + parts[p]
    return out


def w4a16_matmul(x: jax.Array, w: QuantizedWeight, *, block_n: int | None = None,
                 block_k: int | None = None, split_k: int | None = None, block_m: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 phases: int | None = None, x_split: bool | None = None,
                 interpret: bool = False) -> jax.Array:
    """``x[M, K] @ dequant_bf16(w).T`` with bf16 activations and float32 accumulation -> ``f32[M, N]``.

    ``block_m`` is the fixed token tile (the MMA's N side; weight rows are its M side). ``split_k``
    > 1 splits K over that many programs per output tile (more programs for small N); their float32
    partial sums are added left to right after the kernel. Choose them from (N, K), never from M, to
    keep rows invariant. Values left as None come from :func:`default_config` /
    :func:`w4a16_launch`."""
    block_n, block_k, split_k = default_config(*w.shape, w.group_size, "w4a16", block_n, block_k, split_k)
    bm_d, nw_d, ns_d = w4a16_launch(*w.shape, w.group_size)
    block_m = bm_d if block_m is None else block_m
    num_warps = nw_d if num_warps is None else num_warps
    num_stages = ns_d if num_stages is None else num_stages
    n, k, g = _check(x, w, block_n, block_k, split_k)
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {block_m}")
    phases = _w4a16_phases(k, block_k, g) if phases is None else phases
    x_split = (W4A16_X_SPLIT if x_split is None else x_split) or interpret  # no strided loads there
    if phases not in (2, 8) or not _phases_ok(phases, k, block_k, g):
        raise ValueError(f"phases={phases}: needs 2 or 8, K a multiple of {8 * phases}, block_k >= "
                         f"{16 * phases} and group >= {4 * phases}")
    m = x.shape[0]
    xb = x.astype(jnp.bfloat16)
    if x_split:  # [P, M, K/P]: plane t holds the columns k = P*j + t
        xb = xb.reshape(m, k // phases, phases).transpose(2, 0, 1)
        xspec = pl.BlockSpec((phases, block_m, k // phases), lambda i, j, s: (0, i, 0))
    else:
        xspec = pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0))
    packed = w.packed
    if phases == 8:  # the same bytes read as little-endian uint32 words: nibble t = k 8j + t
        packed = jax.lax.bitcast_convert_type(packed.reshape(n, k // 8, 4), jnp.uint32)
    gcount = k // g
    kernel = functools.partial(_w4a16_kernel, m=m, k=k, group=g, block_k=block_k,
                               symmetric=w.symmetric, split_k=split_k, phases=phases, x_split=x_split,
                               interpret=interpret)
    wspec = pl.BlockSpec((block_n, k // phases), lambda i, j, s: (j, 0))
    sspec = pl.BlockSpec((block_n, gcount), lambda i, j, s: (j, 0))
    in_specs = [xspec, wspec, sspec]
    args = [xb, packed, w.scales]
    if not w.symmetric:
        in_specs.append(sspec)
        args.append(w.mins)
    out_shape, out_spec = _split_out(m, n, block_n, split_k, block_m=block_m)
    out = call_kernel(kernel, out_shape, (-(-m // block_m), n // block_n, split_k), in_specs, out_spec,
                interpret, num_warps, num_stages, *args)
    return out if split_k == 1 else _sum_splits(out)


# ----------------------------------------------------------------------------------------- W4AX

def _w4ax_kernel(qx_ref, sa_ref, p_ref, s_ref, *rest, m: int, k: int, group: int, block_k: int,
                 symmetric: bool, return_acc: bool, split_k: int):
    m_ref, o_ref = (None, rest[0]) if symmetric else rest
    bm, bn = qx_ref.shape[0], p_ref.shape[0]
    rows = _row_mask(m, bm)
    chunk = min(group, block_k)  # K of one int8 dot
    per = max(1, block_k // group)  # groups per outer iteration, unrolled
    chunks = group // chunk  # chunks per group (int32 accumulation across them)

    def group_acc(gi):
        def chunk_body(c, carry):
            acc, qs = carry
            k0 = gi * group + c * chunk
            a = _load_rows(qx_ref, rows, pl.ds(k0, chunk))  # int8 [bm, chunk]
            u = _unpack(_load_weight(p_ref, pl.ds(k0 // 2, chunk // 2))).astype(jnp.int8)
            wq = u - np.int8(SYMMETRIC_OFFSET) if symmetric else u  # int8 [bn, chunk]
            acc = acc + jax.lax.dot_general(a, wq, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.int32)
            if not symmetric:
                qs = qs + jnp.sum(a.astype(jnp.int32), axis=1, keepdims=True)
            return acc, qs

        init = (jnp.zeros((bm, bn), jnp.int32), jnp.zeros((bm, 1), jnp.int32))
        if chunks == 1:
            return chunk_body(0, init)
        return jax.lax.fori_loop(0, chunks, chunk_body, init)

    steps = k // split_k // (per * group)  # outer iterations of this program
    base = pl.program_id(2) * steps if split_k > 1 else 0

    def outer(i, tot):
        i = base + i
        for j in range(per):
            gi = i * per + j
            acc, qs = group_acc(gi)
            if return_acc:
                _store_rows(o_ref.at[gi], rows, acc)
                continue
            t = acc.astype(jnp.float32) * s_ref[:, gi].astype(jnp.float32)[None, :]
            if not symmetric:
                t = t + qs.astype(jnp.float32) * m_ref[:, gi].astype(jnp.float32)[None, :]
            tot = tot + t
        return tot

    tot = jax.lax.fori_loop(0, steps, outer, jnp.zeros((bm, bn), jnp.float32))
    if return_acc:
        return
    if split_k > 1:  # partial sums; the wrapper adds them and applies the row scales
        _store_rows(o_ref, rows, tot)
    else:
        sa = pl_triton.load(sa_ref, mask=rows, other=1.0)  # [bm, 1]
        _store_rows(o_ref, rows, sa * tot)


def w4ax_quantized(qx: jax.Array, sa: jax.Array, w: QuantizedWeight, *, block_n: int | None = None,
                   block_k: int | None = None, split_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, interpret: bool = False, return_acc: bool = False) -> jax.Array:
    """The W4AX kernel on pre-quantized rows (``qx`` int8[M, K], ``sa`` f32[M, 1], as
    :func:`pallas_kernels.reference.quantize_activations` returns them) -> ``f32[M, N]``; with
    ``return_acc`` the per-group int32 accumulations ``int32[G, M, N]`` instead (for tests).

    ``split_k`` > 1: each of that many programs per output tile sums its own groups in order; the
    partial sums are added left to right after the kernel, then scaled by ``sa`` (so the group sum
    is no longer one left-to-right chain as in the reference: ~1e-7 relative, not bitwise)."""
    block_n, block_k, split_k = default_config(*w.shape, w.group_size, "w4ax", block_n, block_k, split_k)
    n, k, g = _check(qx, w, block_n, block_k, split_k)
    m = qx.shape[0]
    if qx.dtype != jnp.int8 or sa.shape != (m, 1):
        raise ValueError(f"qx must be int8[M, K] and sa float32[M, 1], got {qx.dtype}{qx.shape}, "
                         f"{sa.shape}")
    gcount = k // g
    kernel = functools.partial(_w4ax_kernel, m=m, k=k, group=g, block_k=block_k,
                               symmetric=w.symmetric, return_acc=return_acc, split_k=split_k)
    wspec = pl.BlockSpec((block_n, k // 2), lambda i, j, s: (j, 0))
    sspec = pl.BlockSpec((block_n, gcount), lambda i, j, s: (j, 0))
    in_specs = [pl.BlockSpec((BLOCK_M, k), lambda i, j, s: (i, 0)),
                pl.BlockSpec((BLOCK_M, 1), lambda i, j, s: (i, 0)), wspec, sspec]
    args = [qx, sa.astype(jnp.float32), w.packed, w.scales]
    if not w.symmetric:
        in_specs.append(sspec)
        args.append(w.mins)
    if return_acc:
        out_shape = jax.ShapeDtypeStruct((gcount, m, n), jnp.int32)
        out_spec = pl.BlockSpec((gcount, BLOCK_M, block_n), lambda i, j, s: (0, i, j))
    else:
        out_shape, out_spec = _split_out(m, n, block_n, split_k)
    out = call_kernel(kernel, out_shape, (-(-m // BLOCK_M), n // block_n, split_k), in_specs, out_spec,
                interpret, num_warps, num_stages, *args)
    if return_acc or split_k == 1:
        return out
    return sa.astype(jnp.float32) * _sum_splits(out)


def w4ax_matmul(x: jax.Array, w: QuantizedWeight, bits: int, *, block_n: int | None = None,
                block_k: int | None = None, split_k: int | None = None, num_warps: int = 4,
                num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """W4A8 (``bits=8``) / W4A4 (``bits=4``): per-row activation quantization (a jnp step before the
    kernel, :func:`pallas_kernels.reference.quantize_activations`), then the int8 kernel with int32
    group accumulation and the float32 epilogue -> ``f32[M, N]``."""
    if bits not in (4, 8):
        raise ValueError(f"activation bits must be 4 or 8, got {bits}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    qx, sa = quantize_activations(x, bits)
    return w4ax_quantized(qx, sa, w, block_n=block_n, block_k=block_k, split_k=split_k,
                          num_warps=num_warps, num_stages=num_stages, interpret=interpret)


# ----------------------------------------------------------------------------------------- dense

DENSE_BLOCK_N, DENSE_BLOCK_K = 64, 256


def _dense_config(n: int, k: int) -> tuple[int, int, int]:
    block_n = next((b for b in (DENSE_BLOCK_N, 32, 16) if n % b == 0), None)
    block_k = next((b for b in (DENSE_BLOCK_K, 128, 64, 32, 16) if k % b == 0), None)
    if block_n is None or block_k is None:
        raise ValueError(f"dense_matmul needs N and K multiples of 16, got N={n}, K={k}")
    split_k = 1
    for s in (2, 4, 8):
        if n // block_n * split_k >= W4A16_MIN_PROGRAMS or k % (s * block_k):
            break
        split_k = s
    return block_n, block_k, split_k


def _dense_kernel(x_ref, w_ref, o_ref, *, m: int, k: int, block_k: int, split_k: int, precision):
    """Float weights: ``acc[bn, bm] += W[bn, bk] @ x[bm, bk].T`` over this program's K range."""
    bm, bn = x_ref.shape[0], w_ref.shape[0]
    rows = _row_mask(m, bm)
    steps = k // split_k // block_k
    base = pl.program_id(2) * steps if split_k > 1 else 0

    def body(i, acc):
        cols = pl.ds((base + i) * block_k, block_k)
        w = _load_weight(w_ref, cols)
        x = _load_rows(x_ref, rows, cols)
        return acc + jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bm), jnp.float32))
    _store_rows(o_ref, rows, acc.T)


def dense_matmul(x: jax.Array, w: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``x[M, K] @ w[N, K].T`` in the weight's float dtype with float32 accumulation -> ``f32[M, N]``
    (the lm_head and float layers on the decode path: row-count invariant like the INT4 kernels).
    Tiles come from (N, K) only: 64 x 256 (smaller where K needs), K split until N / 64 * split
    reaches 264 programs."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    (m, k), n = x.shape, w.shape[0]
    block_n, block_k, split_k = _dense_config(n, k)
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    kernel = functools.partial(_dense_kernel, m=m, k=k, block_k=block_k, split_k=split_k, precision=precision)
    out_shape, out_spec = _split_out(m, n, block_n, split_k)
    out = call_kernel(kernel, out_shape, (-(-m // BLOCK_M), n // block_n, split_k),
                      [pl.BlockSpec((BLOCK_M, k), lambda i, j, s: (i, 0)),
                       pl.BlockSpec((block_n, k), lambda i, j, s: (j, 0))],
                      out_spec, interpret, 4, 3, x.astype(w.dtype), w)
    return out if split_k == 1 else _sum_splits(out)
