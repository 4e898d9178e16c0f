"""The packed INT4 weight layout: the one place that defines how 4-bit weights are stored.

A linear layer ``y = x @ W.T`` with ``W`` of shape ``[N, K]`` (out_features, in_features) is
stored as a :class:`QuantizedWeight`:

* ``packed``: ``uint8[N, K // 2]``, row-major over output channels. K is cut into blocks of
  :data:`PACK_BLOCK` = 64 consecutive elements (the last block may be shorter, of even length
  ``L``); byte ``j`` of a block holds element ``j`` of the block in its low nibble and element
  ``j + L/2`` in its high nibble (``L = 64``: k = 64b + j and 64b + 32 + j). So the low nibbles
  of a block's bytes are 32 consecutive k, as are the high ones: a GPU kernel turns 4 bytes into 4
  int8 operands with one ``and`` (low) or a shift and an ``and`` (high), and an int8 MMA over 32
  consecutive k is one weight group of 32. Every nibble is an unsigned code ``u`` in ``[0, 15]``.
* ``scales``: ``float16[N, K // group_size]``; one scale per output channel and group of
  ``group_size`` consecutive input channels (``group_size == K`` is per-channel).
* ``mins``: ``float16[N, K // group_size]`` for asymmetric weights, ``None`` for symmetric ones.

The value of a code is ``s * (u - 8)`` for symmetric weights (a signed INT4 ``q = u - 8`` in
``[-8, 7]``) and ``s * u + m`` for asymmetric weights (GGUF Q4_1's float group minimum, which an
integer zero point cannot reproduce). Scales and minimums are float16, which holds GGUF's values
exactly and halves their bytes for the memory-bound GPU kernels.

Stacked layers add leading axes to every array; ``group_size`` and ``symmetric`` are static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCALE_DTYPE = np.float16
PACK_BLOCK = 64  # K elements per nibble-planar block (see the module docstring)
SYMMETRIC_OFFSET = 8  # u - 8 maps the unsigned nibble code to the signed INT4 range [-8, 7]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Packed INT4 weights of one linear layer (or a stack of them along leading axes)."""

    packed: jax.Array | np.ndarray
    scales: jax.Array | np.ndarray
    mins: jax.Array | np.ndarray | None
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(N, K)`` of one (unstacked) layer."""
        return self.packed.shape[-2], self.packed.shape[-1] * 2

    def validate(self) -> None:
        """Raise ``ValueError`` if the arrays do not form a consistent packed weight."""
        n, k = self.shape
        if self.packed.dtype != np.uint8:
            raise ValueError(f"packed weights must be uint8, got {self.packed.dtype}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide in_features {k}")
        want = (*self.packed.shape[:-1], k // self.group_size)
        for name, arr in (("scales", self.scales), ("mins", self.mins)):
            if arr is None:
                continue
            if tuple(arr.shape) != want:
                raise ValueError(f"{name} shape {tuple(arr.shape)} != expected {want}")
            if arr.dtype != SCALE_DTYPE:
                raise ValueError(f"{name} must be {np.dtype(SCALE_DTYPE).name}, got {arr.dtype}")


def _blocks(k: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the K blocks: full blocks of PACK_BLOCK, then the (even) rest."""
    out = [(b, PACK_BLOCK) for b in range(0, k - k % PACK_BLOCK, PACK_BLOCK)]
    return out + ([(k - k % PACK_BLOCK, k % PACK_BLOCK)] if k % PACK_BLOCK else [])


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Pack unsigned 4-bit codes ``uint8[..., K]`` (values 0..15, K even) into ``uint8[..., K//2]``."""
    codes = np.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):  # a cast would truncate floats and NaN silently
        raise ValueError(f"4-bit codes must be integers, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"in_features must be even to pack nibbles, got {codes.shape[-1]}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("4-bit codes must lie in [0, 15]")
    codes = codes.astype(np.uint8)
    parts = []
    for start, length in _blocks(codes.shape[-1]):
        half = length // 2
        parts.append(codes[..., start:start + half] | (codes[..., start + half:start + length] << 4))
    return np.concatenate(parts, axis=-1)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """Unpack ``uint8[..., K//2]`` into unsigned codes ``uint8[..., K]`` (inverse of pack_codes)."""
    parts = []
    for start, length in _blocks(packed.shape[-1] * 2):
        block = packed[..., start // 2:(start + length) // 2]
        parts += [block & 0xF, block >> 4]
    return jnp.concatenate(parts, axis=-1)


def signed_codes(w: QuantizedWeight) -> jax.Array:
    """The integer weight operand of the integer matmul, ``int8[..., N, K]``.

    Symmetric weights give ``q = u - 8`` in [-8, 7]; asymmetric weights give ``u`` in [0, 15]
    (their minimum term is applied separately). Checks ``w`` first (:meth:`QuantizedWeight.validate`):
    int8 bytes would unpack to negative codes, and mis-shaped scales would broadcast.
    """
    w.validate()
    u = unpack_codes(w.packed).astype(jnp.int8)
    return u - SYMMETRIC_OFFSET if w.symmetric else u


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """Float weights ``[..., N, K]``: ``s*q`` or ``s*u + m`` computed in float32, cast to dtype."""
    return _grouped(w, lambda q, s, m: q * s if m is None else q * s + m).astype(dtype)


def bf16_round(a: jax.Array) -> jax.Array:
    """``a`` rounded to bfloat16's precision (nearest even), kept in float32. ``reduce_precision``, not a
    convert to bfloat16 and back: XLA's CPU compiler dropped such a pair fused into a dot's operand
    (from 4096 rows on), so the W4A16 reference computed with unrounded activations (2e-3 relative)."""
    return jax.lax.reduce_precision(jnp.asarray(a, jnp.float32), exponent_bits=8, mantissa_bits=7)


def w4a16_weights(w: QuantizedWeight) -> jax.Array:
    """The bfloat16 weight operand of W4A16, ``[..., N, K]``: scales and minimums rounded to
    bfloat16, then ``s*q`` or ``s*u + m`` rounded once to bfloat16 (what one ``mul.bf16x2`` /
    ``fma.bf16x2`` of the GPU kernel gives). ``s*q`` and ``s*u`` are exact in float32 (8 + 4
    significant bits); so is ``s*u + m`` unless the two differ by more than ~2^12 in magnitude."""
    return _grouped(w, lambda q, s, m: q * bf16_round(s) if m is None else q * bf16_round(s) + bf16_round(m)
                    ).astype(jnp.bfloat16)


def _grouped(w: QuantizedWeight, combine) -> jax.Array:
    """``combine(q, s, m)`` over float32 codes grouped as ``[..., N, G, group]`` -> ``[..., N, K]``."""
    q = signed_codes(w).astype(jnp.float32)
    n, k = w.shape
    q = q.reshape(*q.shape[:-1], k // w.group_size, w.group_size)
    s = jnp.asarray(w.scales).astype(jnp.float32)[..., None]
    m = None if w.symmetric else jnp.asarray(w.mins).astype(jnp.float32)[..., None]
    return combine(q, s, m).reshape(*q.shape[:-2], k)


# ------------------------------------------------------------------ round-to-nearest quantization


def group_params(w: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (and minimum) per row of ``w[..., g]`` groups, rounded to the stored float16; a value
    float16 cannot hold is refused (it would be stored as inf)."""
    with np.errstate(over="ignore"):  # an overflow is refused just below
        if symmetric:  # use the whole [-8, 7] code range: the negative side reaches -8 s
            s = np.maximum(np.max(w, -1) / 7.0, -np.min(w, -1) / 8.0)
            s, m = np.where(s > 0, s, 1.0).astype(SCALE_DTYPE), None
        else:
            lo, hi = np.min(w, -1), np.max(w, -1)
            s, m = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(SCALE_DTYPE), lo.astype(SCALE_DTYPE)
    if not (np.isfinite(s).all() and (m is None or np.isfinite(m).all())):
        raise ValueError(f"a weight of magnitude {np.abs(w).max():.3g} overflows the float16 group scale / "
                         "minimum: the checkpoint holds values INT4 with float16 scales cannot represent")
    return s, m


def quantize_codes(w: np.ndarray, s: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """Unsigned codes of ``w[..., g]`` for per-row scale ``s`` (and minimum ``m``), round half to even."""
    s = s.astype(np.float64)[..., None]
    if m is None:
        return (np.clip(np.round(w / s), -8, 7) + SYMMETRIC_OFFSET).astype(np.uint8)
    return np.clip(np.round((w - m.astype(np.float64)[..., None]) / s), 0, 15).astype(np.uint8)


def dequantize_codes(u: np.ndarray, s: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """Float64 values of codes ``u[..., g]`` (the layout's definition, for GPTQ error feedback)."""
    s = s.astype(np.float64)[..., None]
    if m is None:
        return s * (u.astype(np.float64) - SYMMETRIC_OFFSET)
    return s * u + m.astype(np.float64)[..., None]


def rtn(w: np.ndarray, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest INT4 of float ``w[N, K]`` per (row, group of ``group_size``)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features {k}")
    wg = np.asarray(w, np.float64).reshape(n, k // group_size, group_size)
    s, m = group_params(wg, symmetric)
    return QuantizedWeight(pack_codes(quantize_codes(wg, s, m).reshape(n, k)), s, m, group_size)
