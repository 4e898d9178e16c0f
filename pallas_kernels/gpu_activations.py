"""The INT4 matmuls' activation inputs, prepared by one Pallas GPU kernel per call (two for
:func:`swiglu_quantize` and :func:`attention_quantize` at few rows; Triton lowering): the step
before the layer (the RMSNorm before qkv and gate/up, the merge of the attention's cache splits
before o, the MLP's ``silu(gate) * up`` before down), the W4A8 / W4A4 quantization, and the plane
layout the matmul kernel reads (:func:`pallas_kernels.gpu_matmul.activation_planes`).

Unfused, the same work is the norm kernel (or XLA's elementwise merge or SwiGLU), then XLA ops for
the absmax, the quantization and the plane transpose. One program per row (or per part of one,
below): the RMSNorm's statistics as :mod:`pallas_kernels.gpu_norm` computes them (same values, bit
for bit), or :func:`pallas_kernels.reference.swiglu` of the row's gate and up halves, or the merge of
the row's (one query's) per-split attention partials as :func:`pallas_kernels.gpu_attention.merge`
spells it (float32 sums may contract differently: not bitwise the XLA merge), then

* W4AX (:func:`quantize_rows`, :func:`rms_norm_quantize`, :func:`swiglu_quantize`,
  :func:`attention_quantize`): the row's absmax (exact in any order),
  ``scale = absmax * f32(1/qmax)``, codes ``round_half_even(v * f32(1 / scale))`` clamped, as
  :func:`pallas_kernels.reference.quantize_activations` (PTX ``rcp.rn.f32`` for the correctly
  rounded reciprocal, where Triton's division would be approximate, and ``cvt.rni``), written as
  int8 planes ``[2, M, K/2]`` with float32 row scales ``[M, 1]``;
* W4A16 (:func:`rms_norm_planes`, :func:`swiglu_planes`, :func:`attention_planes`): the prepared
  row as bf16 planes ``[4, M, K/4]``.

The row is read in tiles of whole 64-element blocks: ``[blocks, 32]`` per W4AX plane, ``[blocks, 16]``
(every other element) per W4A16 plane; the whole row in one tile up to ``MAX_BLOCKS`` (rows past a
non-power-of-two block count masked), since a loop over tiles costs each tile's load latency (a
K = 14336 row in 1024-element tiles took 15 µs, in one tile 3.4 µs, on the H200). The exceptions:
the SwiGLU (quantized or as planes) of up to :data:`SPREAD_ROWS` rows spreads each row's tiles over
programs (:func:`_swiglu_call`), where one program per row took
13-15 µs quantized (3-5 µs spread) and 8.7 µs as planes (Llama-2-7B, 16 rows); the
attention merge below :data:`MERGE_PROGRAMS` rows spreads a row's KV heads over programs
(:func:`merge_head_tile`; one program per row read all 16 splits' partials of Llama-2-7B's 32
heads, 256 KB, in 7.5 µs per layer at batch 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels.gpu_norm import NUM_WARPS, inv_rms, normalized
from pallas_kernels.launch import (LAYER_SPEC, at_layer, call_kernel, check_count, check_eps, check_float, check_rows,
                                   pl_triton, stacked_input, stacked_spec)
from pallas_kernels.layout import PACK_BLOCK

HALF = PACK_BLOCK // 2  # a 64-block's elements in each W4AX plane (and each half of a block)
MAX_BLOCKS = 256  # 64-blocks per tile at most (16384 elements)
SPREAD_ROWS = 64  # swiglu_quantize spreads a row over programs up to this many rows
SPREAD_BLOCKS = 16  # 64-blocks per program when spread
MERGE_PROGRAMS = 128  # the attention-merge prologue spreads a row's KV heads over programs below this many rows
_RCP_ASM = "rcp.rn.f32 $0, $1;"  # 1 / x, correctly rounded
_ROUND_ASM = "cvt.rni.s32.f32 $0, $1;"  # to the nearest integer, ties to even


def tile_blocks(blocks: int, max_blocks: int) -> int:
    """The largest divisor of the row's 64-block count that is at most ``max_blocks`` (the whole row
    if it fits): tiles never straddle the row's end, and on the GPU a tile's rows past a power of two
    are masked."""
    return max(d for d in range(1, min(blocks, max_blocks) + 1) if blocks % d == 0)


def _asm(code: str, v: jax.Array, dtype) -> jax.Array:
    """One PTX instruction per float32 element of ``v`` (``f``: a float32 register, ``r``: int32)."""
    out = "=f" if dtype == jnp.float32 else "=r"
    return pl_triton.elementwise_inline_asm(code, args=[v], constraints=f"{out},f", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, dtype)])[0]


def reciprocal(v: jax.Array, interpret: bool) -> jax.Array:
    """``f32(1 / v)`` correctly rounded, elementwise over a float32 tile."""
    return np.float32(1) / v if interpret else _asm(_RCP_ASM, v, jnp.float32)


def round_half_even(v: jax.Array, interpret: bool) -> jax.Array:
    """``round_half_even(v)`` as int32."""
    return jnp.round(v).astype(jnp.int32) if interpret else _asm(_ROUND_ASM, v, jnp.int32)


def _span(tb: int, interpret: bool) -> int:
    """The rows a tile of ``tb`` 64-blocks occupies: Triton's tiles are powers of two (the rows past
    ``tb`` masked off); the interpreter takes any size."""
    return tb if interpret else pl.next_power_of_2(tb)


def _mask(tb: int, shape: tuple, axis: int, load: bool = True) -> dict:
    """Load / store keywords: none if ``shape[axis]`` is ``tb``, else a mask of the rows below ``tb``
    along ``axis`` (a load reads 0 past it)."""
    if shape[axis] == tb:
        return {}
    mask = jax.lax.broadcasted_iota(jnp.int32, shape, axis) < tb
    return {"mask": mask, "other": 0} if load else {"mask": mask}


def _load_cols(ref, layer, first: jax.Array, tb: int, half: int, byte: int | None, interpret: bool):
    """Blocks ``[first, first + tb)`` of a ``[.., blocks, 64]`` row: half ``half`` of each block
    ``[span, 32]``, or with ``byte`` its elements ``byte, byte + 2, ...`` ``[span, 16]`` (rows past
    ``tb`` read as 0)."""
    span = _span(tb, interpret)
    rows = pl.ds(first, span)
    if byte is None or interpret:  # the interpreter takes no strided slice: every other column after
        v = pl_triton.load(at_layer(ref, layer, (rows, pl.ds(half * HALF, HALF)), interpret),
                           **_mask(tb, (span, HALF), 0))
        return v if byte is None else v[:, byte::2]
    cols = pl.ds(half * HALF + byte, HALF // 2, stride=2)
    return pl_triton.load(at_layer(ref, layer, (rows, cols), interpret), **_mask(tb, (span, HALF // 2), 0))


def _store_rows(ref, plane: int, first: jax.Array, tb: int, v: jax.Array) -> None:
    """``ref[plane, first:first + tb] = v[:tb]`` for a tile ``v[span, width]``."""
    pl_triton.store(ref.at[pl.ds(plane, 1), pl.ds(first, v.shape[0]), :], v[None], **_mask(tb, (1, *v.shape), 1, load=False))


def _prologue_kernel(l_ref, x_ref, x2_ref, *rest, h: int, eps: float | None, swiglu: bool, bits: int | None,
                     max_blocks: int, interpret: bool):
    """Row ``x_ref[H]`` (also as ``x2_ref[H / 64, 64]``), its RMSNorm when ``eps`` is set (scale
    ``s_ref[L, H / 64, 64]`` at the layer), or with ``swiglu`` the SwiGLU of its halves (``x_ref[2H]``,
    gate then up), then W4AX codes ``q_ref[2, H / 64, 32]`` and their scale ``sa_ref[1]``
    (``bits``), or bf16 W4A16 planes ``p_ref[4, H / 64, 16]`` (``bits`` None)."""
    norm = eps is not None
    s_ref, *outs = rest if norm else (None, *rest)
    layer = l_ref[0]
    blocks = h // PACK_BLOCK
    tb = tile_blocks(blocks, max_blocks)
    r = inv_rms(x_ref, h, eps) if norm else None

    def values(i, half, byte=None):
        """The prepared values of tile ``i``, plane ``(half, byte)``, in the input's dtype."""
        v = _load_cols(x2_ref, None, i * tb, tb, half, byte, interpret)
        if norm:
            v = normalized(v, r, _load_cols(s_ref, layer, i * tb, tb, half, byte, interpret), interpret)
        if swiglu:
            v = _swiglu(v, x2_ref, blocks, i * tb, tb, half, byte, interpret)
        return v

    _emit(values, outs, blocks, tb, bits, interpret)


def _swiglu(gate, x2_ref, blocks: int, first, tb: int, half: int, byte: int | None, interpret: bool):
    """``reference.swiglu`` of the gate tile ``gate`` (blocks ``[first, first + tb)`` of a row
    ``[gate | up]``, plane ``(half, byte)``) and its up tile, ``blocks`` 64-blocks further on."""
    up = _load_cols(x2_ref, None, blocks + first, tb, half, byte, interpret)
    return reference.swiglu(gate, up, lambda d: reciprocal(d, interpret))


def _tile_absmax(values, i, m: jax.Array) -> jax.Array:
    """``max(m, |tile i|)`` over both W4AX planes of tile ``i``."""
    for half in (0, 1):
        m = jnp.maximum(m, jnp.max(jnp.abs(values(i, half).astype(jnp.float32))))
    return m


def quant_scale(amax: jax.Array, bits: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """The row's scale ``absmax * f32(1 / qmax)`` (1 for an all-zero row) and its reciprocal ``[1]``."""
    scale = jnp.where(amax > 0, amax * np.float32(1 / (2 ** (bits - 1) - 1)), np.float32(1))
    return scale, reciprocal(jnp.full((1,), scale, jnp.float32), interpret)


def _tile_planes(values, i, p_ref, tb: int) -> None:
    """Tile ``i``'s values as bf16, into the four W4A16 planes of ``p_ref`` (elementwise: a row's
    bits do not depend on how its tiles are spread over programs)."""
    for byte in (0, 1):
        for half in (0, 1):
            _store_rows(p_ref, 2 * byte + half, i * tb, tb, values(i, half, byte).astype(jnp.bfloat16))


def _tile_codes(values, i, q_ref, tb: int, inv: jax.Array, bits: int, interpret: bool) -> None:
    """Tile ``i``'s codes ``round_half_even(v * inv)`` clamped to ``bits``, into both planes of ``q_ref``."""
    qmax = 2 ** (bits - 1) - 1
    for half in (0, 1):
        q = round_half_even(values(i, half).astype(jnp.float32) * inv[:, None], interpret)
        _store_rows(q_ref, half, i * tb, tb, jnp.clip(q, -qmax - 1, qmax).astype(jnp.int8))


def _emit(values, outs, blocks: int, tb: int, bits: int | None, interpret: bool) -> None:
    """Write a row given ``values(i, half, byte)`` (its tile ``i`` of ``tb`` 64-blocks, plane ``(half,
    byte)``): W4AX codes ``q_ref[2, blocks, 32]`` and their scale ``sa_ref[1]`` (``bits``), or bf16
    W4A16 planes ``p_ref[4, blocks, 16]`` (``bits`` None)."""
    if bits is None:
        (p_ref,) = outs

        def planes(i, carry):
            _tile_planes(values, i, p_ref, tb)
            return carry

        jax.lax.fori_loop(0, blocks // tb, planes, 0)
        return

    q_ref, sa_ref = outs
    amax = jax.lax.fori_loop(0, blocks // tb, lambda i, m: _tile_absmax(values, i, m), jnp.float32(0))
    scale, inv = quant_scale(amax, bits, interpret)

    def codes(i, carry):
        _tile_codes(values, i, q_ref, tb, inv, bits, interpret)
        return carry

    jax.lax.fori_loop(0, blocks // tb, codes, 0)
    sa_ref[...] = jnp.full((1,), scale, jnp.float32)


def _swiglu_values(x2_ref, blocks: int, tb: int, interpret: bool):
    """``values(i, half, byte=None)``: the SwiGLU of tile ``i`` (``tb`` 64-blocks) of the row
    ``x2_ref = [gate | up]``, W4AX plane ``half`` (or W4A16 plane ``(half, byte)``)."""
    return lambda i, half, byte=None: _swiglu(_load_cols(x2_ref, None, i * tb, tb, half, byte, interpret),
                                              x2_ref, blocks, i * tb, tb, half, byte, interpret)


def _codes_out(m: int, blocks: int, row) -> tuple[tuple, tuple]:
    """Shapes and specs of the W4AX outputs, codes ``[2, M, blocks, 32]`` and scales ``[M, 1]``; a
    program writes row ``row(*its grid indices)``."""
    return ((jax.ShapeDtypeStruct((2, m, blocks, HALF), jnp.int8), jax.ShapeDtypeStruct((m, 1), jnp.float32)),
            (pl.BlockSpec((2, None, blocks, HALF), lambda *g: (0, row(*g), 0, 0)),
             pl.BlockSpec((None, 1), lambda *g: (row(*g), 0))))


def _planes_out(m: int, blocks: int, row) -> tuple:
    """Shape and spec of the W4A16 output planes ``[4, M, blocks, 16]``; a program writes row ``row(*g)``."""
    return (jax.ShapeDtypeStruct((4, m, blocks, HALF // 2), jnp.bfloat16),
            pl.BlockSpec((4, None, blocks, HALF // 2), lambda *g: (0, row(*g), 0, 0)))


def _spread_absmax(values, i, amax_ref) -> None:
    """Phase 1 of a row spread over programs: ``amax_ref[1]`` = the absmax of this program's tile
    ``values(i, ...)``."""
    amax_ref[...] = jnp.full((1,), _tile_absmax(values, i, jnp.float32(0)), jnp.float32)


def _spread_codes(values, i, first: jax.Array, tiles: int, amax_ref, q_ref, sa_ref, tb: int, bits: int,
                  interpret: bool) -> None:
    """Phase 2: the row's scale from all its tiles' absmax (``amax_ref[T']``, the first ``tiles``
    written; exact in any order), then this program's codes of tile ``values(i, ...)`` (elementwise:
    the bits of one program per row); the row's ``first`` tile writes the scale."""
    amax = jnp.max(pl_triton.load(amax_ref, **_mask(tiles, amax_ref.shape, 0)))  # unwritten: 0
    scale, inv = quant_scale(amax, bits, interpret)
    _tile_codes(values, i, q_ref, tb, inv, bits, interpret)

    @pl.when(first)
    def _():
        sa_ref[...] = jnp.full((1,), scale, jnp.float32)


def _swiglu_absmax_kernel(x2_ref, amax_ref, *, blocks: int, tb: int, interpret: bool):
    """Phase 1 of the spread :func:`swiglu_quantize` for tile ``program_id(1)`` of the row's SwiGLU."""
    _spread_absmax(_swiglu_values(x2_ref, blocks, tb, interpret), pl.program_id(1), amax_ref)


def _swiglu_codes_kernel(x2_ref, amax_ref, q_ref, sa_ref, *, blocks: int, tb: int, bits: int, interpret: bool):
    """Phase 2 of the spread :func:`swiglu_quantize` for tile ``program_id(1)``."""
    t = pl.program_id(1)
    _spread_codes(_swiglu_values(x2_ref, blocks, tb, interpret), t, t == 0, blocks // tb, amax_ref, q_ref, sa_ref,
                  tb, bits, interpret)


def _swiglu_planes_kernel(x2_ref, p_ref, *, blocks: int, tb: int, interpret: bool):
    """:func:`swiglu_planes` spread over programs: the W4A16 planes of tile ``program_id(1)``."""
    _tile_planes(_swiglu_values(x2_ref, blocks, tb, interpret), pl.program_id(1), p_ref, tb)


def _spreads(m: int, h: int, spread_blocks: int) -> bool:
    """Whether the SwiGLU prologues spread rows of ``h`` outputs over programs by default: up to
    :data:`SPREAD_ROWS` rows, where a row has more than one tile of ``spread_blocks`` 64-blocks."""
    blocks = h // PACK_BLOCK
    return m <= SPREAD_ROWS and tile_blocks(blocks, spread_blocks) < blocks


def _swiglu_call(gate_up: jax.Array, bits: int | None, max_blocks: int | None, spread: bool | None,
                 interpret: bool):
    """The SwiGLU prologues (``bits`` None: the W4A16 planes, else the W4AX codes): one program per
    row, or with ``spread`` (default :func:`_spreads`) a row's tiles spread over programs, since one
    program per row leaves all but M SMs idle. The codes take two kernels (the tiles'
    absmax, then the codes; each reads its tile of ``[gate | up]``, from L2 the second time). Same
    bits either way: the absmax is exact in any order, the rest elementwise."""
    _call_shape(gate_up, 2)
    spread_blocks = _max_blocks(max_blocks, SPREAD_BLOCKS)
    m, h = gate_up.shape[0], gate_up.shape[1] // 2
    if spread is None:
        spread = _spreads(m, h, spread_blocks)
    if not spread:
        return _call(gate_up, bits, None, None, None, max_blocks, interpret, swiglu=True)
    blocks = h // PACK_BLOCK
    tb = tile_blocks(blocks, spread_blocks)
    tiles = blocks // tb
    x2 = gate_up.reshape(m, 2 * blocks, PACK_BLOCK)
    row = pl.BlockSpec((None, 2 * blocks, PACK_BLOCK), lambda i, t: (i, 0, 0))
    if bits is None:
        out_shape, out_specs = _planes_out(m, blocks, lambda i, t: i)
        kernel = functools.partial(_swiglu_planes_kernel, blocks=blocks, tb=tb, interpret=interpret)
        planes = call_kernel(kernel, out_shape, (m, tiles), [row], out_specs, interpret, NUM_WARPS, 1, x2)
        return planes.reshape(4, m, h // 4)
    span = _span(tiles, interpret)
    amax = call_kernel(functools.partial(_swiglu_absmax_kernel, blocks=blocks, tb=tb, interpret=interpret),
                       jax.ShapeDtypeStruct((m, span), jnp.float32), (m, tiles), [row],
                       pl.BlockSpec((None, 1), lambda i, t: (i, t)), interpret, NUM_WARPS, 1, x2)
    out_shape, out_specs = _codes_out(m, blocks, lambda i, t: i)
    kernel = functools.partial(_swiglu_codes_kernel, blocks=blocks, tb=tb, bits=bits, interpret=interpret)
    planes, sa = call_kernel(kernel, out_shape, (m, tiles), [row, pl.BlockSpec((None, span), lambda i, t: (i, 0))],
                             out_specs, interpret, NUM_WARPS, 1, x2, amax)
    return planes.reshape(2, m, h // 2), sa


def _check_bits(bits) -> int:
    if bits not in (4, 8):
        raise ValueError(f"activation bits must be 4 or 8, got {bits}")
    return bits


def _max_blocks(max_blocks: int | None, default: int) -> int:
    max_blocks = default if max_blocks is None else max_blocks
    check_count("max_blocks (64-blocks)", max_blocks)
    return max_blocks


def _call_shape(x: jax.Array, parts: int) -> None:
    name = "gate_up" if parts == 2 else "x"
    if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] % (parts * PACK_BLOCK):
        raise ValueError(f"{name} must be [M, {'2 x ' if parts == 2 else ''}K] with K a multiple of {PACK_BLOCK}, "
                         f"got shape {x.shape}")
    check_float(**{name: x})
    check_rows(name, x.shape)


def _call(x: jax.Array, bits: int | None, scale: jax.Array | None, eps: float | None, layer,
          max_blocks: int | None, interpret: bool, swiglu: bool = False):
    """``bits`` None: W4A16 planes; ``eps`` None: no RMSNorm (the public functions check both);
    ``swiglu``: the rows are ``[gate | up]``, the values their SwiGLU."""
    max_blocks = _max_blocks(max_blocks, MAX_BLOCKS)
    parts = 2 if swiglu else 1
    _call_shape(x, parts)
    m, h = x.shape[0], x.shape[1] // parts
    blocks = h // PACK_BLOCK
    kernel = functools.partial(_prologue_kernel, h=h, eps=eps, swiglu=swiglu, bits=bits, max_blocks=max_blocks,
                               interpret=interpret)
    in_specs = [LAYER_SPEC, pl.BlockSpec((None, parts * h), lambda i: (i, 0)),
                pl.BlockSpec((None, parts * blocks, PACK_BLOCK), lambda i: (i, 0, 0))]
    args = [x, x.reshape(m, parts * blocks, PACK_BLOCK)]
    lidx = jnp.zeros((1,), jnp.int32)
    if eps is not None:
        want = (h,) if layer is None else (scale.shape[0], h)
        if scale.shape != want:
            raise ValueError(f"expected scale {'[H]' if layer is None else '[L, H]'} for x {x.shape}, "
                             f"got {scale.shape}")
        check_float(scale=scale)
        scale, lidx = stacked_input(scale, layer)
        in_specs.append(stacked_spec(scale.shape[0], (blocks, PACK_BLOCK), lambda i: (0, 0)))
        args.append(scale.reshape(scale.shape[0], blocks, PACK_BLOCK))
    if bits is None:
        out_shape, out_specs = _planes_out(m, blocks, lambda i: i)
        planes = call_kernel(kernel, out_shape, (m,), in_specs, out_specs, interpret, NUM_WARPS, 1, lidx, *args)
        return planes.reshape(4, m, h // 4)
    out_shape, out_specs = _codes_out(m, blocks, lambda i: i)
    planes, sa = call_kernel(kernel, out_shape, (m,), in_specs, out_specs, interpret, NUM_WARPS, 1, lidx, *args)
    return planes.reshape(2, m, h // 2), sa


def quantize_rows(x: jax.Array, bits: int, *, max_blocks: int | None = None,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Rows of ``x[M, K]`` quantized to ``bits`` (8 or 4) -> ``(int8 codes [2, M, K/2] in plane layout,
    float32 scales [M, 1])``: ``reference.quantize_activations(x, bits)`` laid out for the W4AX kernel.
    ``max_blocks``: 64-blocks per tile at most (default :data:`MAX_BLOCKS`; timing only: the bits do
    not depend on it)."""
    return _call(x, _check_bits(bits), None, None, None, max_blocks, interpret)


def rms_norm_quantize(x: jax.Array, scale: jax.Array, eps: float, bits: int, *, layer: jax.Array | None = None,
                      max_blocks: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_rows` of ``gpu_norm.rms_norm(x, scale, eps, layer=layer)``, in one kernel (the
    normalized rows are never written out)."""
    return _call(x, _check_bits(bits), scale, check_eps(eps), layer, max_blocks, interpret)


def rms_norm_planes(x: jax.Array, scale: jax.Array, eps: float, *, layer: jax.Array | None = None,
                    max_blocks: int | None = None, interpret: bool = False) -> jax.Array:
    """``gpu_norm.rms_norm(x, scale, eps, layer=layer)`` cast to bf16 and laid out as the W4A16
    kernel's planes ``[4, M, K/4]`` (``activation_planes(y.astype(bf16), 4)``), in one kernel."""
    return _call(x, None, scale, check_eps(eps), layer, max_blocks, interpret)


def swiglu_quantize(gate_up: jax.Array, bits: int, *, max_blocks: int | None = None, spread: bool | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_rows` of ``reference.swiglu(gate, up)`` for rows ``gate_up[M, 2K] = [gate | up]``
    (the MLP's hidden rows are never written out): one kernel (tiles of at most ``max_blocks``
    64-blocks, default :data:`MAX_BLOCKS`), or with ``spread`` (default: up to :data:`SPREAD_ROWS`
    rows, where a row has more than one tile) two kernels that spread each row's tiles (at most
    ``max_blocks``, default :data:`SPREAD_BLOCKS`; :func:`tile_blocks`) over programs; the same bits
    either way."""
    return _swiglu_call(gate_up, _check_bits(bits), max_blocks, spread, interpret)


def swiglu_planes(gate_up: jax.Array, *, max_blocks: int | None = None, spread: bool | None = None,
                  interpret: bool = False) -> jax.Array:
    """``reference.swiglu(gate, up)`` of rows ``gate_up[M, 2K] = [gate | up]`` cast to bf16 in the W4A16
    kernel's planes ``[4, M, K/4]``, in one kernel: one program per row (tiles of at most ``max_blocks``,
    default :data:`MAX_BLOCKS`), or with ``spread`` (the default as for :func:`swiglu_quantize`) one
    program per tile of at most ``max_blocks`` (default :data:`SPREAD_BLOCKS`); the same bits either way."""
    return _swiglu_call(gate_up, None, max_blocks, spread, interpret)


def attention_merge_supported(kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether :func:`attention_quantize` / :func:`attention_planes` can tile a row of these heads:
    Triton tiles are powers of two, so the group and the 64-blocks per head must be (KV heads past
    a power of two are masked)."""
    return kv_heads > 0 and all(v > 0 and v & (v - 1) == 0 for v in (group, head_dim // PACK_BLOCK)) and (
        head_dim % PACK_BLOCK == 0)


def _merged_values(acc_ref, m_ref, l_ref, splits: int, dtype, interpret: bool):
    """``values(i, half, byte)``: this program's KV heads (``acc_ref[KV', P, G, nb, 64]``, ``m_ref``,
    ``l_ref[KV', P, G]``) of one query's attention output, merged from their splits as
    :func:`pallas_kernels.gpu_attention.merge` does (the largest ``m``, weights ``exp(m_p - top)``,
    sums over the splits left to right, times the reciprocal of the weights' sum), cast to ``dtype``:
    one tile of ``KV' * G * nb`` 64-blocks (heads past KV' up to a power of two read as m 0, l 1, acc 0)."""
    kvh, _, g, nb, _ = acc_ref.shape
    span = _span(kvh, interpret)

    def load(ref, idx: tuple, other: float):
        """``ref[:span, *idx]``, heads past kvh read as ``other``."""
        view = ref.at[(pl.ds(0, span), *idx)]
        if span == kvh:
            return pl_triton.load(view)
        shape = view.shape
        return pl_triton.load(view, mask=jax.lax.broadcasted_iota(jnp.int32, shape, 0) < kvh, other=other)

    if interpret:  # the interpreter takes no integer index beside slices: whole arrays, indexed after
        acc_all, m_all, l_all = acc_ref[...], m_ref[...], l_ref[...]
    ms = [m_all[:, p, :] if interpret else load(m_ref, (p, slice(None)), 0.0) for p in range(splits)]
    top = ms[0]
    for p in range(1, splits):
        top = jnp.maximum(top, ms[p])
    ws = [jnp.exp(mp - top) for mp in ms]  # 0 for a split with nothing visible (m = -inf)
    den = None
    for p in range(splits):
        d = ws[p] * (l_all[:, p, :] if interpret else load(l_ref, (p, slice(None)), 1.0))
        den = d if den is None else den + d
    inv = reciprocal(den, interpret)

    def split_cols(p, half, byte):
        """Split ``p``'s accumulator ``[KV, G, nb, width]`` at plane ``(half, byte)``."""
        if interpret:
            a = acc_all[:, p, :, :, half * HALF:(half + 1) * HALF]
            return a if byte is None else a[..., byte::2]
        cols = pl.ds(half * HALF, HALF) if byte is None else pl.ds(half * HALF + byte, HALF // 2, stride=2)
        return load(acc_ref, (p, slice(None), slice(None), cols), 0.0)

    def values(i, half, byte=None):
        num = None
        for p in range(splits):
            t = ws[p][:, :, None, None] * split_cols(p, half, byte)
            num = t if num is None else num + t
        v = num * inv[:, :, None, None]
        return v.reshape(span * g * nb, v.shape[-1]).astype(dtype)

    return values, kvh * g * nb


def _merge_kernel(acc_ref, m_ref, l_ref, *outs, splits: int, dtype, bits: int | None, interpret: bool):
    """This program's KV heads of one query's attention output (:func:`_merged_values`), written by
    :func:`_emit`: W4A16 planes, or (``bits``) the whole row's W4AX codes and scale."""
    values, blocks = _merged_values(acc_ref, m_ref, l_ref, splits, dtype, interpret)
    if bits is not None:  # the absmax and the codes passes read the same two halves: merge them once
        halves = [values(0, half) for half in (0, 1)]
        values = lambda i, half, byte=None: halves[half]  # noqa: E731
    _emit(values, outs, blocks, blocks, bits, interpret)


def _merge_absmax_kernel(acc_ref, m_ref, l_ref, amax_ref, *, splits: int, dtype, interpret: bool):
    """Phase 1 of the spread W4AX merge (:func:`_spread_absmax`) for this program's KV heads of the row."""
    _spread_absmax(_merged_values(acc_ref, m_ref, l_ref, splits, dtype, interpret)[0], 0, amax_ref)


def _merge_codes_kernel(acc_ref, m_ref, l_ref, amax_ref, q_ref, sa_ref, *, splits: int, dtype, tiles: int, bits: int,
                        interpret: bool):
    """Phase 2 (:func:`_spread_codes`) for this program's KV heads, whose output block is its own tile."""
    values, blocks = _merged_values(acc_ref, m_ref, l_ref, splits, dtype, interpret)
    _spread_codes(values, 0, pl.program_id(2) == 0, tiles, amax_ref, q_ref, sa_ref, blocks, bits, interpret)


def merge_head_tile(kv_heads: int, rows: int) -> int:
    """KV heads per program of the attention-merge prologue: all of them (one program per row) from
    :data:`MERGE_PROGRAMS` rows up; below, the largest power of two dividing ``kv_heads`` that still
    gives :data:`MERGE_PROGRAMS` programs (one head per program at worst). A function of the
    shapes; only the work's spread depends on it, not the bits."""
    if rows >= MERGE_PROGRAMS:
        return kv_heads
    per = max(1, kv_heads * rows // MERGE_PROGRAMS)
    return max(d for d in (1 << e for e in range(kv_heads.bit_length())) if kv_heads % d == 0 and d <= per)


def _merge_call(partials, bits: int | None, interpret: bool, head_tile: int | None = None):
    """The merge over ``partials`` (:class:`pallas_kernels.gpu_attention.Partials`), rows ``[B * T,
    H * d]`` as W4AX planes and scales, or W4A16 planes: programs ``(sequence, query, head tile)`` of
    ``head_tile`` KV heads (default :func:`merge_head_tile`); a W4AX row spread over several head
    tiles takes two kernels (its tiles' absmax, then the codes; the bits are the same: the absmax is
    exact in any order, the codes elementwise)."""
    acc, m, l = partials.acc, partials.m, partials.l
    b, t, h, d = partials.shape
    kvh, splits, r = acc.shape[1], acc.shape[2], acc.shape[3]
    g, nb = h // kvh, d // PACK_BLOCK
    if not attention_merge_supported(kvh, g, d):
        raise ValueError(f"the merge kernel needs a power-of-two group ({g}) and a power-of-two number "
                         f"of 64-blocks per head (head_dim {d})")
    hk = merge_head_tile(kvh, b * t) if head_tile is None else head_tile
    check_count("head_tile", hk)
    if hk != kvh and (hk & (hk - 1) or kvh % hk):
        raise ValueError(f"head_tile must be all {kvh} KV heads or a power of two dividing them, got {hk}")
    tiles, blocks = kvh // hk, h * nb
    tile_blocks_ = blocks // tiles  # 64-blocks of a head tile's output
    in_specs = [pl.BlockSpec((None, hk, splits, g, nb, PACK_BLOCK), lambda i, j, c: (i, c, 0, j, 0, 0)),
                pl.BlockSpec((None, hk, splits, g), lambda i, j, c: (i, c, 0, j)),
                pl.BlockSpec((None, hk, splits, g), lambda i, j, c: (i, c, 0, j))]
    args = (acc.reshape(b, kvh, splits, r, nb, PACK_BLOCK), m, l)
    grid, row = (b, t, tiles), lambda i, j, c: i * t + j
    kw = dict(splits=splits, dtype=partials.dtype, interpret=interpret)
    if bits is None:  # no row-wide statistic: each program writes its heads' planes
        planes = call_kernel(functools.partial(_merge_kernel, bits=None, **kw),
                             jax.ShapeDtypeStruct((4, b * t, blocks, HALF // 2), jnp.bfloat16), grid, in_specs,
                             pl.BlockSpec((4, None, tile_blocks_, HALF // 2), lambda i, j, c: (0, row(i, j, c), c, 0)),
                             interpret, NUM_WARPS, 1, *args)
        return planes.reshape(4, b * t, h * d // 4)
    out_shape, out_specs = _codes_out(b * t, blocks, row)
    if tiles == 1:
        planes, sa = call_kernel(functools.partial(_merge_kernel, bits=bits, **kw), out_shape, grid, in_specs,
                                 out_specs, interpret, NUM_WARPS, 1, *args)
        return planes.reshape(2, b * t, h * d // 2), sa
    span = _span(tiles, interpret)
    amax = call_kernel(functools.partial(_merge_absmax_kernel, **kw), jax.ShapeDtypeStruct((b * t, span), jnp.float32),
                       grid, in_specs, pl.BlockSpec((None, 1), lambda i, j, c: (row(i, j, c), c)), interpret,
                       NUM_WARPS, 1, *args)
    out_specs = (pl.BlockSpec((2, None, tile_blocks_, HALF), lambda i, j, c: (0, row(i, j, c), c, 0)), out_specs[1])
    planes, sa = call_kernel(functools.partial(_merge_codes_kernel, tiles=tiles, bits=bits, **kw), out_shape, grid,
                             [*in_specs, pl.BlockSpec((None, span), lambda i, j, c: (row(i, j, c), 0))], out_specs,
                             interpret, NUM_WARPS, 1, *args, amax)
    return planes.reshape(2, b * t, h * d // 2), sa


def attention_quantize(partials, bits: int, *, head_tile: int | None = None,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_rows` of the attention output ``gpu_attention.merge(partials)`` as rows
    ``[B * T, H * d]``, by a kernel that merges the cache splits itself (the output is never written
    out); two kernels where a row's KV heads are spread over programs (``head_tile``: KV heads per
    program, default :func:`merge_head_tile`; the same bits either way)."""
    return _merge_call(partials, _check_bits(bits), interpret, head_tile)


def attention_planes(partials, *, head_tile: int | None = None, interpret: bool = False) -> jax.Array:
    """``gpu_attention.merge(partials)`` as rows ``[B * T, H * d]`` cast to bf16 in the W4A16 kernel's
    planes ``[4, B * T, H * d / 4]``, in one kernel (``head_tile``: as in :func:`attention_quantize`)."""
    return _merge_call(partials, None, interpret, head_tile)
