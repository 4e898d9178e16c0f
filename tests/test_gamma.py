"""gamma="auto": the cost model's choice against a float64 brute force, the switch over round bodies
wired to it, and QSPEC with it still exactly W4A16 (greedy)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from pallas_kernels.precision import W4A8, W4A16
from qspec_jax import gamma as gm
from qspec_jax.api import generate
from qspec_jax.core import AUTO_GAMMA_MAX, Decoder, decode_jit
from qspec_jax.decode import Runtime
from tests.conftest import TINY, memory_model, prefilled, random_source


def _choice64(c: gm.CostModel, gmax: int, accepted, drafted, lengths, running) -> int:
    """The γ with the most expected tokens per byte, from the definitions in float64."""
    run = running.astype(bool)
    n, ctx = run.sum(), lengths[run].mean()
    seen = drafted.astype(np.float64) + gm.PRIOR_DRAFTS
    mean = (accepted + gm.PRIOR_ALPHA * gm.PRIOR_DRAFTS) / seen
    alpha = (np.ones(len(run)) if drafted[run].mean() < gm.EXPLORE_DRAFTS  # too few drafts seen: all accepted
             else np.minimum(mean + gm.OPTIMISM * np.sqrt(mean * (1 - mean) / seen), 1.0))
    seen = ctx if c.window is None else min(ctx, c.window)

    def fwd(rows, kv_tokens, head, kvb):
        return c.weight_bytes * (1 + gm.OVERHEAD + gm.RETILE * (rows - 1) / gm.ROWS_PER_TILE) + kv_tokens * kvb + head

    rate = []
    for g in range(gmax + 1):
        a = np.minimum(alpha[run], 1 - 1e-6)
        tokens = np.sum((1 - a ** (g + 1)) / (1 - a))
        cost = g * fwd(n, n * seen, c.draft_head_bytes, c.draft_kv_bytes) + fwd(n * (g + 1), n * ctx, c.head_bytes,
                                                                                  c.kv_bytes)
        rate.append(tokens / cost)
    return int(np.argmax(rate))


def test_choice_matches_float64_and_follows_acceptance(rng):
    """Random models, batches and acceptance histories: the jitted choice equals the float64 brute force
    wherever the best two rates are not within float32 rounding; no acceptance at all picks γ = 0;
    near-perfect acceptance with cheap drafts (a small window over a long context) picks γ > 0, and so
    do too few drafts seen, even without an accept among them."""
    choose = jax.jit(gm.choose_gamma, static_argnums=(0, 1))
    agreed = 0
    for _ in range(40):
        c = gm.CostModel(weight_bytes=float(rng.uniform(1e8, 1e10)), head_bytes=float(rng.uniform(1e7, 1e9)),
                         draft_head_bytes=float(rng.uniform(1e6, 1e9)), kv_bytes=float(rng.uniform(1e4, 1e6)),
                         draft_kv_bytes=float(rng.uniform(1e3, 1e6)),
                         window=None if rng.random() < 0.5 else int(rng.integers(64, 2048)))
        b = int(rng.integers(1, 33))
        drafted = rng.integers(0, 400 if rng.random() < 0.7 else 12, b).astype(np.float32)
        accepted = np.floor(drafted * rng.uniform(0, 1, b)).astype(np.float32)
        lengths = rng.integers(16, 8192, b).astype(np.float32)
        running = rng.random(b) < 0.8
        running[0] = True
        got = int(choose(c, 5, jnp.asarray(accepted), jnp.asarray(drafted), jnp.asarray(lengths),
                         jnp.asarray(running)))
        agreed += got == _choice64(c, 5, accepted, drafted, lengths, running)
    assert agreed >= 38, agreed  # ties within float32 rounding may go either way
    c = gm.CostModel(1e9, 1e8, 1e7, 5e5, 1e5, window=256)
    ones, lens = jnp.ones(8, bool), jnp.full(8, 4000.0)
    assert int(choose(c, 4, jnp.zeros(8), jnp.full(8, 1000.0), lens, ones)) == 0
    assert int(choose(c, 4, jnp.full(8, 999.0), jnp.full(8, 1000.0), lens, ones)) > 0
    few = gm.EXPLORE_DRAFTS * 8 - 1  # in all: the running sequences' mean just below the threshold
    assert int(choose(c, 4, jnp.zeros(8), jnp.full(8, few / 8), lens, ones)) > 0
    # a Llama-2-13B-like step (batch 1, context 3600, a 1088-slot draft window): 6 of 8 drafts accepted
    # leaves room for a better acceptance, so γ >= 1 runs again; 600 of 800 does not
    c = gm.CostModel(7.93e9, 3.28e8, 3.28e8, 819200.0, 819200.0, window=1088)
    one, at = jnp.ones(1, bool), jnp.full(1, 3600.0)
    assert int(choose(c, 4, jnp.full(1, 6.0), jnp.full(1, 8.0), at, one)) > 0
    assert int(choose(c, 4, jnp.full(1, 600.0), jnp.full(1, 800.0), at, one)) == 0


def test_auto_loop_switches_on_the_cost_model(rng):
    """Drafts that cost nothing: every round drafts ``gamma_max``; drafts that could gain but whose
    sequences had every one of 1000 drafts rejected: no round drafts (the switch's ``gamma_max + 1``
    W4A16 steps every round, so one such round is that many W4A16 steps). Either way the greedy tokens
    are W4A16's."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    rt = Runtime(cfg)
    lengths = rng.choice(np.arange(3, 9), 2, replace=False).astype(np.int32)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)), jnp.int32)

    def state(rejected: bool):
        s = prefilled(params, rt, prompts, lengths, 20, 40, 48)
        return dataclasses.replace(s, drafted=jnp.full(2, 1000, jnp.int32)) if rejected else s

    ref = decode_jit(params, Decoder(rt, W4A16), state(False))
    free = gm.CostModel(1e-3, 1e5, 0.0, 1e3, 0.0)
    cheap = gm.CostModel(1e5, 1e5, 0.0, 1e3, 1e3)  # a draft head that reads nothing: could gain
    for costs, drafts in ((free, True), (cheap, False)):
        assert costs.best_gain(AUTO_GAMMA_MAX, 2, 48) > 1 + gm.MIN_GAIN  # both run the switch over round bodies
        out = decode_jit(params, Decoder(rt, None, W4A8, None, costs), state(not drafts))
        d, r = np.asarray(out.drafted), np.asarray(out.rounds)
        assert (d == AUTO_GAMMA_MAX * r).all() if drafts else (d == 1000).all(), (d, r)
        for i in range(2):
            n = int(ref.lengths[i])
            assert int(out.lengths[i]) == n
            np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), np.asarray(ref.tokens[i, :n]))
        if not drafts:  # one round is AUTO_GAMMA_MAX + 1 W4A16 steps (fewer where a sequence ends)
            one = decode_jit(params, Decoder(rt, None, W4A8, None, costs), state(True), jnp.int32(1))
            start, end = np.asarray(state(True).lengths), np.asarray(one.lengths)
            assert (end - start <= AUTO_GAMMA_MAX + 1).all() and (end - start).max() == AUTO_GAMMA_MAX + 1
            for i in range(2):
                np.testing.assert_array_equal(np.asarray(one.tokens[i, :end[i]]), np.asarray(ref.tokens[i, :end[i]]))


def test_drafts_that_cannot_gain_enough_never_draft(rng):
    """Cost models whose drafts read no fewer bytes than a W4A16 step gain nothing at any γ, and the
    float64 brute force picks γ = 0 for every acceptance, batch and context; the auto loop is the W4A16
    loop itself (the same program, no switch) wherever drafting could gain at most ``MIN_GAIN``: drafts
    as costly, a window as long as the buffer, a draft head that saves only a little; a draft head that
    reads nothing, or a window of 8 slots, brings the switch back."""
    for _ in range(20):
        head, kv = float(rng.uniform(1e7, 1e9)), float(rng.uniform(1e4, 1e6))
        c = gm.CostModel(weight_bytes=float(rng.uniform(1e8, 1e10)), head_bytes=head,
                         draft_head_bytes=head * float(rng.uniform(1, 2)), kv_bytes=kv,
                         draft_kv_bytes=kv * float(rng.uniform(1, 2)))
        b = int(rng.integers(1, 33))
        assert c.best_gain(5, b, int(rng.integers(16, 8192))) <= 1 + 1e-12
        drafted = rng.integers(0, 400, b).astype(np.float64)
        accepted = drafted if rng.random() < 0.5 else np.floor(drafted * rng.uniform(0, 1, b))
        assert _choice64(c, 5, accepted, drafted, rng.integers(16, 8192, b), np.ones(b, bool)) == 0
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    rt = Runtime(cfg)
    state = prefilled(params, rt, jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)), jnp.int32),
                      jnp.asarray([5, 8], jnp.int32), 20, 40, 48)
    slots = state.tokens.shape[1]

    def program(costs):
        decoder = Decoder(rt, W4A16) if costs is None else Decoder(rt, None, W4A8, None, costs)
        return str(jax.make_jaxpr(lambda s: decode_jit.__wrapped__(params, decoder, s))(state))

    ar = program(None)
    same = gm.CostModel(1e5, 1e5, 1e5, 1e3, 1e3)
    little = dataclasses.replace(same, weight_bytes=1e6, draft_head_bytes=0.0)  # weights dominate: ~1.5% at best
    assert 1 < little.best_gain(AUTO_GAMMA_MAX, 2, slots) < 1 + gm.MIN_GAIN
    for costs in (same, little, dataclasses.replace(same, window=slots)):
        assert program(costs) == ar
    for costs in (dataclasses.replace(same, draft_head_bytes=0.0), dataclasses.replace(same, window=8)):
        assert costs.best_gain(AUTO_GAMMA_MAX, 2, slots) > 1 + gm.MIN_GAIN
        got = program(costs)
        assert got != ar and "cond[" in got


def test_generate_auto_gamma_equals_w4a16(rng):
    """The default gamma="auto" gives W4A16's greedy tokens, with and without draft views; its stats
    carry the cost model's best gain, under 1 + MIN_GAIN of which nothing is drafted (the default window
    covers this short buffer, so the drafts read what a W4A16 step reads)."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, False), None)
    model = memory_model(params, cfg)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 12, 3)]
    ref = generate(model, prompts, max_new_tokens=24, method="w4a16")
    assert "best_gain" not in ref.stats
    for view in ({}, dict(draft_kv=8, draft_window=8, draft_sinks=2)):
        got = generate(model, prompts, max_new_tokens=24, **view)
        assert got.stats["drafted"] <= AUTO_GAMMA_MAX * got.stats["rounds"]
        if got.stats["best_gain"] < 1 + gm.MIN_GAIN:
            assert got.stats["drafted"] == 0
        if not view:
            assert got.stats["best_gain"] <= 1
        for a, b in zip(got.sequences, ref.sequences):
            np.testing.assert_array_equal(a, b)


def test_expected_tokens_matches_a_geometric_sum(rng):
    """E[L] for independent accepts: sum over k = 0..gamma of alpha**k, in float64; gamma + 1 at alpha 1."""
    for alpha, gamma in zip(rng.uniform(0, 0.999, 20), rng.integers(1, 9, 20)):
        want = sum(np.float64(alpha) ** k for k in range(gamma + 1))
        assert abs(float(gm.expected_tokens(float(alpha), int(gamma))) - want) < 1e-5 * want
    assert abs(float(gm.expected_tokens(1.0, 4)) - 5.0) < 1e-4 and float(gm.expected_tokens(0.0, 4)) == 1.0
