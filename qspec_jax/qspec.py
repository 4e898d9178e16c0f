"""The QSPEC round (DESIGN.md §1) and the decode loop that repeats it: one ``lax.while_loop``.

Per round, for every running sequence with ``n`` committed tokens:
1. draft ``gamma`` tokens in the draft mode (W4A4 or W4A8), one position at a time from ``n-1``,
   each step writing its (draft-precision) KV slot (with ``Runtime.draft_kv``: the drafts attend
   over the INT8 / INT4 shadow of the cache, and write only it);
2. verify ``[x[n-1], d_1..d_gamma]`` in one W4A16 forward, overwriting those ``gamma+1`` slots
   (and their shadow);
3. accept the longest agreeing prefix (greedy) or run speculative sampling (stochastic);
4. commit the accepted drafts plus one target token (1..gamma+1 tokens).
Afterwards slots ``0..n'-2`` hold W4A16 values again (quantized ones in the shadow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax.decode import DecodeState, Runtime, commit, last_tokens
from qspec_jax.sampling import accept_greedy, accept_stochastic, choose

TARGET_MODE = "w4a16"


def draft(params, state: DecodeState, rt: Runtime, gamma: int, mode: str, key: jax.Array):
    """``gamma`` draft steps: ``(drafts int32[B, gamma], draft probs [B, gamma, V] or None, cache)``."""
    b = state.lengths.shape[0]
    stochastic = not rt.sampling.greedy
    v = rt.config.vocab_size
    init = (last_tokens(state)[:, 0], state.cache, jnp.zeros((b, gamma), jnp.int32),
            jnp.zeros((b, gamma, v) if stochastic else (0,), jnp.float32))

    def step(i, carry):
        tok, cache, drafts, qs = carry
        logits, cache = rt.run(params, tok[:, None], (state.lengths - 1 + i)[:, None], cache, mode,
                               read_shadow=rt.draft_kv is not None)
        nxt, q = choose(logits[:, 0], rt.sampling, jax.random.fold_in(key, i))
        drafts = drafts.at[:, i].set(nxt)
        if stochastic:
            qs = qs.at[:, i].set(q)
        return nxt, cache, drafts, qs

    _, cache, drafts, qs = jax.lax.fori_loop(0, gamma, step, init)
    return drafts, (qs if stochastic else None), cache


def qspec_round(params, state: DecodeState, rt: Runtime, gamma: int, draft_mode: str,
                replay: jax.Array | None = None) -> DecodeState:
    """One draft / verify / accept / commit round for the whole batch (finished rows commit nothing).

    ``replay`` (benchmarks only, greedy): ``int32[R, C]`` accepted-draft counts recorded on real
    weights; round ``r`` of sequence ``b`` accepts ``replay[r % R, b % C]`` drafts instead of
    comparing tokens. Every draft step and the verify pass still run."""
    key, k_draft, k_accept = jax.random.split(state.key, 3)
    drafts, qs, cache = draft(params, state, rt, gamma, draft_mode, k_draft)
    verify_tokens = jnp.concatenate([last_tokens(state), drafts], axis=1)
    positions = state.lengths[:, None] - 1 + jnp.arange(gamma + 1)[None, :]
    logits, cache = rt.run(params, verify_tokens, positions, cache, TARGET_MODE)
    if replay is not None:
        row = replay[state.rounds % replay.shape[0], jnp.arange(drafts.shape[0]) % replay.shape[1]]
        accepted = jnp.clip(row, 0, gamma).astype(jnp.int32)
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        extra = jnp.take_along_axis(target, accepted[:, None], axis=-1)[:, 0]
    elif rt.sampling.greedy:
        accepted, extra = accept_greedy(drafts, logits)
    else:
        accepted, extra = accept_stochastic(drafts, qs, logits, rt.sampling, k_accept)
    j = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    cand = jnp.where(j < accepted[:, None], padded, extra[:, None])
    running = (~state.done).astype(jnp.int32)
    state = dataclasses.replace(state, cache=cache, key=key, rounds=state.rounds + running,
                                drafted=state.drafted + gamma * running)
    state, count = commit(state, cand, accepted + 1, rt)
    return dataclasses.replace(state, accepted=state.accepted + jnp.minimum(accepted, count))


@functools.partial(jax.jit, static_argnames=("rt", "gamma", "draft_mode"), donate_argnames=("state",))
def qspec_loop(params, state: DecodeState, *, rt: Runtime, gamma: int, draft_mode: str,
               replay: jax.Array | None = None) -> DecodeState:
    """QSPEC decoding until every sequence is done: one ``lax.while_loop``, one round per iteration
    (``replay``: see :func:`qspec_round`)."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                              lambda s: qspec_round(params, s, rt, gamma, draft_mode, replay), state)


def acceptance_trace(params, state: DecodeState, *, rt: Runtime, gamma: int, draft_mode: str) -> np.ndarray:
    """Greedy QSPEC round by round from the host, recording ``int32[rounds, B]``: the drafts each
    sequence accepted in each round, -1 once it is done. The input to :func:`qspec_round`'s
    ``replay``, e.g. recorded on real weights and replayed on random ones."""
    step = jax.jit(functools.partial(qspec_round, rt=rt, gamma=gamma, draft_mode=draft_mode))
    rows = []
    while not bool(jnp.all(state.done)):
        before, done = state.accepted, state.done
        state = step(params, state)
        rows.append(np.where(np.asarray(done), -1, np.asarray(state.accepted - before)))
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, state.lengths.shape[0]), np.int32)
