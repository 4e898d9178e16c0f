"""Launching Pallas kernels through the Triton lowering, without its deprecation warning.

Pallas' Triton backend is deprecated on jax 0.11 and warns when a kernel is lowered. Lowering
happens when the caller's ``jit`` compiles, outside any ``catch_warnings`` of ours, so exactly that
message is filtered module-wide (and around each call); users never see it.
"""

from __future__ import annotations

import warnings

from jax.experimental import pallas as pl

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pl_triton


def call_kernel(kernel, out_shape, grid, in_specs, out_specs, interpret: bool, num_warps: int,
                num_stages: int, *args):
    """``pl.pallas_call(kernel, ...)(*args)`` with Triton compiler parameters (none in interpret mode)."""
    params = None if interpret else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, compiler_params=params, interpret=interpret)(*args)
