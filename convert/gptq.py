"""GPTQ (Frantar et al., 2022): column-by-column INT4 rounding with second-order error feedback.

Given a layer's input Hessian ``H = X^T X`` from calibration data, each column's rounding error is
spread over the not-yet-quantized columns through the Cholesky factor of ``H^-1``. Group scales
are taken from the error-updated weights when each group starts, as in the reference code.
"""

from __future__ import annotations

import numpy as np

from convert.quantize import QuantScheme
from pallas_kernels.layout import QuantizedWeight, dequantize_codes, group_params, pack_codes, quantize_codes


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, scheme: QuantScheme,
                  block_size: int = 128, damp: float = 0.01) -> QuantizedWeight:
    """Quantize float ``w[N, K]`` given ``hessian[K, K]`` (float64) into the packed layout."""
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"Hessian shape {hessian.shape} does not match in_features {k}")
    g = scheme.group_for(k)
    if g < k and block_size % g:
        block_size = g * max(1, block_size // g)
    w = np.array(w, np.float64)
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0
    if dead.all():
        raise ValueError("the calibration Hessian is zero (no calibration input reached this layer)")
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1

    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, k // g), np.float16)
    mins = None if scheme.symmetric else np.zeros((n, k // g), np.float16)
    if g == k:  # per channel: one scale from the whole row, fixed before any update
        s, m = group_params(w, scheme.symmetric)
        scales[:, 0] = s
        if mins is not None:
            mins[:, 0] = m
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].copy()
        err = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            grp = col // g
            if g < k and col % g == 0:
                s, m = group_params(w1[:, i:i + g], scheme.symmetric)
                scales[:, grp] = s
                if mins is not None:
                    mins[:, grp] = m
            s, m = scales[:, grp], None if mins is None else mins[:, grp]
            c = quantize_codes(w1[:, i:i + 1], s, m)
            codes[:, col] = c[:, 0]
            e = (w1[:, i] - dequantize_codes(c, s, m)[:, 0]) / u1[i, i]
            w1[:, i:] -= np.outer(e, u1[i, i:])
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return QuantizedWeight(pack_codes(codes), scales, mins, g)
