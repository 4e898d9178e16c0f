"""The decode state and the autoregressive baseline loop, both pure functions under ``jax.jit``.

The state is a plain pytree. Invariant at every loop iteration (docs/design.md §1): sequence ``b`` has
committed ``lengths[b]`` tokens ``tokens[b, :lengths[b]]``; the KV cache holds target (W4A16)
keys/values for positions ``0 .. lengths[b]-2``; the last committed token has no valid KV yet.
Slots beyond are stale; attention masks them by position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.precision import Precision
from pallas_kernels.reference import AttentionWindow
from qspec_jax.config import LlamaConfig
from qspec_jax.kernels import Execution
from qspec_jax.model import KVCache, forward, init_cache, sync_shadow
from qspec_jax.sampling import Sampling, choose

RUNNING, STOP, LENGTH = 0, 1, 2
FINISH_REASONS = {STOP: "stop", LENGTH: "length"}
# Drafts per round at most: the expected accepted run is a / (1 - a) at acceptance a (4 at 0.8, 32 at
# 0.97), so more only adds rejected work, while every draft slot lengthens the cache and the verify
MAX_GAMMA = 32
CACHE_MULTIPLE = 64  # KV cache slots are allocated in multiples of this (the attention kernel's block)
# Slots past prompt + new tokens, the same for every method and gamma: a QSPEC round drafts up to gamma
# positions past the budget. The GPU attention kernel's split of the cache follows its length, so a
# cache sized by gamma could make W4A16 and QSPEC sum a token's attention in different orders.
CACHE_SLACK = MAX_GAMMA + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a decode loop carries: a pytree of arrays whose shapes are fixed by the batch, the
    prompt width and the buffer length, so new settings and budgets reuse the compiled loop."""

    tokens: jax.Array         # int32[B, L] prompt + committed tokens (slots past lengths are scratch)
    lengths: jax.Array        # int32[B] committed tokens (prompt included)
    prompt_lengths: jax.Array  # int32[B]
    budget: jax.Array         # int32[B] new tokens each sequence may commit (its max_new_tokens)
    sampling: Sampling        # per-sequence temperature / top-k / top-p
    finish: jax.Array         # int32[B] RUNNING / STOP / LENGTH
    cache: KVCache            # k, v [L, B, S, KV, hd], and the draft's KV shadow if Runtime.draft_kv
    key: jax.Array            # PRNG key
    rounds: jax.Array         # int32[B] loop iterations in which the sequence was running
    drafted: jax.Array        # int32[B] draft tokens proposed
    accepted: jax.Array       # int32[B] draft tokens accepted and committed
    # float32[B, L]: the log-probability of each committed token under the logits that chose it (the
    # verifier's for QSPEC); None unless Runtime.logprobs
    logprobs: jax.Array | None
    prompt_width: int = dataclasses.field(metadata=dict(static=True))  # tokens[:, :prompt_width]: the prefill's input

    @property
    def done(self) -> jax.Array:
        return self.finish != RUNNING


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Static settings of a decode loop (hashable: part of the jit cache key)."""

    config: LlamaConfig
    eos_ids: tuple[int, ...] = ()  # a sequence stops after any of these (none: only at its budget)
    stochastic: bool = False  # sample (DecodeState.sampling); False: every sequence greedy, no sampling work
    dtype: Any = jnp.float32
    online_rotation_seed: int | None = None
    # how decode-time forwards run (the prefill drops the row tile); one without a row tile makes the
    # decode steps plain XLA, not row-count invariant (benchmark baselines)
    execution: Execution = dataclasses.field(default_factory=Execution.decode)
    draft_kv: int | None = None  # 8 / 4: QSPEC's drafts read an INT8 / INT4 shadow of the KV cache
    draft_window: AttentionWindow | None = None  # QSPEC's drafts attend over sinks + a sliding window only
    draft_head: bool = False  # QSPEC's drafts read the params' draft head (model.with_draft_head), not the lm_head
    logprobs: bool = False  # record each committed token's log-probability (DecodeState.logprobs)
    tp_axis: str | None = None  # forwards run as one shard of this mesh axis (config: the shard's; qspec_jax.sharding)

    def run(self, params, tokens, positions, cache, precision: Precision, execution: Execution | None = None,
            draft: bool = False, logits_at: jax.Array | None = None):
        """One forward (``execution`` None: the decode-time one); a ``draft`` reads the draft's views
        of the cache (``draft_kv``, ``draft_window``) and head (``draft_head``); ``logits_at``: only those
        positions' logits (:func:`~qspec_jax.model.forward`). Unless it is a draft reading the shadow, the
        shadow follows the new slots."""
        read_shadow = draft and self.draft_kv is not None
        logits, cache = forward(params, self.config, tokens, positions, cache, precision=precision, dtype=self.dtype,
                                online_rotation_seed=self.online_rotation_seed,
                                execution=self.execution if execution is None else execution,
                                read_shadow=read_shadow, window=self.draft_window if draft else None,
                                draft_head=draft and self.draft_head, tp_axis=self.tp_axis, logits_at=logits_at)
        return logits, cache if read_shadow else sync_shadow(cache, positions)


def token_logprobs(logits: jax.Array, tokens: jax.Array, rt: Runtime) -> jax.Array | None:
    """``float32[...]``: log-softmax of ``logits [..., V]`` at ``tokens [...]`` (None unless ``rt.logprobs``)."""
    if not rt.logprobs:
        return None
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def commit(state: DecodeState, cand: jax.Array, n_new: jax.Array, rt: Runtime,
           cand_logprobs: jax.Array | None = None) -> tuple[DecodeState, jax.Array]:
    """Append up to ``n_new[b]`` tokens of ``cand[b]`` (and, with ``rt.logprobs``, their
    ``cand_logprobs``) to each running sequence, stopping after an EOS and at its budget.
    Returns the new state and the number committed per sequence."""
    b, w = cand.shape
    j = jnp.arange(w)[None, :]
    generated = state.lengths - state.prompt_lengths
    room = jnp.minimum(n_new, state.budget - generated)
    is_eos = (jnp.isin(cand, jnp.asarray(rt.eos_ids, cand.dtype)) if rt.eos_ids else jnp.zeros(cand.shape, bool)
              ) & (j < room[:, None])
    has_eos = jnp.any(is_eos, axis=-1)
    upto = jnp.where(has_eos, jnp.argmax(is_eos, axis=-1) + 1, room)
    count = jnp.where(state.done, 0, upto).astype(jnp.int32)
    cols = jnp.where(j < count[:, None], state.lengths[:, None] + j, state.tokens.shape[1])  # drop others
    tokens = state.tokens.at[jnp.arange(b)[:, None], cols].set(cand, mode="drop")
    logprobs = state.logprobs
    if rt.logprobs:
        logprobs = logprobs.at[jnp.arange(b)[:, None], cols].set(cand_logprobs, mode="drop")
    lengths = state.lengths + count
    stopped = ~state.done & has_eos
    full = ~state.done & ~has_eos & (lengths - state.prompt_lengths >= state.budget)
    finish = jnp.where(stopped, STOP, jnp.where(full, LENGTH, state.finish))
    return dataclasses.replace(state, tokens=tokens, lengths=lengths, finish=finish, logprobs=logprobs), count


def buffer_length(prompt_width: int, max_new_tokens: int) -> int:
    """Token slots for prompts ``prompt_width`` wide and up to ``max_new_tokens`` new tokens, with room
    for a QSPEC round of up to :data:`MAX_GAMMA` drafts past the budget."""
    return prompt_width + max_new_tokens + CACHE_SLACK


def cache_slots(buffer_len: int) -> int:
    """KV cache slots for ``buffer_len`` tokens: rounded up to whole :data:`CACHE_MULTIPLE` blocks."""
    return -(-buffer_len // CACHE_MULTIPLE) * CACHE_MULTIPLE


def init_state(rt: Runtime, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array, budget: jax.Array,
               sampling: Sampling, buffer_len: int, cache_len: int | None = None) -> DecodeState:
    """A state holding right-padded ``prompts [B, P]`` of ``prompt_lengths`` tokens, an empty KV cache
    of ``cache_len`` slots (None: :func:`cache_slots` of ``buffer_len``), nothing committed yet, and
    each sequence's ``budget`` (int32, [B] or scalar) and ``sampling``."""
    b, p = prompts.shape
    cache_len = cache_slots(buffer_len) if cache_len is None else cache_len
    zeros = lambda: jnp.zeros((b,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
    return DecodeState(
        tokens=jnp.zeros((b, buffer_len), jnp.int32).at[:, :p].set(prompts),
        lengths=jnp.array(prompt_lengths, jnp.int32), prompt_lengths=jnp.array(prompt_lengths, jnp.int32),
        budget=jnp.array(jnp.broadcast_to(budget, (b,)), jnp.int32),
        sampling=Sampling(*(jnp.array(jnp.broadcast_to(a, (b,)), dt) for a, dt in (
            (sampling.temperature, jnp.float32), (sampling.top_k, jnp.int32), (sampling.top_p, jnp.float32)))),
        finish=zeros(), cache=init_cache(rt.config, b, cache_len, rt.dtype, rt.draft_kv), key=key,
        rounds=zeros(), drafted=zeros(), accepted=zeros(),
        logprobs=jnp.zeros((b, buffer_len), jnp.float32) if rt.logprobs else None, prompt_width=p)


def prefill(params, state: DecodeState, rt: Runtime, precision: Precision) -> DecodeState:
    """Run the prompts of a fresh :func:`init_state` through the model in ``precision`` (filling the KV
    cache) and commit each sequence's first token."""
    b, p = state.tokens.shape[0], state.prompt_width
    logits, cache = rt.run(params, state.tokens[:, :p], jnp.broadcast_to(jnp.arange(p), (b, p)), state.cache,
                           precision, execution=rt.execution.for_prompt(), logits_at=(state.prompt_lengths - 1)[:, None])
    key, sub = jax.random.split(state.key)
    last = logits[:, 0]
    first, _ = choose(last, state.sampling, sub, rt.stochastic)
    state = dataclasses.replace(state, cache=cache, key=key)
    logp = token_logprobs(last[:, None], first[:, None], rt)
    return commit(state, first[:, None], jnp.ones((b,), jnp.int32), rt, logp)[0]


def last_tokens(state: DecodeState) -> jax.Array:
    """``int32[B, 1]``: each sequence's last committed token (the one without KV yet)."""
    return jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)


def ar_step(params, state: DecodeState, rt: Runtime, precision: Precision) -> DecodeState:
    """One autoregressive step: feed the last token, choose the next, commit it."""
    logits, cache = rt.run(params, last_tokens(state), (state.lengths - 1)[:, None], state.cache, precision)
    key, sub = jax.random.split(state.key)
    nxt, _ = choose(logits[:, 0], state.sampling, sub, rt.stochastic)
    running = (~state.done).astype(jnp.int32)
    state = dataclasses.replace(state, cache=cache, key=key, rounds=state.rounds + running)
    return commit(state, nxt[:, None], jnp.ones_like(state.lengths), rt, token_logprobs(logits, nxt[:, None], rt))[0]


def run_loop(body, state: DecodeState, rounds: jax.Array | None) -> DecodeState:
    """``body`` repeated in one ``lax.while_loop`` until every sequence is done, or (``rounds``, a traced
    int32) at most that many times: a run resumed from its result continues exactly where it stopped."""
    if rounds is None:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done) & (c[1] < rounds), lambda c: (body(c[0]), c[1] + 1),
                              (state, jnp.zeros((), jnp.int32)))[0]


def ar_loop(params, state: DecodeState, rounds: jax.Array | None, rt: Runtime, precision: Precision) -> DecodeState:
    """Autoregressive decoding in ``precision`` until every sequence is done (or for ``rounds`` steps)."""
    return run_loop(lambda s: ar_step(params, s, rt, precision), state, rounds)


def pad_prompts(prompts: list[list[int]], multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``(int32[B, P], lengths int32[B])``, P the longest prompt rounded up
    to ``multiple``; empty prompts raise."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    tokens = np.zeros((len(prompts), -(-int(lengths.max()) // multiple) * multiple), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths
