"""Quality metrics: perplexity over token windows, and teacher-forced top-1 agreement."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.precision import Precision
from qspec_jax.config import LlamaConfig
from qspec_jax.kernels import Execution
from qspec_jax.model import forward
from qspec_jax.sampling import check_token_ids, is_integer


@functools.partial(jax.jit, static_argnames=("config", "precision", "dtype", "online_rotation_seed", "execution"))
def _scores(params, tokens, *, config: LlamaConfig, precision: Precision, dtype: Any,
            online_rotation_seed: int | None, execution: Execution):
    """Per-position ``(log p(next token), argmax)`` of ``tokens[B, T]`` in one precision."""
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = forward(params, config, tokens, pos, precision=precision, dtype=dtype,
                        online_rotation_seed=online_rotation_seed, execution=execution)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def token_scores(params, config: LlamaConfig, tokens: np.ndarray, *, precision: Precision, dtype: Any = jnp.float32,
                 online_rotation_seed: int | None = None, kernels: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """``(nll[B, T-1], argmax[B, T])`` of full-sequence (teacher-forced) forwards; ``kernels``: see
    :mod:`qspec_jax.kernels` (prefill-like forwards, no row tile)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] < 1 or not 2 <= tokens.shape[1] <= config.max_position_embeddings:
        raise ValueError(f"tokens must be [B, T] with B >= 1 and 2 <= T <= {config.max_position_embeddings} "
                         f"(the model's positions), got shape {tokens.shape}")
    check_token_ids(tokens, config.vocab_size)
    nll, top = _scores(params, jnp.asarray(tokens, jnp.int32), config=config, precision=precision, dtype=dtype,
                       online_rotation_seed=online_rotation_seed, execution=Execution.prefill(kernels))
    return np.asarray(nll), np.asarray(top)


def perplexity(params, config: LlamaConfig, ids: np.ndarray, *, window: int, precision: Precision, batch: int = 4,
               dtype: Any = jnp.float32, online_rotation_seed: int | None = None, kernels: str = "auto") -> float:
    """Perplexity of ``ids`` cut into non-overlapping windows of ``window`` tokens (a trailing
    partial window is dropped); each window is scored from its own start, predicting tokens 2..window."""
    if not is_integer(window) or not 2 <= window <= config.max_position_embeddings:
        raise ValueError(f"window must be an integer in [2, {config.max_position_embeddings}], got {window!r}")
    if not is_integer(batch) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids must be a 1-D sequence of token ids, got shape {ids.shape}")
    check_token_ids(ids, config.vocab_size)
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"need at least {window} tokens for one window, got {len(ids)}")
    windows = np.asarray(ids[: n * window], np.int32).reshape(n, window)
    total = []
    for i in range(0, n, batch):
        nll, _ = token_scores(params, config, windows[i:i + batch], precision=precision, dtype=dtype,
                              online_rotation_seed=online_rotation_seed, kernels=kernels)
        total.append(nll.reshape(-1))
    return float(np.exp(np.concatenate(total).astype(np.float64).mean()))


def simulate_rounds(agree: np.ndarray, gamma: int) -> int:
    """QSPEC rounds needed to commit a teacher-forced sequence of ``len(agree)`` tokens.

    ``agree[i]`` says whether the draft's top-1 equals the target's at position ``i``. A round
    starting at ``i`` accepts the run of agreeing positions (at most ``gamma``) and commits it plus
    one target token, so the next round starts ``accepted + 1`` positions later.
    """
    i, rounds, n = 0, 0, len(agree)
    while i < n:
        a = 0
        while a < gamma and i + a < n and agree[i + a]:
            a += 1
        i += a + 1
        rounds += 1
    return rounds
