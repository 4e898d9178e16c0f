"""Autoregressive ``generate`` (KV cache, padded batch, one while_loop) against a naive re-run-everything loop."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import TINY, jit_forward, memory_model, random_source
from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from qspec_jax.api import generate
from pallas_kernels.precision import parse_precision

NEW_TOKENS = 8
# how close the top-2 logits of a naive step may be before the draw counts as a near-tie (the cached
# and uncached paths differ in rounding, and w4a16 rounds activations to bfloat16)
TIE_MARGIN = {"w16a16": 1e-4, "w4a16": 2e-3}


def naive_generate(params, cfg, prompt: list[int], n: int, mode: str, eos_id: int | None):
    """Re-run the full no-cache forward on prompt + generated tokens; return (tokens, min top-2 margin)."""
    seq, out, margin = list(prompt), [], np.inf
    for _ in range(n):
        t = len(seq)
        logits, _ = jit_forward(params, cfg, np.asarray([seq], np.int32), np.arange(t, dtype=np.int32)[None],
                                precision=parse_precision(mode))
        last = np.asarray(logits[0, -1], np.float64)
        top2 = np.sort(last)[-2:]
        margin = min(margin, top2[1] - top2[0])
        nxt = int(np.argmax(last))
        out.append(nxt)
        seq.append(nxt)
        if nxt == eos_id:
            break
    return out, margin


def model_and_prompts(rng, mode: str):
    scheme = None if mode == "w16a16" else QuantScheme(16, bool(rng.integers(2)))
    params, cfg, _ = convert_model(random_source(TINY, rng), scheme, None)
    lengths = rng.choice(np.arange(1, 8), 3, replace=False)  # all different: right padding is exercised
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    return params, cfg, prompts


def draw_untied(rng, mode: str, eos_id, accept=lambda naive: True, attempts: int = 6):
    """A model + prompts whose naive greedy path has no near-ties (so argmax is rounding-robust)."""
    for _ in range(attempts):
        params, cfg, prompts = model_and_prompts(rng, mode)
        runs = [naive_generate(params, cfg, p, NEW_TOKENS, mode, eos_id) for p in prompts]
        if min(m for _, m in runs) > TIE_MARGIN[mode] and accept([r for r, _ in runs]):
            return params, cfg, prompts, [r for r, _ in runs]
    pytest.fail("no tie-free random model drawn in 6 attempts")  # ~1e-7 odds for a correct model


@pytest.mark.parametrize("mode", ["w16a16", "w4a16"])
def test_greedy_matches_naive_loop(mode, rng):
    eos = TINY.vocab_size - 1
    params, cfg, prompts, naive = draw_untied(rng, mode, eos)
    got = _greedy(params, cfg, prompts, mode, eos)
    assert got == naive


@pytest.mark.parametrize("several", [False, True])
def test_eos_stops_only_its_sequence(rng, several):
    """A sequence stops after its first token among the EOS ids (one id, or a list as Llama-3-Instruct's
    config gives); the other sequences run on. The stops are drawn from the naive continuations: prompt
    0's 4th token (and, with several, prompt 1's 3rd), which must not occur earlier in them."""
    mode = "w16a16"
    stops_of = lambda r: [r[0][3], r[1][2]] if several else [r[0][3]]  # noqa: E731

    def cut(seq, stops):
        return next((seq[: i + 1] for i, t in enumerate(seq) if t in stops), seq)

    def accept(r):
        return len(cut(r[0], stops_of(r))) == 4 and (not several or len(cut(r[1], stops_of(r))) == 3)

    params, cfg, prompts, naive = draw_untied(rng, mode, None, accept=accept)
    stops = stops_of(naive)
    got = _greedy(params, cfg, prompts, mode, stops if several else stops[0])
    assert got == [cut(r, stops) for r in naive]


def _greedy(params, cfg, prompts, mode, eos) -> list[list[int]]:
    res = generate(memory_model(params, cfg, quantized=mode != "w16a16"), prompts, max_new_tokens=NEW_TOKENS,
                   method=mode, eos_token_id=eos)
    return [s.tolist() for s in res.sequences]


def test_prompt_lengths_in_one_bucket_share_the_compiled_loop(rng):
    """Prompts are padded to a multiple of PROMPT_MULTIPLE: a longest prompt of 3 or of 40 tokens
    runs the same compiled prefill and loop (and the same tokens come out for the short one); 70
    tokens is the next bucket. (Evaluation over many prompts would otherwise compile per batch.)"""
    from qspec_jax.api import PROMPT_MULTIPLE
    from qspec_jax.core import decode_jit, prefill_jit

    assert PROMPT_MULTIPLE == 64
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    model = memory_model(params, cfg, quantized=True)
    short = rng.integers(0, cfg.vocab_size, 3).tolist()
    first = generate(model, [short], max_new_tokens=4, method="w4a16", eos_token_id=-1, max_len=200)
    sizes = decode_jit._cache_size(), prefill_jit._cache_size()
    generate(model, [rng.integers(0, cfg.vocab_size, 40).tolist()], max_new_tokens=4, method="w4a16",
             eos_token_id=-1, max_len=200)
    assert (decode_jit._cache_size(), prefill_jit._cache_size()) == sizes
    again = generate(model, [short], max_new_tokens=4, method="w4a16", eos_token_id=-1, max_len=200)
    np.testing.assert_array_equal(again.sequences[0], first.sequences[0])
    generate(model, [rng.integers(0, cfg.vocab_size, 70).tolist()], max_new_tokens=4, method="w4a16",
             eos_token_id=-1, max_len=200)
    assert decode_jit._cache_size() == sizes[0] + 1


def test_default_dtype_follows_the_backend(monkeypatch):
    """``generate(dtype=None)``'s resolver: bfloat16 on a GPU backend, float32 on any other."""
    import jax
    import jax.numpy as jnp

    from qspec_jax import api

    assert api.default_dtype("gpu") == jnp.bfloat16
    assert api.default_dtype("cpu") == api.default_dtype("tpu") == jnp.float32
    for backend, want in (("gpu", jnp.bfloat16), ("cpu", jnp.float32)):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert api.default_dtype() == want


def test_dtype_none_is_float32_on_cpu(rng):
    """On the CPU ``dtype=None`` decodes exactly as ``dtype=float32`` (same tokens, greedy and sampled)."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "gpu":
        pytest.skip("None means bfloat16 on a GPU")
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, True), None)
    model = memory_model(params, cfg)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 6)]
    for kw in (dict(method="w4a16"), dict(method="qspec", temperature=1.0, seed=3)):
        got = generate(model, prompts, max_new_tokens=6, eos_token_id=-1, **kw)
        want = generate(model, prompts, max_new_tokens=6, eos_token_id=-1, dtype=jnp.float32, **kw)
        for a, b in zip(got.sequences, want.sequences):
            np.testing.assert_array_equal(a, b)
