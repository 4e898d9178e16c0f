"""Orthogonal transforms for QuaRot-style rotation: Hadamard matrices and their online use.

A dimension ``n = m * 2**k`` gets the transform ``kron(A, H_p) `` with ``H_p`` a normalized
Sylvester Hadamard matrix of order ``p`` (a power of two) and ``A`` a normalized Hadamard matrix
of a small order ``m`` built by Paley's constructions — or, when no such order divides ``n``,
a seeded random orthogonal matrix of the odd part. The online transforms (o_proj input per head,
down_proj input) apply it with two small contractions instead of an ``n x n`` matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


MAX_SMALL_ORDER = 256  # larger Paley factors would cost more online than the matmul they precede


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in residues else -1 for a in range(1, q)])
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley(m: int) -> np.ndarray | None:
    """A Hadamard matrix of order m by Paley I (m-1 prime = 3 mod 4) or II (m/2-1 prime = 1 mod 4)."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        s = np.zeros((m, m), dtype=np.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return s + np.eye(m, dtype=np.int64)
    if m % 2 == 0:
        q = m // 2 - 1
        if _is_prime(q) and q % 4 == 1:
            c = np.zeros((q + 1, q + 1), dtype=np.int64)
            c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
            return np.kron(c, [[1, 1], [1, -1]]) + np.kron(np.eye(q + 1, dtype=np.int64), [[1, -1], [-1, -1]])
    return None


def sylvester(p: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix of order p (a power of two)."""
    if p < 1 or p & (p - 1):
        raise ValueError(f"Sylvester order must be a power of two, got {p}")
    h = np.ones((1, 1), dtype=np.int64)
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """A Haar-random orthogonal ``n x n`` matrix (float64), reproducible from ``seed``."""
    g = np.random.default_rng(seed).standard_normal((n, n))
    q, r = np.linalg.qr(g)
    return q * np.sign(np.diag(r))


@functools.lru_cache(maxsize=64)
def kron_factors(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(A [m, m], B [p, p], is_hadamard)``, both orthonormal float64, with ``kron(A, B)`` of order n."""
    if n < 1:
        raise ValueError(f"dimension must be positive, got {n}")
    k = (n & -n).bit_length() - 1
    odd = n >> k
    for j in range(k + 1):
        m = odd << j
        if m > MAX_SMALL_ORDER:
            break
        h = np.ones((1, 1), dtype=np.int64) if m == 1 else _paley(m)
        if h is not None:
            assert np.array_equal(h @ h.T, m * np.eye(m, dtype=np.int64)), m
            p = n // m
            return h / np.sqrt(m), sylvester(p) / np.sqrt(p), True
    return random_orthogonal(odd, seed), sylvester(1 << k) / np.sqrt(1 << k), False


def transform_matrix(n: int, seed: int = 0) -> np.ndarray:
    """The dense ``n x n`` orthogonal matrix that :func:`apply_transform` multiplies by."""
    a, b, _ = kron_factors(n, seed)
    return np.kron(a, b)


def random_hadamard(n: int, seed: int) -> np.ndarray:
    """The residual-stream rotation: a randomized Hadamard ``diag(signs) @ H / sqrt(n)`` where
    a Hadamard of order n is constructible, else a seeded random orthogonal matrix (float64)."""
    a, b, is_hadamard = kron_factors(n, seed)
    if not is_hadamard:
        return random_orthogonal(n, seed)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=n)
    return signs[:, None] * np.kron(a, b)


def apply_transform(x: jax.Array, seed: int = 0) -> jax.Array:
    """``x @ transform_matrix(n)`` along the last axis, as two small contractions."""
    n = x.shape[-1]
    a, b, _ = kron_factors(n, seed)
    xs = x.reshape(*x.shape[:-1], a.shape[0], b.shape[0])
    hi = jax.lax.Precision.HIGHEST
    xs = jnp.einsum("...ij,ik->...kj", xs, jnp.asarray(a, x.dtype), precision=hi)
    xs = jnp.einsum("...kj,jl->...kl", xs, jnp.asarray(b, x.dtype), precision=hi)
    return xs.reshape(x.shape)
