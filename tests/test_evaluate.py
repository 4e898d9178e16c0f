"""Perplexity / token scores against float64 numpy, and simulate_rounds against a run-length formula."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import TINY, jit_forward, random_source
from convert.pipeline import convert_model
from qspec_jax.evaluate import perplexity, simulate_rounds, token_scores
from pallas_kernels.precision import W16A16


def rounds_by_runs(agree: np.ndarray, gamma: int) -> int:
    """Cut the sequence after every disagreement: blocks ``T^r F`` and a trailing ``T^r``.

    Inside a run of r agreements a round commits gamma accepted tokens plus one target token
    (itself an agreeing position) while more than gamma remain; the round that reaches the
    disagreement accepts what is left and commits the disagreeing position as its target token.
    So a block ``T^r F`` takes ``r // (gamma + 1) + 1`` rounds and the tail ``ceil(r / (gamma + 1))``.
    """
    runs = "".join("T" if a else "F" for a in agree).split("F")
    *blocks, tail = [len(r) for r in runs]
    return sum(r // (gamma + 1) + 1 for r in blocks) + -(-tail // (gamma + 1))


@pytest.mark.parametrize("gamma", range(1, 7))
def test_simulate_rounds_matches_run_lengths(gamma, rng):
    for _ in range(40):
        n = int(rng.integers(0, 60))
        agree = rng.random(n) < rng.uniform(0.0, 1.0)
        assert simulate_rounds(agree, gamma) == rounds_by_runs(agree, gamma)


@pytest.mark.parametrize("gamma", range(1, 7))
def test_simulate_rounds_corner_cases(gamma, rng):
    n = int(rng.integers(1, 50))
    assert simulate_rounds(np.ones(n, bool), gamma) == math.ceil(n / (gamma + 1))
    assert simulate_rounds(np.zeros(n, bool), gamma) == n
    assert simulate_rounds(np.zeros(0, bool), gamma) == 0


def np_nll(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float64 ``-log softmax(logits[:, t])[tokens[:, t + 1]]`` for t < T - 1."""
    z = np.asarray(logits, np.float64)[:, :-1]
    m = z.max(-1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    b, t = tokens.shape
    return -logp[np.arange(b)[:, None], np.arange(t - 1)[None], tokens[:, 1:]]


def full_logits(params, cfg, tokens):
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(jit_forward(params, cfg, tokens.astype(np.int32), pos, precision=W16A16)[0])


@pytest.fixture
def tiny_model(rng):
    params, cfg, _ = convert_model(random_source(TINY, rng), None, None)
    return params, cfg


def test_token_scores_match_numpy(tiny_model, rng):
    params, cfg = tiny_model
    tokens = rng.integers(0, cfg.vocab_size, (3, 10)).astype(np.int32)
    nll, top = token_scores(params, cfg, tokens, precision=W16A16)
    logits = full_logits(params, cfg, tokens)
    assert nll.shape == (3, 9) and top.shape == (3, 10)
    np.testing.assert_allclose(nll, np_nll(logits, tokens), rtol=1e-5, atol=1e-5)
    # argmax bitwise, except where the top two logits are within rounding of each other
    srt = np.sort(logits, axis=-1)
    clear = srt[..., -1] - srt[..., -2] > 1e-4
    assert clear.mean() > 0.9 and np.array_equal(top[clear], np.argmax(logits, axis=-1)[clear])


def test_perplexity_matches_numpy_windows(tiny_model, rng):
    params, cfg = tiny_model
    window, n_windows = 8, 5
    extra = int(rng.integers(1, window))  # a trailing partial window, which must be dropped
    ids = rng.integers(0, cfg.vocab_size, n_windows * window + extra)
    got = perplexity(params, cfg, ids, window=window, precision=W16A16, batch=2)  # batches of 2, 2, 1
    windows = ids[: n_windows * window].reshape(n_windows, window)
    want = math.exp(np_nll(full_logits(params, cfg, windows), windows).mean())
    assert got == pytest.approx(want, rel=1e-5)


def test_perplexity_needs_one_window(tiny_model, rng):
    params, cfg = tiny_model
    window = int(rng.integers(2, 12))
    with pytest.raises(ValueError, match=f"need at least {window} tokens"):
        perplexity(params, cfg, rng.integers(0, cfg.vocab_size, window - 1), window=window, precision=W16A16)


def test_bad_windows_and_ids_are_refused(tiny_model, rng):
    """A window of one token (no prediction: NaN), past the model's positions, ids outside the vocabulary
    or of a float type (gathered or truncated silently) are refused, as are batch sizes below 1."""
    params, cfg = tiny_model
    ids = rng.integers(0, cfg.vocab_size, 64)
    for window in (0, 1, 8.0, cfg.max_position_embeddings + 1):
        with pytest.raises(ValueError, match="window must be an integer in"):
            perplexity(params, cfg, ids, window=window, precision=W16A16)
    for batch in (0, -1, 2.0):
        with pytest.raises(ValueError, match="batch must be an integer >= 1"):
            perplexity(params, cfg, ids, window=8, precision=W16A16, batch=batch)
    i = int(rng.integers(len(ids)))
    for bad, match in [(ids.astype(np.float32), "must be integers"), (ids.reshape(8, 8), "1-D"),
                       (np.where(np.arange(len(ids)) == i, cfg.vocab_size, ids), r"must lie in \[0, 97\)"),
                       (np.where(np.arange(len(ids)) == i, -1, ids), r"must lie in \[0, 97\)")]:
        with pytest.raises(ValueError, match=match):
            perplexity(params, cfg, bad, window=8, precision=W16A16)
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        token_scores(params, cfg, ids[:10], precision=W16A16)


def test_perplexity_passes_its_kernels_to_the_forward(tiny_model, rng, monkeypatch):
    """``kernels`` reaches the forward (bench.fidelity's --kernels, for its perplexity column), resolved;
    an unknown name is refused. (Full-sequence forwards have no row tile, so they take the XLA paths
    either way: with "pallas", W4A16 as a bf16 dot, :func:`qspec_jax.kernels.linear`.)"""
    import qspec_jax.evaluate as evaluate

    params, cfg = tiny_model
    ids = rng.integers(0, cfg.vocab_size, 16)
    seen = []
    real_forward = evaluate.forward
    monkeypatch.setattr(evaluate, "forward",
                        lambda *a, **k: seen.append(k["execution"].backend) or real_forward(*a, **k))
    perplexity(params, cfg, ids, window=8, precision=W16A16, kernels="interpret")
    assert seen == ["interpret"]  # traced here: no other test scores with "interpret"
    with pytest.raises(ValueError, match="unknown kernels 'triton'"):
        perplexity(params, cfg, ids, window=8, precision=W16A16, kernels="triton")
