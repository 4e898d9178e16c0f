"""The packed INT4 weight layout: the one place that defines how 4-bit weights are stored.

A linear layer ``y = x @ W.T`` with ``W`` of shape ``[N, K]`` (out_features, in_features) is
stored as a :class:`QuantizedWeight`:

* ``packed``: ``uint8[N, K // 2]``, row-major over output channels, K contiguous. Byte ``j`` of
  row ``n`` holds element ``k = 2j`` in its low nibble and ``k = 2j + 1`` in its high nibble.
  Every nibble is an unsigned code ``u`` in ``[0, 15]``.
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


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Pack unsigned 4-bit codes ``uint8[..., K]`` (values 0..15, K even) into ``uint8[..., K//2]``."""
    codes = np.asarray(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"in_features must be even to pack nibbles, got {codes.shape[-1]}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("4-bit codes must lie in [0, 15]")
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """Unpack ``uint8[..., K//2]`` into unsigned codes ``uint8[..., K]`` (inverse of pack_codes)."""
    low = packed & 0xF
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def signed_codes(w: QuantizedWeight) -> jax.Array:
    """The integer weight operand of the integer matmul, ``int8[..., N, K]``.

    Symmetric weights give ``q = u - 8`` in [-8, 7]; asymmetric weights give ``u`` in [0, 15]
    (their minimum term is applied separately).
    """
    u = unpack_codes(w.packed).astype(jnp.int8)
    return u - SYMMETRIC_OFFSET if w.symmetric else u


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """Float weights ``[..., N, K]``: ``s*q`` or ``s*u + m`` computed in float32, cast to dtype."""
    q = signed_codes(w).astype(jnp.float32)
    n, k = w.shape
    g = k // w.group_size
    q = q.reshape(*q.shape[:-1], g, w.group_size)
    s = jnp.asarray(w.scales).astype(jnp.float32)[..., None]
    out = q * s
    if not w.symmetric:
        out = out + jnp.asarray(w.mins).astype(jnp.float32)[..., None]
    return out.reshape(*q.shape[:-2], k).astype(dtype)
