"""Weight quantization schemes and round-to-nearest (RTN) quantization into the packed layout."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.layout import SCALE_DTYPE, SYMMETRIC_OFFSET, QuantizedWeight, pack_codes

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


def quantize_rtn(w: np.ndarray, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest INT4 of float ``w[N, K]`` per (row, group)."""
    n, k = w.shape
    g = scheme.group_for(k)
    wg = np.asarray(w, np.float64).reshape(n, k // g, g)
    s, m = group_params(wg, scheme.symmetric)
    codes = quantize_codes(wg, s, m).reshape(n, k)
    return QuantizedWeight(pack_codes(codes), s, m, g)


def asymmetric_form(w: QuantizedWeight) -> QuantizedWeight | None:
    """Symmetric ``w`` written as asymmetric weights of the same values, ``s * u + m`` with ``m = -8 s``
    (exact: a power-of-two multiple of a float16), or None where ``8 s`` overflows float16."""
    with np.errstate(over="ignore"):
        mins = (np.asarray(w.scales) * np.float16(-SYMMETRIC_OFFSET)).astype(SCALE_DTYPE)
    return QuantizedWeight(w.packed, w.scales, mins, w.group_size) if np.isfinite(mins).all() else None
