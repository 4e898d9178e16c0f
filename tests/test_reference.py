"""Reference numerics of the quantized matmuls against independent integer / float64 numpy math."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels import gpu_attention, reference
from pallas_kernels.layout import QuantizedWeight, dequantize, pack_codes, unpack_codes
from pallas_kernels.precision import PRECISIONS, parse_precision


def random_weight(rng, n: int, k: int, group: int, symmetric: bool) -> tuple[QuantizedWeight, np.ndarray]:
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (n, k // group)) * 10.0 ** rng.uniform(-3, -1)).astype(np.float16)
    mins = None if symmetric else rng.uniform(-0.1, 0.0, (n, k // group)).astype(np.float16)
    return QuantizedWeight(pack_codes(codes), scales, mins, group), codes


@pytest.mark.parametrize("k", [64, 192, 96, 40])
def test_pack_unpack_roundtrip(rng, k):
    """The nibble-planar layout, checked nibble by nibble: in each block of 64 k (a shorter last
    block of length L), byte j holds element j low and element j + L/2 high."""
    codes = rng.integers(0, 16, (3, 5, k), dtype=np.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (3, 5, k // 2) and packed.dtype == np.uint8
    for kk in range(k):
        start = kk - kk % 64
        length = min(64, k - start)
        j, high = (kk - start) % (length // 2), (kk - start) >= length // 2
        byte = packed[..., start // 2 + j]
        assert np.array_equal((byte >> 4) if high else (byte & 0xF), codes[..., kk]), kk
    assert np.array_equal(np.asarray(unpack_codes(jnp.asarray(packed))), codes)


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_codes(np.array([[0, 16]]))
    with pytest.raises(ValueError, match="even"):
        pack_codes(np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="must be integers"):  # a cast would truncate 1.7 to 1
        pack_codes(np.array([[1.7, 2.0]]))


@pytest.mark.parametrize("mode", [p.name for p in PRECISIONS])
def test_reference_matmul_refuses_inconsistent_weights(rng, mode):
    """Scales of another shape (which would broadcast), int8 bytes (whose high nibbles would unpack
    negative) and an input of the wrong width are refused by name, in every mode."""
    w, _ = random_weight(rng, 8, 64, 32, bool(rng.integers(2)))
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    bad = [(QuantizedWeight(w.packed, w.scales[:, :1], w.mins, 32), "scales shape"),
           (QuantizedWeight(w.packed, w.scales[:1], w.mins, 32), "scales shape"),
           (QuantizedWeight(w.packed.view(np.int8), w.scales, w.mins, 32), "must be uint8")]
    for weight, msg in bad:
        with pytest.raises(ValueError, match=msg):
            reference.quantized_matmul(x, weight, parse_precision(mode))
    with pytest.raises(ValueError, match="input of 96 features"):
        reference.quantized_matmul(jnp.ones((2, 96)), w, parse_precision(mode))
    assert reference.quantized_matmul(x, w, parse_precision(mode)).shape == (2, 8)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_matches_definition(rng, symmetric):
    w, codes = random_weight(rng, 24, 64, 16, symmetric)
    s = np.repeat(w.scales.astype(np.float32), 16, axis=1)
    expect = s * (codes.astype(np.float32) - 8) if symmetric else \
        s * codes.astype(np.float32) + np.repeat(w.mins.astype(np.float32), 16, axis=1)
    assert np.array_equal(np.asarray(dequantize(w, jnp.float32)), expect)


@pytest.mark.parametrize("bits", [4, 8])
def test_activation_quantization_matches_numpy(rng, bits):
    qmax = 2 ** (bits - 1) - 1
    # bfloat16-representable values (as the model's activations are): x / scale then often lands on
    # a half-integer that x * (1 / scale) misses, so the test tells the two definitions apart
    x = (rng.standard_normal((64, 96)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    x[0] = 0.0  # an all-zero row must not divide by zero
    x[1, :4] = [qmax, 2.5, -1.5, 0.5]  # scale 1 exactly: ties must round half to even
    x[1, 4:] = 0.0
    q, s = reference.quantize_activations(jnp.asarray(x), bits)
    absmax = np.abs(x).max(-1, keepdims=True)
    s_np = np.where(absmax > 0, absmax * np.float32(1 / qmax), np.float32(1.0)).astype(np.float32)
    q_np = np.clip(np.rint(x * (np.float32(1) / s_np)), -qmax - 1, qmax).astype(np.int8)
    assert np.array_equal(np.asarray(s), s_np)
    assert np.array_equal(np.asarray(q), q_np)
    assert list(np.asarray(q)[1, :4]) == [qmax, 2, -2, 0]


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_shadow_packing_matches_numpy(rng, bits):
    """The shadow's int16 words hold the per-vector codes of quantize_activations, offset to unsigned,
    plane j = the j-th contiguous slice of the vector (unpacked here with numpy bit operations); the
    GPU kernel's float16 unpacking gives the same codes exactly; dequantized values lie within half a
    step of float64; unsupported widths and head sizes raise."""
    d, planes = 64, 16 // bits
    x = np.asarray(jnp.asarray(rng.standard_normal((3, 5, 2, d)) * rng.uniform(0.1, 20, (3, 5, 2, 1)),
                               jnp.bfloat16), np.float32)
    words, scale = reference.quantize_kv(jnp.asarray(x), bits)
    assert words.dtype == jnp.int16 and words.shape == (3, 5, 2, d // planes) and scale.shape == (3, 5, 2)
    q, s = (np.asarray(a) for a in reference.quantize_activations(jnp.asarray(x), bits))
    u = np.asarray(words).view(np.uint16).astype(np.int64)
    nib = [((u >> (bits * j)) & ((1 << bits) - 1)) for j in range(planes)]
    codes = np.concatenate(nib, axis=-1) - (1 << (bits - 1))  # stored offset, unsigned
    assert np.array_equal(codes, q.astype(np.int64))
    assert np.array_equal(np.asarray(scale), s[..., 0])
    f16 = np.concatenate([np.asarray(p, np.float64) for p in gpu_attention.kv_planes_f16(words, bits, interpret=True)], axis=-1)
    assert np.array_equal(f16, codes)
    back = np.asarray(reference.dequantize_kv(words, scale, bits), np.float64)
    assert np.all(np.abs(back - x) <= 0.5 * s.astype(np.float64) * (1 + 1e-5))  # x * f32(1/s) rounds
    with pytest.raises(ValueError, match="bits"):
        reference.quantize_kv(jnp.asarray(x), 2)
    with pytest.raises(ValueError, match="multiple"):
        reference.quantize_kv(jnp.asarray(x[..., :6]), 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4ax_int32_accumulation_exact(rng, bits, symmetric):
    group = int(rng.choice([16, 32, 64]))
    m, n, k = int(rng.integers(1, 9)), int(rng.integers(1, 40)), group * int(rng.integers(1, 5))
    w, codes = random_weight(rng, n, k, group, symmetric)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    qa, sa = reference.quantize_activations(jnp.asarray(x), bits)
    qw = codes.astype(np.int64) - (8 if symmetric else 0)
    qa64 = np.asarray(qa).astype(np.int64)
    acc_np = np.einsum("mgk,ngk->mgn", qa64.reshape(m, -1, group), qw.reshape(n, -1, group))
    acc = reference.group_accumulate(qa, jnp.asarray(qw.astype(np.int8)), group)
    assert acc.dtype == jnp.int32
    assert np.array_equal(np.asarray(acc), acc_np)

    # the scaled result against the same formula in float64
    s = w.scales.astype(np.float64).T[None]
    y64 = (acc_np * s).sum(1)
    if not symmetric:
        qsum = qa64.reshape(m, -1, group).sum(-1)
        y64 = y64 + qsum @ w.mins.astype(np.float64).T
    y64 *= np.asarray(sa, np.float64)
    y = np.asarray(reference.quantized_matmul(jnp.asarray(x), w, parse_precision(f"w4a{bits}")))
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-6 * np.abs(y64).max())


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_within_bf16_tolerance_of_float64(rng, symmetric):
    m, n, k, group = 5, 48, 256, 32
    w, codes = random_weight(rng, n, k, group, symmetric)
    x = rng.standard_normal((2, m, k)).astype(np.float32)
    s = np.repeat(w.scales.astype(np.float64), group, axis=1)
    w64 = s * (codes - 8.0) if symmetric else s * codes + np.repeat(w.mins.astype(np.float64), group, axis=1)
    y64 = x.astype(np.float64) @ w64.T
    y = np.asarray(reference.quantized_matmul(jnp.asarray(x), w, parse_precision("w4a16")))
    assert y.shape == (2, m, n) and y.dtype == np.float32
    # bf16 keeps 8 significant bits of x and w: a few 2^-8 relative errors, averaged over k terms
    err = np.abs(y - y64) / (np.abs(x).astype(np.float64) @ np.abs(w64).T)
    assert err.max() < 1e-2
    assert np.linalg.norm(y - y64) / np.linalg.norm(y64) < 1e-2


def test_w16a16_is_float_exact_on_dequantized_weights(rng):
    w, codes = random_weight(rng, 16, 64, 32, False)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w64 = np.asarray(dequantize(w, jnp.float32), np.float64)
    y = np.asarray(reference.quantized_matmul(jnp.asarray(x), w, parse_precision("w16a16")))
    np.testing.assert_allclose(y, x @ w64.T, rtol=1e-5, atol=1e-6)


def test_unknown_mode_rejected(rng):
    w, _ = random_weight(rng, 4, 32, 32, True)
    with pytest.raises(ValueError, match="unknown mode"):
        reference.quantized_matmul(jnp.zeros((1, 32)), w, parse_precision("w2a2"))


def test_validate_catches_inconsistent_arrays(rng):
    w, _ = random_weight(rng, 4, 64, 32, False)
    with pytest.raises(ValueError, match="scales shape"):
        QuantizedWeight(w.packed, w.scales[:, :1], w.mins, 32).validate()
    with pytest.raises(ValueError, match="float16"):
        QuantizedWeight(w.packed, w.scales.astype(np.float32), None, 32).validate()
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedWeight(w.packed, w.scales, w.mins, 48).validate()
