"""The one matmul entry point of the model: a dense or packed-INT4 weight in a given mode."""

from __future__ import annotations

import jax

from pallas_kernels import reference
from pallas_kernels.layout import QuantizedWeight

MODES = reference.MODES


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ``ValueError``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    return mode


def linear(x: jax.Array, w: QuantizedWeight | jax.Array, mode: str, row_tile: int | None = None) -> jax.Array:
    """``x @ W.T`` as float32: packed weights in any mode, float weights only in ``w16a16``.

    With ``row_tile`` set, rows run in fixed-size tiles so results are row-count invariant.
    """
    if isinstance(w, QuantizedWeight):
        return reference.quantized_matmul(x, w, mode, row_tile)
    if mode != "w16a16":
        raise ValueError(
            f"mode {mode!r} needs packed INT4 weights, but this layer holds float weights "
            "(convert the checkpoint with quantization)")
    return reference.dense_matmul(x, w, row_tile)
