"""Weight quantization schemes and round-to-nearest (RTN) quantization into the packed layout."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.layout import SCALE_DTYPE, SYMMETRIC_OFFSET, QuantizedWeight, rtn

METHODS = ("rtn", "gptq")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How the decoder linears are quantized: INT4, a group size (None = per channel), symmetry."""

    group_size: int | None = 32
    symmetric: bool = False
    method: str = "rtn"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; expected one of {METHODS}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group size must be an even number >= 2 or None, got {self.group_size}")

    def group_for(self, in_features: int) -> int:
        g = self.group_size or in_features
        if in_features % g:
            raise ValueError(f"group size {g} does not divide in_features {in_features}")
        return g

    def matches(self, w: QuantizedWeight) -> bool:
        """Whether already-packed weights are in exactly this scheme (so need no re-rounding)."""
        return w.group_size == self.group_for(w.shape[1]) and w.symmetric == self.symmetric


def quantize_rtn(w: np.ndarray, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest INT4 of float ``w[N, K]`` per (row, group) in ``scheme``."""
    return rtn(w, scheme.group_for(w.shape[1]), scheme.symmetric)


def asymmetric_form(w: QuantizedWeight) -> QuantizedWeight | None:
    """Symmetric ``w`` written as asymmetric weights of the same values, ``s * u + m`` with ``m = -8 s``
    (exact: a power-of-two multiple of a float16), or None where ``8 s`` overflows float16."""
    with np.errstate(over="ignore"):
        mins = (np.asarray(w.scales) * np.float16(-SYMMETRIC_OFFSET)).astype(SCALE_DTYPE)
    return QuantizedWeight(w.packed, w.scales, mins, w.group_size) if np.isfinite(mins).all() else None
