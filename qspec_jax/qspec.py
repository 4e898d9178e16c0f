"""The QSPEC round (docs/design.md §1) and the decode loop that repeats it: one ``lax.while_loop``.

Per round, for every running sequence with ``n`` committed tokens:
1. draft ``gamma`` tokens in the draft precision (W4A4 or W4A8), one position at a time from
   ``n-1``, each step writing its (draft-precision) KV slot (with ``Runtime.draft_kv``: the drafts
   attend over the INT8 / INT4 shadow of the cache, and write only it; with ``Runtime.draft_window``
   they attend over its first slots and a sliding window only);
2. verify ``[x[n-1], d_1..d_gamma]`` in one W4A16 forward, overwriting those ``gamma+1`` slots
   (and their shadow);
3. accept the longest agreeing prefix (greedy) or run speculative sampling (stochastic);
4. commit the accepted drafts plus one target token (1..gamma+1 tokens).
Afterwards slots ``0..n'-2`` hold W4A16 values again (quantized ones in the shadow).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.precision import W4A16, Precision
from qspec_jax.decode import DecodeState, Runtime, ar_loop, commit, last_tokens, run_loop, token_logprobs
from qspec_jax.gamma import CostModel, choose_gamma, drafting_can_pay
from qspec_jax.sampling import accept_greedy, accept_stochastic, choose

TARGET = W4A16  # the verifier's precision
# (drafts [B, g], draft probs [B, g, V] or None, target logits [B, g+1, V], state, key) -> (accepted [B], next [B])
Accept = Callable[[jax.Array, jax.Array | None, jax.Array, DecodeState, jax.Array], tuple[jax.Array, jax.Array]]


def draft_tokens(params, state: DecodeState, rt: Runtime, gamma: int, precision: Precision, key: jax.Array):
    """``gamma`` draft steps: ``(drafts int32[B, gamma], draft probs [B, gamma, V] or None, cache)``."""
    b = state.lengths.shape[0]
    stochastic = rt.stochastic
    v = rt.config.vocab_size
    init = (last_tokens(state)[:, 0], state.cache, jnp.zeros((b, gamma), jnp.int32),
            jnp.zeros((b, gamma, v) if stochastic else (0,), jnp.float32))

    def step(i, carry):
        tok, cache, drafts, qs = carry
        logits, cache = rt.run(params, tok[:, None], (state.lengths - 1 + i)[:, None], cache, precision, draft=True)
        nxt, q = choose(logits[:, 0], state.sampling, jax.random.fold_in(key, i), stochastic)
        drafts = drafts.at[:, i].set(nxt)
        if stochastic:
            qs = qs.at[:, i].set(q)
        return nxt, cache, drafts, qs

    _, cache, drafts, qs = jax.lax.fori_loop(0, gamma, step, init)
    return drafts, (qs if stochastic else None), cache


def accept_rule(rt: Runtime) -> Accept:
    """The longest agreeing prefix (greedy), else (``rt.stochastic``) speculative sampling, which for a
    sequence at temperature 0 accepts exactly the drafts equal to the target's argmax."""
    if not rt.stochastic:
        return lambda drafts, qs, logits, state, key: accept_greedy(drafts, logits)
    return lambda drafts, qs, logits, state, key: accept_stochastic(drafts, qs, logits, state.sampling, key)


def qspec_round(params, state: DecodeState, rt: Runtime, gamma: int, draft: Precision,
                accept: Accept | None = None) -> DecodeState:
    """One draft / verify / accept / commit round for the whole batch (finished rows commit nothing).
    ``accept`` (None: :func:`accept_rule`) decides how many drafts each sequence keeps and its next
    token; every draft step and the verify pass run whatever it decides."""
    key, k_draft, k_accept = jax.random.split(state.key, 3)
    drafts, qs, cache = draft_tokens(params, state, rt, gamma, draft, k_draft)
    verify_tokens = jnp.concatenate([last_tokens(state), drafts], axis=1)
    positions = state.lengths[:, None] - 1 + jnp.arange(gamma + 1)[None, :]
    logits, cache = rt.run(params, verify_tokens, positions, cache, TARGET)
    accepted, extra = (accept_rule(rt) if accept is None else accept)(drafts, qs, logits, state, k_accept)
    j = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    cand = jnp.where(j < accepted[:, None], padded, extra[:, None])
    running = (~state.done).astype(jnp.int32)
    state = dataclasses.replace(state, cache=cache, key=key, rounds=state.rounds + running,
                                drafted=state.drafted + gamma * running)
    state, count = commit(state, cand, accepted + 1, rt, token_logprobs(logits, cand, rt))
    return dataclasses.replace(state, accepted=state.accepted + jnp.minimum(accepted, count))


def qspec_loop(params, state: DecodeState, rounds: jax.Array | None, rt: Runtime, gamma: int,
               draft: Precision, accept: Accept | None = None) -> DecodeState:
    """QSPEC decoding until every sequence is done (or for ``rounds`` rounds): one ``lax.while_loop``,
    one round per iteration (``accept`` as in :func:`qspec_round`)."""
    return run_loop(lambda s: qspec_round(params, s, rt, gamma, draft, accept), state, rounds)


def auto_round(params, state: DecodeState, rt: Runtime, gamma_max: int, draft: Precision, costs: CostModel,
               accept: Accept | None = None) -> DecodeState:
    """One round with γ chosen by :func:`qspec_jax.gamma.choose_gamma`: ``gamma_max + 1`` W4A16 steps
    (γ = 0; as many tokens as the longest round commits, so the choice and its switch are paid once for
    them) or a :func:`qspec_round` of 1..``gamma_max`` drafts (``accept`` as there), through ``lax.switch``."""
    branches = [lambda s: ar_loop(params, s, jnp.int32(gamma_max + 1), rt, TARGET)] + [
        functools.partial(lambda s, g: qspec_round(params, s, rt, g, draft, accept), g=g)
        for g in range(1, gamma_max + 1)]
    g = choose_gamma(costs, gamma_max, state.accepted, state.drafted, state.lengths, ~state.done)
    return jax.lax.switch(g, branches, state)


def qspec_auto_loop(params, state: DecodeState, rounds: jax.Array | None, rt: Runtime, gamma_max: int,
                    draft: Precision, costs: CostModel, accept: Accept | None = None) -> DecodeState:
    """QSPEC decoding with γ chosen every round: one ``lax.while_loop`` of :func:`auto_round`. Where
    drafting could gain at most :data:`~qspec_jax.gamma.MIN_GAIN` over W4A16 steps at the state's batch
    and buffer length (drafts that read as many bytes as a W4A16 step gain nothing), it is the W4A16
    loop itself (γ = 0 every round, without a switch and a cost evaluation per step)."""
    if not drafting_can_pay(costs.best_gain(gamma_max, state.lengths.shape[0], state.tokens.shape[1])):
        return ar_loop(params, state, rounds, rt, TARGET)
    return run_loop(lambda s: auto_round(params, s, rt, gamma_max, draft, costs, accept), state, rounds)
