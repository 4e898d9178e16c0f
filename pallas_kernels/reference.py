"""Reference numerics of the quantized matmuls, in plain ``jnp``.

These functions define what every :class:`~pallas_kernels.precision.Precision` computes; the Pallas
GPU kernels must reproduce them (the W4A4/W4A8 int32 accumulations bitwise, the float results to
tolerance).

* W16A16: float weights (dequantized in float32) times activations in their own dtype.
* W4A16: weights dequantized in bfloat16 (:func:`pallas_kernels.layout.w4a16_weights`),
  activations cast to bfloat16, float32 accumulation.
* W4A8 / W4A4: activations quantized per token (row) to symmetric INT8 / INT4
  (scale = absmax * f32(1/127) or f32(1/7), q = round_half_even(x * f32(1 / scale)), clamp), int8 x int8 -> int32 products
  summed within each weight group, then ``y = s_act * sum_g(s_w[g] * acc[g] + m_w[g] * sum(q_act[g]))``
  in float32 (the minimum term only for asymmetric weights).

The draft's KV shadow (:func:`quantize_kv`): each (token, KV head) vector quantized like an
activation row to INT8 or INT4, the codes packed into int16 words.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import QuantizedWeight, bf16_round, dequantize, signed_codes, w4a16_weights
from pallas_kernels.precision import Precision
from pallas_kernels.rows import map_row_tiles


def quantize_activations(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric quantization: ``(int8 codes [..., K], float32 scales [..., 1])``."""
    qmax = 2 ** (bits - 1) - 1
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    # absmax * f32(1/qmax), not absmax / qmax: compilers turn division by a constant into this
    # multiplication anyway (XLA on CPU does), so spelling it out makes every backend agree.
    scale = jnp.where(absmax > 0, absmax * np.float32(1 / qmax), 1.0)
    # times the reciprocal, not / scale: XLA rewrites a division by a broadcast into this product
    # (on the CPU it does), so spelling it out makes the references and the kernels agree bitwise.
    q = jnp.clip(jnp.round(xf * (np.float32(1) / scale)), -qmax - 1, qmax).astype(jnp.int8)
    return q, scale


KV_BITS = (8, 4)  # the draft's KV shadow: codes per int16 word = 16 // bits


def quantize_kv(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """The draft's KV shadow of ``x[..., d]`` (one key or value vector per token and KV head):
    ``(int16 words [..., d * bits // 16], float32 scales [...])``, symmetric per vector as
    :func:`quantize_activations`, each code stored offset by ``2**(bits-1)`` (unsigned). Word ``i``
    holds codes ``i, i + d/P, ..., i + (P-1) d/P`` (``P = 16 // bits``, lowest bits first): plane ``j``
    of the words is the ``j``-th contiguous ``d/P`` slice of the vector, so a kernel dots each plane
    with a contiguous slice of the query. int16 words and not bytes: the Triton lowering indexes an
    array of 2**31 to 2**32 elements with wrapping int32 offsets
    (:func:`pallas_kernels.launch.int32_offsets_wrap`), and a batch-16 7B int8 shadow is one."""
    if bits not in KV_BITS:
        raise ValueError(f"KV shadow bits must be one of {KV_BITS}, got {bits!r}")
    planes = 16 // bits
    if x.shape[-1] % planes:
        raise ValueError(f"the head dimension {x.shape[-1]} is not a multiple of {planes} ({bits}-bit KV codes)")
    q, scale = quantize_activations(x, bits)
    parts = jnp.split(q.astype(jnp.int32) + (1 << (bits - 1)), planes, axis=-1)
    word = sum(p << (bits * j) for j, p in enumerate(parts))
    return jax.lax.bitcast_convert_type(word.astype(jnp.uint16), jnp.int16), scale[..., 0]


def kv_shadow_bits(words_per_head: int, head_dim: int) -> int:
    """The code width of a shadow holding ``words_per_head`` int16 words per ``head_dim`` vector."""
    for bits in KV_BITS:
        if words_per_head * 16 == head_dim * bits:
            return bits
    raise ValueError(f"{words_per_head} int16 words per head do not hold {head_dim} codes of "
                     f"{' or '.join(map(str, KV_BITS))} bits")


def kv_planes(words: jax.Array, bits: int) -> list[jax.Array]:
    """The ``16 // bits`` signed code planes (int32 ``[..., d * bits // 16]`` each) of shadow words."""
    w = words.astype(jnp.int32)
    return [((w >> (bits * j)) & ((1 << bits) - 1)) - (1 << (bits - 1)) for j in range(16 // bits)]


def dequantize_kv(words: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """float32 ``[..., d]`` key or value vectors from their shadow (:func:`quantize_kv`)."""
    codes = jnp.concatenate(kv_planes(words, bits), axis=-1)
    return codes.astype(jnp.float32) * scale[..., None]


def swiglu(gate: jax.Array, up: jax.Array, reciprocal=lambda v: np.float32(1) / v) -> jax.Array:
    """The MLP's ``silu(gate) * up``: ``gate * (1 / (1 + exp(-gate))) * up`` in float32, rounded once
    to ``gate``'s dtype. ``reciprocal``: the GPU prologue kernel passes PTX ``rcp.rn`` (correctly
    rounded, as ``1 / v`` is), where Triton's division would be approximate; ``exp`` is each
    backend's own (within its ulps), so the GPU kernel and XLA may differ in the last bit."""
    g = gate.astype(jnp.float32)
    return (g * reciprocal(1 + jnp.exp(-g)) * up.astype(jnp.float32)).astype(gate.dtype)


def round_to(dtype):
    """float32 -> float32 rounded to ``dtype``'s precision (XLA may not drop it, as it may a cast pair)."""
    fi = jnp.finfo(dtype)
    return lambda v: jax.lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def split_sum(parts, scale: jax.Array | None = None) -> jax.Array:
    """A linear layer's float32 result from its K-split partial sums: ``parts[0] + parts[1] + ...``
    left to right, times the W4AX row ``scale`` where there is one (not yet rounded)."""
    y = parts[0]
    for p in parts[1:]:
        y = y + p
    return y if scale is None else scale * y


def rope(lo: jax.Array, hi: jax.Array, cos: jax.Array, sin: jax.Array, rounded=None) -> tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE of a vector's halves: ``(lo cos - hi sin, hi cos + lo sin)`` in ``lo``'s dtype,
    each product and the sum rounded to it (float32 arithmetic), as ``x * cos + rotate_half(x) * sin``
    computes it op by op; ``cos, sin`` are in that dtype too. ``rounded``: float32 -> float32 at the
    dtype's precision (the GPU kernel passes a cast pair, which Triton keeps)."""
    dtype = lo.dtype
    rounded = round_to(dtype) if rounded is None else rounded
    lo, hi, c, s = (v.astype(jnp.float32) for v in (lo, hi, cos, sin))
    return ((rounded(lo * c) - rounded(hi * s)).astype(dtype), (rounded(hi * c) + rounded(lo * s)).astype(dtype))


def group_accumulate(qa: jax.Array, qw: jax.Array, group_size: int) -> jax.Array:
    """Integer products summed per weight group: ``int32[M, G, N]`` from ``int8[M, K]``, ``int8[N, K]``."""
    (m, k), n = qa.shape, qw.shape[0]
    g = k // group_size
    a = qa.reshape(m, g, group_size).transpose(1, 0, 2)  # [G, M, g]
    b = qw.reshape(n, g, group_size).transpose(1, 0, 2)  # [G, N, g]
    acc = jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.int32)
    return acc.transpose(1, 0, 2)


def _w4ax_rows(x: jax.Array, w: QuantizedWeight, qw: jax.Array, bits: int) -> jax.Array:
    """W4A8 / W4A4 of rows ``x[M, K]`` given the integer weight operand ``qw = signed_codes(w)``."""
    qa, sa = quantize_activations(x, bits)
    acc = group_accumulate(qa, qw, w.group_size)  # [M, G, N]
    scales = jnp.asarray(w.scales).astype(jnp.float32).T  # [G, N]
    y = acc.astype(jnp.float32) * scales
    if not w.symmetric:
        qsum = qa.astype(jnp.int32).reshape(qa.shape[0], -1, w.group_size).sum(-1)  # [M, G]
        y = y + qsum.astype(jnp.float32)[:, :, None] * jnp.asarray(w.mins).astype(jnp.float32).T
    return sa * jnp.sum(y, axis=1)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x[M, K] @ w[N, K].T`` at full precision with a float32 result."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def dense_matmul(x: jax.Array, w: jax.Array, row_tile: int | None = None) -> jax.Array:
    """Float matmul ``x @ w.T`` in the activations' dtype, float32 result."""
    wd = w.astype(x.dtype)
    return map_row_tiles(lambda r: _dot(r, wd), x, row_tile)


def quantized_matmul(x: jax.Array, w: QuantizedWeight, precision: Precision, row_tile: int | None = None) -> jax.Array:
    """The reference matmul of ``x[..., K]`` with packed weights in ``precision``, float32 out.

    The weight operand is prepared once (dequantized, or unpacked to int8); the rows then run in
    tiles of ``row_tile`` (see :mod:`pallas_kernels.rows`) so each row's result is independent of
    how many rows the call has.
    """
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"input of {x.shape[-1]} features for a weight of shape (N, K) = {w.shape}")
    if not precision.quantized:
        return dense_matmul(x, dequantize(w, x.dtype), row_tile)
    if not precision.int_acts:
        # bf16 x bf16 products are exact in float32: this is a bf16 matmul with f32 accumulation,
        # spelled in float32 because XLA's CPU bf16 dot is slow and takes other code paths.
        wd = bf16_round(w4a16_weights(w))  # (bf16_round: the roundings survive XLA's fusions)
        return map_row_tiles(lambda r: _dot(bf16_round(r), wd), x, row_tile)
    qw = signed_codes(w)
    return map_row_tiles(lambda r: _w4ax_rows(r, w, qw, precision.act_bits), x, row_tile)


@dataclasses.dataclass(frozen=True)
class AttentionWindow:
    """A draft's sparse view of the KV cache (StreamingLLM-style): a query at position ``p`` sees the
    first ``sinks`` slots and the ``size`` slots ending at ``p`` (its own slot included), nothing else."""

    sinks: int
    size: int

    def __post_init__(self):
        for name, least in (("sinks", 0), ("size", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise ValueError(f"the attention window's {name} must be an integer >= {least}, got {value!r}")

    def visible(self, k_pos, q_pos):
        """Whether a key at ``k_pos`` is in the window of a query at ``q_pos`` (broadcasting; causality
        is the caller's mask)."""
        return (k_pos < self.sinks) | (k_pos > q_pos - self.size)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              window: AttentionWindow | None = None) -> jax.Array:
    """Grouped-query attention ``q[B,T,H,d]`` over ``k, v[B,S,KV,d]``; key ``s`` is visible to query
    ``t`` iff ``k_pos[b,s] <= q_pos[b,t]`` (and, with ``window``, it lies in the query's window).
    Scores and softmax in float32, probabilities cast to ``v``'s dtype, float32 accumulation, output
    in ``q``'s dtype."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(d).astype(np.float32)
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if window is not None:
        mask &= window.visible(k_pos[:, None, :], q_pos[:, :, None])
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
