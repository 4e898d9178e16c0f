"""Decode attention as a Pallas GPU kernel (Triton lowering): 1..γ+1 new queries per sequence
against that sequence's KV cache, grouped-query, row-count invariant.

``out[b, t, h] = softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(d)) @ v[b, s, h // G]`` over the
slots ``s <= q_pos[b, t]`` (slot ``s`` holds position ``s``), ``G = H / KV``. It reproduces
:func:`pallas_kernels.reference.attention` to float tolerance (online softmax instead of a
two-pass one).

Layout of the work: one program per (sequence, KV head, split of the cache). The G query heads that
share a KV head and all T new tokens form the rows ``r = t * G + g`` of that program, cut into row
tiles of :data:`ROW_TILE`; each KV block is loaded once and applied to every row tile, so the cache
is read once per sequence per call. A program walks its split's KV blocks in order, only as far as
the largest query position of its sequence needs; partial results ``(max, sum, acc)`` of the
splits are merged after the kernel by elementwise ops in a fixed order (:func:`merge`), or by the
next matmul's activation prologue (:func:`pallas_kernels.gpu_activations.attention_quantize`).

Row-count invariance: a row tile always has the same shape, whatever T is; a KV block that lies
beyond a row's position is fully masked for that row and leaves its running state bitwise
unchanged (scale 1, added zeros), so visiting more blocks for a longer call changes nothing; the
number of splits and the block size depend on the cache length, batch and head counts, never on T.
A draft's sliding window (:class:`pallas_kernels.reference.AttentionWindow`) gives that up: its
blocks follow the call's positions (drafts run one token per call, and need no invariance).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels.gpu_specs import programs_per_wave
from pallas_kernels.launch import (LAYER_SPEC, at_layer, call_kernel, check_count, check_float, check_positions,
                                   check_rows, pl_triton, stacked_input, x2)

ROW_TILE = 16  # query rows per MMA tile (the MMA's M side)
BLOCK_S = 64  # cache slots per KV block
PROGRAMS_PER_SM = 2  # split the cache until B * KV * splits reaches this many programs per SM
MAX_SPLITS = 16
SHADOW_STAGES = 3  # software-pipeline stages over a KV shadow's blocks
# warps per program: over a bf16 cache 2 fit one more program per SM than 4, whose register count can
# leave a second, nearly empty wave; over a shadow 4 are as fast as 2 and faster than 8
FLOAT_WARPS, SHADOW_WARPS = 2, 4


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def num_splits(batch: int, kv_heads: int, slots: int, block_s: int = BLOCK_S) -> int:
    """Cache splits per (sequence, KV head): a function of batch, heads and cache length only."""
    blocks = slots // block_s
    want = -(-programs_per_wave(PROGRAMS_PER_SM) // (batch * kv_heads))
    return int(max(1, min(MAX_SPLITS, blocks, _next_pow2(want))))


def supported(head_dim: int, slots: int, kv_bits: int | None = None) -> bool:
    """Whether :func:`decode_attention` takes this head size and cache length (and shadow codes:
    each code plane must be at least 16 wide for the MMA)."""
    planes = 1 if kv_bits is None else 16 // kv_bits
    return head_dim >= 16 * planes and head_dim & (head_dim - 1) == 0 and slots % 16 == 0


def _attention_kernel(layer_ref, q_ref, pos_ref, k_ref, v_ref, *refs, tiles: int, queries: int, group: int,
                      block_s: int, blocks: int, blocks_per_split: int, scale: float, compute, precision,
                      kv_bits: int | None, window: reference.AttentionWindow | None, interpret: bool):
    """One (sequence, KV head, split): online softmax over the split's KV blocks for all row tiles.

    The row tiles are gathered from the caller's ``q [B * T * H, d]`` and ``q_pos [B * T]`` as they
    are (no padded, transposed copy is made first): row ``r = t * G + g`` is query head ``g`` of
    this KV head at query ``t``; the rows past ``T * G`` that fill the last tile repeat query ``T - 1``
    (their results are never read, and a row's result does not depend on the other rows).

    With ``kv_bits`` the cache is the draft's shadow (:func:`pallas_kernels.reference.quantize_kv`,
    ``refs`` starting with its key and value scales): each code plane becomes float16 codes
    (:func:`kv_planes_f16`) dotted with its slice of the float16 queries; the key scales multiply
    the scores and the value scales the probabilities (rounded to float16 for the second dot), so no
    dequantized block is ever formed. Float16 suits a draft: about 1e-3 relative error against float64
    (bf16: about 2e-3); a query element beyond 65504 would overflow."""
    k_scale_ref, v_scale_ref = refs[:2] if kv_bits else (None, None)
    acc_ref, m_ref, l_ref = refs[-3:]
    planes = 1 if kv_bits is None else 16 // kv_bits
    d = q_ref.shape[-1]
    dp = d // planes  # the width of one code plane (all of d for a float cache)
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    heads = q_ref.shape[0] // pos_ref.shape[0]  # H: q holds H rows per query
    row = [i * ROW_TILE + jax.lax.broadcasted_iota(jnp.int32, (ROW_TILE,), 0) for i in range(tiles)]
    query = [seq * queries + jnp.minimum(r // group, queries - 1) for r in row]  # index into q_pos
    qs = [[q_ref[qi * heads + head * group + r % group, pl.ds(j * dp, dp)].astype(compute) for j in range(planes)]
          for qi, r in zip(query, row)]
    ps = [pos_ref[qi] for qi in query]
    # blocks any row can see: a query at or past the cache's end sees every slot (no block past it is read)
    needed = jnp.minimum(functools.reduce(jnp.maximum, [jnp.max(p) for p in ps]) // block_s + 1, blocks)
    first = split * blocks_per_split
    if window is None:
        block_at, last = (lambda n: n), jnp.minimum(first + blocks_per_split, needed)
    else:  # the splits share the sink blocks and the window's blocks, from the lowest row's window start
        sink_blocks = jnp.minimum(-(-window.sinks // block_s), needed)
        low = functools.reduce(jnp.minimum, [jnp.min(p) for p in ps])
        start = jnp.clip((low - window.size + 1) // block_s, sink_blocks, needed)
        count = sink_blocks + needed - start
        block_at = lambda n: jnp.where(n < sink_blocks, n, start + n - sink_blocks)  # noqa: E731
        # the last split also takes what the static share missed (queries spread wider than T positions)
        last = jnp.where(split == pl.num_programs(2) - 1, count, jnp.minimum(first + blocks_per_split, count))
    dims_qk, dims_pv = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))
    # a draft's softmax: 2**(x log2 e), one multiply and the approximate exp2, where expf takes ~8
    # instructions; the target's (a float cache) keeps expf
    exp = (lambda x: jnp.exp2(x * np.float32(math.log2(math.e)))) if kv_bits else jnp.exp

    def body(n, carry):
        j = block_at(n)  # the n-th block this program visits
        slots = (pl.ds(j * block_s, block_s), slice(None))
        k = pl_triton.load(at_layer(k_ref, layer, slots, interpret))  # [bs, d] (or [bs, dp] words)
        v = pl_triton.load(at_layer(v_ref, layer, slots, interpret))
        score_scale = np.float32(scale)
        if kv_bits:
            blk = (pl.ds(j * block_s, block_s),)
            score_scale = score_scale * pl_triton.load(at_layer(k_scale_ref, layer, blk, interpret))[None, :]
            v_scale = pl_triton.load(at_layer(v_scale_ref, layer, blk, interpret))[None, :]
            ks, vs = kv_planes_f16(k, kv_bits, interpret=interpret), kv_planes_f16(v, kv_bits, interpret=interpret)
        else:
            ks, vs = [k], [v]
        slot = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        out = []
        for i in range(tiles):
            m, l, acc = carry[i]
            s = functools.reduce(operator.add, [jax.lax.dot_general(
                qp, kp, dims_qk, precision=precision, preferred_element_type=jnp.float32)
                for qp, kp in zip(qs[i], ks)]) * score_scale
            seen = slot <= ps[i][:, None]
            if window is not None:
                seen &= window.visible(slot, ps[i][:, None])
            s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet
            alpha, p = exp(m - m_use), exp(s - m_use[:, None])
            l = alpha * l + jnp.sum(p, axis=1)
            pw = (p if kv_bits is None else p * v_scale).astype(vs[0].dtype)
            out.append((m_new, l, tuple(alpha[:, None] * a + jax.lax.dot_general(
                pw, vp, dims_pv, precision=precision, preferred_element_type=jnp.float32) for a, vp in zip(acc, vs))))
        return tuple(out)

    init = tuple((jnp.full((ROW_TILE,), -jnp.inf, jnp.float32), jnp.zeros((ROW_TILE,), jnp.float32),
                  tuple(jnp.zeros((ROW_TILE, dp), jnp.float32) for _ in range(planes))) for _ in range(tiles))
    final = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    for i, (m, l, acc) in enumerate(final):
        rows = pl.ds(i * ROW_TILE, ROW_TILE)
        m_ref[rows] = m
        l_ref[rows] = l
        for j, a in enumerate(acc):
            acc_ref[rows, pl.ds(j * dp, dp)] = a


_F16_1024 = 0x6400  # float16 bits of 1024.0: (0x6400 | u) is 1024 + u for a code u < 1024


def _plane_asm(bits: int, j: int) -> str:
    """PTX (pack=2) for code plane ``j`` of two adjacent int16 words (one 32-bit register): put the
    code under 1024's exponent (INT8: one ``prmt`` that also interleaves the 0x64 bytes; INT4: a
    shift and a ``lop3``), then one ``sub.f16x2`` of ``1024 + 2**(bits-1)`` leaves the exact codes."""
    offset = x2(_F16_1024 + (1 << (bits - 1)))
    if bits == 8:  # bytes j and 2 + j of the register, each under a 0x64 byte
        place = f"prmt.b32 m, $1, {x2(0x6464)}, {0x4240 + 0x101 * j:#06x};\n"
    else:
        src = "$1" if j == 0 else "m"
        place = ((f"shr.u32 m, $1, {bits * j};\n" if j else "")
                 + f"lop3.b32 m, {src}, {x2((1 << bits) - 1)}, {x2(_F16_1024)}, 0xEA;\n")
    return "{\n.reg .b32 m, c;\n" + place + f"mov.b32 c, {offset};\nsub.rn.f16x2 $0, m, c;\n}}"


def kv_planes_f16(words: jax.Array, bits: int, *, interpret: bool) -> list[jax.Array]:
    """:func:`pallas_kernels.reference.kv_planes` as float16, exactly, by bit operations instead of a
    (quarter-rate) int-to-float conversion: an offset code ``u < 1024`` ORed into the bits of 1024.0
    is ``1024 + u``; subtracting ``1024 + 2**(bits-1)`` leaves the code. On the GPU as PTX on pairs of
    words (:func:`_plane_asm`: fewer instructions per code than Triton's 16-bit integer ops);
    ``interpret`` (the CPU) with jnp's int16 ops."""
    if not interpret:
        return [pl_triton.elementwise_inline_asm(
            _plane_asm(bits, j), args=[words], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)])[0] for j in range(16 // bits)]
    mask, magic = np.int16((1 << bits) - 1), np.float16(1024 + (1 << (bits - 1)))
    planes = [words if j == 0 else words >> np.int16(bits * j) for j in range(16 // bits)]  # int16 ops only
    return [jax.lax.bitcast_convert_type((p & mask) | np.int16(0x6400), jnp.float16) - magic for p in planes]


def _merge(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Combine split partials ``[..., P, R(, d)]`` left to right with elementwise ops only, the sum
    times the correctly rounded reciprocal of the weights' sum (XLA rewrites a division by a
    broadcast into that product on some backends and not others: spelled out, they all compute
    the same; the merge kernel of :mod:`pallas_kernels.gpu_activations` too, up to how the compiler
    contracts the weighted sums into fused multiply-adds)."""
    top = m[:, :, 0]
    for p in range(1, m.shape[2]):
        top = jnp.maximum(top, m[:, :, p])
    num = den = None
    for p in range(m.shape[2]):
        w = jnp.exp(m[:, :, p] - top)  # 0 for a split with nothing visible (m = -inf)
        a, b = w[..., None] * acc[:, :, p], w * l[:, :, p]
        num, den = (a, b) if num is None else (num + a, den + b)
    return num * (np.float32(1) / den)[..., None]


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, *,
                     layer: jax.Array | None = None, scales: tuple[jax.Array, jax.Array] | None = None,
                     window: reference.AttentionWindow | None = None, block_s: int | None = None,
                     splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """Attention of ``q[B, T, H, d]`` over the cache ``k, v[B, S, KV, d]``; slot ``s`` is visible to
    query ``t`` iff ``s <= q_pos[b, t]`` (int32 ``[B, T]``, each ``>= 0``). Output like ``q``.
    With ``layer`` (an int32 scalar) the cache is the model's stack ``[L, B, S, KV, d]``, read at
    that layer in place. With ``scales`` (float32 key and value scales, head-major ``[B, KV, S]``
    so that a KV block's scales are contiguous, or their stacks) ``k, v`` are the draft's shadow:
    int16 words of 8- or 4-bit codes (:func:`pallas_kernels.reference.quantize_kv`; the bits follow
    from the word count). With ``window``, each query sees only its window's slots, and a program
    reads only the blocks its rows' windows touch.

    ``S`` must be a multiple of the KV block (default :data:`BLOCK_S`, or the largest power of two
    >= 16 dividing S). ``splits`` defaults to :func:`num_splits`."""
    return merge(attention_partials(q, k, v, q_pos, layer=layer, scales=scales, window=window, block_s=block_s,
                                    splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Partials:
    """The kernel's per-split online-softmax state of each row ``r = t * G + g`` (query ``t``, head
    ``g`` of a KV head's group): ``acc [B, KV, P, R, d]``, ``m``, ``l [B, KV, P, R]`` (float32, ``R``
    padded past ``T * G``), and the output's shape and dtype."""

    acc: jax.Array
    m: jax.Array
    l: jax.Array
    shape: tuple[int, int, int, int] = dataclasses.field(metadata=dict(static=True))  # [B, T, H, d]
    dtype: Any = dataclasses.field(metadata=dict(static=True))


def merge(p: Partials) -> jax.Array:
    """The attention output ``[B, T, H, d]`` from the splits' partials (:func:`_merge`)."""
    b, t, h, d = p.shape
    kvh = p.acc.shape[1]
    out = _merge(p.acc, p.m, p.l)[:, :, :t * (h // kvh)]  # [B, KV, T*G, d]
    return out.reshape(b, kvh, t, h // kvh, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d).astype(p.dtype)


def attention_partials(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, *,
                       layer: jax.Array | None = None, scales: tuple[jax.Array, jax.Array] | None = None,
                       window: reference.AttentionWindow | None = None, block_s: int | None = None,
                       splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       interpret: bool = False) -> Partials:
    """:func:`decode_attention` up to the merge of the cache splits: the kernel's :class:`Partials`
    (for :func:`merge`, or for a consumer that merges them itself,
    :func:`pallas_kernels.gpu_activations.attention_quantize`)."""
    cache_dims = 4 if layer is None else 5
    if q.ndim != 4 or k.ndim != cache_dims or v.shape != k.shape:
        raise ValueError(f"expected q [B,T,H,d] and k, v {'[B,S,KV,d]' if layer is None else '[L,B,S,KV,d]'}; "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    b, t, h, d = q.shape
    check_float(q=q)
    check_rows("q", q.shape[:2] + (d,))
    kv_bits = _shadow_bits(q, k, v, scales)
    (k, v, *scales), lidx = stacked_input((k, v, *(scales or ())), layer)
    nl, _, s, kvh, dk = k.shape
    if k.shape[1] != b or dk * 16 != d * (kv_bits or 16) or h % kvh:
        raise ValueError(f"q {q.shape} does not match the cache {k.shape} (batch, head_dim, or "
                         "query heads not a multiple of KV heads)")
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}")
    if not supported(d, s, kv_bits):
        raise ValueError(f"head_dim must be a power of two >= 16 (>= {16 * 16 // (kv_bits or 16)} for "
                         f"{kv_bits}-bit codes) and the cache length a multiple of 16; got head_dim {d}, "
                         f"cache length {s}")
    check_positions("q_pos", q_pos)  # a query's position in its sequence
    if block_s is None:
        block_s = next(c for c in (BLOCK_S, 32, 16) if s % c == 0)
    check_count("block_s", block_s, 16)
    if block_s % 16 or s % block_s:
        raise ValueError(f"the KV block must be a multiple of 16 dividing the cache length {s}, got {block_s}")
    g = h // kvh
    rows = t * g
    tiles = -(-rows // ROW_TILE)
    rows_pad = _next_pow2(tiles * ROW_TILE)  # the partials' rows
    blocks = s // block_s
    if window is not None:  # the blocks a call of T consecutive positions visits at most
        blocks = min(blocks, -(-window.sinks // block_s) + -(-(window.size + t - 1) // block_s) + 1)
    splits = num_splits(b, kvh, blocks * block_s, block_s) if splits is None else splits
    check_count("splits", splits)
    if splits > blocks:
        raise ValueError(f"splits must lie in [1, {blocks}] (the KV blocks a call reads), got {splits}")
    if num_stages is None:  # the shadow's smaller blocks hide latency better with a third stage
        num_stages = SHADOW_STAGES if kv_bits else 2
    if num_warps is None:
        num_warps = SHADOW_WARPS if kv_bits else FLOAT_WARPS
    blocks_per_split = -(-blocks // splits)

    compute = jnp.float16 if kv_bits else k.dtype  # the shadow's codes are float16 (kv_planes_f16)
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    kernel = functools.partial(_attention_kernel, tiles=tiles, queries=t, group=g, block_s=block_s,
                               blocks=s // block_s, blocks_per_split=blocks_per_split, scale=1.0 / math.sqrt(d),
                               compute=compute, precision=precision, kv_bits=kv_bits, window=window,
                               interpret=interpret)
    kv_spec = pl.BlockSpec((nl, None, s, None, dk), lambda i, j, p: (0, i, 0, j, 0))
    scale_spec = pl.BlockSpec((nl, None, None, s), lambda i, j, p: (0, i, j, 0))
    part = (b, kvh, splits, rows_pad)
    acc, m, l = call_kernel(
        kernel,
        (jax.ShapeDtypeStruct(part + (d,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
         jax.ShapeDtypeStruct(part, jnp.float32)),
        (b, kvh, splits),
        [LAYER_SPEC, pl.BlockSpec((b * t * h, d), lambda i, j, p: (0, 0)),
         pl.BlockSpec((b * t,), lambda i, j, p: (0,)), kv_spec, kv_spec, *[scale_spec] * len(scales)],
        (pl.BlockSpec((None, None, None, rows_pad, d), lambda i, j, p: (i, j, p, 0, 0)),
         pl.BlockSpec((None, None, None, rows_pad), lambda i, j, p: (i, j, p, 0)),
         pl.BlockSpec((None, None, None, rows_pad), lambda i, j, p: (i, j, p, 0))),
        interpret, num_warps, num_stages, lidx, q.reshape(b * t * h, d), q_pos.astype(jnp.int32).reshape(b * t),
        k, v, *scales)
    return Partials(acc, m, l, (b, t, h, d), q.dtype)


def _shadow_bits(q: jax.Array, k: jax.Array, v: jax.Array, scales) -> int | None:
    """The code width of a shadow cache (None for a float cache), after checking its dtypes and shapes."""
    if scales is None:
        if jnp.issubdtype(k.dtype, jnp.integer):
            raise ValueError(f"an integer cache ({k.dtype}) needs its scales (the draft's KV shadow)")
        return None
    if k.dtype != jnp.int16 or v.dtype != jnp.int16:
        raise ValueError(f"a KV shadow holds int16 words of codes, got {k.dtype}, {v.dtype}")
    want = (*k.shape[:-3], k.shape[-2], k.shape[-3])  # head-major
    if len(scales) != 2 or any(sc.shape != want or sc.dtype != jnp.float32 for sc in scales):
        raise ValueError(f"the shadow's scales must be two float32 arrays of shape {want} (head-major), got "
                         f"{[(sc.shape, sc.dtype) for sc in scales]}")
    return reference.kv_shadow_bits(k.shape[-1], q.shape[-1])
