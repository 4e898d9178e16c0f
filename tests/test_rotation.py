"""Hadamard constructions and the online transform."""

from __future__ import annotations

import numpy as np
import pytest

from qspec_jax.rotation import apply_transform, kron_factors, random_hadamard, sylvester, transform_matrix


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 36, 64, 576, 1536, 11008 // 64, 86, 6, 5 * 16])
def test_transform_is_orthogonal(n, rng):
    t = transform_matrix(n, seed=int(rng.integers(2**31)))
    np.testing.assert_allclose(t @ t.T, np.eye(n), atol=1e-10)


@pytest.mark.parametrize("n", [12, 20, 28, 36, 44, 60, 576, 1536, 14336 // 16])
def test_hadamard_orders_are_true_hadamards(n):
    a, b, is_hadamard = kron_factors(n)
    assert is_hadamard
    h = np.kron(a, b) * np.sqrt(n)
    assert np.allclose(np.abs(h), 1.0)  # entries +-1
    np.testing.assert_allclose(h @ h.T, n * np.eye(n), atol=1e-8)


def test_fallback_is_seeded_random_orthogonal(rng):
    s1, s2 = (int(s) for s in rng.choice(2**31, 2, replace=False))
    a1, b1, h1 = kron_factors(86, seed=s1)  # 86 = 2 * 43: no Hadamard of order 43 or 86 is built
    a2, _, _ = kron_factors(86, seed=s2)
    assert not h1 and a1.shape == (43, 43) and b1.shape == (2, 2)
    assert not np.allclose(a1, a2)


def test_random_hadamard_has_random_signs(rng):
    s1, s2 = (int(s) for s in rng.choice(2**31, 2, replace=False))
    r1, r2 = random_hadamard(64, s1), random_hadamard(64, s2)
    h = sylvester(64) / 8.0
    assert np.allclose(np.abs(r1), np.abs(h)) and not np.allclose(r1, r2)
    np.testing.assert_allclose(r1 @ r1.T, np.eye(64), atol=1e-12)


@pytest.mark.parametrize("n", [12, 64, 80, 86])
def test_apply_transform_matches_dense(rng, n):
    x = rng.standard_normal((3, 5, n)).astype(np.float32)
    seed = int(rng.integers(2**31))
    y = np.asarray(apply_transform(x, seed=seed))
    np.testing.assert_allclose(y, x.astype(np.float64) @ transform_matrix(n, seed), atol=1e-5)


def test_sylvester_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        sylvester(12)
