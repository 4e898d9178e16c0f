"""The functional core (init_state / prefill / decode) and the settings that are arrays, not constants:
per-sequence budgets and sampling, no recompilation across values, use inside a user's jit and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from pallas_kernels.precision import W4A8, W4A16
from qspec_jax.api import generate
from qspec_jax.core import Decoder, buffer_length, decode, decode_jit, init_state, prefill, prefill_jit
from qspec_jax.decode import Runtime, pad_prompts
from tests.conftest import TINY, memory_model, random_source


@pytest.fixture
def tiny(rng):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, bool(rng.integers(2))), None)
    return memory_model(params, cfg)


def _prompts(rng, n: int) -> list[list[int]]:
    return [rng.integers(0, TINY.vocab_size, int(k)).tolist() for k in rng.integers(2, 12, n)]


def test_settings_sweep_compiles_once_per_bucket(tiny, rng):
    """3 values each of max_new_tokens (one bucket), temperature and top_p: the first value of a bucket
    compiles the decode loop at most once, every further value reuses it. Greedy to sampling is a
    second bucket; a budget past NEW_TOKENS_MULTIPLE a third."""
    prompts = _prompts(rng, 5)  # batch 5: a shape no other test compiles
    kw = dict(method="qspec", gamma=2, eos_token_id=-1)

    def sweep(values):
        counts = []
        for v in values:
            generate(tiny, prompts, **kw, **v)
            counts.append((decode_jit._cache_size(), prefill_jit._cache_size()))
        return counts

    before = (decode_jit._cache_size(), prefill_jit._cache_size())
    greedy = sweep([dict(max_new_tokens=n) for n in (5, 9, 17)])
    assert greedy[0][0] <= before[0] + 1 and greedy[0][1] <= before[1] + 1
    assert greedy[1] == greedy[2] == greedy[0]
    sampled = sweep([dict(max_new_tokens=9, temperature=t, top_p=p, seed=int(rng.integers(2**31)))
                     for t, p in ((0.5, 0.8), (0.9, 0.9), (1.3, 0.95))])
    assert sampled[0][0] <= greedy[0][0] + 1 and sampled[1] == sampled[2] == sampled[0]
    longer = sweep([dict(max_new_tokens=70)])
    assert longer[0][0] == sampled[0][0] + 1


def test_per_sequence_budgets_and_temperatures(tiny, rng):
    """A list of max_new_tokens gives each prompt its own budget: each sequence equals its own greedy
    run; a temperature list with a 0 keeps that row greedy (bitwise its greedy tokens) while others sample."""
    prompts = _prompts(rng, 3)
    budgets = [int(n) for n in rng.integers(1, 12, 3)]
    got = generate(tiny, prompts, max_new_tokens=budgets, method="qspec", gamma=3, eos_token_id=-1)
    for p, n, seq in zip(prompts, budgets, got.sequences):
        want = generate(tiny, [p], max_new_tokens=n, method="w4a16", eos_token_id=-1).sequences[0]
        np.testing.assert_array_equal(seq, want)
    assert got.finish_reasons == ["length"] * 3
    greedy = generate(tiny, prompts, max_new_tokens=10, method="qspec", gamma=2, eos_token_id=-1)
    mixed = generate(tiny, prompts, max_new_tokens=10, method="qspec", gamma=2, eos_token_id=-1,
                     temperature=[0.0, 1.5, 1.5], top_k=[None, 20, None], seed=int(rng.integers(2**31)))
    np.testing.assert_array_equal(mixed.sequences[0], greedy.sequences[0])
    assert any(not np.array_equal(a, b) for a, b in zip(mixed.sequences[1:], greedy.sequences[1:]))


@pytest.mark.parametrize("bad,match", [
    (dict(max_new_tokens=[3, 4]), "one value per prompt: 3 expected, got 2"),
    (dict(max_new_tokens=[3, -1, 4]), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=[3, 2.5, 4]), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=4, temperature=[0.5, 1.0]), "temperature as a list"),
    (dict(max_new_tokens=4, temperature=[0.5, 0.0, 1.0], top_p=0.9), "temperature=0 decodes greedily"),
    (dict(max_new_tokens=4, temperature=[0.5, float("nan"), 1.0]), "finite number"),
    (dict(max_new_tokens=4, temperature=1.0, top_k=[1, 0, 2]), "top_k must be an integer >= 1"),
    (dict(max_new_tokens=[4, 4, 10**6]), "exceeds the cache length"),
])
def test_bad_per_sequence_settings_are_refused(tiny, rng, bad, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny, _prompts(rng, 3), **bad)


def test_decode_inside_a_user_jit_equals_generate(tiny, rng):
    """init_state -> prefill -> decode traced inside one jax.jit of the caller's (budgets traced), and the
    same stepped two rounds at a time from the host: generate's tokens, bitwise."""
    prompts = _prompts(rng, 3)
    budgets = np.asarray(rng.integers(8, 14, 3), np.int32)  # a round commits at most 3: more than one chunk of 2
    want = generate(tiny, prompts, max_new_tokens=budgets.tolist(), method="qspec", gamma=2, eos_token_id=-1)
    tokens, lengths = pad_prompts(prompts)
    dec = Decoder(Runtime(tiny.config), None, W4A8, 2)
    params = tiny.checkpoint.params
    buf = buffer_length(tokens.shape[1], int(budgets.max()))

    @jax.jit
    def run(params, tokens, lengths, budgets):
        st = init_state(dec, tokens, lengths, jax.random.key(0), max_new_tokens=budgets, buffer_len=buf)
        st = decode(params, dec, prefill(params, dec, st))
        return st.tokens, st.lengths

    toks, lens = jax.device_get(run(params, tokens, lengths, budgets))
    st = prefill_jit(params, dec, init_state(dec, tokens, lengths, jax.random.key(0), max_new_tokens=budgets,
                                             buffer_len=buf))
    chunks = 0
    while not bool(jnp.all(st.done)):
        st = decode_jit(params, dec, st, jnp.int32(2))
        chunks += 1
    assert chunks > 1
    for i, seq in enumerate(want.sequences):
        np.testing.assert_array_equal(toks[i, lengths[i]:lens[i]], seq)
        np.testing.assert_array_equal(np.asarray(st.tokens[i, lengths[i]:st.lengths[i]]), seq)


def test_vmap_over_settings(tiny, rng):
    """The core vmapped over a leading axis of per-run settings (budgets, temperatures, keys) equals each
    run made alone."""
    prompts = _prompts(rng, 2)
    tokens, lengths = pad_prompts(prompts)
    dec = Decoder(Runtime(tiny.config, stochastic=True), W4A16)
    params = tiny.checkpoint.params
    buf = buffer_length(tokens.shape[1], 12)
    budgets = jnp.asarray(rng.integers(2, 12, (3, 2)), jnp.int32)
    temps = jnp.asarray([[0.0, 0.0], [0.8, 0.0], [1.2, 2.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)

    def run(budget, temp, key):
        st = init_state(dec, tokens, lengths, key, max_new_tokens=budget, buffer_len=buf, temperature=temp)
        st = decode(params, dec, prefill(params, dec, st))
        return st.tokens, st.lengths

    batched = jax.device_get(jax.jit(jax.vmap(run))(budgets, temps, keys))
    for r in range(3):
        alone = jax.device_get(jax.jit(run)(budgets[r], temps[r], keys[r]))
        np.testing.assert_array_equal(batched[1][r], alone[1])
        np.testing.assert_array_equal(batched[1][r] - lengths, budgets[r])
        for i in range(2):
            np.testing.assert_array_equal(batched[0][r, i, :alone[1][i]], alone[0][i, :alone[1][i]])


def test_decoder_refuses_bad_static_settings(tiny):
    rt = Runtime(tiny.config)
    with pytest.raises(ValueError, match="cost model"):
        Decoder(rt, None, W4A8, None)
    with pytest.raises(ValueError, match="gamma must be in"):
        Decoder(rt, None, W4A8, 0)
