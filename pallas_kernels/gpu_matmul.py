"""Pallas GPU matmuls over packed INT4 weights (``pl.pallas_call`` lowered through Triton).

``y[M, N] = x[M, K] @ W[N, K].T`` with ``W`` a :class:`~pallas_kernels.layout.QuantizedWeight`
(the nibble-planar layout: in each block of 64 k, the low nibbles of the 32 bytes are k 0..31 and
the high nibbles k 32..63), in the modes of :mod:`pallas_kernels.reference`:

* :func:`w4a16_matmul`: the packed bytes are read as uint16 elements; nibble ``t`` of two adjacent
  elements (one register) becomes a bfloat16x2 operand in four PTX instructions (a shift,
  ``lop3`` masking the nibble under the exponent of 128, ``sub.bf16x2`` leaving the exact code,
  ``mul.bf16x2`` or ``fma.bf16x2`` applying the bf16 scale (and minimum) with one rounding:
  :func:`pallas_kernels.layout.w4a16_weights`). The 4 nibble positions feed 4 bf16 MMAs against
  the matching activation columns (the wrapper permutes x into 4 planes ``[4, M, K/4]``); float32
  accumulation.
* :func:`w4ax_matmul` (``bits`` 8 or 4): activations quantized per row by a small kernel before
  the matmul (:mod:`pallas_kernels.gpu_activations`, fused with the RMSNorm where one comes first;
  int8 codes laid out as the weights' low/high planes ``[2, M, K/2]``, float32 row scales). In the
  kernel, 4 packed bytes become 4 int8 weight operands in one or two instructions: the codes ``u``
  (asymmetric weights), or ``16 * (u - 8)`` for symmetric ones (the nibble at the byte's top, its
  top bit flipped), so that no offset correction and no activation sums are needed (a stack read as
  uint16 words, :func:`w4ax_quantized`'s ``words``, first gathers each byte position with ``prmt``); each weight
  group is one int8 x int8 -> int32 MMA per plane over its (>= 32) consecutive k; then the float32
  epilogue in the reference's order: ``t = f32(acc_g) * s_g`` (``+ f32(sum_g(x)) * m_g`` for
  asymmetric weights; for symmetric ones ``f32(16 acc_g) * (s_g / 16)``, the same bits),
  ``tot = tot + t`` for g = 0, 1, ..., and ``y = s_act * tot``.
* :func:`dense_matmul`: float weights (the lm_head on the decode path).

The weight tile is the MMA's M side (``block_n`` rows), a row tile of ``bm`` tokens its N side
(16 to 128 rows, following M: :data:`TILE_HEIGHTS`); W4A16 row tiles of at most
:data:`ROWS_FIRST_MAX` rows swap the two sides. A program holds up to :data:`ROW_TILES`
row tiles and applies each weight tile, once loaded and unpacked, to all of them. Grid:
``(ceil(M / (bm * tiles)), N / block_n, split_k)``; each program loops over its K range in chunks
of ``block_k``; with ``split_k`` > 1 (K cut into that many ranges of whole chunks or groups,
``ceil(units / split_k)`` each) the float32 partial sums of the K ranges are added left to right
after the kernel.

Row-count invariance: a row's products and their K order are the same whatever M is and whichever
program, tile slot or tile width holds it (rows beyond M are masked: never read, fed to the MMA as
zeros, never written; no pad or slice outside the kernel); each output element is reduced over K
in one fixed order; K tiles, splits and warps are chosen from ``(N, K, group)`` only. That the MMA
gives an element the same bits in a 16- and a 32-column tile, and with the sides swapped, is
checked on the GPU, bitwise (tests/test_gpu.py). The W4AX integer accumulation is exact anyway,
and its epilogue is elementwise per row.

In interpret mode (CPU tests) the PTX steps are replaced by the same operations in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.layout import PACK_BLOCK, SYMMETRIC_OFFSET, QuantizedWeight
from pallas_kernels.launch import (LAYER_SPEC, at_layer, call_kernel, check_count, check_float, check_rows,
                                   int32_offsets_wrap, pl_triton, stacked_input, stacked_spec, x2)
from pallas_kernels.gpu_activations import quantize_rows
from pallas_kernels.gpu_specs import gpu_spec, programs_per_wave
from pallas_kernels.reference import split_sum

# (rows per row tile, pipeline stages), smallest first, by activation operand; a call takes the first
# tile that holds its M rows, else the last. The tile height is the MMA's N side: a tile wider than M
# wastes work, one narrower than M repeats the weight dequantization per tile (128-row tiles fit shared
# memory only for int8 activations and with 2 stages). A token's result does not depend on the tile
# height (each output element is the same MMA k-sequence; checked bitwise by tests/test_gpu.py), so
# choosing it from M keeps row-count invariance.
TILE_HEIGHTS = {"bf16": ((16, 3), (32, 3), (64, 3)), "int8": ((16, 3), (32, 3), (64, 3), (128, 2))}
# Shared memory a block leaves to layout conversions; the rest holds the software pipeline's buffers
# (:func:`pipeline_smem`), and calls take fewer stages where those would not fit (float32 dense tiles).
LAYOUT_SMEM = 67 * 1024
# W4A16 row tiles up to this height put the tokens on the MMA's M side (``rows_first``: the same bits as
# the weights-first kernel, faster at M = 16 / 32); at 64-row tiles it runs out of shared memory.
ROWS_FIRST_MAX = 32
PLANE_ELEMS = 16  # uint16 elements of a 64-block, each holding 4 nibbles (W4A16)
ROW_TILES = 1  # row tiles per program at most (>1: a weight tile unpacked once for more rows)
PROGRAMS_PER_SM = 2  # split K until N / block_n * split_k reaches this many programs per SM (min_programs)
WARPS = 4
# Programs that loop over at least this many K iterations load each iteration's scales one iteration ahead
# (:func:`_w4a16_kernel`); shorter loops are faster unrolled, which the carried scales would prevent.
PREFETCH_MIN_ITERATIONS = 5


def min_programs() -> int:
    """Programs a K split aims for: :data:`PROGRAMS_PER_SM` on every SM of the GPU (264 on an H100 / H200)."""
    return programs_per_wave(PROGRAMS_PER_SM)


def pipeline_smem() -> int:
    """Shared memory for the software pipeline: stages - 1 copies of a stage's input tiles (160 KiB on an
    H100 / H200)."""
    return gpu_spec().smem_per_block - LAYOUT_SMEM


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _units(k: int, group: int, block_k: int) -> int:
    """K ranges that a split never cuts: K chunks, or whole groups when a group spans chunks."""
    return k // max(group, block_k)


def _split_ok(k: int, group: int, block_k: int, split_k: int) -> bool:
    """K splits hold whole units, ceil(units / split_k) each, the last one fewer but at least one."""
    units = _units(k, group, block_k)
    return k % max(group, block_k) == 0 and split_k >= 1 and -(-units // split_k) * (split_k - 1) < units


def default_config(n: int, k: int, group: int, kind: str, block_n: int | None = None,
                   block_k: int | None = None, split_k: int | None = None) -> tuple[int, int, int]:
    """``(block_n, block_k, split_k)`` for a weight shape; ``kind`` is "w4a16" or "w4ax".

    A function of ``(N, K, group)`` only, never of M (row-count invariance): 64-row weight tiles,
    256-wide K chunks (halved until they fit K and the group), K
    split in 2, 4 or 8 until there are :func:`min_programs` programs, for W4A16 giving each split
    (but the last) at least 2 K chunks: one chunk leaves Triton's pipeline nothing to overlap. Given
    values are kept."""
    if kind not in ("w4a16", "w4ax"):
        raise ValueError(f"kind must be 'w4a16' or 'w4ax', got {kind!r}")
    for name, value in (("block_n", block_n), ("block_k", block_k), ("split_k", split_k)):
        if value is not None:
            check_count(name, value)
    if block_n is None:
        block_n = next((b for b in (64, 32, 16) if n % b == 0), 16)
    if block_k is None:  # 256 rather than 512: a 512-chunk's stage buffers leave room for one 64-row
        # program per SM, slow for the verify pass (M = batch x (gamma + 1))
        block_k = 256
        while block_k > PACK_BLOCK and (k % block_k or not (block_k % group == 0 or group % block_k == 0)
                                        or (split_k is not None and not _split_ok(k, group, block_k, split_k))):
            block_k //= 2
    if split_k is None:
        chunks = 2 if kind == "w4a16" else 1  # K units per split (but the last) at least
        split_k = _default_split(n // block_n, lambda s: _split_ok(k, group, block_k, s)
                                 and -(-_units(k, group, block_k) // s) >= chunks)
    return block_n, block_k, split_k


def _default_split(programs: int, ok) -> int:
    """The largest of 1, 2, 4, 8 that ``ok`` allows, stopping once ``programs * split`` reaches
    :func:`min_programs`."""
    split_k = 1
    for s in (2, 4, 8):
        if programs * split_k >= min_programs():
            break
        if ok(s):
            split_k = s
    return split_k


def _check_tiles(n: int, k: int, g: int, block_n: int, block_k: int, split_k: int) -> None:
    if k % PACK_BLOCK:
        raise ValueError(f"K={k} must be a multiple of the packing block {PACK_BLOCK}")
    if not _is_pow2(block_k) or block_k < PACK_BLOCK:
        raise ValueError(f"block_k must be a power of two >= {PACK_BLOCK}, got {block_k}")
    if k % block_k:
        raise ValueError(f"K={k} is not a multiple of the K block {block_k}")
    if g != 32 and g % PACK_BLOCK:
        raise ValueError(f"group size {g} must be 32 or a multiple of {PACK_BLOCK}")
    if not (block_k % g == 0 or g % block_k == 0):
        raise ValueError(f"group size {g} must divide the K block {block_k} or be a multiple of it")
    if not _is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if n % block_n:
        raise ValueError(f"N={n} is not a multiple of the N block {block_n}")
    if split_k < 1 or not _split_ok(k, g, block_k, split_k):
        raise ValueError(f"split_k={split_k}: K={k} has only {_units(k, g, block_k)} K blocks / groups "
                         f"(group {g}, block_k {block_k}) to split")


def supported(kind: str, n: int, k: int, group: int) -> bool:
    """Whether the ``kind`` ("w4a16", "w4ax" or "dense") kernel can tile an ``[N, K]`` weight with
    its default tiles (the model falls back to the fixed-tile reference where it cannot)."""
    try:
        if kind == "dense":
            _dense_config(n, k)
        else:
            _check_tiles(n, k, group, *default_config(n, k, group, kind))
        return True
    except ValueError:
        return False


def _check_out_dtype(out_dtype) -> None:
    """The matmuls return float results (the epilogues scale in float32)."""
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"out_dtype must be a float type, got {jnp.dtype(out_dtype)}")


def _config(x, w: QuantizedWeight, kind: str, block_n: int | None, block_k: int | None,
            split_k: int | None) -> tuple[int, int, int]:
    """Check ``x`` (an ``[M, K]`` array or shape struct) against ``w``, then ``(block_n, block_k,
    split_k)``: :func:`default_config` with the given values kept, checked by :func:`_check_tiles`."""
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"x must be [M, K] with M >= 1 rows, got shape {x.shape}")
    w.validate()
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but the weight has in_features {k}")
    tiles = default_config(n, k, w.group_size, kind, block_n, block_k, split_k)
    _check_tiles(n, k, w.group_size, *tiles)
    return tiles


# ------------------------------------------------------------------------------ shared pieces

def _tiles(m: int, operand: str, block_m: int | None, stage_bytes) -> tuple[int, int, int]:
    """``(rows per tile, row tiles per program, pipeline stages)`` for M rows of ``operand`` ("bf16" or
    "int8") activations: the tile from :data:`TILE_HEIGHTS` (or ``block_m``), as many tiles as M
    needs, at most ROW_TILES, and as many stages as :func:`pipeline_smem` holds of
    ``stage_bytes(rows)`` (a stage's input bytes for a program of that many rows). Only timing
    depends on these, never the arithmetic, so they may follow M."""
    heights = TILE_HEIGHTS[operand]
    if block_m is None:
        bm, stages = next(((h, s) for h, s in heights if m <= h), heights[-1])
    else:
        check_count("block_m", block_m, 16)
        if not _is_pow2(block_m):
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        bm, stages = block_m, dict(heights).get(block_m, 2)
    tiles = min(ROW_TILES, -(-m // bm))
    return bm, tiles, max(1, min(stages, 1 + pipeline_smem() // stage_bytes(tiles * bm)))


def _row_masks(m: int, bm: int, tiles: int) -> list[jax.Array]:
    """``bool[bm, 1]`` per row tile of this program: which of its rows exist (rows >= M are never
    read or written; they enter the MMA as zeros)."""
    first = pl.program_id(0) * tiles * bm
    iota = jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    return [first + r * bm + iota < m for r in range(tiles)]


def _load_rows(view, mask):
    return pl_triton.load(view, mask=jnp.broadcast_to(mask, view.shape), other=0)


def _plane_rows(ref, plane: int, r: int, cols, mask, interpret: bool):
    """Row tile ``r`` of ``ref[plane, :, cols]`` (rows beyond M as zeros)."""
    bm = mask.shape[0]
    return _load_rows(at_layer(ref, plane, (pl.ds(r * bm, bm), cols), interpret), mask)


def _load_layer(ref, layer, cols, interpret: bool, valid=None, **kw):
    """Columns ``cols`` of ``ref[layer]`` (``ref`` itself if ``layer`` is None): scales, minimums;
    with ``valid`` (a scalar bool) nothing is read where it is false (zeros)."""
    view = at_layer(ref, layer, (slice(None), cols), interpret)
    if valid is not None:
        kw.update(mask=jnp.broadcast_to(valid, view.shape), other=0)
    return pl_triton.load(view, **kw)


def _load_weight(ref, layer, cols, interpret: bool):
    """A weight tile, read once per program: ask the cache to evict it first."""
    return _load_layer(ref, layer, cols, interpret, eviction_policy="evict_first")


def _as_words(packed: jax.Array) -> jax.Array:
    """The packed bytes ``[..., K/2]`` as little-endian uint16 words ``[..., K/4]`` (a bitcast): word
    ``i`` holds bytes ``2i`` (low) and ``2i + 1``."""
    return jax.lax.bitcast_convert_type(packed.reshape(*packed.shape[:-1], packed.shape[-1] // 2, 2), jnp.uint16)


def _stacked_arrays(w: QuantizedWeight, packed: jax.Array, layer) -> tuple[tuple, jax.Array]:
    """``((packed, scales, mins) as stacks, int32[1] layer index)``; ``packed`` is ``w.packed`` or a
    view of it."""
    if w.packed.ndim != (2 if layer is None else 3):
        raise ValueError("a layer index needs stacked weights [L, N, K/2] and stacked weights need one; "
                         f"got packed {w.packed.shape}, layer {layer}")
    return stacked_input((packed, w.scales, w.mins), layer)


def _store_tiles(o_ref, masks, accs, rows_first: bool = False):
    """Store each row tile's ``acc[bn, bm]`` transposed (``acc[bm, bn]`` with ``rows_first``) into its
    rows of ``o_ref``, rounded to its dtype."""
    for r, (mask, acc) in enumerate(zip(masks, accs)):
        view = o_ref.at[pl.ds(r * mask.shape[0], mask.shape[0]), :]
        tile = (acc if rows_first else acc.T).astype(o_ref.dtype)
        pl_triton.store(view, tile, mask=jnp.broadcast_to(mask, view.shape))


def _split_out(m: int, n: int, block_n: int, split_k: int, rows: int, dtype=jnp.float32):
    """Output shape and spec: ``dtype[M, N]``, or ``f32[split_k, M, N]`` partial sums when K is split."""
    if split_k == 1:
        return jax.ShapeDtypeStruct((m, n), dtype), pl.BlockSpec((rows, block_n), lambda i, j, s: (i, j))
    return (jax.ShapeDtypeStruct((split_k, m, n), jnp.float32),
            pl.BlockSpec((None, rows, block_n), lambda i, j, s: (s, i, j)))


def _result(out: jax.Array, split_k: int, parts: bool, out_dtype, scale: jax.Array | None = None) -> jax.Array:
    """A matmul kernel's output as the wrapper returns it: with ``parts`` the partial sums ``[split_k, M,
    N]`` as they are (one part where K is not split); else the result in ``out_dtype``, the split
    partials summed (and scaled by ``scale``) after the kernel, which stored an unsplit one itself."""
    if parts:
        return out if split_k > 1 else out[None]
    return out if split_k == 1 else split_sum(out, scale).astype(out_dtype)


def default_prefetch(n: int, k: int, group: int, kind: str) -> bool:
    """Whether a weight shape's default tiles load the scales one K iteration ahead (``kind`` as in
    :func:`default_config`)."""
    _, block_k, split_k = default_config(n, k, group, kind)
    return _prefetch(None, k // (block_k if kind == "w4a16" else max(group, block_k)), split_k)


def _prefetch(prefetch: bool | None, iterations: int, split_k: int) -> bool:
    """Whether to load scales one K iteration ahead: as given, else where a program has at least
    :data:`PREFETCH_MIN_ITERATIONS` of the ``iterations`` (timing only: the same bits either way)."""
    return -(-iterations // split_k) >= PREFETCH_MIN_ITERATIONS if prefetch is None else prefetch


def _k_range(units: int, split_k: int) -> tuple[jax.Array | int, jax.Array | int]:
    """(first unit, units) of this program's K range: ``ceil(units / split_k)`` per split, the last
    split the rest (a function of the shape only)."""
    if split_k == 1:
        return 0, units
    per = -(-units // split_k)
    base = pl.program_id(2) * per
    return base, jnp.minimum(per, units - base)


# ----------------------------------------------------------------------------------------- W4A16

_BF16_128 = 0x4300  # bfloat16 bits of 128.0: (0x4300 | u) is 128 + u for a nibble u


def _nibble_asm(t: int, symmetric: bool) -> str:
    """PTX (pack=2) for nibble ``t`` of two adjacent uint16 elements (one 32-bit register): shift
    nibble t down, mask it under 128's exponent (``lop3``: bf16x2 128 + u), subtract the offset
    exactly, then apply the bf16 scale: ``s*(u-8)`` (mul) or ``s*u + m`` (fma), one rounding."""
    src = "$1"
    shift = ""
    if t:
        shift, src = f"shr.u32 m, $1, {4 * t};\n", "m"
    offset = x2(0x4308 if symmetric else _BF16_128)  # 136 = 128 + 8, or 128
    scale = "mul.rn.bf16x2 $0, m, $2;" if symmetric else "fma.rn.bf16x2 $0, m, $2, $3;"
    return ("{\n.reg .b32 m, c;\n" + shift +
            f"lop3.b32 m, {src}, 0x000F000F, {x2(_BF16_128)}, 0xEA;\n"
            f"mov.b32 c, {offset};\nsub.rn.bf16x2 m, m, c;\n{scale}\n}}")


def _w4a16_operand(p, t, s, mn, interpret):
    """bf16 weights of nibble ``t`` of the uint16 tile ``p`` with their scales ``s`` (and minimums
    ``mn``), bf16 tiles of p's shape: :func:`pallas_kernels.layout.w4a16_weights`' values."""
    if interpret:
        u = ((p >> np.uint16(4 * t)) & np.uint16(0xF)).astype(jnp.float32)
        sf = s.astype(jnp.float32)
        v = (u - SYMMETRIC_OFFSET) * sf if mn is None else u * sf + mn.astype(jnp.float32)
        return v.astype(jnp.bfloat16)
    args = [p, s] if mn is None else [p, s, mn]
    return pl_triton.elementwise_inline_asm(
        _nibble_asm(t, mn is None), args=args, constraints="=r," + ",".join("r" * len(args)),
        pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)])[0]


def _chunk_group_values(ref, layer, i, block_k, group, interpret, valid=None):
    """The scale (or minimum) tiles of K chunk ``i`` as loaded, before :func:`_plane_group_values`
    spreads them over a plane: ``([bn, 1],)`` for a group spanning the chunk, ``([bn, groups],)`` for
    groups of >= 64, and the even and odd groups ``([bn, blocks], [bn, blocks])`` for groups of 32
    (the low and high half of each 64-block); ``valid``: as in :func:`_load_layer`."""
    if group >= block_k:  # one group for the whole chunk
        return (_load_layer(ref, layer, pl.ds((i * block_k) // group, 1), interpret, valid),)
    per = block_k // group  # groups in the chunk
    if group != 32:
        return (_load_layer(ref, layer, pl.ds(i * per, per), interpret, valid),)
    if interpret:
        v = _load_layer(ref, layer, pl.ds(i * per, per), interpret, valid)
        return v[:, 0::2], v[:, 1::2]
    return tuple(_load_layer(ref, layer, pl.ds(i * per + h, per // 2, stride=2), interpret, valid) for h in (0, 1))


def _plane_group_values(tiles, t, block_k, group, words):
    """Per-element bf16 tile ``[bn, words]`` of plane ``t`` from its chunk's :func:`_chunk_group_values`.

    Element ``e`` of a chunk's plane ``t`` lies in K block ``e // 16``; with groups of 32 its group
    is ``2 * block + t % 2`` (low / high half), with groups of >= 64, ``block * 64 // group``."""
    v = (tiles[t % 2] if group == 32 else tiles[0]).astype(jnp.bfloat16)
    bn = v.shape[0]
    if group >= block_k:
        return jnp.broadcast_to(v, (bn, words))
    rep = PLANE_ELEMS if group == 32 else group // 4
    return jnp.broadcast_to(v[:, :, None], (bn, v.shape[1], rep)).reshape(bn, words)


def _w4a16_kernel(l_ref, x_ref, p_ref, s_ref, *rest, m: int, k: int, group: int, block_k: int,
                  split_k: int, bm: int, tiles: int, rows_first: bool, prefetch: bool, interpret: bool):
    """Weight rows ``[bn]`` x up to ``tiles`` row tiles: ``acc_r[bn, bm] += sum_t W_t @ x_t,r.T``
    over the 4 nibble planes ``t`` of the chunk's uint16 elements; with ``rows_first`` the tokens are
    the MMA's M side instead, ``acc_r[bm, bn] += sum_t x_t,r @ W_t.T`` (the dequantized weights its
    shared-memory operand). With ``prefetch`` each iteration loads the next chunk's scales (and
    minimums) and carries them: Triton's pipeline does not take these small strided loads, so loaded
    in the iteration that uses them they stall its dequantization for a memory round trip."""
    symmetric = len(rest) == 1
    m_ref, o_ref = (None, rest[0]) if symmetric else rest
    layer = l_ref[0]
    bn = p_ref.shape[1]
    masks = _row_masks(m, bm, tiles)
    words = block_k // 4  # uint16 elements per weight row in a chunk
    base, steps = _k_range(k // block_k, split_k)
    dims = (((1,), (1,)), ((), ()))

    def group_values(i, valid=None):
        return tuple(None if r is None else _chunk_group_values(r, layer, i, block_k, group, interpret, valid)
                     for r in (s_ref, m_ref))

    def body(j, carry):
        accs, values = carry
        i = base + j
        if prefetch:  # the next chunk's (none after this program's last)
            values, carry_on = values, group_values(jnp.minimum(i + 1, k // block_k - 1), j + 1 < steps)
        else:
            values, carry_on = group_values(i), values
        p = _load_weight(p_ref, layer, pl.ds(i * words, words), interpret)  # uint16 [bn, words]
        accs = list(accs)
        for t in range(4):
            s, mn = (None if v is None else _plane_group_values(v, t, block_k, group, words) for v in values)
            w_t = _w4a16_operand(p, t, s, mn, interpret)
            for r in range(tiles):
                x_t = _plane_rows(x_ref, t, r, pl.ds(i * words, words), masks[r], interpret)
                a, b = (x_t, w_t) if rows_first else (w_t, x_t)
                accs[r] = accs[r] + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
        return tuple(accs), carry_on

    zeros = tuple(jnp.zeros((bm, bn) if rows_first else (bn, bm), jnp.float32) for _ in range(tiles))
    first = group_values(base) if prefetch else (None, None)
    accs, _ = jax.lax.fori_loop(0, steps, body, (zeros, first))
    _store_tiles(o_ref, masks, accs, rows_first)


def activation_planes(x: jax.Array, planes: int) -> jax.Array:
    """``x[M, K]`` in the order the kernels read it, ``[planes, M, K / planes]``: 2 planes (W4AX:
    the low / high halves of each 64-block) or 4 (W4A16: nibble ``t`` of uint16 element ``e`` of a
    block is k = 32 * (t % 2) + 2 * e + t // 2)."""
    m, k = x.shape
    nb = k // PACK_BLOCK
    if planes == 2:
        return x.reshape(m, nb, 2, 32).transpose(2, 0, 1, 3).reshape(2, m, k // 2)
    x5 = x.reshape(m, nb, 2, PLANE_ELEMS, 2)  # [m, block, half, element, byte]
    return x5.transpose(4, 2, 0, 1, 3).reshape(4, m, k // 4)  # plane = 2 * byte + half


def w4a16_matmul(x: jax.Array, w: QuantizedWeight, *, layer: jax.Array | None = None,
                 block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                 block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 rows_first: bool | None = None, prefetch: bool | None = None, out_dtype=jnp.float32,
                 parts: bool = False, interpret: bool = False) -> jax.Array:
    """``x[M, K] @ w4a16_weights(w).T`` with bf16 activations and float32 accumulation -> ``[M, N]`` in
    ``out_dtype`` (the float32 result rounded once: by the kernel's store where K is not split); with
    ``parts``, the float32 partial sums of the K splits ``[split_k, M, N]`` unsummed (their sum left to
    right is the result), for a consumer kernel that adds them itself;
    ``x`` may already be bf16 planes ``[4, M, K/4]`` (:func:`activation_planes`, as
    :func:`pallas_kernels.gpu_activations.rms_norm_planes` writes them).

    With ``layer`` (an int32 scalar), ``w`` is a stack ``[L, N, ...]`` and layer ``layer`` is read in
    place. Tiles left as None come from :func:`default_config` (a function of N, K and the group size);
    ``block_m`` (rows per tile), ``num_warps`` and ``num_stages`` change only timing (for tuning);
    ``rows_first`` (tokens on the MMA's M side, see :func:`_w4a16_kernel`; default: for row tiles of at
    most :data:`ROWS_FIRST_MAX` rows) gives the same bits as the weights-first kernel on the GPU, which
    row-count invariance needs since it follows M (tests/test_gpu.py checks M = 1..256 bitwise;
    interpret mode cannot tell). ``prefetch``: the next K chunk's scales loaded one iteration
    ahead (default: :func:`_prefetch`; timing only, the same bits)."""
    if x.ndim == 3 and (x.shape[0] != 4 or x.dtype != jnp.bfloat16):
        raise ValueError(f"activation planes must be bfloat16 [4, M, K/4], got {x.dtype}{x.shape}")
    check_float(x=x)
    _check_out_dtype(out_dtype)
    xp = x if x.ndim == 3 else None
    if xp is not None:
        x = jax.ShapeDtypeStruct((xp.shape[1], 4 * xp.shape[2]), jnp.bfloat16)
    block_n, block_k, split_k = _config(x, w, "w4a16", block_n, block_k, split_k)
    (n, k), g = w.shape, w.group_size
    # read as uint16 elements, before stacking: 2-byte elements keep int32 offsets valid
    (packed, scales, mins), lidx = _stacked_arrays(w, _as_words(w.packed), layer)
    nl = packed.shape[0]
    m = x.shape[0]
    bm, tiles, stages = _tiles(m, "bf16", block_m, lambda rows: (rows * 2 + block_n // 2) * block_k)
    rows = tiles * bm
    if rows_first is None:
        rows_first = bm <= ROWS_FIRST_MAX
    if xp is None:
        xp = activation_planes(x.astype(jnp.bfloat16), 4)
    kernel = functools.partial(_w4a16_kernel, m=m, k=k, group=g, block_k=block_k, split_k=split_k,
                               bm=bm, tiles=tiles, rows_first=rows_first,
                               prefetch=_prefetch(prefetch, k // block_k, split_k), interpret=interpret)
    sspec = stacked_spec(nl, (block_n, k // g), lambda i, j, s: (j, 0))
    in_specs = [LAYER_SPEC, pl.BlockSpec((4, rows, k // 4), lambda i, j, s: (0, i, 0)),
                stacked_spec(nl, (block_n, k // 4), lambda i, j, s: (j, 0)), sspec]
    args = [lidx, xp, packed, scales]
    if not w.symmetric:
        in_specs.append(sspec)
        args.append(mins)
    out_shape, out_spec = _split_out(m, n, block_n, split_k, rows, jnp.float32 if parts else out_dtype)
    out = call_kernel(kernel, out_shape, (-(-m // rows), n // block_n, split_k), in_specs, out_spec,
                      interpret, WARPS if num_warps is None else num_warps,
                      stages if num_stages is None else num_stages, *args)
    return _result(out, split_k, parts, out_dtype)


# ----------------------------------------------------------------------------------------- W4AX

# 4 bytes per instruction: the codes u (asymmetric weights), or 16 * (u - 8) (symmetric): the nibble
# moved to the byte's top and its top bit flipped, (u << 4) ^ 0x80 read as int8 (lop3 0x6A: (a & b) ^ c)
_CODE_ASM = {
    (False, False): "and.b32 $0, $1, 0x0F0F0F0F;",
    (True, False): "{\n.reg .b32 t;\nshr.u32 t, $1, 4;\nand.b32 $0, t, 0x0F0F0F0F;\n}",
    (False, True): "{\n.reg .b32 t;\nshl.b32 t, $1, 4;\nlop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6A;\n}",
    (True, True): "lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;",
}
SIGNED_SCALE = 16  # symmetric codes enter the MMA as 16 * (u - 8): acc = 16 * sum((u - 8) * x), exactly
# (|16 (u - 8) x| <= 16256: int32 holds a group of up to 132k elements)
assert SYMMETRIC_OFFSET == 8 and SIGNED_SCALE == 16, "_CODE_ASM hard-codes both (0x80: -8 << 4)"


def _codes_int8(p: jax.Array, high: bool, symmetric: bool, interpret: bool) -> jax.Array:
    """The low or high nibbles ``u`` of a uint8 tile as int8: ``u`` in [0, 15], or for symmetric
    weights ``16 * (u - 8)`` (no offset correction, no activation sums needed)."""
    if interpret:
        u = ((p >> np.uint8(4)) if high else (p & np.uint8(0xF))).astype(jnp.int32)
        return (SIGNED_SCALE * (u - SYMMETRIC_OFFSET) if symmetric else u).astype(jnp.int8)
    return pl_triton.elementwise_inline_asm(
        _CODE_ASM[high, symmetric], args=[p], constraints="=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.int8)])[0]


def _word_codes_int8(p16: jax.Array, byte: int, high: bool, symmetric: bool, interpret: bool) -> jax.Array:
    """:func:`_codes_int8` of byte ``byte`` (0: low, 1: high) of each element of a uint16 tile: on the
    GPU one ``prmt`` gathers that byte of 4 words into a register, then the same transform."""
    if interpret:
        return _codes_int8(((p16 >> np.uint16(8 * byte)) & np.uint16(0xFF)).astype(jnp.uint8), high, symmetric,
                           interpret)
    gather = f"prmt.b32 w, $1, $2, {0x7531 if byte else 0x6420:#06x};"  # bytes `byte`, 2 + byte of each register
    return pl_triton.elementwise_inline_asm(
        "{\n.reg .b32 w;\n" + gather + "\n" + _CODE_ASM[high, symmetric].replace("$1", "w") + "\n}",
        args=[p16], constraints="=r,r,r", pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(p16.shape, jnp.int8)])[0]


def _w4ax_kernel(l_ref, qx_ref, sa_ref, p_ref, s_ref, *rest, m: int, k: int, group: int, block_k: int,
                 split_k: int, bm: int, tiles: int, words: bool, rows_first: bool, return_acc: bool,
                 parts: bool, prefetch: bool, interpret: bool):
    """Weight rows ``[bn]`` x row tiles: per weight group, int8 MMAs into int32, then the epilogue.
    Tiles are ``[bn, bm]`` (weights on the MMA's M side), or ``[bm, bn]`` with ``rows_first``.

    Groups of 32 are the low and high planes of one 64-block (groups 2b and 2b + 1); a group of
    >= 64 k is the same byte range of both planes (K = g/2 each), read in chunks of ``block_k`` when
    it is longer than that (int32 accumulation across chunks: exact). ``words``: the packed bytes
    are read as uint16 words (``p_ref[L, N, K/4]``), see :func:`w4ax_quantized`."""
    symmetric = len(rest) == 1
    m_ref, o_ref = (None, rest[0]) if symmetric else rest
    layer = l_ref[0]
    bn = p_ref.shape[1]
    masks = _row_masks(m, bm, tiles)
    dims = (((1,), (1,)), ((), ()))
    tile = (bm, bn) if rows_first else (bn, bm)
    sums = (bm, 1) if rows_first else (1, bm)  # the activation sums (asymmetric weights)
    zeros = tuple((jnp.zeros(tile, jnp.int32), None if symmetric else jnp.zeros(sums, jnp.int32))
                  for _ in range(tiles))

    def weight_codes(byte0, nbytes):
        """``codes(high)``: the int8 weight tile ``[bn, nbytes]`` of bytes [byte0, +nbytes), plane
        ``high``; with ``words`` the even and the odd bytes of the uint16 words, interleaved back."""
        if not words:
            p = _load_weight(p_ref, layer, pl.ds(byte0, nbytes), interpret)  # uint8 [bn, nbytes]
            return lambda high: _codes_int8(p, high, symmetric, interpret)
        word0 = jax.lax.shift_right_logical(byte0, 1)  # not byte0 // 2: floor division hides the alignment
        p16 = _load_weight(p_ref, layer, pl.ds(word0, nbytes // 2), interpret)  # uint16 [bn, nbytes / 2]
        return lambda high: jnp.stack([_word_codes_int8(p16, b, high, symmetric, interpret) for b in (0, 1)],
                                      axis=-1).reshape(bn, nbytes)

    def planes(byte0, nbytes):
        """``[plane][tile] -> (int32 acc, int32 sum(x) or None)`` of bytes [byte0, +nbytes): acc(u) and
        the activation sums (asymmetric), or 16 * acc(u - 8) (symmetric); ``[bn, bm]`` and ``[1, bm]``,
        or ``[bm, bn]`` and ``[bm, 1]`` with ``rows_first``."""
        cols = pl.ds(byte0, nbytes)
        codes = weight_codes(byte0, nbytes)
        out = []
        for h in (0, 1):
            wq = codes(h == 1)
            res = []
            for r in range(tiles):
                xq = _plane_rows(qx_ref, h, r, cols, masks[r], interpret)  # int8 [bm, nbytes]
                a, b = (xq, wq) if rows_first else (wq, xq)
                xs = None if symmetric else jnp.sum(xq.astype(jnp.int32), axis=1)
                res.append((jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32),
                            None if symmetric else (xs[:, None] if rows_first else xs[None, :])))
            out.append(res)
        return out

    def both(res):
        return tuple((a0 + a1, None if s0 is None else s0 + s1) for (a0, s0), (a1, s1) in zip(*res))

    def group_values(gi, valid=None):
        """The epilogue's float32 ``(s_g, m_g or None)`` of group ``gi``: ``[bn, 1]``, ``[1, bn]`` with
        ``rows_first``. Symmetric: ``s_g / 16`` (the accumulator holds 16 * acc_g; exact powers of two,
        so the epilogue's ``t`` has the same bits). ``valid``: as in :func:`_load_layer`."""
        s = _load_layer(s_ref, layer, pl.ds(gi, 1), interpret, valid).astype(jnp.float32)  # [bn, 1]
        if symmetric:
            s = s * np.float32(1 / SIGNED_SCALE)
        mn = None if symmetric else _load_layer(m_ref, layer, pl.ds(gi, 1), interpret, valid).astype(jnp.float32)
        if rows_first:  # per output column: [1, bn]
            s, mn = s.reshape(1, bn), None if mn is None else mn.reshape(1, bn)
        return s, mn

    def epilogue(tots, res, gi, values):
        """``tot += f32(acc_g) * s_g (+ f32(sum_g) * m_g)`` per row tile, ``values`` being group
        ``gi``'s :func:`group_values`."""
        s, mn = values
        out = []
        for r, (acc, xs) in enumerate(res):
            if return_acc:
                view = o_ref.at[pl.ds(gi, 1), pl.ds(r * bm, bm), :]
                exact = jax.lax.shift_right_arithmetic(acc, np.int32(4)) if symmetric else acc  # acc_g
                pl_triton.store(view, (exact if rows_first else exact.T)[None],
                                mask=jnp.broadcast_to(masks[r][None], view.shape))
                out.append(tots[r])
                continue
            t = acc.astype(jnp.float32) * s
            if not symmetric:
                t = t + xs.astype(jnp.float32) * mn
            out.append(tots[r] + t)
        return tuple(out)

    if group <= block_k:  # a loop iteration per K chunk: one or more groups (pairs of groups of 32)
        unit = max(group, PACK_BLOCK) // 2  # bytes per group (or per 64-block for groups of 32)
        base, steps = _k_range(k // block_k, split_k)
        iterations = k // block_k
        units = [j * unit for j in range(block_k // 2 // unit)]  # a unit's first byte in its chunk

        def groups(i):  # the iteration's groups in the order accumulate applies them
            firsts = [i * (block_k // 2) + u for u in units]
            return [b // 16 + h for b in firsts for h in (0, 1)] if group == 32 else [b * 2 // group for b in firsts]

        def accumulate(i, tots, values):
            gis = iter(zip(groups(i), values))
            for u in units:
                res = planes(i * (block_k // 2) + u, unit)
                for r in (res if group == 32 else [both(res)]):
                    tots = epilogue(tots, r, *next(gis))
            return tots
    else:  # a loop iteration per group, in K chunks
        base, steps = _k_range(k // group, split_k)
        iterations = k // group

        def groups(i):
            return [i]

        def accumulate(gi, tots, values):
            def chunk(c, carry):
                res = both(planes(gi * (group // 2) + c * (block_k // 2), block_k // 2))
                return tuple((a + ra, None if s is None else s + rs) for (a, s), (ra, rs) in zip(carry, res))

            return epilogue(tots, jax.lax.fori_loop(0, group // block_k, chunk, zeros), gi, values[0])

    def load(i, valid=None):
        return tuple(group_values(g, valid) for g in groups(i))

    def body(j, carry):
        tots, values = carry
        i = base + j
        if prefetch:  # the next iteration's (none after this program's last); see _w4a16_kernel
            return accumulate(i, tots, values), load(jnp.minimum(i + 1, iterations - 1), j + 1 < steps)
        return accumulate(i, tots, load(i)), values

    zeros_f32 = tuple(jnp.zeros(tile, jnp.float32) for _ in range(tiles))
    tots, _ = jax.lax.fori_loop(0, steps, body, (zeros_f32, load(base) if prefetch else ()))
    if return_acc:
        return
    if split_k > 1 or parts:  # partial sums; the wrapper or their consumer adds them, applies the row scales
        _store_tiles(o_ref, masks, tots, rows_first)
    else:
        sas = [pl_triton.load(sa_ref.at[pl.ds(r * bm, bm), :], mask=masks[r], other=1.0)
               for r in range(tiles)]  # [bm, 1]
        _store_tiles(o_ref, masks, [t * (sa if rows_first else sa.T) for t, sa in zip(tots, sas)], rows_first)


def w4ax_quantized(qx: jax.Array, sa: jax.Array, w: QuantizedWeight, *, layer: jax.Array | None = None,
                   block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                   block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   words: bool | None = None, rows_first: bool = False, prefetch: bool | None = None,
                   out_dtype=jnp.float32, parts: bool = False, interpret: bool = False,
                   return_acc: bool = False) -> jax.Array:
    """The W4AX kernel on pre-quantized rows (``qx`` int8[M, K], ``sa`` f32[M, 1], as
    :func:`pallas_kernels.reference.quantize_activations` returns them, or ``qx`` already in the
    kernel's plane layout ``[2, M, K/2]`` as :mod:`pallas_kernels.gpu_activations` writes it) ->
    ``[M, N]`` in ``out_dtype`` (the float32 result rounded once: by the kernel's store where K is
    not split); with ``parts``, the float32 partial sums of the K splits ``[split_k, M, N]``, unsummed
    and not yet scaled by ``sa`` (the result is ``sa`` times their sum left to right:
    :func:`pallas_kernels.reference.split_sum`), for a consumer kernel that adds them itself; with
    ``return_acc`` the per-group int32 accumulations ``int32[G, M, N]`` instead (for tests).

    ``split_k`` > 1: each of that many programs per output tile sums its own groups in order; the
    partial sums are added left to right after the kernel, then scaled by ``sa`` (so the group sum
    is no longer one left-to-right chain as in the reference: ~1e-7 relative, not bitwise). ``layer``,
    ``block_m``, ``num_warps``, ``num_stages``: as in :func:`w4a16_matmul`. ``rows_first``: the tokens
    on the MMA's M side (a tuning variant; the int32 accumulation is exact and the epilogue
    elementwise, so it gives the same bits). ``prefetch``: as in :func:`w4a16_matmul`.

    ``words`` (default: where needed): read the packed bytes as uint16 words, their even and odd
    bytes' codes interleaved back into the tile the byte path reads (the same MMAs, the same bits).
    A uint8 stack of 2-4 GiB (Llama-2-13B's gate/up, 2.8 GB) would otherwise be indexed with
    wrapping int32 offsets and has to be sliced, a copy of the layer's weight per call; words keep
    the offsets in range."""
    if qx.dtype != jnp.int8 or qx.ndim not in (2, 3) or (qx.ndim == 3 and qx.shape[0] != 2):
        raise ValueError(f"qx must be int8 [M, K] or [2, M, K/2], got {qx.dtype}{qx.shape}")
    _check_out_dtype(out_dtype)
    m, kx = (qx.shape[1], 2 * qx.shape[2]) if qx.ndim == 3 else qx.shape
    block_n, block_k, split_k = _config(jax.ShapeDtypeStruct((m, kx), jnp.int8), w, "w4ax", block_n, block_k,
                                        split_k)
    (n, k), g = w.shape, w.group_size
    planes = qx if qx.ndim == 3 else activation_planes(qx, 2)
    if sa.shape != (m, 1):
        raise ValueError(f"sa must be float32[M, 1] for M={m} rows, got {sa.shape}")
    if words is None:  # uint8 the lowering would index with wrapping int32 offsets
        words = int32_offsets_wrap(w.packed)
    packed = _as_words(w.packed) if words else w.packed
    (packed, scales, mins), lidx = _stacked_arrays(w, packed, layer)
    nl = packed.shape[0]
    bm, tiles, stages = _tiles(m, "int8", block_m, lambda rows: (rows + block_n // 2) * block_k)
    rows = tiles * bm
    gcount = k // g
    kernel = functools.partial(_w4ax_kernel, m=m, k=k, group=g, block_k=block_k, split_k=split_k,
                               bm=bm, tiles=tiles, words=words, rows_first=rows_first, return_acc=return_acc,
                               parts=parts, prefetch=_prefetch(prefetch, k // max(g, block_k), split_k),
                               interpret=interpret)
    sspec = stacked_spec(nl, (block_n, gcount), lambda i, j, s: (j, 0))
    in_specs = [LAYER_SPEC, pl.BlockSpec((2, rows, k // 2), lambda i, j, s: (0, i, 0)),
                pl.BlockSpec((rows, 1), lambda i, j, s: (i, 0)),
                stacked_spec(nl, (block_n, packed.shape[-1]), lambda i, j, s: (j, 0)), sspec]
    args = [lidx, planes, sa.astype(jnp.float32), packed, scales]
    if not w.symmetric:
        in_specs.append(sspec)
        args.append(mins)
    if return_acc:
        out_shape = jax.ShapeDtypeStruct((gcount, m, n), jnp.int32)
        out_spec = pl.BlockSpec((gcount, rows, block_n), lambda i, j, s: (0, i, j))
    else:
        out_shape, out_spec = _split_out(m, n, block_n, split_k, rows, jnp.float32 if parts else out_dtype)
    out = call_kernel(kernel, out_shape, (-(-m // rows), n // block_n, split_k), in_specs, out_spec,
                      interpret, WARPS if num_warps is None else num_warps,
                      stages if num_stages is None else num_stages, *args)
    return out if return_acc else _result(out, split_k, parts, out_dtype, sa.astype(jnp.float32))


def w4ax_matmul(x: jax.Array, w: QuantizedWeight, bits: int, *, layer: jax.Array | None = None,
                block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                rows_first: bool = False, prefetch: bool | None = None, interpret: bool = False) -> jax.Array:
    """W4A8 (``bits=8``) / W4A4 (``bits=4``): per-row activation quantization
    (:func:`pallas_kernels.gpu_activations.quantize_rows`: ``reference.quantize_activations`` in one
    kernel that writes the plane layout), then the int8 kernel with int32 group accumulation and the
    float32 epilogue -> ``f32[M, N]`` (tiling arguments: :func:`w4ax_quantized`)."""
    check_float(x=x)
    _config(x, w, "w4ax", block_n, block_k, split_k)  # before quantize_rows meets a bad x
    qx, sa = quantize_rows(x, bits, interpret=interpret)
    return w4ax_quantized(qx, sa, w, layer=layer, block_n=block_n, block_k=block_k, split_k=split_k,
                          block_m=block_m, num_warps=num_warps, num_stages=num_stages, rows_first=rows_first,
                          prefetch=prefetch, interpret=interpret)


# ----------------------------------------------------------------------------------------- dense

DENSE_BLOCK_N, DENSE_BLOCK_K = 64, 256


def _dense_config(n: int, k: int) -> tuple[int, int, int]:
    block_n = next((b for b in (DENSE_BLOCK_N, 32, 16) if n % b == 0), None)
    block_k = next((b for b in (DENSE_BLOCK_K, 128, 64, 32, 16) if k % b == 0), None)
    if block_n is None or block_k is None:
        raise ValueError(f"dense_matmul needs N and K multiples of 16, got N={n}, K={k}")
    return block_n, block_k, _default_split(n // block_n, lambda s: _split_ok(k, block_k, block_k, s))


def _dense_kernel(x_ref, w_ref, o_ref, *, m: int, k: int, block_k: int, split_k: int, bm: int, tiles: int,
                  precision):
    """Float weights: ``acc_r[bn, bm] += W[bn, bk] @ x_r[bm, bk].T`` over this program's K range."""
    bn = w_ref.shape[0]
    masks = _row_masks(m, bm, tiles)
    base, steps = _k_range(k // block_k, split_k)

    def body(i, accs):
        cols = pl.ds((base + i) * block_k, block_k)
        w = _load_weight(w_ref, None, cols, False)
        return tuple(acc + jax.lax.dot_general(
            w, _load_rows(x_ref.at[pl.ds(r * bm, bm), cols], masks[r]), (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32) for r, acc in enumerate(accs))

    accs = jax.lax.fori_loop(0, steps, body, tuple(jnp.zeros((bn, bm), jnp.float32) for _ in range(tiles)))
    _store_tiles(o_ref, masks, accs)


def dense_matmul(x: jax.Array, w: jax.Array, *, block_m: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """``x[M, K] @ w[N, K].T`` in the weight's float dtype with float32 accumulation -> ``f32[M, N]``
    (the lm_head and float layers on the decode path: row-count invariant like the INT4 kernels on the
    GPU; in interpret mode float32 tiles of different heights may differ in the last bit, since XLA's
    CPU dot sums a tile of another shape in another order).
    Tiles come from (N, K) only: 64 x 256 (smaller where K needs), K split until N / 64 * split
    reaches :func:`min_programs`. ``block_m``, ``num_warps``, ``num_stages``: as in :func:`w4a16_matmul`."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    check_float(x=x, w=w)
    check_rows("x", x.shape)
    (m, k), n = x.shape, w.shape[0]
    block_n, block_k, split_k = _dense_config(n, k)
    item = w.dtype.itemsize
    bm, tiles, stages = _tiles(m, "bf16", block_m, lambda rows: (rows + block_n) * block_k * item)
    rows = tiles * bm
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    kernel = functools.partial(_dense_kernel, m=m, k=k, block_k=block_k, split_k=split_k, bm=bm, tiles=tiles,
                               precision=precision)
    out_shape, out_spec = _split_out(m, n, block_n, split_k, rows)
    out = call_kernel(kernel, out_shape, (-(-m // rows), n // block_n, split_k),
                      [pl.BlockSpec((rows, k), lambda i, j, s: (i, 0)),
                       pl.BlockSpec((block_n, k), lambda i, j, s: (j, 0))],
                      out_spec, interpret, WARPS if num_warps is None else num_warps,
                      stages if num_stages is None else num_stages, x.astype(w.dtype), w)
    return _result(out, split_k, False, jnp.float32)
