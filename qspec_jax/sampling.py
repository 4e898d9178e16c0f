"""Token selection: temperature / top-k / top-p processing, and the speculative acceptance rules.

The same processing applies to the draft (q) and the target (p) distributions, so stochastic
QSPEC samples exactly from the processed W4A16 distribution (Leviathan et al. / Chen et al.).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy when ``temperature == 0``."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not is_integer(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and (not is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1] or None, got {self.top_p!r}")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k / top_p shape the sampled distribution, and temperature=0 decodes greedily: "
                             "give a temperature > 0 or leave them out")
        # plain Python numbers: the runtime is a static (hashed) argument of the jitted loops
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", None if self.top_k is None else int(self.top_k))
        object.__setattr__(self, "top_p", None if self.top_p is None else float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_real(v) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_integer(v) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_token_ids(ids: np.ndarray, vocab: int, hint: str = "") -> None:
    """Integer token ids in ``[0, vocab)``: a float or an id out of range would be gathered silently
    (garbage), not fail; ``hint`` ends the message (where the ids came from)."""
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    if ids.size and not (0 <= ids.min() and ids.max() < vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}), got values from {ids.min()} to {ids.max()}{hint}")


def probabilities(logits: jax.Array, s: Sampling) -> jax.Array:
    """The processed distribution ``[..., V]`` (float32): temperature, then top-k, then top-p. The
    logits are shifted to a maximum of 0 before the division, and the temperature is at least
    float32's smallest normal number, so that a tiny temperature tends to greedy instead of NaN.
    Top-k keeps every token tied with the k-th largest value (more than k where there are ties)."""
    x = logits.astype(jnp.float32)
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / max(s.temperature, float(jnp.finfo(jnp.float32).tiny))
    if s.top_k is not None and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    e = jnp.exp(x)  # the maximum is already 0 (top-k keeps it): softmax without a second max
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    if s.top_p is not None and s.top_p < 1:
        sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
        # keep the smallest prefix whose mass reaches top_p: entries whose preceding mass < top_p, and
        # always the most probable one (a top_p below float32's smallest normal would keep nothing)
        keep = (before < s.top_p) | (jnp.arange(sorted_p.shape[-1]) == 0)
        cutoff = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= cutoff, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def choose(logits: jax.Array, s: Sampling, key: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``(tokens [...], processed probs or None when greedy)`` from ``logits [..., V]``."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = probabilities(logits, s)
    return sample(probs, key), probs


def sample(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One categorical draw per row of ``probs [..., V]``."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def accept_greedy(drafts: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax; ``(accepted [B], next token [B])``.

    ``drafts [B, g]`` were proposed for positions whose target logits are ``target_logits[:, :g]``;
    the next token is the target's argmax at the first mismatch (or the bonus position ``g``).
    """
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, g+1]
    match = drafts == target[:, :-1]
    accepted = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(target, accepted[:, None], axis=-1)[:, 0]


def accept_stochastic(drafts: jax.Array, q: jax.Array, target_logits: jax.Array, s: Sampling,
                      key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: accept ``d_i`` with prob ``min(1, p_i(d_i) / q_i(d_i))``; at the first
    rejection sample ``norm(max(0, p - q))``; if all pass, sample the bonus token from ``p_g``.

    ``drafts [B, g]``, draft distributions ``q [B, g, V]``, ``target_logits [B, g+1, V]``.
    """
    g = drafts.shape[1]
    p = probabilities(target_logits, s)  # [B, g+1, V]
    k_acc, k_res = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_acc, drafts.shape)
    ok = u * q_d < p_d  # u < p/q without dividing; q_d > 0 since d was drawn from q
    accepted = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # bonus position: residual = p
    q_a = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_a)
    return accepted, sample(residual, k_res)
