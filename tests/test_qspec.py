"""QSPEC decoding (draft in W4A4/W4A8, verify in W4A16): greedy exactness against W4A16 on SmolLM2,
bitwise row-count invariance of the verify pass, the KV invariant, distribution preservation of
stochastic QSPEC (with a wrong acceptance rule that the same statistic must reject), counters,
edge cases, and the one-compiled-loop property."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from pallas_kernels.layout import dequantize
from pallas_kernels.reference import AttentionWindow, quantize_kv as ref_quantize_kv
from qspec_jax.core import Decoder, decode_jit, init_state
from qspec_jax.decode import MAX_GAMMA, Runtime, prefill
from qspec_jax.api import generate, load
from qspec_jax.gamma import CostModel, cost_model
from qspec_jax.model import KVCache, forward, init_cache, with_draft_head
from bench import hooks
from qspec_jax.qspec import qspec_round
from qspec_jax.sampling import Sampling, probabilities, sample
from qspec_jax.tokenizer import chat_prompt
from tests.conftest import TINY, jit_forward, memory_model, prefilled, random_source, tiny_variant

# the modules themselves (the package re-exports a function named ``generate``)
import qspec_jax.api as gen_mod
import qspec_jax.qspec as qspec_mod
from pallas_kernels.precision import W16A16, W4A16, W4A4, W4A8
from qspec_jax.kernels import Execution

GSM8K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k_test_dev.jsonl"
FALLBACK_PROMPTS = [
    "What is 7 times 8?",
    "Tom has 3 apples and buys 5 more. He gives 2 to his sister. How many apples does he have now?",
    "A train travels 60 miles per hour for 2.5 hours, then 40 miles per hour for another hour. "
    "How far does it travel in total? Explain your reasoning step by step.",
    "Name a colour.",
]
NEW = 32  # greedy SmolLM2 tokens per sequence in the exactness tests
FINISH_NEW = 40  # enough for the four sequences to stop at three different points at least


def gsm8k_prompts() -> list[str]:
    """Four questions of clearly different lengths (hard-coded prompts when the data file is absent)."""
    if not GSM8K.is_file():
        return FALLBACK_PROMPTS
    with GSM8K.open() as f:
        qs = [json.loads(line)["question"] for _, line in zip(range(40), f)]
    qs = sorted(qs, key=len)
    return [qs[0], qs[-1], qs[13], qs[26]]  # not sorted by length: padding lands in mixed places


# ---------------------------------------------------------------------------------------------
# 1. greedy QSPEC == greedy W4A16 on the real model
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_ckpt):
    return load(smollm2_ckpt)


@pytest.fixture(scope="module")
def smol_batches(smol):
    prompts = gsm8k_prompts()
    lengths = [len(chat_prompt(smol.tokenizer, p)) for p in prompts]
    assert len(set(lengths)) == 4, lengths  # the padded batch is exercised
    return {1: prompts[:1], 4: prompts}


@pytest.fixture(scope="module")
def w4a16_refs(smol, smol_batches):
    """Greedy W4A16 reference of a batch size, computed once when a test first asks for it."""
    return functools.cache(lambda b: generate(smol, smol_batches[b], max_new_tokens=NEW, method="w4a16", chat=True))


# each draft, batch and shadow at least once (not their whole product: CI's time); gamma 5 over the float
# cache is test_sequences_finish_in_different_rounds_smollm2's run. W4A4's drafts are mostly rejected, so its
# rounds are many: batch 1 and gamma 1 keep that run short
@pytest.mark.parametrize("gamma,draft,batch,draft_kv,window", [
    (3, "w4a8", 4, 4, None), (1, "w4a4", 1, None, None), (3, "w4a8", 4, 8, 24)])
def test_greedy_qspec_equals_w4a16_smollm2(smol, smol_batches, w4a16_refs, gamma, draft, batch, draft_kv, window):
    """Bitwise the W4A16 tokens, with the drafts reading the float cache or its INT8 / INT4 shadow, or
    a sinks + window view of the shadow (far shorter than the prompts)."""
    ref = w4a16_refs(batch)
    extra = {} if window is None else dict(draft_window=window, draft_sinks=4)
    got = generate(smol, smol_batches[batch], max_new_tokens=NEW, method="qspec", draft=draft, gamma=gamma,
                   draft_kv=draft_kv, chat=True, **extra)
    assert len(got.sequences) == batch
    for i, (a, b) in enumerate(zip(got.sequences, ref.sequences)):
        assert np.array_equal(a, b), f"sequence {i} diverges at token {_first_diff(a, b)}"
    assert got.finish_reasons == ref.finish_reasons
    s = got.stats
    assert s["drafted"] == gamma * s["rounds"] and 0 <= s["accepted"] <= s["drafted"]
    if draft == "w4a8":
        assert s["accepted"] > 0, s  # acceptance is exercised, not just the correction token


def _first_diff(a, b) -> int:
    n = min(len(a), len(b))
    d = np.nonzero(a[:n] != b[:n])[0]
    return int(d[0]) if d.size else n


# ---------------------------------------------------------------------------------------------
# 2. row-count invariance of the W4A16 verify pass (bitwise)
# ---------------------------------------------------------------------------------------------

def test_verify_pass_is_row_count_invariant(smol, rng):
    """A verify pass over ``width`` tokens (γ + 1 for a random γ of 1..5) equals ``width`` one-token
    steps bitwise: logits and cache."""
    width = int(rng.integers(2, 7))
    cfg, params = smol.config, smol.checkpoint.params
    seed = smol.checkpoint.online_rotation_seed
    lengths = rng.choice(np.arange(3, 20), 3, replace=False)
    p = int(lengths.max())
    prompts = rng.integers(0, cfg.vocab_size, (3, p)).astype(np.int32)
    cache = init_cache(cfg, 3, p + width + 2)
    _, cache = jit_forward(params, cfg, prompts, np.broadcast_to(np.arange(p, dtype=np.int32), (3, p)), cache,
                    precision=W4A16, online_rotation_seed=seed)
    toks = rng.integers(0, cfg.vocab_size, (3, width)).astype(np.int32)
    toks[:, 0] = prompts[np.arange(3), lengths - 1]  # the last committed token, as in a round
    pos = (lengths[:, None] - 1 + np.arange(width)[None]).astype(np.int32)

    many, many_cache = jit_forward(params, cfg, toks, pos, cache, precision=W4A16, execution=Execution.decode(),
                            online_rotation_seed=seed)
    one_cache, ones = cache, []
    for i in range(width):
        lg, one_cache = jit_forward(params, cfg, toks[:, i:i + 1], pos[:, i:i + 1], one_cache, precision=W4A16,
                             execution=Execution.decode(), online_rotation_seed=seed)
        ones.append(lg)
    ones = np.concatenate([np.asarray(x) for x in ones], axis=1)
    np.testing.assert_array_equal(np.asarray(many), ones)
    for a, b in zip(jax.tree.leaves(many_cache), jax.tree.leaves(one_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# 3. stochastic QSPEC samples from the W4A16 distribution
# ---------------------------------------------------------------------------------------------

SMALL_V = 12
N_CALLS, N_PER_CALL = 4, 6000  # 24000 draws of (x1, x2, x3)
ALPHA = 1e-5                   # a correct sampler fails one statistic with probability <= 1e-5


def _softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def exact_target(params, cfg, prompt: np.ndarray):
    """Exact W4A16 p(x1), p(x2|x1), p(x3|x1,x2) by enumeration, the draft q(x2|x1) of a W4A4 step, and
    the W4A16 logits behind p (for the distributions that temperature / top-k / top-p make of them)."""
    v, n = cfg.vocab_size, len(prompt)
    pos = lambda b, t: np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))  # noqa: E731
    lg, _ = jit_forward(params, cfg, prompt[None], pos(1, n), init_cache(cfg, 1, n + 4), precision=W4A16)
    l1 = np.asarray(lg[0, -1])
    p1 = _softmax64(l1)
    seq1 = np.concatenate([np.tile(prompt, (v, 1)), np.arange(v)[:, None]], 1).astype(np.int32)
    lg, _ = jit_forward(params, cfg, seq1, pos(v, n + 1), precision=W4A16)
    l2 = np.asarray(lg[:, -1])
    p2 = _softmax64(l2)
    x1, x2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    seq2 = np.concatenate([np.tile(prompt, (v * v, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    lg, _ = jit_forward(params, cfg, seq2.astype(np.int32), pos(v * v, n + 2), precision=W4A16)
    l3 = np.asarray(lg[:, -1]).reshape(v, v, v)
    p3 = _softmax64(l3)
    cache = init_cache(cfg, v, n + 4)
    _, cache = jit_forward(params, cfg, np.tile(prompt, (v, 1)), pos(v, n), cache, precision=W4A16)
    lg, _ = jit_forward(params, cfg, np.arange(v, dtype=np.int32)[:, None], np.full((v, 1), n, np.int32), cache,
                 precision=W4A4)
    q2 = _softmax64(lg[:, 0])
    return p1, p2, p3, q2, (l1, l2, l3)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expected below ``min_expected`` are pooled into one."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel() / probs.sum()
    expected = counts.sum() * probs
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert np.all(obs[~keep] == 0), "a draw of a zero-probability cell"
    obs, exp = obs[keep], exp[keep]
    stat = np.sum((obs - exp) ** 2 / exp)
    return float(chi2.sf(stat, len(obs) - 1))


def noncentrality(n: int, wrong: np.ndarray, right: np.ndarray, min_expected: float = 5.0) -> float:
    """``n * chi2-divergence`` on the pooled cells: the chi-square's expected excess for a wrong sampler."""
    wrong, right = wrong.ravel(), right.ravel()
    big = n * right >= min_expected
    w = np.append(wrong[big], wrong[~big].sum())
    r = np.append(right[big], right[~big].sum())
    return float(n * np.sum((w - r) ** 2 / np.maximum(r, 1e-300)))


@pytest.fixture(scope="module")
def dist_setup():
    """A tiny random quantized model + prompt where W4A4 drafts differ strongly from the W4A16 target
    (so a wrong acceptance rule is detectable with the sample size used)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"dist_setup: seed {seed}")
    rng = np.random.default_rng(seed)
    cfg0 = tiny_variant(vocab_size=SMALL_V, eos_token_id=None)  # no EOS: every draw has 3 tokens
    n = N_CALLS * N_PER_CALL
    for _ in range(8):
        params, cfg, _ = convert_model(random_source(cfg0, rng), QuantScheme(16, True), None)
        prompt = rng.integers(0, SMALL_V, int(rng.integers(3, 7))).astype(np.int32)
        p1, p2, p3, q2, logits = exact_target(params, cfg, prompt)
        m = np.minimum(p2, q2)
        wrong2 = m + (1 - m.sum(-1, keepdims=True)) * p2  # the law of x2 when rejection resamples from p
        lam = noncentrality(n, p1[:, None] * wrong2, p1[:, None] * p2)
        if lam > 300:
            return dict(params=params, cfg=cfg, prompt=prompt, p1=p1, p2=p2, p3=p3, lam=lam, logits=logits,
                        seeds=rng.integers(0, 2**31, N_CALLS).tolist())
    pytest.fail("no random model whose W4A4 draft differs enough from W4A16 in 8 attempts")


def _draw(setup, gamma: int, draft_kv: int | None = None, calls: int = N_CALLS, view: dict | None = None,
          **sampling) -> np.ndarray:
    """``int[N, 3]`` draws (x1, x2, x3) of stochastic QSPEC from one generate call per seed, ``calls`` of
    them (with ``draft_kv`` the drafts and their probabilities come from the INT8 / INT4 KV shadow;
    ``view``: generate's draft_window / draft_sinks; ``sampling``: generate's temperature / top_k / top_p,
    by default temperature 1)."""
    v = setup["cfg"].vocab_size
    model = memory_model(setup["params"], setup["cfg"], draft_vocab=np.arange(v, dtype=np.int32)[::-1].copy())
    out = []
    for seed in setup["seeds"][:calls]:
        res = generate(model, np.tile(setup["prompt"], (N_PER_CALL, 1)), max_new_tokens=3, method="qspec",
                       draft="w4a4", gamma=gamma, draft_kv=draft_kv, seed=seed, **(view or {}),
                       **(sampling or {"temperature": 1.0}))
        assert res.finish_reasons == ["length"] * N_PER_CALL
        out.append(np.stack(res.sequences))
    return np.concatenate(out)


def _pvalues(setup, draws: np.ndarray, probs: tuple | None = None) -> tuple[float, float]:
    """Chi-square p-values of the (x1, x2) and (x1, x2, x3) counts against ``probs`` (p1, p2, p3; by
    default the setup's temperature-1 distributions)."""
    v = SMALL_V
    p1, p2, p3 = probs or (setup["p1"], setup["p2"], setup["p3"])
    p12 = p1[:, None] * p2
    c12 = np.bincount(draws[:, 0] * v + draws[:, 1], minlength=v * v)
    c123 = np.bincount((draws[:, 0] * v + draws[:, 1]) * v + draws[:, 2], minlength=v ** 3)
    return chi2_pvalue(c12, p12), chi2_pvalue(c123, p12[..., None] * p3)


# gamma 3: a round drafts past the 3 tokens; every view at once: an INT4 KV shadow seen through a window of 2
# slots after 1 sink (the drafts see little of the prompt, and that coarsely) and a draft head of 6 of the 12
# tokens in INT4 (the drafts never propose the other 6, which the target still draws): the drafts'
# distribution moves, the target's must not
@pytest.mark.parametrize("gamma,draft_kv,view", [
    (3, None, None), (2, 4, dict(draft_window=2, draft_sinks=1, draft_head=6, draft_head_bits=4))])
def test_stochastic_qspec_samples_target_distribution(dist_setup, gamma, draft_kv, view):
    draws = _draw(dist_setup, gamma, draft_kv, view=view)
    p12, p123 = _pvalues(dist_setup, draws)
    assert p12 > ALPHA and p123 > ALPHA, (p12, p123)


def test_stochastic_qspec_samples_the_processed_target_distribution(dist_setup):
    """With a temperature, top-k and top-p, QSPEC's (x1, x2, x3) follow W4A16's processed distribution
    (float64, from the definitions: :func:`_processed64`); a token they drop is never drawn (chi2_pvalue
    fails on a draw of a zero-probability cell). 12000 draws."""
    t, top_k, top_p = 0.7, SMALL_V - 3, 0.9
    probs = tuple(np.apply_along_axis(_processed64, -1, lg, t, top_k, top_p) for lg in dist_setup["logits"])
    assert all((p == 0).any() for p in probs[1:])  # the filters drop tokens here
    draws = _draw(dist_setup, 3, calls=2, temperature=t, top_k=top_k, top_p=top_p)
    p12, p123 = _pvalues(dist_setup, draws, probs)
    assert p12 > ALPHA and p123 > ALPHA, (p12, p123)
    assert _pvalues(dist_setup, draws)[0] < ALPHA  # and the temperature-1 law is rejected: the check has power


def _accept_resample_from_p(drafts, q, target_logits, s, key):
    """WRONG rule: accept with min(1, p/q) but on rejection resample from p, not norm(max(0, p - q))."""
    _accept_resample_from_p.traced += 1
    g = drafts.shape[1]
    p = probabilities(target_logits, s)
    k_acc, k_res = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = jax.random.uniform(k_acc, drafts.shape) * q_d < p_d
    accepted = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    return accepted, sample(p_a, k_res)


def test_wrong_acceptance_rule_is_rejected(dist_setup, monkeypatch):
    _accept_resample_from_p.traced = 0
    try:
        with monkeypatch.context() as m:
            m.setattr(qspec_mod, "accept_stochastic", _accept_resample_from_p)
            decode_jit.clear_cache()  # the loop must be traced again with the patched rule
            draws = _draw(dist_setup, 2)
    finally:
        decode_jit.clear_cache()  # no compiled wrong rule survives this test
    assert _accept_resample_from_p.traced > 0
    p12, _ = _pvalues(dist_setup, draws)
    assert p12 < ALPHA, (p12, dist_setup["lam"])


def test_top_k_1_sampling_equals_greedy_w4a16(rng):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, bool(rng.integers(2))), None)
    model = memory_model(params, cfg)
    lengths = rng.choice(np.arange(1, 9), 3, replace=False)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    ref = generate(model, prompts, max_new_tokens=16, method="w4a16", eos_token_id=-1)
    got = generate(model, prompts, max_new_tokens=16, method="qspec", draft="w4a4", gamma=3, temperature=1.0,
                   top_k=1, seed=int(rng.integers(2**31)), eos_token_id=-1)
    for a, b in zip(got.sequences, ref.sequences):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# 4. the KV invariant after some rounds
# ---------------------------------------------------------------------------------------------

_round_jit = jax.jit(qspec_round, static_argnames=("rt", "gamma", "draft"))


def test_committed_kv_slots_hold_w4a16_values(rng):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, bool(rng.integers(2))), None)
    gamma, rounds, new = 3, 4, 24
    lengths = rng.choice(np.arange(2, 9), 3, replace=False).astype(np.int32)
    prompts = np.zeros((3, lengths.max()), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = rng.integers(0, cfg.vocab_size, n)
    rt = Runtime(cfg)
    buf = int(lengths.max()) + new + gamma + 1
    state = prefilled(params, rt, prompts, lengths, new, buf, buf)
    for _ in range(rounds):
        state = _round_jit(params, state, rt=rt, gamma=gamma, draft=W4A4)
    toks, lens = np.asarray(state.tokens), np.asarray(state.lengths)
    assert np.all(lens > lengths + rounds)  # every round committed at least one token
    cache_k, cache_v = (np.asarray(c) for c in (state.cache.k, state.cache.v))

    differing = 0
    for b in range(3):
        n = int(lens[b])
        seq = toks[b:b + 1, :n]
        pos = np.arange(n, dtype=np.int32)[None]
        _, ref16 = jit_forward(params, cfg, seq, pos, init_cache(cfg, 1, n), precision=W4A16)
        _, ref4 = jit_forward(params, cfg, seq, pos, init_cache(cfg, 1, n), precision=W4A4)
        for got, want16, want4 in zip((cache_k, cache_v), (ref16.k, ref16.v), (ref4.k, ref4.v)):
            got = got[:, b, : n - 1]
            want16, want4 = np.asarray(want16)[:, 0, : n - 1], np.asarray(want4)[:, 0, : n - 1]
            scale = np.abs(want16).max()
            # W4A16 rounds each matmul's activations to bf16: the prefill's and this recompute's shapes sum
            # in other orders, and a flipped rounding moves later layers by ~1e-3 * scale (seen on 2 of 12
            # seeds, 0 elsewhere), far inside W4A4's distance of ~0.25 * scale (checked below)
            np.testing.assert_allclose(got, want16, rtol=0, atol=2e-2 * scale)
            # layer 0 keys/values depend only on (token, position): exactly what a W4A4 draft step writes
            far = np.abs(want16[0] - want4[0]) > 1e-2 * scale
            assert np.all(np.abs(got[0] - want4[0])[far] > 5e-3 * scale)
            differing += int(far[lengths[b]:].any(axis=(-1, -2)).sum())  # generated positions that tell
    assert differing >= 2 * rounds  # the check has teeth: W4A4 entries would be visible there


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_shadow_follows_the_cache_and_alone_feeds_the_drafts(rng, bits):
    """After QSPEC rounds with a KV shadow, each committed slot's shadow is exactly quantize_kv of the
    float cache there (bitwise); a draft forward's logits do not change when the float cache is
    scrambled, and do when the shadow is: the drafts read the shadow and only it."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    gamma, new = 2, 16
    lengths = rng.choice(np.arange(2, 9), 2, replace=False).astype(np.int32)
    prompts = rng.integers(0, cfg.vocab_size, (2, int(lengths.max()))).astype(np.int32)
    rt = Runtime(cfg, draft_kv=bits)
    buf = int(lengths.max()) + new + gamma + 1
    state = prefilled(params, rt, prompts, lengths, new, buf, buf)
    for _ in range(3):
        state = _round_jit(params, state, rt=rt, gamma=gamma, draft=W4A8)
    k, v, shadow = state.cache.k, state.cache.v, state.cache.draft.arrays
    for b, n in enumerate(np.asarray(state.lengths)):
        for full, words, scales in ((k, shadow[0], shadow[2]), (v, shadow[1], shadow[3])):
            want_w, want_s = ref_quantize_kv(full[:, b, :n - 1], bits)
            np.testing.assert_array_equal(np.asarray(words[:, b, :n - 1]), np.asarray(want_w))
            np.testing.assert_array_equal(np.asarray(scales[:, b, :, :n - 1]), np.swapaxes(np.asarray(want_s), 1, 2))
    tok = jnp.asarray(np.asarray(state.tokens)[np.arange(2), np.asarray(state.lengths) - 1][:, None])
    pos = (state.lengths - 1)[:, None]
    draft = jax.jit(lambda c: rt.run(params, tok, pos, c, W4A8, draft=True)[0])
    base = np.asarray(draft(state.cache))
    noise = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (k, v)]
    np.testing.assert_array_equal(np.asarray(draft(KVCache(*noise, state.cache.draft))), base)
    scrambled = jnp.asarray(rng.integers(-2**15, 2**15, shadow[0].shape), jnp.int16)
    scrambled_cache = KVCache(k, v, state.cache.draft.with_arrays((scrambled, *shadow[1:])))
    assert not np.array_equal(np.asarray(draft(scrambled_cache)), base)


# ---------------------------------------------------------------------------------------------
# 5. edge cases, EOS inside a drafted run, counters
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_model(rng):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, False), None)
    return memory_model(params, cfg)


@pytest.mark.parametrize("bits", [None, 4])
def test_draft_window_limits_what_a_draft_sees(rng, bits):
    """A draft forward with a sinks + window view: its logits do not change when the cache outside the
    window is scrambled and do when a slot inside is; with a window covering every slot they are the
    full view's bitwise; the verifier's forward ignores the window."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    p, sinks, size = 24, 2, 5
    rt = Runtime(cfg, draft_kv=bits)
    windowed = dataclasses.replace(rt, draft_window=AttentionWindow(sinks, size))
    prompts = rng.integers(0, cfg.vocab_size, (2, p)).astype(np.int32)
    state = prefill(params, init_state(Decoder(rt, W4A16), jnp.asarray(prompts), jnp.full((2,), p, jnp.int32),
                                       jax.random.key(0), max_new_tokens=4, buffer_len=p + 8, cache_len=p + 8),
                    rt, W4A16)
    tok, pos = jnp.asarray(prompts[:, -1:]), jnp.full((2, 1), p - 1, jnp.int32)

    def run(r, cache, draft=True):
        return np.asarray(jax.jit(lambda c: r.run(params, tok, pos, c, W4A8, draft=draft)[0])(cache))

    def scramble(cache, slots):
        noisy = lambda a: a.at[:, :, slots].set(jnp.asarray(  # noqa: E731
            rng.integers(-2000, 2000, a[:, :, slots].shape), a.dtype))
        if bits is None:
            return dataclasses.replace(cache, k=noisy(cache.k), v=noisy(cache.v))
        return dataclasses.replace(cache, draft=dataclasses.replace(
            cache.draft, k_words=noisy(cache.draft.k_words), v_words=noisy(cache.draft.v_words)))

    base = run(windowed, state.cache)
    outside = np.arange(sinks, p - size)
    np.testing.assert_array_equal(run(windowed, scramble(state.cache, outside)), base)
    assert not np.array_equal(run(windowed, scramble(state.cache, np.array([p - 3]))), base)
    assert not np.array_equal(run(rt, state.cache), base)
    wide = dataclasses.replace(rt, draft_window=AttentionWindow(0, p))
    np.testing.assert_array_equal(run(wide, state.cache), run(rt, state.cache))
    np.testing.assert_array_equal(run(windowed, state.cache, draft=False), run(rt, state.cache, draft=False))


def test_draft_head_reads_its_rows_and_keeps_qspec_exact(rng):
    """A draft head over the first rows of a token ranking: the draft's logits of those tokens are the
    full head's (to float tolerance), every other token's -inf; greedy QSPEC with it equals W4A16;
    bad requests are refused."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    ranking = rng.permutation(cfg.vocab_size).astype(np.int32)
    rows = int(rng.integers(8, cfg.vocab_size // 2))
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    run = lambda p, **kw: np.asarray(forward(p, cfg, toks, pos, precision=W4A8, **kw)[0])  # noqa: E731
    full, sub = run(params), run(with_draft_head(params, cfg, ranking, rows), draft_head=True)
    ids = ranking[:rows]
    np.testing.assert_allclose(sub[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    assert np.all(np.delete(sub, ids, axis=-1) == -np.inf)
    with pytest.raises(ValueError, match="draft_head"):
        run(params, draft_head=True)
    model = memory_model(params, cfg, draft_vocab=ranking)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 9)]
    ref = generate(model, prompts, max_new_tokens=24, method="w4a16")
    got = generate(model, prompts, max_new_tokens=24, method="qspec", draft="w4a8", gamma=3, draft_head=rows)
    for a, b in zip(got.sequences, ref.sequences):
        np.testing.assert_array_equal(a, b)
    for method, bad in (("qspec", 0), ("qspec", cfg.vocab_size + 1), ("qspec", 4.0), ("w4a16", rows)):
        with pytest.raises(ValueError, match="draft_head"):
            generate(model, prompts, max_new_tokens=4, method=method, draft_head=bad)
    with pytest.raises(ValueError, match="--draft-vocab"):
        generate(memory_model(params, cfg), prompts, max_new_tokens=4, draft_head=rows)


def test_invalid_requests_raise(tiny_model):
    ok = [[3, 4, 5]]
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_model, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_model, [[3, 4], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds"):
        generate(tiny_model, [list(range(3, 11))], max_new_tokens=5, max_len=12)
    with pytest.raises(ValueError, match="exceeds"):
        generate(tiny_model, ok, max_new_tokens=TINY.max_position_embeddings)
    with pytest.raises(ValueError, match=f"max_len=300 exceeds the model's max_position_embeddings "
                                         f"{TINY.max_position_embeddings}"):
        generate(tiny_model, ok, max_new_tokens=4, max_len=300)
    for g in (0, -1, True, 2.0, MAX_GAMMA + 1, 10**7):
        with pytest.raises(ValueError, match="gamma"):
            generate(tiny_model, ok, max_new_tokens=4, gamma=g)
    for new in (-1, True, 4.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generate(tiny_model, ok, max_new_tokens=new)
    with pytest.raises(ValueError, match="unknown method"):
        generate(tiny_model, ok, max_new_tokens=4, method="w8a8")
    with pytest.raises(ValueError, match="unknown draft"):
        generate(tiny_model, ok, max_new_tokens=4, draft="w4a16")
    for method, kv in (("qspec", 2), ("qspec", 16), ("qspec", 8.0), ("qspec", True), ("w4a16", 8)):
        with pytest.raises(ValueError, match="draft_kv"):
            generate(tiny_model, ok, max_new_tokens=4, method=method, draft_kv=kv)
    for method, size in (("qspec", 0), ("qspec", 8.0), ("qspec", True), ("w4a16", 16)):
        with pytest.raises(ValueError, match="draft_window"):
            generate(tiny_model, ok, max_new_tokens=4, method=method, draft_window=size)
    for sinks in (-1, 2.5, None):
        with pytest.raises(ValueError, match="draft_sinks"):
            generate(tiny_model, ok, max_new_tokens=4, draft_window=8, draft_sinks=sinks)
    with pytest.raises(ValueError, match="needs a draft_window"):
        generate(tiny_model, ok, max_new_tokens=4, draft_window=None, draft_sinks=8)
    with pytest.raises(ValueError, match="apply to method 'qspec' only"):
        generate(tiny_model, ok, max_new_tokens=4, method="w4a16", draft_sinks=8)
    for bad in ([3, TINY.vocab_size], [-1, 3]):
        with pytest.raises(ValueError, match="token ids must lie in"):
            generate(tiny_model, [bad], max_new_tokens=4)
    bad_args = [("seed", v) for v in (1.5, None, 2**70, True)] + [("max_len", v) for v in (10.5, "100", 0)] + [
        ("eos_token_id", v) for v in (2.5, TINY.vocab_size, -2, [], [2, TINY.vocab_size], [2, None])] + [
        ("dtype", np.int32), ("dtype", "foo"), ("prompts", None), ("prompts", 5), ("prompts", np.array(3))] + [("temperature", v) for v in (float("nan"), float("inf"), -1.0, "0.7", None)] + [
        ("top_k", v) for v in (2.5, 0, True)] + [("top_p", v) for v in (0.0, 1.5, float("nan"))]
    for name, value in bad_args:
        extra = {"temperature": 1.0} if name in ("top_k", "top_p") else {}
        args = {"prompts": ok, "max_new_tokens": 4, name: value, **extra}
        with pytest.raises(ValueError, match=name):
            generate(tiny_model, **args)
    for name, value in (("top_k", 5), ("top_p", 0.9)):  # no effect when greedy: refused rather than ignored
        with pytest.raises(ValueError, match="temperature=0"):
            generate(tiny_model, ok, max_new_tokens=4, **{name: value})
    with pytest.raises(ValueError, match="chat=True"):
        generate(tiny_model, ok, max_new_tokens=4, chat=True)
    with pytest.raises(ValueError, match=r"a list of them: \[\[1, 2, 3\]\]"):
        generate(tiny_model, ok[0], max_new_tokens=4)  # a flat list of ids: a batch of 0-d prompts
    with pytest.raises(ValueError, match="must be a qspec_jax.Model"):
        generate(str(tiny_model.checkpoint.path), ok, max_new_tokens=4)
    for method in ("w4a16", "w4a8", "w16a16"):  # QSPEC's settings are refused, not ignored, by the AR methods
        for extra, named in ((dict(gamma=5), "gamma"), (dict(draft="w4a4"), "draft"),
                             (dict(gamma="auto", draft="w4a8"), "draft and gamma")):
            with pytest.raises(ValueError, match=f"{named} apply to method 'qspec' only; method '{method}'"):
                generate(tiny_model, ok, max_new_tokens=4, method=method, **extra)
    with pytest.raises(ValueError, match="kernels='pallas' needs a GPU.*'reference'.*'interpret'"):
        generate(tiny_model, ok, max_new_tokens=4, kernels="pallas")
    with pytest.raises(ValueError, match="a prompt of 1 token plus"):
        generate(tiny_model, [[3]], max_new_tokens=TINY.max_position_embeddings)


def test_stats_are_the_method_s(tiny_model):
    """Autoregressive runs report steps, not QSPEC's rounds and acceptance; QSPEC reports its counters."""
    ar = generate(tiny_model, [[3, 4, 5]], max_new_tokens=6, method="w4a16", eos_token_id=-1).stats
    assert set(ar) == {"steps", "generated", "wall_time_s", "tokens_per_s"} and ar["steps"] == 5
    qs = generate(tiny_model, [[3, 4, 5]], max_new_tokens=6, gamma=2, eos_token_id=-1).stats
    assert {"rounds", "drafted", "accepted", "acceptance_rate", "tokens_per_round", "generated"} <= set(qs)
    assert "steps" not in qs and qs["drafted"] == 2 * qs["rounds"]


def test_tokenizer_must_match_the_model(tmp_path, rng, smollm2_tokenizer_json):
    """A checkpoint with tokenizer.json alone loads its tokenizer; a tokenizer whose ids (SmolLM2's
    49152) or EOS fall outside the model's vocabulary (97) is refused, not gathered out of range."""
    import json
    from tokenizers import Tokenizer
    from qspec_jax.checkpoint import save_checkpoint

    params, cfg, manifest = convert_model(random_source(TINY, rng), QuantScheme(16, False), None)
    ck = save_checkpoint(tmp_path / "ck", params, cfg, {"tokenizer.json": smollm2_tokenizer_json}, **manifest)
    model = load(ck)
    assert model.tokenizer is not None
    text = "a tokenizer of a bigger model"
    assert max(model.tokenizer.encode(text, add_special_tokens=False)) >= TINY.vocab_size
    with pytest.raises(ValueError, match="from the tokenizer: it does not match the model"):
        generate(model, text, max_new_tokens=2)
    eos = int(rng.integers(TINY.vocab_size, 49152))
    tok_cfg = json.dumps({"eos_token": Tokenizer.from_str(smollm2_tokenizer_json).id_to_token(eos)})
    save_checkpoint(ck, params, cfg, {"tokenizer.json": smollm2_tokenizer_json, "tokenizer_config.json": tok_cfg},
                    **manifest)
    model = load(ck)
    assert model.tokenizer.eos_token_id == eos
    with pytest.raises(ValueError, match="the tokenizer's / config's eos_token_id must be token ids in"):
        generate(model, [[3, 4]], max_new_tokens=2)


def test_numpy_integer_arguments(tiny_model):
    """gamma / max_new_tokens as small NumPy integers decode as Python ints would (np.int8 overflowed the
    cache size)."""
    want = generate(tiny_model, [[3, 4, 5]], max_new_tokens=5, gamma=3, eos_token_id=-1).sequences[0]
    got = generate(tiny_model, [[3, 4, 5]], max_new_tokens=np.int8(5), gamma=np.int8(3), eos_token_id=-1).sequences[0]
    np.testing.assert_array_equal(got, want)


def test_seed_uses_all_64_bits(tiny_model):
    """Seeds that differ only above bit 31 (or only in sign) draw different tokens; jax.random.key keeps the
    low 32 bits without 64-bit mode. Seeds below 2**31 keep jax.random.key's key."""
    key_data = jax.random.key_data
    np.testing.assert_array_equal(key_data(gen_mod.seed_key(12345)), key_data(jax.random.key(12345)))
    keys = {s: tuple(np.asarray(key_data(gen_mod.seed_key(s))).tolist()) for s in (0, 2**32, -1, 2**32 - 1, -2**63)}
    assert len(set(keys.values())) == len(keys), keys
    kw = dict(max_new_tokens=24, method="w4a16", temperature=1.0, eos_token_id=-1)
    draws = {s: generate(tiny_model, [[3, 4, 5]] * 4, seed=s, **kw).sequences for s in (0, 2**32)}
    assert any(not np.array_equal(a, b) for a, b in zip(draws[0], draws[2**32]))
    again = generate(tiny_model, [[3, 4, 5]] * 4, seed=2**32, **kw).sequences
    assert all(np.array_equal(a, b) for a, b in zip(again, draws[2**32]))


def test_cache_length_does_not_depend_on_method_or_gamma(tiny_model, monkeypatch):
    """Every method and gamma gets the same KV cache for the same prompts and budget: the GPU attention
    kernel splits the cache by its length, so a cache sized by gamma could sum W4A16's and QSPEC's
    attention in different orders (max_new_tokens 63 gave QSPEC one 64-slot block more)."""
    seen = []

    class Sized(Exception):
        pass

    def spy(params, decoder, state):  # records the sizes generate() chose, then stops it before anything compiles
        seen.append((state.tokens.shape[1], state.cache.k.shape[2]))
        raise Sized

    monkeypatch.setattr(gen_mod, "prefill_jit", spy)
    for new in (1, 30, 31, 63, 64):
        seen.clear()
        runs = [dict(method="w4a16"), dict(method="w4a8"), *(dict(method="qspec", gamma=g) for g in (1, 5, MAX_GAMMA))]
        for kw in runs:
            with pytest.raises(Sized):
                generate(tiny_model, [[3, 4, 5]], max_new_tokens=new, eos_token_id=-1, **kw)
        assert len(seen) == len(runs) and len(set(seen)) == 1, (new, seen)
        buffer_len, cache_len = seen[0]
        assert buffer_len >= 3 + new + MAX_GAMMA + 1 and cache_len % 64 == 0 and buffer_len <= cache_len < buffer_len + 64


def test_one_array_prompt_is_one_sequence(tiny_model):
    ids = [3, 4, 5, 6]
    want = generate(tiny_model, [ids], max_new_tokens=3, method="w4a16", eos_token_id=-1).sequences
    for one in (np.asarray(ids), jnp.asarray(ids)):
        got = generate(tiny_model, one, max_new_tokens=3, method="w4a16", eos_token_id=-1).sequences
        assert len(got) == 1 and np.array_equal(got[0], want[0])


def test_tiny_temperature_tends_to_greedy(rng):
    """A temperature whose division would overflow float32 still gives a distribution: all its mass on
    the argmax (numpy's), not NaN."""
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 10
    for t in (1e-38, 1e-30):
        probs = np.asarray(probabilities(jnp.asarray(logits), Sampling.of(t)))
        np.testing.assert_array_equal(probs, np.eye(50, dtype=np.float32)[np.argmax(logits, axis=-1)])


def _processed64(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """float64 temperature -> top-k -> top-p processing of one row of logits, written from the definitions."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[mass_before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def test_processed_distribution_matches_float64(rng):
    """``probabilities`` against a float64 computation, on fresh logits, temperatures, top-k and top-p, all
    settings at once and then one setting per row (ties are improbable in continuous random logits, so
    the kept sets agree)."""
    v = 300
    logits = (rng.standard_normal((5, v)) * rng.uniform(0.5, 8)).astype(np.float32)
    combos = [(None, None), (int(rng.integers(1, v)), None), (None, float(rng.uniform(0.05, 0.99))),
              (int(rng.integers(2, v)), float(rng.uniform(0.05, 0.99))),
              (None, 1e-39)]  # below float32's smallest normal: still the most probable token
    temps = [float(rng.uniform(0.2, 3)) for _ in combos]
    runs = [([t] * 5, [k] * 5, [p] * 5) for t, (k, p) in zip(temps, combos)]
    runs.append((temps, [k for k, _ in combos], [p for _, p in combos]))  # row i: combination i
    for ts, ks, ps in runs:
        got = np.asarray(probabilities(jnp.asarray(logits), Sampling.of(ts, ks, ps, batch=5)))
        for row in range(logits.shape[0]):
            want = _processed64(logits[row], ts[row], ks[row], ps[row])
            # a kept token's float32 probability may underflow to 0; a dropped one must be exactly 0
            assert not np.any((got[row] > 0) & (want == 0))
            np.testing.assert_array_equal(got[row][want > 1e-30] > 0, True)
            np.testing.assert_allclose(got[row], want, rtol=2e-5, atol=1e-7)


def test_prompt_filling_max_len_exactly_is_accepted(tiny_model):
    res = generate(tiny_model, [list(range(3, 11))], max_new_tokens=4, max_len=12, gamma=5, eos_token_id=-1)
    assert len(res.sequences[0]) == 4 and res.finish_reasons == ["length"]


def test_zero_and_one_new_tokens(tiny_model):
    res = generate(tiny_model, [[3, 4, 5], [6]], max_new_tokens=0)
    assert [len(s) for s in res.sequences] == [0, 0]
    assert res.finish_reasons == ["length", "length"]
    assert list(res.lengths) == [0, 0] and res.stats["generated"] == 0
    # one new token: the prefill's, no round runs
    ref = generate(tiny_model, [[3, 4, 5], [6]], max_new_tokens=1, method="w4a16", eos_token_id=-1)
    res = generate(tiny_model, [[3, 4, 5], [6]], max_new_tokens=1, eos_token_id=-1)
    assert [s.tolist() for s in res.sequences] == [s.tolist() for s in ref.sequences]
    assert [len(s) for s in res.sequences] == [1, 1] and res.finish_reasons == ["length", "length"]
    assert res.stats["rounds"] == 0 and res.stats["drafted"] == 0


def predicted_counters(stop: int, gamma: int) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) when every draft is accepted and the sequence commits ``stop + 1``
    tokens (index 0 from the prefill): each round commits min(gamma+1, left), of which
    min(gamma, committed) are drafts (the EOS or the budget may cut a round inside its drafts)."""
    left, rounds, accepted = stop, 0, 0
    while left > 0:
        c = min(gamma + 1, left)
        rounds, accepted, left = rounds + 1, accepted + min(gamma, c), left - c
    return rounds, gamma * rounds, accepted


def _greedy_margin(params, cfg, prompt: list[int], seq: np.ndarray) -> float:
    """Smallest top-2 logit gap along a greedy path (no-cache W4A16 forward of prompt + seq)."""
    full = np.asarray(prompt + seq.tolist(), np.int32)[None]
    lg, _ = jit_forward(params, cfg, full, np.arange(full.shape[1], dtype=np.int32)[None], precision=W4A16)
    top2 = np.sort(np.asarray(lg[0, len(prompt) - 1:-1], np.float64), axis=-1)[:, -2:]
    return float(np.min(top2[:, 1] - top2[:, 0]))


def test_eos_inside_accepted_drafts_and_exact_counters(rng, monkeypatch):
    """Self-draft (the target weights as draft: every draft accepted) makes every counter predictable."""
    monkeypatch.setattr(gen_mod, "DRAFT_PRECISIONS", gen_mod.DRAFT_PRECISIONS + (W4A16,))
    gamma, new = 3, 12
    for _ in range(8):
        params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, bool(rng.integers(2))), None)
        model = memory_model(params, cfg)
        prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 2)]
        ref = generate(model, prompts, max_new_tokens=new, method="w4a16", eos_token_id=-1).sequences
        r0 = ref[0].tolist()
        # eos := a first occurrence (k >= 2) in one of the first gamma-1 draft slots of a round, so that
        # drafts after it in the same round are accepted and must be dropped, with budget left afterwards
        ks = [k for k in range(2, new - 2) if r0[k] not in r0[:k] and (k - 1) % (gamma + 1) < gamma - 1]
        if ks and min(_greedy_margin(params, cfg, p, s) for p, s in zip(prompts, ref)) > 2e-3:
            break
    else:
        pytest.fail("no tie-free random model with a usable EOS in 8 attempts")
    k = ks[-1]
    eos = r0[k]
    got = generate(model, prompts, max_new_tokens=new, method="qspec", draft="w4a16", gamma=gamma,
                   eos_token_id=eos)
    r1 = ref[1].tolist()
    stops = [k, r1.index(eos) if eos in r1 else new - 1]  # index of each sequence's last token
    for i, s in enumerate(stops):
        np.testing.assert_array_equal(got.sequences[i], ref[i][: s + 1])
    assert got.finish_reasons[0] == "stop" and got.sequences[0][-1] == eos
    assert got.finish_reasons[1] == ("stop" if eos in r1 else "length")
    want = np.sum([predicted_counters(s, gamma) for s in stops], axis=0)
    st = got.stats
    assert (st["rounds"], st["drafted"], st["accepted"]) == tuple(int(x) for x in want)
    assert st["generated"] == sum(s + 1 for s in stops)
    # identity: generated = batch (prefill tokens) + accepted + rounds - (rounds that committed no target token)
    cut = sum(s > 0 and (s - 1) % (gamma + 1) != gamma for s in stops)  # the last round ended inside its drafts
    assert st["generated"] == 2 + st["accepted"] + st["rounds"] - cut
    assert st["tokens_per_round"] == pytest.approx((st["generated"] - 2) / st["rounds"])


def test_sequences_finish_in_different_rounds_smollm2(smol, smol_batches):
    """EOS taken from prompt 0's greedy output; each sequence must equal its own W4A16 output cut at
    its first EOS, whatever round it finishes in (gamma=5, W4A8 drafts)."""
    # the reference must not stop on the tokenizer's EOS: the run below stops on another token only
    open_ref = generate(smol, smol_batches[4], max_new_tokens=FINISH_NEW, method="w4a16", chat=True, eos_token_id=-1)
    refs = [s.tolist() for s in open_ref.sequences]
    best = None
    for k in range(2, len(refs[0])):
        t = refs[0][k]
        if t in refs[0][:k]:
            continue
        stops = [r.index(t) if t in r else None for r in refs]
        score = len({s for s in stops}) + (None in stops)
        if best is None or score > best[0]:
            best = (score, t, stops)
    _, eos, stops = best
    assert len({s for s in stops}) >= 3, stops  # different finishing points (and rounds)
    gamma = 5
    got = generate(smol, smol_batches[4], max_new_tokens=FINISH_NEW, method="qspec", draft="w4a8", gamma=gamma,
                   chat=True, eos_token_id=eos)
    for i, (seq, ref, s) in enumerate(zip(got.sequences, refs, stops)):
        want = ref if s is None else ref[: s + 1]
        assert seq.tolist() == want, i
        assert got.finish_reasons[i] == ("stop" if s is not None else "length")
    st = got.stats
    assert st["drafted"] == gamma * st["rounds"] and 0 < st["accepted"] <= st["drafted"]
    # every round commits its accepted drafts + one target token, except possibly a sequence's last round
    # (cut by EOS / budget inside the drafts): 0 <= batch + accepted + rounds - generated <= batch
    slack = 4 + st["accepted"] + st["rounds"] - st["generated"]
    assert 0 <= slack <= 4, st


# ---------------------------------------------------------------------------------------------
# 6. one compiled loop, compiled once per shape
# ---------------------------------------------------------------------------------------------

def test_qspec_loop_is_one_while_loop_and_compiles_once(tiny_model, rng):
    cfg, params = tiny_model.config, tiny_model.checkpoint.params
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 7)]
    rt = Runtime(cfg)
    dec = Decoder(rt, None, W4A4, 4)
    tokens = np.zeros((2, 7), np.int32)
    tokens[0, :4], tokens[1] = prompts[0], prompts[1]
    state = prefilled(params, rt, tokens, np.array([4, 7], np.int32), 7, 19, 19)
    text = decode_jit.lower(params, dec, state).as_text()
    assert "stablehlo.while" in text
    # the jitted function is exactly one while loop: nothing (no round, no step) runs outside it
    outer = jax.make_jaxpr(lambda p, s: decode_jit(p, dec, s))(params, state)
    assert [e.primitive.name for e in outer.jaxpr.eqns] == ["jit"]
    assert [e.primitive.name for e in outer.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns] == ["while"]

    # a shape / static combination used nowhere else in this file: max_new_tokens=7, gamma=4, batch 2
    kw = dict(max_new_tokens=7, method="qspec", draft="w4a4", gamma=4, eos_token_id=-1)
    before = decode_jit._cache_size()
    a = generate(tiny_model, prompts, **kw)
    after_first = decode_jit._cache_size()
    b = generate(tiny_model, [p[::-1] for p in prompts], **kw)  # same shapes, other tokens
    assert after_first == before + 1
    assert decode_jit._cache_size() == after_first
    assert [len(s) for s in a.sequences] == [len(s) for s in b.sequences] == [7, 7]


@pytest.fixture
def replay_setup(tiny_model, rng):
    """(params, runtime, prompt lengths, a function making a fresh W4A16-prefilled state of 3 random prompts)."""
    cfg, params = tiny_model.config, tiny_model.checkpoint.params
    rt = Runtime(cfg)
    tokens = rng.integers(0, cfg.vocab_size, (3, 6)).astype(np.int32)
    lengths = np.array([6, 4, 5], np.int32)
    return params, rt, lengths, lambda: prefilled(params, rt, tokens, lengths, 12, 22, 22)


def test_replayed_acceptance_trace(replay_setup):
    """A trace recorded round by round, replayed in the loop, reproduces the greedy run exactly; a
    made-up trace drives the counters (every round accepts what the trace says)."""
    params, rt, lengths, fresh = replay_setup

    trace = hooks.acceptance_trace(params, fresh(), rt=rt, gamma=3, draft=W4A4)
    greedy = decode_jit(params, Decoder(rt, None, W4A4, 3), fresh())
    replayed = hooks.replay_loop(params, fresh(), jnp.asarray(trace), rt=rt, gamma=3, draft=W4A4)
    for a, b in zip((greedy.tokens, greedy.lengths, greedy.rounds, greedy.accepted),
                    (replayed.tokens, replayed.lengths, replayed.rounds, replayed.accepted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert trace.shape == (int(np.asarray(greedy.rounds).max()), 3)
    made_up = np.array([[3, 0, 2]], np.int32)  # every round: 3, 0 and 2 accepted drafts
    st = hooks.replay_loop(params, fresh(), jnp.asarray(made_up), rt=rt, gamma=3, draft=W4A4)
    # 11 tokens after the prefill's first: rounds of 4, 1 and 3 tokens -> 3, 11 and 4 rounds
    np.testing.assert_array_equal(np.asarray(st.rounds), [3, 11, 4])
    np.testing.assert_array_equal(np.asarray(st.lengths - lengths), [12, 12, 12])


def test_replayed_auto_loop_follows_its_cost_model(replay_setup, rng):
    """gamma="auto" with replayed acceptance: drafts that cost nothing pick the largest γ every round,
    so the run equals the γ = 4 replay of the same trace (clipped per round); drafts that cost as much
    as a W4A16 step never pay off, so every round is a W4A16 step and nothing is drafted."""
    params, rt, lengths, fresh = replay_setup

    trace = jnp.asarray(rng.integers(0, 6, (int(rng.integers(2, 6)), 3)), jnp.int32)  # recorded at γ 5
    # no weight bytes: a draft step costs its head and KV reads only, nothing here
    cheap = CostModel(weight_bytes=0.0, head_bytes=1e8, draft_head_bytes=0.0, kv_bytes=1e3, draft_kv_bytes=0.0)
    got = hooks.replay_auto_loop(params, fresh(), trace, rt=rt, gamma_max=4, draft=W4A4, costs=cheap)
    want = hooks.replay_loop(params, fresh(), trace, rt=rt, gamma=4, draft=W4A4)
    for a, b in zip((got.tokens, got.lengths, got.rounds, got.accepted, got.drafted),
                    (want.tokens, want.lengths, want.rounds, want.accepted, want.drafted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    costly = dataclasses.replace(cheap, draft_head_bytes=1e8, draft_kv_bytes=1e3)
    st = hooks.replay_auto_loop(params, fresh(), trace, rt=rt, gamma_max=4, draft=W4A4, costs=costly)
    np.testing.assert_array_equal(np.asarray(st.drafted), [0, 0, 0])
    # 11 tokens after the prefill's first, one W4A16 step each
    np.testing.assert_array_equal(np.asarray(st.rounds), [11, 11, 11])
    np.testing.assert_array_equal(np.asarray(st.lengths - lengths), [12, 12, 12])


def test_chat_conversations_and_system_prompt(smol, smollm2_tokenizer_json):
    """A conversation (a list of messages) and ``system=`` go through the chat template as transformers'
    own ``apply_chat_template`` renders them; a one-turn string equals its one-message conversation;
    malformed conversations and misplaced system prompts are refused."""
    from qspec_jax import api

    tok = smol.tokenizer
    convo = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
             {"role": "user", "content": "And 3 + 3?"}]
    want = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *convo], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    assert api.tokenize(smol, convo, chat=True, system="Be brief.") == [want]  # one conversation
    assert api.tokenize(smol, [convo, "And 3 + 3?"], chat=True) == [
        chat_prompt(tok, convo), chat_prompt(tok, [{"role": "user", "content": "And 3 + 3?"}])]
    res = generate(smol, [convo], max_new_tokens=3, chat=True, method="w4a16")
    assert len(res.sequences) == 1 and res.prompt_lengths[0] == len(chat_prompt(tok, convo))
    bad = [([{"role": "user"}], "message 0"), ([{"role": "bot", "content": "x"}], "role 'bot'"),
           ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "'system' only first"),
           ([{"role": "user", "content": 3}], "message 0")]
    for convo_bad, match in bad:
        with pytest.raises(ValueError, match=match):
            generate(smol, [convo_bad], max_new_tokens=2, chat=True)
    with pytest.raises(ValueError, match="needs chat=True"):
        generate(smol, [convo], max_new_tokens=2)
    with pytest.raises(ValueError, match="system= is a chat message"):
        generate(smol, ["hi"], max_new_tokens=2, system="Be brief.")
    with pytest.raises(ValueError, match="has a system message already"):
        generate(smol, [[{"role": "system", "content": "a"}, *convo]], max_new_tokens=2, chat=True, system="b")


def test_stop_strings_cut_after_the_completing_token(smol, rng):
    """``cut_at_stop`` against a brute force over every prefix: the fewest tokens whose text contains a
    stop string, and the text before its first occurrence; ``generate(stop=...)`` applies it to each
    sequence (finish reason "stop") and leaves sequences without a match as they were."""
    from qspec_jax.tokenizer import cut_at_stop

    tok = smol.tokenizer
    words = ["Answer", ":", " 12", "\n", "\n\n", "Question", " total", " is", " 7", ".", " ####", " 3 + 4"]
    for _ in range(20):
        text = "".join(rng.choice(words, int(rng.integers(3, 15))))
        ids = tok.encode(text, add_special_tokens=False)
        stops = list(rng.choice(["\n\n", "Question:", "####", " is 7", "zzz"], int(rng.integers(1, 3)), replace=False))
        full = tok.decode(ids, skip_special_tokens=True)
        found = [full.find(s) for s in stops if s in full]
        got = cut_at_stop(tok, ids, stops)
        if not found:
            assert got is None
            continue
        n = next(n for n in range(1, len(ids) + 1)
                 if any(s in tok.decode(ids[:n], skip_special_tokens=True) for s in stops))
        assert list(got[0]) == ids[:n] and got[1] == full[:min(found)]
    ref = generate(smol, ["Count from 1 to 20, one number per line."], max_new_tokens=24, chat=True, method="w4a16",
                   eos_token_id=-1)
    text = ref.texts[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a string the output holds
    got = generate(smol, ["Count from 1 to 20, one number per line.", "Say hi."], max_new_tokens=24, chat=True,
                   method="qspec", gamma=2, eos_token_id=-1, stop=[stop, "no such text ~~~"])
    cut = cut_at_stop(smol.tokenizer, ref.sequences[0], [stop])
    assert got.finish_reasons[0] == "stop" and got.texts[0] == cut[1] == text[:text.find(stop)]
    assert list(got.sequences[0]) == list(cut[0]) and got.lengths[0] == len(cut[0])
    for bad in ("", [], ["ok", ""], 5, [None]):
        with pytest.raises(ValueError, match="stop must be"):
            generate(smol, ["hi"], max_new_tokens=2, stop=bad)


def test_logprobs_match_a_float64_recomputation(tiny_model, rng):
    """``return_logprobs``: each generated token's log-probability equals log-softmax in float64 of the
    logits one forward over prompt + output gives at its position (W4A16, float32 compute); QSPEC's
    (the verifier's) equal W4A16 decoding's bitwise, greedy; W16A16 decoding reports its own model's."""
    cfg, params = tiny_model.config, tiny_model.checkpoint.params
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 9, 3)]
    kw = dict(max_new_tokens=int(rng.integers(5, 12)), eos_token_id=-1, return_logprobs=True)
    ar = generate(tiny_model, prompts, method="w4a16", **kw)
    for gamma in (2, "auto"):
        qs = generate(tiny_model, prompts, method="qspec", gamma=gamma, **kw)
        for a, b in zip(ar.logprobs, qs.logprobs):
            np.testing.assert_array_equal(a, b)
    # W4A16 rounds each matmul input to bf16: the decode's and the one forward's float32 sums, added in
    # other orders, can round one input element to neighbouring bf16 values (2**-8 apart); W16A16 rounds none
    for method, precision, tol in (("w4a16", W4A16, 5e-3), ("w16a16", W16A16, 1e-4)):  # prefill and steps alike
        res = ar if method == "w4a16" else generate(tiny_model, prompts, method=method, **kw)
        for p, seq, lp in zip(prompts, res.sequences, res.logprobs):
            full = np.array(p + seq.tolist(), np.int32)
            logits, _ = jit_forward(params, cfg, jnp.asarray(full[None, :-1]), jnp.arange(len(full) - 1)[None],
                                    precision=precision)
            x = np.asarray(logits[0, len(p) - 1:], np.float64)
            x -= x.max(-1, keepdims=True)
            want = x[np.arange(len(seq)), seq] - np.log(np.exp(x).sum(-1))
            assert lp.shape == seq.shape and lp.dtype == np.float32
            np.testing.assert_allclose(lp, want, rtol=tol, atol=tol)
    assert generate(tiny_model, prompts, max_new_tokens=3).logprobs is None
    with pytest.raises(ValueError, match="return_logprobs"):
        generate(tiny_model, prompts, max_new_tokens=3, return_logprobs=1)


@pytest.mark.parametrize("method,gamma", [("qspec", 2), ("qspec", "auto"), ("w4a16", None)])
def test_stream_generate_yields_generate_s_tokens(tiny_model, rng, method, gamma):
    """Chunks of 1 or 3 rounds: the tokens yielded, in order, are exactly generate()'s (bitwise), each
    sequence reports finished once done, and the last update carries generate()'s result."""
    from qspec_jax.api import stream_generate

    prompts = [rng.integers(0, TINY.vocab_size, int(n)).tolist() for n in rng.integers(2, 9, 3)]
    kw = dict(max_new_tokens=int(rng.integers(6, 14)), method=method, eos_token_id=int(rng.integers(0, TINY.vocab_size)),
              **({} if gamma is None else {"gamma": gamma}))
    want = generate(tiny_model, prompts, **kw)
    longest = max(len(s) for s in want.sequences)
    counts = {}
    for chunk in (1, 3):
        updates = list(stream_generate(tiny_model, prompts, chunk_rounds=chunk, **kw))
        counts[chunk] = len(updates)
        assert updates[-1].result is not None
        assert all(u.result is None for u in updates[:-1]) and all(updates[-1].finished)
        for i, seq in enumerate(want.sequences):
            got = np.concatenate([u.tokens[i] for u in updates])
            np.testing.assert_array_equal(got, seq)
            np.testing.assert_array_equal(updates[-1].result.sequences[i], seq)
            flags = [u.finished[i] for u in updates]
            assert flags == sorted(flags)  # once finished, it stays so
        assert updates[-1].result.finish_reasons == want.finish_reasons
    # one update per chunk of rounds; every round commits at least one token of each unfinished sequence
    assert counts[3] == -(-counts[1] // 3)
    if method == "w4a16":
        assert counts[1] == max(1, longest - 1)
    else:
        assert counts[1] <= max(1, longest - 1)
    with pytest.raises(ValueError, match="chunk_rounds"):
        next(stream_generate(tiny_model, prompts, chunk_rounds=0, **kw))
    with pytest.raises(TypeError, match="stream_generate.*gama"):  # generate's options only, by name
        next(stream_generate(tiny_model, prompts, gama=3, **kw))
    with pytest.raises(TypeError, match="max_new_tokens"):
        next(stream_generate(tiny_model, prompts, method=method))


def test_stream_generate_text_and_stop_strings(smol):
    """Streamed text joins to generate()'s text; a stop string ends a sequence early (its text is never
    yielded, even where it spans chunks) and the result equals generate(stop=...)'s."""
    from qspec_jax.api import stream_generate

    prompts = ["Count from 1 to 20, one number per line.", "Name three colors."]
    kw = dict(max_new_tokens=20, chat=True, method="qspec", gamma=2, eos_token_id=-1)
    ref = generate(smol, prompts, **kw)
    updates = list(stream_generate(smol, prompts, chunk_rounds=2, **kw))
    assert ["".join(u.texts[i] for u in updates) for i in range(2)] == ref.texts
    stop = ref.texts[0][len(ref.texts[0]) // 2:len(ref.texts[0]) // 2 + 2]
    want = generate(smol, prompts, stop=[stop], **kw)
    updates = list(stream_generate(smol, prompts, chunk_rounds=1, stop=[stop], **kw))
    got = updates[-1].result
    assert got.texts == want.texts and got.finish_reasons[0] == "stop"
    assert ["".join(u.texts[i] for u in updates) for i in range(2)] == want.texts
    for i in range(2):
        np.testing.assert_array_equal(np.concatenate([u.tokens[i] for u in updates]), want.sequences[i])
    # the first sequence stopped early: fewer loop rounds than running it to max_new_tokens
    assert got.stats["rounds"] <= ref.stats["rounds"]


def test_int4_draft_head_is_rtn_of_the_head_and_keeps_qspec_exact(rng):
    """An INT4 draft head (of every row, or of a ranking's first rows) holds the lm_head's rows to
    within round-to-nearest's error (float64 bound from each group's range); the drafts' logits are those
    rows' W4A16 product (bfloat16 activations); greedy QSPEC with it equals W4A16; the cost model counts its packed bytes."""
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    head = np.asarray(params["embed"] if cfg.tie_word_embeddings else params["lm_head"], np.float64)
    ranking = rng.permutation(cfg.vocab_size).astype(np.int32)
    rows = int(rng.integers(8, cfg.vocab_size // 2))
    for order, n in ((None, None), (ranking, rows)):
        q = with_draft_head(params, cfg, order, n, bits=4)["draft_head"]
        ids = np.arange(cfg.vocab_size) if order is None else ranking[:rows]
        np.testing.assert_array_equal(np.asarray(q["ids"]), ids)
        w = q["w"]
        g = w.group_size
        want = head[ids].reshape(len(ids), -1, g)
        span = (want.max(-1) - want.min(-1))[..., None]
        err = np.abs(np.asarray(dequantize(w), np.float64).reshape(want.shape) - want)
        assert np.all(err <= span / 30 * (1 + 2e-3) + np.abs(want).max(-1, keepdims=True) * 2e-3), err.max()
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    q4 = with_draft_head(params, cfg, ranking, rows, bits=4)
    as_float = {**q4, "draft_head": {"w": dequantize(q4["draft_head"]["w"]), "ids": q4["draft_head"]["ids"]}}
    run = lambda p: np.asarray(forward(p, cfg, toks, pos, precision=W4A8, draft_head=True)[0])  # noqa: E731
    got, want = run(q4), run(as_float)
    # W4A16 rounds the activations to bfloat16 (2**-9 relative each, summed over the hidden size): a few
    # hundredths of the largest logit; a wrong row or order is off by the logits' own spread
    np.testing.assert_allclose(got[..., ranking[:rows]], want[..., ranking[:rows]], rtol=0,
                               atol=0.03 * np.abs(want[..., ranking[:rows]]).max())
    assert np.all(np.delete(got, ranking[:rows], axis=-1) == -np.inf)
    c = cost_model(q4, cfg, jnp.float32, None, None)
    w = q4["draft_head"]["w"]
    assert c.draft_head_bytes == sum(np.asarray(a).nbytes for a in (w.packed, w.scales, w.mins)) < c.head_bytes
    model = memory_model(params, cfg, draft_vocab=ranking)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 9)]
    ref = generate(model, prompts, max_new_tokens=24, method="w4a16")
    for kw in (dict(draft_head_bits=4), dict(draft_head=rows, draft_head_bits=4)):
        got = generate(model, prompts, max_new_tokens=24, method="qspec", draft="w4a8", gamma=3, **kw)
        assert got.stats["drafted"] > 0
        for a, b in zip(got.sequences, ref.sequences):
            np.testing.assert_array_equal(a, b)
    built = dict(model._built)  # each head is built once per model, not on every call; W4A16 reads no head
    assert set(built) == {(None, 1), ((None, 4), 1), ((rows, 4), 1)}
    generate(model, prompts, max_new_tokens=4, method="qspec", draft="w4a8", gamma=3, draft_head_bits=4)
    assert set(model._built) == set(built) and all(model._built[k] is v for k, v in built.items())
    for method, bits in (("qspec", 8), ("qspec", "4"), ("w4a16", 4)):
        with pytest.raises(ValueError, match="draft_head_bits"):
            generate(model, prompts, max_new_tokens=4, method=method, draft_head_bits=bits)
