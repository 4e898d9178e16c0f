"""RTN and GPTQ weight quantization."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from convert.gptq import gptq_quantize
from convert.quantize import QuantScheme, quantize_rtn
from pallas_kernels.layout import dequantize, unpack_codes


def _deq(w) -> np.ndarray:
    return np.asarray(dequantize(w, jnp.float32), np.float64)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [16, 64, None])
def test_rtn_rounds_to_nearest_grid_point(rng, symmetric, group):
    w = rng.standard_normal((12, 128)) * rng.uniform(0.01, 1, (12, 1))
    q = quantize_rtn(w, QuantScheme(group, symmetric, "rtn"))
    q.validate()
    g = group or 128
    s = np.repeat(q.scales.astype(np.float64), g, axis=1)
    err = np.abs(_deq(q) - w)
    # every weight lies within half a step of its grid point (the clamp never bites: the grid spans
    # the group's range), up to float16 rounding of the scale and minimum
    assert np.all(err <= 0.5 * s * (1 + 2e-3) + 1e-3 * np.abs(w) + 1e-6)
    # and no other code of the group's grid is closer (round to nearest)
    codes = np.asarray(unpack_codes(jnp.asarray(q.packed))).astype(np.float64)
    base = s * (codes - 8) if symmetric else s * codes + np.repeat(q.mins.astype(np.float64), g, axis=1)
    for step in (-1, 1):
        alt = base + step * s
        valid = (codes + step >= 0) & (codes + step <= 15)
        assert np.all(np.abs(alt - w)[valid] >= err[valid] - 1e-6 * s[valid])


def test_gptq_with_diagonal_hessian_is_rtn(rng):
    """Uncorrelated inputs leave GPTQ no error to propagate: it must round exactly like RTN."""
    w = rng.standard_normal((16, 96))
    h = np.diag(rng.uniform(0.5, 2.0, 96))
    for scheme in (QuantScheme(32, False, "gptq"), QuantScheme(None, True, "gptq")):
        a, b = gptq_quantize(w, h, scheme), quantize_rtn(w, scheme)
        assert np.array_equal(a.packed, b.packed) and np.array_equal(a.scales, b.scales)
        assert (a.mins is None) == (b.mins is None) and (a.mins is None or np.array_equal(a.mins, b.mins))


@pytest.mark.parametrize("scheme", [QuantScheme(32, False, "gptq"), QuantScheme(None, True, "gptq"),
                                    QuantScheme(64, True, "gptq")])
def test_gptq_reduces_output_error_on_correlated_inputs(rng, scheme):
    k = 128
    x = rng.standard_normal((1024, k)) @ rng.standard_normal((k, k))
    w = rng.standard_normal((48, k))
    h = x.T @ x
    err = lambda q: np.linalg.norm(x @ (_deq(q) - w).T)  # noqa: E731
    assert err(gptq_quantize(w, h, scheme)) < 0.85 * err(quantize_rtn(w, scheme))


def test_gptq_hessian_shape_checked(rng):
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_quantize(rng.standard_normal((4, 32)), np.eye(16), QuantScheme(32, True, "gptq"))
    with pytest.raises(ValueError, match="Hessian is zero"):  # no calibration input: not an all-zero weight
        gptq_quantize(rng.standard_normal((4, 32)), np.zeros((32, 32)), QuantScheme(32, True, "gptq"))


def test_scheme_validation():
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantScheme(32, True, "awq")
    with pytest.raises(ValueError, match="group size"):
        QuantScheme(7, True, "rtn")
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn(np.zeros((2, 48)), QuantScheme(32, True, "rtn"))
