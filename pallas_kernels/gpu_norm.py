"""RMSNorm as a Pallas GPU kernel (Triton lowering): each row reduced in one fixed order.

``y = scale * (x * rsqrt(mean(x^2) + eps)).astype(x.dtype)`` with the statistics in float32, as the
model's jnp RMSNorm computes it. One program per row; the row is read in chunks of a fixed width
(chosen from the hidden size only), squares summed chunk-wise in a fixed order then across the
chunk, so a row's result does not depend on how many rows the call has.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels.launch import (LAYER_SPEC, at_layer, call_kernel, check_eps, check_float, check_rows, pl_triton,
                                   stacked_input, stacked_spec)

MAX_CHUNK = 1024
# Warps per row program. inv_rms' sum across the chunk is a tree over the threads, so its bits depend
# on this: every kernel that normalizes a row uses it.
NUM_WARPS = 4


def _chunk(h: int) -> int:
    c = MAX_CHUNK
    while c >= 16 and h % c:
        c //= 2
    if c < 16:
        raise ValueError(f"hidden size {h} must be a multiple of 16")
    return c


def inv_rms(x_ref, h: int, eps: float) -> jax.Array:
    """``rsqrt(mean(x^2) + eps)`` of the row ``x_ref[H]`` in float32: squares summed chunk-wise in a
    fixed order, then across the chunk (a function of H only)."""
    chunk = _chunk(h)

    def sq(i, acc):
        v = x_ref[pl.ds(i * chunk, chunk)].astype(jnp.float32)
        return acc + v * v

    ss = jnp.sum(jax.lax.fori_loop(0, h // chunk, sq, jnp.zeros((chunk,), jnp.float32)))
    return jax.lax.rsqrt(ss / np.float32(h) + np.float32(eps))


def rounder(dtype, interpret: bool):
    """float32 -> float32 rounded to ``dtype``'s precision, in a kernel: a cast pair on the GPU (Triton
    keeps it); in interpret mode ``reference.round_to`` (XLA may drop a cast pair: excess precision)."""
    return reference.round_to(dtype) if interpret else lambda v: v.astype(dtype).astype(jnp.float32)


def normalized(v: jax.Array, r: jax.Array, s: jax.Array, interpret: bool) -> jax.Array:
    """``s * (v * r)`` in ``v``'s dtype (each product rounded to it), as the model's RMSNorm does."""
    rounded = rounder(v.dtype, interpret)
    y = rounded(v.astype(jnp.float32) * r)
    return rounded(s.astype(v.dtype).astype(jnp.float32) * y).astype(v.dtype)


def _rms_norm_kernel(l_ref, x_ref, s_ref, o_ref, *, h: int, eps: float, interpret: bool):
    chunk = _chunk(h)
    layer = l_ref[0]
    r = inv_rms(x_ref, h, eps)

    def write(i, carry):
        cols = pl.ds(i * chunk, chunk)
        o_ref[cols] = normalized(x_ref[cols], r, pl_triton.load(at_layer(s_ref, layer, (cols,), interpret)), interpret)
        return carry

    jax.lax.fori_loop(0, h // chunk, write, 0)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, *, layer: jax.Array | None = None,
             interpret: bool = False) -> jax.Array:
    """RMSNorm of the rows of ``x[M, H]`` with ``scale[H]`` -> ``[M, H]`` in ``x.dtype``; with
    ``layer`` (an int32 scalar), ``scale`` is a stack ``[L, H]`` read at that layer in place."""
    want = (x.shape[-1],) if layer is None else (scale.shape[0], x.shape[-1])
    if x.ndim != 2 or scale.shape != want:
        raise ValueError(f"expected x [M, H] and scale {'[H]' if layer is None else '[L, H]'}, "
                         f"got {x.shape} and {scale.shape}")
    check_float(x=x, scale=scale)
    check_rows("x", x.shape)
    eps = check_eps(eps)
    m, h = x.shape
    scale, lidx = stacked_input(scale, layer)
    kernel = functools.partial(_rms_norm_kernel, h=h, eps=eps, interpret=interpret)
    return call_kernel(kernel, jax.ShapeDtypeStruct((m, h), x.dtype), (m,),
                       [LAYER_SPEC, pl.BlockSpec((None, h), lambda i: (i, 0)),
                        stacked_spec(scale.shape[0], (h,), lambda i: (0,))],
                       pl.BlockSpec((None, h), lambda i: (i, 0)), interpret, NUM_WARPS, 1, lidx, x, scale)
