"""The functional core: pure, jittable ``init_state`` / ``prefill`` / ``decode`` over a :class:`DecodeState`.

:func:`qspec_jax.generate` is a host wrapper over these; call them to run decoding inside your own
``jax.jit``, ``vmap`` it over settings, or step it a few rounds at a time::

    dec = Decoder(Runtime(model.config, eos_ids=(2,)), gamma=3)        # static: QSPEC, W4A8 drafts, γ = 3
    state = init_state(dec, prompts, prompt_lengths, key, max_new_tokens=budgets,
                       buffer_len=buffer_length(prompts.shape[1], 256))
    state = decode(params, dec, prefill(params, dec, state))           # state.tokens, state.lengths: the output

Everything static (model config, method, γ, dtype, draft views, whether to sample) is in the hashable
:class:`Decoder`; per-sequence budgets and sampling settings are arrays in the state, so new values
reuse the compiled code.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.precision import W4A8, W4A16, W16A16, Precision
from qspec_jax.decode import (MAX_GAMMA, DecodeState, Runtime, ar_loop, buffer_length, cache_slots,
                              init_state as _init_state, prefill as _prefill)
from qspec_jax.gamma import CostModel
from qspec_jax.qspec import qspec_auto_loop, qspec_loop
from qspec_jax import sharding
from qspec_jax.sampling import Sampling

__all__ = ["AUTO_GAMMA_MAX", "DecodeState", "Decoder", "Runtime", "buffer_length", "cache_slots", "decode",
           "decode_jit", "init_state", "prefill", "prefill_jit"]

AUTO_GAMMA_MAX = 4  # gamma=None (auto) picks each round's gamma in 0..AUTO_GAMMA_MAX


@dataclasses.dataclass(frozen=True)
class Decoder:
    """How to decode (hashable: the static part of the compiled functions). ``method``: an
    autoregressive precision, or None for QSPEC with ``draft`` drafts, ``gamma`` per round (None: chosen
    each round from ``costs``, :mod:`qspec_jax.gamma`, in ``0..AUTO_GAMMA_MAX``). ``tensor_parallel``:
    shards over the first that many devices (:mod:`qspec_jax.sharding`; params from
    :func:`~qspec_jax.sharding.shard_params`)."""

    runtime: Runtime
    method: Precision | None = None
    draft: Precision = W4A8
    gamma: int | None = None
    costs: CostModel | None = None
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.method is None:
            if self.gamma is None and self.costs is None:
                raise ValueError("gamma=None chooses each round's gamma from a cost model: give costs "
                                 "(qspec_jax.gamma.cost_model) or an integer gamma")
            if self.gamma is not None and not 1 <= self.gamma <= MAX_GAMMA:
                raise ValueError(f"gamma must be in [1, {MAX_GAMMA}] or None, got {self.gamma!r}")
        sharding.check(self.runtime.config, self.tensor_parallel, self.runtime.online_rotation_seed)


def init_state(decoder: Decoder, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array, *,
               max_new_tokens, buffer_len: int, temperature=0.0, top_k=0, top_p=1.0,
               cache_len: int | None = None) -> DecodeState:
    """A state for right-padded ``prompts int32[B, P]`` (``prompt_lengths int32[B]``), nothing decoded.
    ``max_new_tokens``, ``temperature``, ``top_k`` (0: none), ``top_p`` (1: none): per sequence ``[B]`` or
    one value, traced. ``buffer_len`` (static) must hold ``P + max(max_new_tokens)`` plus a round's
    drafts: :func:`buffer_length`. A temperature > 0 needs ``decoder.runtime.stochastic``."""
    return _init_state(decoder.runtime, prompts, prompt_lengths, key, max_new_tokens,
                       Sampling(temperature, top_k, top_p), buffer_len, cache_len)


def prefill(params, decoder: Decoder, state: DecodeState) -> DecodeState:
    """The prompts through the model (W4A16; W16A16 for that method), the KV cache filled and each
    sequence's first token committed."""
    precision = W16A16 if decoder.method == W16A16 else W4A16
    if decoder.tensor_parallel > 1:
        rt = sharding.local_runtime(decoder.runtime, decoder.tensor_parallel)
        return sharding.run_sharded(lambda p, s: _prefill(p, s, rt, precision), decoder.tensor_parallel, params, state)
    return _prefill(params, state, decoder.runtime, precision)


def decode(params, decoder: Decoder, state: DecodeState, rounds: jax.Array | None = None) -> DecodeState:
    """Rounds (QSPEC) or steps (autoregressive) until every sequence is done, or at most ``rounds``
    (traced int32) of them: one ``lax.while_loop``. A state it returns can be decoded further."""
    tp = decoder.tensor_parallel
    if tp > 1:
        one = dataclasses.replace(decoder, runtime=sharding.local_runtime(decoder.runtime, tp), tensor_parallel=1)
        if rounds is None:
            return sharding.run_sharded(lambda p, s: decode(p, one, s), tp, params, state)
        return sharding.run_sharded(lambda p, s, r: decode(p, one, s, r), tp, params, state, rounds)
    rt = decoder.runtime
    if decoder.method is not None:
        return ar_loop(params, state, rounds, rt, decoder.method)
    if decoder.gamma is None:
        return qspec_auto_loop(params, state, rounds, rt, AUTO_GAMMA_MAX, decoder.draft, decoder.costs)
    return qspec_loop(params, state, rounds, rt, decoder.gamma, decoder.draft)


# compiled once per decoder and shapes; the state is donated (its buffers reused in place)
prefill_jit = jax.jit(prefill, static_argnames=("decoder",), donate_argnames=("state",))
decode_jit = jax.jit(decode, static_argnames=("decoder",), donate_argnames=("state",))
