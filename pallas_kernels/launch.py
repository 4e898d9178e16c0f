"""Launching Pallas kernels through the Triton lowering, without its deprecation warning, and
handing them inputs that are one layer of a stack.

Pallas' Triton backend is deprecated on jax 0.11 and warns when a kernel is lowered. Lowering
happens when the caller's ``jit`` compiles, outside any ``catch_warnings`` of ours, so exactly that
message is filtered module-wide (and around each call); users never see it.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pl_triton


def call_kernel(kernel, out_shape, grid, in_specs, out_specs, interpret: bool, num_warps: int,
                num_stages: int, *args, aliases: dict[int, int] | None = None):
    """``pl.pallas_call(kernel, ...)(*args)`` with Triton compiler parameters (none in interpret mode);
    ``aliases``: the ``input_output_aliases`` (an input updated in place)."""
    check_count("num_warps", num_warps)
    check_count("num_stages", num_stages)
    params = None if interpret else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, input_output_aliases=aliases or {}, compiler_params=params,
                              interpret=interpret)(*args)


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    """A tiling argument (warps, stages, block sizes, splits) must be an integer >= ``minimum``: a
    float or zero would fail deep in the lowering, or tile nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_rows(name: str, shape: tuple[int, ...]) -> None:
    """A kernel input of ``shape`` must hold at least one row (its leading dims): an empty grid has
    nothing to launch, and the tile arithmetic would divide by zero."""
    if not all(shape[:-1]):
        raise ValueError(f"{name} must hold at least one row, got shape {shape}")


def check_float(**arrays: jax.Array) -> None:
    """Each named array (activations, float weights, queries, tables) must have a float dtype."""
    for name, a in arrays.items():
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {a.dtype}")


def check_eps(eps: Any) -> float:
    """An RMSNorm eps: a finite number >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) or not 0 <= eps < np.inf:
        raise ValueError(f"the RMSNorm's eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_positions(name: str, pos: jax.Array) -> None:
    """Concrete positions must be >= 0 (a negative one would index before the cache); traced ones
    (inside the model's jit) are the caller's to keep in range."""
    if not isinstance(pos, jax.core.Tracer) and pos.size and (low := np.asarray(pos).min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {low}")


def int32_offsets_wrap(a) -> bool:
    """Whether the Triton lowering would index ``a`` with int32 element offsets that pass 2**31: it
    takes 32-bit offsets for arrays of at most 2**32 bytes, so 1-byte arrays of 2-4 GiB (a whole
    Llama-2-13B gate/up stack as uint8) would read the wrong memory."""
    return a.size >= 2**31 and a.size * a.dtype.itemsize <= 2**32


def check_layer(layer, layers: int) -> None:
    """``layer`` must be an integer scalar, and a concrete one in ``[0, layers)``: dynamic indexing would
    clamp it to the stack silently. A traced one (the model's layer scan) is the caller's to keep in range."""
    if not jnp.issubdtype(jnp.result_type(layer), jnp.integer) or jnp.ndim(layer):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{jnp.shape(layer)}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < layers:
        raise ValueError(f"layer {int(layer)} out of range for a stack of {layers}")


def stacked_input(a, layer) -> tuple:
    """``(stack, int32[1] layer index)`` for a kernel input that may be one layer of a stack.

    The model keeps its layers stacked ``[L, ...]`` and the kernels read layer ``layer`` in place:
    a slice passed to a ``pallas_call`` would be copied out first (a full copy of every weight and
    of the KV cache per decode step). An unstacked input (``layer`` None) becomes a stack of one;
    ``a`` may be a pytree of arrays (a :class:`~pallas_kernels.layout.QuantizedWeight`). A concrete
    index is range-checked; a traced one (the model's layer scan) is the caller's to keep in range.
    A stack the lowering could not index correctly (:func:`int32_offsets_wrap`) is sliced after all."""
    if layer is not None:
        check_layer(layer, jax.tree.leaves(a)[0].shape[0])
        if not any(int32_offsets_wrap(v) for v in jax.tree.leaves(a)):
            return a, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
        a = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, layer, keepdims=False), a)
    return jax.tree.map(lambda v: v[None], a), jnp.zeros((1,), jnp.int32)


def at_layer(ref, layer, idx: tuple, interpret: bool):
    """The view ``ref[layer][idx]`` of a stacked kernel input (or of any leading index, such as an
    activation plane). One indexer on the GPU (the Triton
    lowering takes one per load); the layer index first in interpret mode (Pallas' interpreter takes
    no integer index beside slices in one indexer). ``layer`` None: an unstacked ``ref[idx]``."""
    if layer is None:
        return ref.at[idx]
    return ref.at[layer].at[idx] if interpret else ref.at[(layer, *idx)]


def stacked_spec(layers: int, block: tuple, index_map) -> pl.BlockSpec:
    """A BlockSpec over a stacked input: ``block`` of every layer (the kernel picks its layer)."""
    return pl.BlockSpec((layers, *block), lambda *g: (0, *index_map(*g)))


LAYER_SPEC = pl.BlockSpec((1,), lambda *g: (0,))  # the int32[1] layer index


def x2(bits16: int) -> str:
    """A PTX 32-bit immediate holding the 16-bit pattern ``bits16`` in both halves (an f16x2 /
    bf16x2 constant, or a mask for two packed 16-bit words)."""
    if not 0 <= bits16 < 1 << 16:
        raise ValueError(f"not a 16-bit pattern: {bits16:#x}")
    return f"{bits16 << 16 | bits16:#010x}"
