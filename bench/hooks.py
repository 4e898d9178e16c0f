"""Benchmark hooks on the decoding core: accept decisions replayed from a recorded trace, the trace's
recording, and per-layer params for plain-XLA baselines. Nothing here changes what ``generate`` does."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.precision import Precision
from qspec_jax.decode import DecodeState, Runtime
from qspec_jax.gamma import CostModel
from qspec_jax.qspec import Accept, qspec_auto_loop, qspec_loop, qspec_round


def replay_accept(trace: jax.Array) -> Accept:
    """An accept rule for :func:`qspec_jax.qspec.qspec_round` (greedy): ``trace int32[R, C]`` holds
    accepted-draft counts recorded on real weights; round ``r`` of sequence ``b`` accepts
    ``trace[r % R, b % C]`` drafts (clipped to ``[0, gamma]``) instead of comparing tokens, then the
    target's argmax at that position."""

    def accept(drafts, draft_probs, logits, state: DecodeState, key):
        row = trace[state.rounds % trace.shape[0], jnp.arange(drafts.shape[0]) % trace.shape[1]]
        accepted = jnp.clip(row, 0, drafts.shape[1]).astype(jnp.int32)
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return accepted, jnp.take_along_axis(target, accepted[:, None], axis=-1)[:, 0]

    return accept


@functools.partial(jax.jit, static_argnames=("rt", "gamma", "draft"), donate_argnames=("state",))
def replay_loop(params, state: DecodeState, trace: jax.Array, *, rt: Runtime, gamma: int,
                draft: Precision) -> DecodeState:
    """:func:`qspec_jax.qspec.qspec_loop` with :func:`replay_accept`'s decisions (``trace`` traced)."""
    return qspec_loop(params, state, None, rt, gamma, draft, replay_accept(trace))


@functools.partial(jax.jit, static_argnames=("rt", "gamma_max", "draft", "costs"), donate_argnames=("state",))
def replay_auto_loop(params, state: DecodeState, trace: jax.Array, *, rt: Runtime, gamma_max: int,
                     draft: Precision, costs: CostModel) -> DecodeState:
    """:func:`qspec_jax.qspec.qspec_auto_loop` with :func:`replay_accept`'s decisions: ``trace`` recorded
    at a gamma >= ``gamma_max``, clipped to each round's gamma (greedy drafts do not depend on gamma,
    so a round of gamma g keeps min(accepted, g) of the same drafts)."""
    return qspec_auto_loop(params, state, None, rt, gamma_max, draft, costs, replay_accept(trace))


def acceptance_trace(params, state: DecodeState, *, rt: Runtime, gamma: int, draft: Precision) -> np.ndarray:
    """Greedy QSPEC round by round from the host, recording ``int32[rounds, B]``: the drafts each
    sequence accepted in each round, -1 once it is done. The input to :func:`replay_accept`, e.g.
    recorded on real weights and replayed on random ones."""
    step = jax.jit(functools.partial(qspec_round, rt=rt, gamma=gamma, draft=draft))
    rows = []
    while not bool(jnp.all(state.done)):
        before, done = state.accepted, state.done
        state = step(params, state)
        rows.append(np.where(np.asarray(done), -1, np.asarray(state.accepted - before)))
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, state.lengths.shape[0]), np.int32)


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with its stacked ``layers`` split into a list of per-layer trees, which
    :class:`qspec_jax.model.Llama` runs as an unrolled loop. For plain-XLA runs (the W16A16 benchmark
    baseline): XLA hands a library dot a layer sliced out of a stack only after copying it, which the
    kernels avoid by reading the stack in place. Longer compiles; the same math (XLA may fuse it
    differently)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        raise ValueError("params['layers'] is already a list of per-layer trees")
    n = jax.tree.leaves(layers)[0].shape[0]
    per = [jax.tree.map(lambda a: a[i], layers) for i in range(n)]
    return {**params, "layers": per}
