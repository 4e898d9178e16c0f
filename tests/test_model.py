"""The Flax Llama against an independent float64 numpy decoder, KV-cache consistency, quantized modes."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import TINY, jit_forward, random_source, tiny_variant
from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from pallas_kernels.layout import QuantizedWeight, dequantize
import qspec_jax.model as model_mod
from pallas_kernels.reference import quantize_kv as ref_quantize_kv
from bench.hooks import unstack_layers
from qspec_jax.model import KVCache, KVShadow, Linear, Llama, forward, init_cache, sync_shadow
from pallas_kernels.precision import W4A4, W4A16, W16A16, parse_precision
from qspec_jax.kernels import Execution

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

CONFIGS = {
    "gqa-untied": tiny_variant(num_heads=4, num_kv_heads=2, tie_word_embeddings=False, attention_bias=False),
    "bias-tied": tiny_variant(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, attention_bias=True),
    "llama3-rope": tiny_variant(num_heads=4, num_kv_heads=1, rope_theta=10000.0,
                                rope_scaling=tuple(sorted(LLAMA3_SCALING.items()))),
}


# ----------------------------------------------------------------------------- numpy float64 reference

def ref_inv_freq(cfg) -> np.ndarray:
    """HF ``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``, one frequency at a time."""
    d = cfg.head_dim
    out = []
    for i in range(d // 2):
        f = cfg.rope_theta ** (-(2.0 * i) / d)
        if cfg.rope_scaling is not None:
            sc = dict(cfg.rope_scaling)
            factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
            old = sc["original_max_position_embeddings"]
            wavelen = 2.0 * math.pi / f
            if wavelen < old / hi:  # high frequency: unchanged
                pass
            elif wavelen > old / lo:  # low frequency: divided by the factor
                f = f / factor
            else:  # interpolate between the two
                smooth = (old / wavelen - lo) / (hi - lo)
                f = (1.0 - smooth) * f / factor + smooth * f
        out.append(f)
    return np.array(out, np.float64)


def ref_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x[T, heads, d]`` written as a complex rotation of (x[i], x[i + d/2])."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    z = z * np.exp(1j * pos[:, None, None] * inv_freq[None, None, :])
    return np.concatenate([z.real, z.imag], axis=-1)


def ref_rmsnorm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def ref_forward(p: dict, cfg, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 logits ``[B, T, V]`` of the HF Llama decoder (causal in sequence order)."""
    H, KV, hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    inv = ref_inv_freq(cfg)
    L = p["layers"]
    out = []
    for b in range(tokens.shape[0]):
        x = p["embed"][tokens[b]]
        T = x.shape[0]
        pos = positions[b].astype(np.float64)
        for l in range(cfg.num_layers):
            h = ref_rmsnorm(x, L["attn_norm"]["scale"][l], cfg.rms_norm_eps)
            wqkv = L["attn"]["qkv"]["w"][l]
            wq, wk, wv = wqkv[: H * hd], wqkv[H * hd:(H + KV) * hd], wqkv[(H + KV) * hd:]
            q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
            if cfg.attention_bias:
                bq = L["attn"]["qkv"]["b"][l]
                q, k, v = q + bq[: H * hd], k + bq[H * hd:(H + KV) * hd], v + bq[(H + KV) * hd:]
            q = ref_rope(q.reshape(T, H, hd), pos, inv)
            k = ref_rope(k.reshape(T, KV, hd), pos, inv)
            v = v.reshape(T, KV, hd)
            heads = []
            for head in range(H):
                kvh = head // (H // KV)  # HF repeat_kv: kv head j serves query heads j*g .. j*g+g-1
                s = q[:, head] @ k[:, kvh].T / math.sqrt(hd)
                s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
                pr = np.exp(s - s.max(-1, keepdims=True))
                pr = pr / pr.sum(-1, keepdims=True)
                heads.append(pr @ v[:, kvh])
            x = x + np.concatenate(heads, axis=-1) @ L["attn"]["o"]["w"][l].T
            h = ref_rmsnorm(x, L["mlp_norm"]["scale"][l], cfg.rms_norm_eps)
            wgu = L["mlp"]["gate_up"]["w"][l]
            g, u = h @ wgu[:F].T, h @ wgu[F:].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ L["mlp"]["down"]["w"][l].T
        x = ref_rmsnorm(x, p["final_norm"]["scale"], cfg.rms_norm_eps)
        head = p["embed"] if cfg.tie_word_embeddings else p["lm_head"]
        out.append(x @ head.T)
    return np.stack(out)


def ref_dequant(w: QuantizedWeight) -> np.ndarray:
    """float64 weights of a (stacked) packed weight per the layout doc: in each block of 64 k (a
    shorter last block of length L), byte j holds element j (low nibble) and j + L/2 (high)."""
    packed = np.asarray(w.packed)
    k = packed.shape[-1] * 2
    u = np.empty((*packed.shape[:-1], k), np.float64)
    for start in range(0, k, 64):
        half = min(64, k - start) // 2
        block = packed[..., start // 2:start // 2 + half]
        u[..., start:start + half] = block % 16
        u[..., start + half:start + 2 * half] = block // 16
    s = np.repeat(np.asarray(w.scales, np.float64), w.group_size, axis=-1)
    if w.mins is None:
        return s * (u - 8.0)
    return s * u + np.repeat(np.asarray(w.mins, np.float64), w.group_size, axis=-1)


def to_f64(params) -> dict:
    return jax.tree.map(lambda a: ref_dequant(a) if isinstance(a, QuantizedWeight) else np.asarray(a, np.float64),
                        params, is_leaf=lambda a: isinstance(a, QuantizedWeight))


# ----------------------------------------------------------------------------- helpers

def random_params(cfg, rng, tokens, positions) -> dict:
    """Params in the model's layout (from ``Llama.init``), redrawn so norms, biases and attention matter."""
    init = Llama(cfg, W16A16).init(jax.random.key(int(rng.integers(2**31))), tokens, positions)["params"]

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if "scale" in name:
            a = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name.endswith("['b']"):
            a = 0.5 * rng.standard_normal(shape)
        elif "embed" in name:
            a = rng.standard_normal(shape)
        else:  # linear weights [.., out, in]
            a = 1.5 * rng.standard_normal(shape) / math.sqrt(shape[-1])
        return np.asarray(a, np.float32)

    return jax.tree_util.tree_map_with_path(draw, init)


def random_batch(cfg, rng, b, t, gaps=True):
    """Random tokens; positions increase along the sequence, with random offsets and gaps (so RoPE
    distances differ from index distances) unless ``gaps`` is False (then ``0..t-1``)."""
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    if not gaps:
        return tokens, np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    steps = np.concatenate([rng.integers(0, 40, (b, 1)), rng.integers(1, 5, (b, t - 1))], axis=1)
    return tokens, np.cumsum(steps, axis=1).astype(np.int32)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_float64_reference(name, rng):
    cfg = CONFIGS[name]
    tokens, positions = random_batch(cfg, rng, 2, 9)
    params = random_params(cfg, rng, tokens, positions)
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)
    assert ("b" in params["layers"]["attn"]["qkv"]) == cfg.attention_bias
    logits, cache = jit_forward(params, cfg, tokens, positions, precision=W16A16)
    assert cache is None and logits.dtype == jnp.float32
    ref = ref_forward(to_f64(params), cfg, tokens, positions)
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(np.asarray(logits, np.float64) - ref).max() < 1e-4 * scale


def test_forward_packed_weights_w16a16_matches_reference(rng):
    """The w16a16 path over a converted packed tree equals the numpy decoder on numpy-dequantized weights."""
    cfg = CONFIGS["gqa-untied"]
    params, cfg, _ = convert_model(random_source(cfg, rng), QuantScheme(16, bool(rng.integers(2))), None)
    tokens, positions = random_batch(cfg, rng, 2, 7)
    logits, _ = jit_forward(params, cfg, tokens, positions, precision=W16A16)
    ref = ref_forward(to_f64(params), cfg, tokens, positions)
    assert np.abs(np.asarray(logits, np.float64) - ref).max() < 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_kv_cache_chunks_match_full_forward(rng):
    cfg = CONFIGS["gqa-untied"]
    t, prefill, chunks = 11, 4, (1, 3, 1, 1, 1)
    assert prefill + sum(chunks) == t
    tokens, positions = random_batch(cfg, rng, 2, t, gaps=False)
    params = random_params(cfg, rng, tokens, positions)
    full, _ = jit_forward(params, cfg, tokens, positions, precision=W16A16)
    cache = init_cache(cfg, 2, t + 5)  # spare slots beyond the sequence must stay invisible
    got, cache = jit_forward(params, cfg, tokens[:, :prefill], positions[:, :prefill], cache, precision=W16A16)
    parts, start = [got], prefill
    for n in chunks:
        got, cache = jit_forward(params, cfg, tokens[:, start:start + n], positions[:, start:start + n], cache,
                          precision=W16A16)
        parts.append(got)
        start += n
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=0, atol=1e-5 * max(1.0, np.abs(full).max()))
    # the cache holds one entry per position, zero beyond the sequence
    assert cache.k.shape == (cfg.num_layers, 2, t + 5, cfg.num_kv_heads, cfg.head_dim)
    assert not np.any(np.asarray(cache.k)[:, :, t:]) and np.all(np.any(np.asarray(cache.k)[:, :, :t], axis=-1))


def test_prompt_forward_attends_over_its_own_keys_and_gives_the_asked_logits(rng):
    """A ``causal_prompt`` forward (the prefill's: each query over the new keys alone) gives the logits and
    cache of attending over the whole cache, and ``logits_at`` picks rows of those logits."""
    cfg = CONFIGS["gqa-untied"]
    t = int(rng.integers(3, 9))
    tokens, positions = random_batch(cfg, rng, 2, t, gaps=False)
    params = random_params(cfg, rng, tokens, positions)
    cache = init_cache(cfg, 2, t + int(rng.integers(1, 6)))  # spare slots: masked on one side, absent on the other
    full, want_cache = forward(params, cfg, tokens, positions, cache, precision=W16A16)
    at = jnp.asarray(rng.integers(0, t, (2, 2)), jnp.int32)
    got, got_cache = forward(params, cfg, tokens, positions, cache, precision=W16A16,
                             execution=Execution().for_prompt(), logits_at=at)
    want = np.take_along_axis(np.asarray(full), np.asarray(at)[..., None], axis=1)
    tol = 1e-5 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    for a, b in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)
    for bad, msg in ((at.astype(jnp.float32), "integers"), (at[:1], "batch 2"), (at[0], r"\[batch, K\]"),
                     (at.at[0, 0].set(t), "must index the")):
        with pytest.raises(ValueError, match=msg):
            forward(params, cfg, tokens, positions, cache, precision=W16A16, logits_at=bad)
    with pytest.raises(ValueError, match="no row tile"):
        Execution("reference", 8, causal_prompt=True)
    shifted = positions + np.arange(2)[:, None]  # row 1 starts at 1: its keys would not be the prompt's own
    with pytest.raises(ValueError, match="positions 0..T-1 in every row"):
        forward(params, cfg, tokens, shifted, cache, precision=W16A16, execution=Execution().for_prompt())


@pytest.mark.parametrize("mode", ["w16a16", "w4a16"])
def test_unstacked_layers_give_the_stacked_results(mode, rng):
    """Per-layer trees (an unrolled layer loop, for plain-XLA baselines) and the stacked layers (a
    scan) compute the same logits and cache; float and packed weights."""
    cfg = CONFIGS["gqa-untied"]
    params, cfg, _ = convert_model(random_source(cfg, rng), QuantScheme(16, True), None)
    if mode == "w16a16":
        params = {**params, "layers": jax.tree.map(
            lambda a: np.asarray(dequantize(a, jnp.float32)) if isinstance(a, QuantizedWeight) else a,
            params["layers"], is_leaf=lambda a: isinstance(a, QuantizedWeight))}
    tokens, positions = random_batch(cfg, rng, 2, 6, gaps=False)
    per_layer = unstack_layers(params)
    assert isinstance(per_layer["layers"], list) and len(per_layer["layers"]) == cfg.num_layers
    outs = [jit_forward(p, cfg, tokens, positions, init_cache(cfg, 2, 8), precision=parse_precision(mode))
            for p in (params, per_layer)]
    (la, ca), (lb, cb) = outs
    (ka, va), (kb, vb) = (ca.k, ca.v), (cb.k, cb.v)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=1e-6, atol=1e-6 * float(np.abs(la).max()))
    for a, b in ((ka, kb), (va, vb)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_layer_count_mismatch_raises(rng):
    """Params, config and cache must agree on the number of layers (the layer scan would otherwise
    read clamped layers and drop cache writes silently)."""
    cfg = CONFIGS["gqa-untied"]
    tokens, positions = random_batch(cfg, rng, 1, 3, gaps=False)
    params = random_params(cfg, rng, tokens, positions)
    with pytest.raises(ValueError, match="layer counts differ"):
        forward(params, cfg, tokens, positions, jax.tree.map(lambda c: c[:-1], init_cache(cfg, 1, 8)), precision=W16A16)
    with pytest.raises(ValueError, match="layer counts differ"):
        forward(params, dataclasses.replace(cfg, num_layers=cfg.num_layers + 1), tokens, positions, precision=W16A16)


def _with_scales(cache, scales):
    """``cache`` with both shadow scale arrays replaced by ``scales``."""
    return dataclasses.replace(cache, draft=dataclasses.replace(cache.draft, k_scales=scales, v_scales=scales))


def test_cache_of_another_layout_raises(rng):
    """A cache made for another batch or head layout is refused: on the reference path a row past the
    cache's batch had its keys dropped and attended over another row's (no error, wrong logits)."""
    cfg = CONFIGS["gqa-untied"]
    tokens, positions = random_batch(cfg, rng, 2, 3, gaps=False)
    params = random_params(cfg, rng, tokens, positions)
    other = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads)
    for cache in (init_cache(cfg, 1, 8), init_cache(cfg, 3, 8), init_cache(other, 2, 8),
                  init_cache(cfg, 1, 8, shadow_bits=8), _with_scales(init_cache(cfg, 2, 8, shadow_bits=8),
                               jnp.zeros((cfg.num_layers, 2, 8, cfg.num_kv_heads), jnp.float32))):
        for row_tile in (None, 8):
            with pytest.raises(ValueError, match="KV cache"):
                forward(params, cfg, tokens, positions, cache, precision=W16A16,
                        execution=Execution.decode(row_tile=row_tile))
    logits, _ = forward(params, cfg, tokens, positions, init_cache(cfg, 2, 8, shadow_bits=4), precision=W16A16)
    assert logits.shape == (2, 3, cfg.vocab_size)


def test_bad_tokens_or_positions_raise(rng):
    """forward refuses float or mis-shaped inputs, and (untraced) token ids outside the vocabulary or
    negative positions: the embedding would gather NaN, and a negative position's cache write wraps to
    the cache's last slots."""
    cfg = CONFIGS["gqa-untied"]
    tokens, positions = random_batch(cfg, rng, 2, 3, gaps=False)
    params = random_params(cfg, rng, tokens, positions)
    cache = init_cache(cfg, 2, 8)
    bad_id, bad_pos = tokens.copy(), positions.copy()
    bad_id[rng.integers(2), rng.integers(3)] = rng.choice([-1, cfg.vocab_size])
    bad_pos[rng.integers(2), rng.integers(3)] = -1
    cases = [((bad_id, positions), "token ids must lie in"), ((tokens, bad_pos), "positions must be >= 0"),
             ((tokens.astype(np.float32), positions), "tokens must be integers"),
             ((tokens, positions.astype(np.float32)), "positions must be integers"),
             ((tokens, positions[:, :2]), r"\[batch, time\]"), ((tokens[0], positions[0]), r"\[batch, time\]"),
             ((tokens[:, :0], positions[:, :0]), "at least one token")]
    for (t, p), msg in cases:
        with pytest.raises(ValueError, match=msg):
            forward(params, cfg, t, p, cache, precision=W16A16)
    logits, _ = forward(params, cfg, tokens, positions, cache, precision=W16A16)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_quantized_modes(symmetric, rng):
    cfg = CONFIGS["gqa-untied"]
    params, cfg, _ = convert_model(random_source(cfg, rng), QuantScheme(16, symmetric), None)
    assert isinstance(params["layers"]["attn"]["qkv"]["w"], QuantizedWeight)
    tokens, positions = random_batch(cfg, rng, 4, 8)
    out = {m: np.asarray(jit_forward(params, cfg, tokens, positions, precision=parse_precision(m))[0], np.float64)
           for m in ("w16a16", "w4a16", "w4a8", "w4a4")}
    ref = out["w16a16"]
    assert rel_err(out["w4a16"], ref) < 5e-2
    per_seq = {m: np.mean([rel_err(out[m][i], ref[i]) for i in range(len(ref))]) for m in ("w4a8", "w4a4")}
    assert per_seq["w4a8"] < per_seq["w4a4"]
    assert rel_err(out["w4a8"], out["w4a16"]) > 1e-4  # the activations really are quantized (not run as w4a16)
    assert per_seq["w4a8"] < 0.1  # and w4a8 is still a close approximation


def test_linear_float_weight_needs_w16a16(rng):
    x = jnp.asarray(rng.standard_normal((2, 8)), jnp.float32)
    with pytest.raises(ValueError, match="needs packed INT4"):
        Linear(4, W4A4).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="needs packed INT4"):
        Linear(4, W4A16).init(jax.random.key(0), x)


def test_unknown_mode_raises(rng):
    cfg = CONFIGS["gqa-untied"]
    tokens, positions = random_batch(cfg, rng, 1, 3)
    with pytest.raises(ValueError, match="unknown mode"):
        Llama(cfg, parse_precision("w3a3")).init(jax.random.key(0), tokens, positions)


@pytest.mark.parametrize("bits", [8, 4])
def test_sync_shadow_requantizes_exactly_the_given_slots(rng, monkeypatch, bits):
    """sync_shadow, all layers at once (decode) and layer by layer (prefill), against quantize_kv of
    the float pair, bitwise: the given slots hold it, a position past the cache is dropped, every
    other slot keeps what it held; a cache without a shadow is returned as it is."""
    cfg = TINY
    b, s = 3, 16
    cache = init_cache(cfg, b, s, jnp.float32, shadow_bits=bits)
    k, v = (jnp.asarray(rng.standard_normal(cache.k.shape), jnp.float32) for _ in range(2))
    junk = tuple(jnp.asarray(rng.integers(-2**15, 2**15, a.shape), a.dtype) if a.dtype == jnp.int16
                 else jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in cache.draft.arrays)
    positions = jnp.asarray([[0, 5, 15], [3, 4, 16], [7, 9, 2]], jnp.int32)  # 16: past the cache
    outs = []
    for at_once in (10**6, 0):
        monkeypatch.setattr(model_mod, "SYNC_LAYERS_AT_ONCE", at_once)
        synced = sync_shadow(KVCache(k, v, KVShadow(*junk, bits=bits)), positions)
        outs.append([np.asarray(a) for a in jax.tree.leaves(synced)])
    for a, c in zip(*outs):
        np.testing.assert_array_equal(a, c)
    got = outs[0]
    (kw, ks), (vw, vs) = ref_quantize_kv(k, bits), ref_quantize_kv(v, bits)
    hit = np.zeros((b, s), bool)
    for i in range(b):
        for p in np.asarray(positions[i]):
            if p < s:
                hit[i, p] = True
    for stored, want, old in zip(got[2:4], (kw, vw), junk[:2]):
        np.testing.assert_array_equal(stored[:, hit], np.asarray(want)[:, hit])
        np.testing.assert_array_equal(stored[:, ~hit], np.asarray(old)[:, ~hit])
    for stored, want, old in zip(got[4:], (ks, vs), junk[2:]):  # head-major [L, B, KV, S]
        stored, old = np.swapaxes(stored, 2, 3), np.swapaxes(np.asarray(old), 2, 3)
        np.testing.assert_array_equal(stored[:, hit], np.asarray(want)[:, hit])
        np.testing.assert_array_equal(stored[:, ~hit], old[:, ~hit])
    assert sync_shadow(KVCache(k, v), positions).k is k

