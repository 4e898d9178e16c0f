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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each sequence's tokens are chosen, as arrays (traced: new values reuse the compiled loop).
    ``temperature`` 0 chooses greedily; ``top_k`` 0 and ``top_p`` 1 restrict nothing."""

    temperature: jax.Array  # float32[B] (or a scalar for every row)
    top_k: jax.Array        # int32[B]
    top_p: jax.Array        # float32[B]

    @classmethod
    def of(cls, temperature=0.0, top_k=None, top_p=None, batch: int | None = None) -> "Sampling":
        """Checked settings from Python numbers or per-sequence lists of them (``batch`` long; None:
        scalars); ``top_k`` / ``top_p`` None restrict nothing."""
        t, k, p = (per_row(v, batch, name) for v, name in
                   ((temperature, "temperature"), (top_k, "top_k"), (top_p, "top_p")))
        for ti, ki, pi in zip(t, k, p):
            if not is_real(ti) or not math.isfinite(ti) or ti < 0:
                raise ValueError(f"temperature must be a finite number >= 0, got {ti!r}")
            if ki is not None and (not is_integer(ki) or ki < 1):
                raise ValueError(f"top_k must be an integer >= 1 or None, got {ki!r}")
            if pi is not None and (not is_real(pi) or not 0 < pi <= 1):
                raise ValueError(f"top_p must be a number in (0, 1] or None, got {pi!r}")
            if ti == 0 and (ki is not None or pi is not None):
                raise ValueError("top_k / top_p shape the sampled distribution, and temperature=0 decodes "
                                 "greedily: give a temperature > 0 or leave them out")
        shape = () if batch is None else (batch,)
        return cls(np.asarray(t, np.float32).reshape(shape),
                   np.asarray([0 if ki is None else min(int(ki), 2**31 - 1) for ki in k], np.int32).reshape(shape),
                   np.asarray([1.0 if pi is None else pi for pi in p], np.float32).reshape(shape))

    @property
    def greedy(self) -> bool:
        """Every sequence greedy (host values only): the loop then skips the sampling work."""
        return not np.any(np.asarray(self.temperature))


def per_row(v, batch: int | None, name: str) -> list:
    """``v`` as a list of ``batch`` values (one value repeated; a list checked for its length)."""
    if isinstance(v, (list, tuple, np.ndarray)):
        if batch is None or len(v) != batch:
            raise ValueError(f"{name} as a list gives one value per prompt: {batch or 1} expected, got {len(v)}")
        return [x.item() if isinstance(x, np.generic) else x for x in v]
    return [v] * (batch or 1)


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


def _rows(a: jax.Array, x: jax.Array) -> jax.Array:
    """A per-row setting ``[B]`` (or scalar) shaped to broadcast against ``x [B, ..., V]``."""
    a = jnp.asarray(a)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim)) if a.ndim else a


def probabilities(logits: jax.Array, s: Sampling) -> jax.Array:
    """The processed distribution ``[..., V]`` (float32): temperature, then top-k, then top-p, per row.
    The logits are shifted to a maximum of 0 before the division, and the temperature is at least
    float32's smallest normal number, so that a tiny (or zero) temperature tends to greedy instead of
    NaN. Top-k keeps every token tied with the k-th largest value (more than k where there are ties).
    One sort serves both cuts (the settings are traced, so neither can be skipped at compile time)."""
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    t, k, p = _rows(s.temperature, x), _rows(s.top_k, x), _rows(s.top_p, x)
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.maximum(t, jnp.finfo(jnp.float32).tiny)
    desc = jnp.sort(x, axis=-1)[..., ::-1]
    k = jnp.broadcast_to(jnp.where(k > 0, jnp.minimum(k, v), v), x.shape[:-1] + (1,))
    kth = jnp.take_along_axis(desc, k - 1, axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    e = jnp.exp(x)  # the maximum is already 0 (top-k keeps it): softmax without a second max
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / total
    sorted_p = jnp.exp(jnp.where(desc < kth, -jnp.inf, desc)) / total  # probs in descending order
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
    # keep the smallest prefix whose mass reaches top_p: entries whose preceding mass < top_p, and
    # always the most probable one (a top_p below float32's smallest normal would keep nothing)
    keep = (before < p) | (jnp.arange(v) == 0)
    cutoff = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1, keepdims=True)
    nucleus = jnp.where(probs >= cutoff, probs, 0.0)
    return jnp.where(p < 1, nucleus / jnp.sum(nucleus, axis=-1, keepdims=True), probs)


def choose(logits: jax.Array, s: Sampling, key: jax.Array, stochastic: bool) -> tuple[jax.Array, jax.Array | None]:
    """``(tokens [...], processed probs or None)`` from ``logits [..., V]``: the argmax unless
    ``stochastic`` (static), else a draw from :func:`probabilities` (rows at temperature 0: the argmax)."""
    if not stochastic:
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
