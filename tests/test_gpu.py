"""GPU-only checks of the Pallas kernels and of the decode path that uses them (skipped without a GPU).

Run on the device: ``PYTHONPATH=. python3 -m pytest -q -s tests/test_gpu.py`` (with
``QSPEC_JAX_CACHE`` pointing at a converted SmolLM2 for the last test; see scripts/gpu_carry.sh).

* the kernels against the references, on the GPU: W4A4/W4A8 bitwise (symmetric weights, K not
  split) or to 1e-6 (asymmetric / split K), the int32 group accumulations bitwise, W4A16, the dense
  kernel, attention (also over a draft's sinks + window view) and RMSNorm within 1e-2 relative of
  float64 numpy;
* the RoPE + KV-write kernel bitwise against numpy's op-by-op rounding (bf16), with donated caches;
* the activation prologue kernels (quantization alone or fused with the RMSNorm, the RMSNorm in
  the W4A16 plane layout) bitwise against the reference quantization computed on the CPU and the
  RMSNorm kernel; the SwiGLU and attention-merge prologues against float64 and row-count invariant;
* a prefill's causal attention (cuDNN flash attention) within 1e-2 relative of float64 numpy;
* row-count invariance, bitwise: every row of an M-row call equals the same row computed alone, for
  M = 1..256 (matmuls, RMSNorm) and 1..8 queries per sequence (attention);
* the Mosaic W4A16 kernel (Hopper) within float32 accumulation error of float64 numpy, and row-count
  invariant;
* the whole decode-time forward: a verify pass over several tokens gives bitwise the logits and KV
  of one-token steps (float32 and bfloat16), and greedy QSPEC equals greedy W4A16;
* SmolLM2: greedy ``generate`` on the GPU with the kernels (``qspec`` identical to ``w4a16``) against
  the CPU with the references; where they part, the first differing token must be a near tie
  (bf16 activation rounding turns float32-ulp differences between backends into logit differences
  of ~1e-2 that flip near-tied argmaxes).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.random_model import random_model
from pallas_kernels import gpu_attention, gpu_matmul, gpu_norm, gpu_rope, reference
from pallas_kernels.layout import QuantizedWeight, dequantize, pack_codes, w4a16_weights
from tests.test_kernels import _attention64, as_jnp, rope_store_case
from pallas_kernels.precision import W4A16, parse_precision
from qspec_jax.kernels import Execution

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

INVARIANCE_MS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 128, 129, 200, 255, 256)
# (N, K, group, symmetric): SmolLM2 qkv/down, Llama o (g128), a per-channel down
MATMUL_SHAPES = [(960, 576, 32, False), (576, 1536, 32, False), (4096, 4096, 128, True),
                 (4096, 14336, 14336, True)]


def _weight(rng, n, k, group, symmetric) -> QuantizedWeight:
    codes = rng.integers(0, 16, (n, k))
    scales = (0.002 + 0.02 * rng.random((n, k // group))).astype(np.float16)
    mins = None if symmetric else (0.1 * rng.standard_normal((n, k // group))).astype(np.float16)
    return QuantizedWeight(jnp.asarray(pack_codes(codes)), jnp.asarray(scales),
                           None if mins is None else jnp.asarray(mins), group)


def _x(rng, m, k, dtype=jnp.float32):
    x = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))
    return jnp.asarray(x, dtype)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("n,k,group,symmetric", MATMUL_SHAPES)
def test_matmul_kernels_match_references(rng, n, k, group, symmetric):
    w = _weight(rng, n, k, group, symmetric)
    x = _x(rng, 13, k)
    wd = np.asarray(w4a16_weights(w).astype(jnp.float32), np.float64)
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    y16 = jax.jit(gpu_matmul.w4a16_matmul)(x, w)
    err = _rel(y16, xb @ wd.T)
    print(f"W4A16 {n}x{k} g{group}: rel err {err:.2e} vs float64")
    assert err <= 1e-2
    y16_bf16 = jax.jit(lambda a, b: gpu_matmul.w4a16_matmul(a, b, out_dtype=jnp.bfloat16))(x, w)  # rounded once
    np.testing.assert_array_equal(np.asarray(y16_bf16).view(np.uint16),
                                  np.asarray(y16.astype(jnp.bfloat16)).view(np.uint16))
    for bits, mode in ((8, "w4a8"), (4, "w4a4")):
        qx, sa = reference.quantize_activations(x, bits)
        acc = jax.jit(lambda q, s: gpu_matmul.w4ax_quantized(q, s, w, return_acc=True))(qx, sa)
        want = reference.group_accumulate(qx, reference.signed_codes(w), group).transpose(1, 0, 2)
        np.testing.assert_array_equal(np.asarray(acc), np.asarray(want))
        f32, b16 = (jax.jit(lambda q, s, dt=dt: gpu_matmul.w4ax_quantized(q, s, w, out_dtype=dt))(qx, sa)
                    for dt in (jnp.float32, jnp.bfloat16))  # a bf16 result: the float32 one rounded once
        np.testing.assert_array_equal(np.asarray(b16).view(np.uint16),
                                      np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
        got = jax.jit(lambda a: gpu_matmul.w4ax_matmul(a, w, bits))(x)
        # the reference on the CPU: XLA's float32 division on the GPU is not correctly rounded, so its
        # activation codes may differ
        with jax.default_device(cpu := jax.devices("cpu")[0]):
            w_cpu, x_cpu = jax.device_put(w, cpu), jax.device_put(x, cpu)
            exp = jax.jit(lambda a: reference.quantized_matmul(a, w_cpu, parse_precision(mode)))(x_cpu)
        split = gpu_matmul.default_config(n, k, group, "w4ax")[2]
        if symmetric and split == 1:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
        else:
            np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-6, atol=1e-6 * float(jnp.abs(exp).max()))
    wf = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    err = _rel(jax.jit(gpu_matmul.dense_matmul)(x.astype(jnp.bfloat16), wf),
               xb @ np.asarray(wf.astype(jnp.float32), np.float64).T)
    assert err <= 1e-2


@pytest.mark.parametrize("n,k,group,symmetric", MATMUL_SHAPES + [(5120, 13824, 128, True)])
def test_scale_prefetch_gives_the_same_bits(rng, n, k, group, symmetric):
    """On the GPU: the matmuls with each K iteration's scales loaded one iteration ahead or in the
    iteration itself give the same outputs (W4A16, W4A8) and int32 group accumulations, bitwise, at
    1 and 13 rows (Llama-2-13B's down: 54 K chunks split 8, the default prefetching)."""
    w = _weight(rng, n, k, group, symmetric)
    x = _x(rng, 13, k)
    qx, sa = reference.quantize_activations(x, 8)
    calls = {"w4a16": lambda a, q, s, pf: gpu_matmul.w4a16_matmul(a, w, prefetch=pf),
             "w4a8": lambda a, q, s, pf: gpu_matmul.w4ax_quantized(q, s, w, prefetch=pf),
             "w4a8 acc": lambda a, q, s, pf: gpu_matmul.w4ax_quantized(q, s, w, return_acc=True, prefetch=pf)}
    for name, call in calls.items():
        for rows in (slice(0, 13), slice(4, 5)):
            on, off = (np.asarray(jax.jit(call, static_argnums=3)(x[rows], qx[rows], sa[rows], pf))
                       for pf in (True, False))
            np.testing.assert_array_equal(on, off, err_msg=f"{name} rows {rows}")


@pytest.mark.parametrize("n,k,group,symmetric", [(4096, 4096, 128, True), (1024, 1536, 32, False)])
def test_w4ax_words_match_bytes(rng, n, k, group, symmetric):
    """On the GPU: the W4AX kernel reading a stack's packed bytes as uint16 words (how it reads
    Llama-2-13B's gate/up) gives the reference's int32 group accumulations and the byte path's
    outputs, bitwise, at 1 and 13 rows (row-count invariance)."""
    layers = [_weight(rng, n, k, group, symmetric) for _ in range(2)]
    stack = QuantizedWeight(*(None if a[0] is None else jnp.stack(a) for a in
                              zip(*((w.packed, w.scales, w.mins) for w in layers))), group)
    qx, sa = reference.quantize_activations(_x(rng, 13, k), 8)
    call = lambda q, s, words, acc=False: gpu_matmul.w4ax_quantized(  # noqa: E731
        q, s, stack, layer=jnp.int32(1), words=words, return_acc=acc)
    acc = jax.jit(lambda q, s: call(q, s, True, True))(qx, sa)
    want = reference.group_accumulate(qx, reference.signed_codes(layers[1]), group).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(want))
    words, bytes_ = (jax.jit(lambda q, s, wd=wd: call(q, s, wd)) for wd in (True, False))
    np.testing.assert_array_equal(np.asarray(words(qx, sa)), np.asarray(bytes_(qx, sa)))
    np.testing.assert_array_equal(np.asarray(words(qx[4:5], sa[4:5])), np.asarray(words(qx, sa))[4:5])


def _compile_all(fn, arg_sets: list[tuple]) -> list:
    """``jax.jit(fn)`` compiled for each argument set, the compiles in parallel threads (a GPU test
    that tries many row counts spends most of its time compiling)."""
    lowered = [jax.jit(fn).lower(*args) for args in arg_sets]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda low: low.compile(), lowered))


def _rows_alone(fn, x):
    """Each row of ``x`` through ``fn`` as a 1-row call (one compiled function)."""
    one = jax.jit(fn)
    return np.concatenate([np.asarray(one(x[i:i + 1])) for i in range(x.shape[0])])


@pytest.mark.parametrize("kind", ["w4a16", "w4a8", "w4a4", "dense", "dense_f32", "rmsnorm"])
@pytest.mark.parametrize("n,k,group,symmetric", [MATMUL_SHAPES[0], MATMUL_SHAPES[2]])
def test_row_count_invariance(rng, kind, n, k, group, symmetric):
    w = _weight(rng, n, k, group, symmetric)
    dtype = jnp.bfloat16 if kind in ("dense", "rmsnorm") else jnp.float32
    scale = jnp.asarray(rng.random(k) + 0.5, dtype)
    fn = {"w4a16": lambda a: gpu_matmul.w4a16_matmul(a, w),
          "w4a8": lambda a: gpu_matmul.w4ax_matmul(a, w, 8),
          "w4a4": lambda a: gpu_matmul.w4ax_matmul(a, w, 4),
          "dense": lambda a: gpu_matmul.dense_matmul(a, dequantize(w, jnp.bfloat16)),
          "dense_f32": lambda a: gpu_matmul.dense_matmul(a, dequantize(w, jnp.float32)),
          "rmsnorm": lambda a: gpu_norm.rms_norm(a, scale, 1e-5)}[kind]
    x = _x(rng, max(INVARIANCE_MS), k, dtype)
    alone = _rows_alone(fn, x)
    for m, call in zip(INVARIANCE_MS, _compile_all(fn, [(x[:m],) for m in INVARIANCE_MS]), strict=True):
        np.testing.assert_array_equal(np.asarray(call(x[:m])), alone[:m], err_msg=f"M={m}")


@pytest.mark.parametrize("n,k,group", [(256, 512, 128), (384, 1024, 256), (1024, 4096, 4096)])
def test_mosaic_w4a16_against_float64_and_row_count_invariant(rng, n, k, group):
    """The Mosaic W4A16 kernel: within float32 accumulation error of float64 numpy over the same
    bfloat16 weights ``bf16(q * s)``, and every row of an M-row call bitwise the row computed alone."""
    from pallas_kernels import mgpu_matmul

    if "H100" not in jax.devices()[0].device_kind and "H200" not in jax.devices()[0].device_kind:
        pytest.skip("the Mosaic kernel is for Hopper")
    q = rng.integers(-8, 8, (n, k))
    s = (0.002 + 0.02 * rng.random((k // group, n))).astype(np.float32)
    s = np.asarray(jnp.asarray(s, jnp.bfloat16).astype(jnp.float32))
    w = np.asarray(jnp.asarray(q * np.repeat(s, group, axis=0).T, jnp.float32).astype(jnp.bfloat16), np.float64)
    codes = mgpu_matmul.tile_codes(jnp.asarray(q, jnp.int8).astype(jnp.int4))
    scales = jnp.asarray(s, jnp.bfloat16)
    fn = lambda a: mgpu_matmul.w4a16_int4_matmul(a, codes, scales)  # noqa: E731
    x = _x(rng, max(INVARIANCE_MS), k, jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    alone = _rows_alone(fn, x)
    for m, call in zip(INVARIANCE_MS, _compile_all(fn, [(x[:m],) for m in INVARIANCE_MS]), strict=True):
        got = np.asarray(call(x[:m]))
        np.testing.assert_array_equal(got, alone[:m], err_msg=f"M={m}")
        bound = 1e-5 * (np.abs(x64[:m]) @ np.abs(w).T) + 1e-30
        assert np.all(np.abs(got - x64[:m] @ w.T) <= bound), f"M={m}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (32, 8, 128), (16, 16, 64), (40, 40, 128)])
def test_attention_kernel(rng, dtype, heads, kv, d):
    b, s = 4, 320
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    q = jnp.asarray(rng.standard_normal((b, 8, heads, d)), dtype)
    start = rng.integers(0, s - 8, b)
    pos = jnp.asarray(start[:, None] + np.arange(8)[None], jnp.int32)
    att = jax.jit(gpu_attention.decode_attention)
    full = np.asarray(att(q, k, v, pos))
    err = _rel(full, _attention64(*(a.astype(jnp.float32) for a in (q, k, v)), pos))
    print(f"attention H={heads} KV={kv} d={d} {jnp.dtype(dtype).name}: rel err {err:.2e}")
    assert err <= 1e-2
    sets = [(q[:, :t], k, v, pos[:, :t]) for t in range(1, 9)]
    for t, call in enumerate(_compile_all(gpu_attention.decode_attention, sets), start=1):
        # queries 0..t-1 in one call == the same queries of the 8-query call
        np.testing.assert_array_equal(np.asarray(call(*sets[t - 1])), full[:, :t], err_msg=f"T={t}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_kernel_query_past_the_cache(rng, dtype):
    """A query at or past the cache's end sees every slot and nothing beyond, with the default blocks and
    splits where the splits overrun the cache (17 blocks of 16 slots in 16 splits of 2 blocks): a block
    read past the cache would add another sequence's memory to the visible slots."""
    b, s, heads, kv, d = 2, 272, 32, 8, 128
    splits = gpu_attention.num_splits(b, kv, s, 16)
    assert splits * -(-(s // 16) // splits) > s // 16  # the case under test: the last splits start past the cache
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, 2, heads, d)), dtype)
    pos = jnp.asarray([[s - 1, s], [s + int(rng.integers(1, 50)), 2 * s]], jnp.int32)
    got = np.asarray(jax.jit(gpu_attention.decode_attention)(q, k, v, pos).astype(jnp.float32))
    assert np.isfinite(got).all()
    err = _rel(got, _attention64(*(a.astype(jnp.float32) for a in (q, k, v)), pos))
    print(f"attention past the cache {jnp.dtype(dtype).name}: rel err {err:.2e}")
    assert err <= 1e-2


@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (32, 8, 128)])
def test_prompt_attention_flash(rng, heads, kv, d):
    """A prefill's attention on the GPU (cuDNN flash attention, bf16, causal over the prompt's own keys)
    within 1e-2 relative of float64 numpy."""
    from qspec_jax.kernels import prompt_attention

    b, t = 2, int(rng.integers(100, 300))
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for h in (heads, kv, kv))
    f = jax.jit(lambda *a: prompt_attention(*a, Execution("pallas").for_prompt()))
    assert "cudnn$fmha" in f.lower(q, k, v).as_text()  # the flash kernel, not the float32 reference
    got = f(q, k, v)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    err = _rel(got.astype(jnp.float32), _attention64(*(a.astype(jnp.float32) for a in (q, k, v)), pos))
    print(f"prompt attention H={heads} KV={kv} d={d} T={t}: rel err {err:.2e}")
    assert err <= 1e-2


@pytest.mark.parametrize("dtype,heads,kv,d,parts,bits,scaled", [
    *((dtype, *case) for dtype in (jnp.float32, jnp.bfloat16)
      for case in ((9, 3, 64, 0, None, False), (32, 8, 128, 4, None, False), (40, 40, 128, 2, None, True))),
    (jnp.bfloat16, 32, 8, 128, 4, 8, True), (jnp.bfloat16, 9, 3, 64, 0, 4, False)])  # float32 keys: an ulp (FMA)
def test_rope_store_kernel(rng, dtype, heads, kv, d, parts, bits, scaled):
    """The RoPE + KV-write kernel on the GPU, jitted with the caches donated (written in place): bf16
    queries and keys bitwise as numpy's op-by-op rounding (float32 to its rounding: Triton may fuse
    a product into an FMA), values copied, all other slots untouched; one token's results equal the
    same token's inside a 4-token call, bitwise. ``parts``: qkv as float32 K-split partial sums
    (``scaled``: times a W4AX row scale); ``bits``: the cache is a draft's shadow (bf16: codes and
    scales bitwise as the reference's)."""
    scale = rng.uniform(0.5, 2.0, (3, 4, 1)).astype(np.float32) if scaled else np.ones((3, 4, 1), np.float32)
    args, q, want = rope_store_case(rng, dtype, b=3, t=4, heads=heads, kv=kv, d=d, slots=64, parts=parts, bits=bits,
                                    scale=scale if scaled else None)
    call = jax.jit(lambda x, c, s, p, kv, sc: gpu_rope.rope_store(x, c, s, p, kv, heads=heads, layer=jnp.int32(1),
                                                                  scale=sc if scaled else None),
                   donate_argnums=(4,))
    got_q, got = call(*as_jnp(args), jnp.asarray(scale))
    got = [np.asarray(got_q), *map(np.asarray, got)]
    for g, w in zip(got, (q, *want)):
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
        else:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    token = (slice(None),) * (1 + bool(parts)) + (slice(1, 2),)
    one_q, one = call(*as_jnp((args[0][token], *(a[:, 1:2] for a in args[1:4]), args[4])), jnp.asarray(scale[:, 1:2]))
    np.testing.assert_array_equal(np.asarray(one_q), got[0][:, 1:2])
    rows, slot = np.arange(3), args[3][:, 1]
    for c, full in zip(one[:2], got[1:3]):
        np.testing.assert_array_equal(np.asarray(c)[1, rows, slot], full[1, rows, slot])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv,d,bits", [(9, 3, 64, 8), (32, 8, 128, 4), (32, 32, 128, 8)])
def test_attention_kernel_over_kv_shadow(rng, dtype, heads, kv, d, bits):
    """The draft's shadow attention against float64 attention over the dequantized shadow, and
    row-count invariant (bitwise) over 1..8 queries."""
    from pallas_kernels import reference

    b, s = 4, 320
    (kw, ks), (vw, vs) = (reference.quantize_kv(jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype), bits)
                          for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, 8, heads, d)), dtype)
    pos = jnp.asarray(rng.integers(0, s - 8, b)[:, None] + np.arange(8)[None], jnp.int32)
    head_major = (jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2))
    att = jax.jit(lambda q, p: gpu_attention.decode_attention(q, kw, vw, p, scales=head_major))
    full = np.asarray(att(q, pos))
    k64, v64 = (np.asarray(reference.dequantize_kv(w, sc, bits), np.float64) for w, sc in ((kw, ks), (vw, vs)))
    q64, g = np.asarray(q.astype(jnp.float32), np.float64), heads // kv
    sc = np.einsum("bthd,bshd->bhts", q64, np.repeat(k64, g, axis=2)) / np.sqrt(d)
    sc = np.where(np.arange(s)[None, None, None] <= np.asarray(pos)[:, None, :, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), np.repeat(v64, g, axis=2))
    err = _rel(full, want)
    print(f"shadow attention {bits}-bit H={heads} KV={kv} d={d} {jnp.dtype(dtype).name}: rel err {err:.2e}")
    assert err <= 1e-2
    for t in range(1, 8):
        np.testing.assert_array_equal(np.asarray(att(q[:, :t], pos[:, :t])), full[:, :t], err_msg=f"T={t}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_attention_kernel_window(rng, dtype, bits):
    """A draft's sinks + sliding-window view, one query per sequence (as drafts call it) and three,
    over a float cache or its shadow: against float64 attention with the window's mask over what the
    kernel reads (the cache, or the dequantized shadow)."""
    from pallas_kernels import reference

    b, s, kv, heads, d = 4, 2048, 8, 32, 128
    window = reference.AttentionWindow(int(rng.choice([4, 64, 100])), int(rng.choice([64, 300, 512])))
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype) for _ in range(2))
    if bits:
        (kw, ks), (vw, vs) = reference.quantize_kv(k, bits), reference.quantize_kv(v, bits)
        cache, scales = (kw, vw), (jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2))
        k, v = reference.dequantize_kv(kw, ks, bits), reference.dequantize_kv(vw, vs, bits)
    else:
        cache, scales = (k, v), None
    for t in (1, 3):
        q = jnp.asarray(rng.standard_normal((b, t, heads, d)), dtype)
        pos = jnp.asarray(rng.integers(0, s - t, b)[:, None] + np.arange(t)[None], jnp.int32)
        got = np.asarray(jax.jit(lambda q, p: gpu_attention.decode_attention(q, *cache, p, scales=scales,
                                                                             window=window))(q, pos))
        want = _attention64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), pos,
                            window.sinks, window.size)
        err = _rel(got, want)
        print(f"window {window} {bits or 'float'} {jnp.dtype(dtype).name} T={t}: rel err {err:.2e}")
        assert err <= 1e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_planes_ptx_unpacking_is_exact(rng, bits):
    """The shadow's codes as float16 by PTX on pairs of words (the kernel's GPU path), bitwise
    against the codes read off the words with numpy bit operations."""
    from jax.experimental import pallas as pl

    from pallas_kernels.launch import call_kernel

    planes, dk = 16 // bits, 64
    words = jnp.asarray(rng.integers(-2**15, 2**15, (64, dk)), jnp.int16)

    def kernel(w_ref, *out_refs):
        for o, p in zip(out_refs, gpu_attention.kv_planes_f16(w_ref[...], bits, interpret=False)):
            o[...] = p

    spec = pl.BlockSpec((64, dk), lambda i: (0, 0))
    got = call_kernel(kernel, [jax.ShapeDtypeStruct((64, dk), jnp.float16)] * planes, (1,), [spec],
                      [spec] * planes, False, 4, 1, words)
    u = np.asarray(words).view(np.uint16).astype(np.int64)
    for j, g in enumerate(got):
        want = ((u >> (bits * j)) & ((1 << bits) - 1)) - (1 << (bits - 1))
        np.testing.assert_array_equal(np.asarray(g, np.float64), want, err_msg=f"plane {j}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h", [1536, 28672])
def test_activation_prologue_kernels(rng, dtype, h):
    """On the GPU, bitwise: quantize_rows == the reference quantization computed on the CPU (IEEE
    reciprocal and round-half-even in PTX), rms_norm_quantize == the same of the RMSNorm kernel's
    output, for 1..40 rows, both bit widths, in the W4AX plane layout; rms_norm_planes == that output
    in the W4A16 plane layout. Rows of 24 64-blocks (one tile padded to 32, masked) and of 448 (tiles
    of 64)."""
    from pallas_kernels import gpu_activations

    cpu = jax.devices("cpu")[0]
    scales = jnp.asarray(rng.random((3, h)) + 0.5, dtype)
    for m in (1, 7, 40):
        x = _x(rng, m, h, dtype)
        normed = gpu_norm.rms_norm(x, scales, 1e-5, layer=jnp.int32(1))
        for bits in (8, 4):
            for name, (planes, sa), values in (
                    ("quantize_rows", gpu_activations.quantize_rows(x, bits), x),
                    ("rms_norm_quantize", gpu_activations.rms_norm_quantize(x, scales, 1e-5, bits, layer=jnp.int32(1)),
                     normed)):
                with jax.default_device(cpu):
                    q, s = reference.quantize_activations(jax.device_put(values, cpu), bits)
                    want = gpu_matmul.activation_planes(q, 2)
                np.testing.assert_array_equal(np.asarray(planes), np.asarray(want), err_msg=f"{name} M={m} bits={bits}")
                np.testing.assert_array_equal(np.asarray(sa), np.asarray(s), err_msg=f"{name} M={m} bits={bits}")
        bf = gpu_activations.rms_norm_planes(x, scales, 1e-5, layer=jnp.int32(1))
        want = gpu_matmul.activation_planes(normed.astype(jnp.bfloat16), 4)
        np.testing.assert_array_equal(np.asarray(bf, np.float32), np.asarray(want, np.float32), err_msg=f"planes M={m}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv", [(32, 8), (40, 40)])
def test_attention_merge_prologue(rng, dtype, heads, kv):
    """On the GPU, Llama-3-8B and Llama-2-13B heads (40 KV heads: the kernel masks 24 more) with the
    cache split (the default splits at batch 4, 2048 slots):
    attention_planes against float64 attention; attention_quantize's codes within 1 of the reference
    quantization of the XLA merge of the same partials; each query's row bitwise the same in calls of
    1..4 queries (row-count invariance; the KV heads per program follow the row count) and with all
    of a row's heads in one program."""
    from pallas_kernels import gpu_activations

    b, s, t, g = 4, 2048, 4, heads // kv
    width = heads * 128
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, 128)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, heads, 128)), dtype)
    pos = jnp.asarray(rng.integers(0, s - t, b)[:, None] + np.arange(t)[None], jnp.int32)
    parts = jax.jit(gpu_attention.attention_partials)
    assert parts(q, k, v, pos).acc.shape[2] > 1  # the cache is split
    planes = np.asarray(jax.jit(lambda *a: gpu_activations.attention_planes(parts(*a)))(q, k, v, pos), np.float32)
    got = planes.reshape(2, 2, b * t, width // 64, 16).transpose(2, 3, 1, 4, 0).reshape(b * t, width)
    q64, k64, v64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (q, k, v))
    sc = np.einsum("bthd,bshd->bhts", q64, np.repeat(k64, g, axis=2)) / np.sqrt(128)
    sc = np.where(np.arange(s)[None, None, None] <= np.asarray(pos)[:, None, :, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), np.repeat(v64, g, axis=2)).reshape(b * t, width)
    assert _rel(got, want) <= 1e-2
    merged = jax.jit(lambda *a: gpu_attention.merge(parts(*a)))(q, k, v, pos).reshape(b * t, width)
    quant = jax.jit(lambda *a, bits: gpu_activations.attention_quantize(parts(*a), bits), static_argnames="bits")
    for bits in (8, 4):
        codes, sa = quant(q, k, v, pos, bits=bits)
        q_ref, s_ref = reference.quantize_activations(merged, bits)
        assert np.abs(np.asarray(codes, np.int32) - np.asarray(gpu_matmul.activation_planes(q_ref, 2), np.int32)).max() <= 1
        np.testing.assert_allclose(np.asarray(sa), np.asarray(s_ref), rtol=1e-6 if dtype == jnp.float32 else 8e-3)
        for n in range(1, t):
            c, s_n = quant(q[:, :n], k, v, pos[:, :n], bits=bits)
            rows = (np.arange(b)[:, None] * t + np.arange(n)[None]).reshape(-1)
            np.testing.assert_array_equal(np.asarray(c), np.asarray(codes)[:, rows], err_msg=f"T={n} bits={bits}")
            np.testing.assert_array_equal(np.asarray(s_n), np.asarray(sa)[rows], err_msg=f"T={n} bits={bits}")
        # all of a row's KV heads in one program instead of the default's head tiles: the same bits
        one = jax.jit(lambda *a: gpu_activations.attention_quantize(parts(*a), bits, head_tile=kv))(q, k, v, pos)
        np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(codes), err_msg=f"one program, bits={bits}")
        np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(sa), err_msg=f"one program, bits={bits}")
    one = jax.jit(lambda *a: gpu_activations.attention_planes(parts(*a), head_tile=kv))(q, k, v, pos)
    np.testing.assert_array_equal(np.asarray(one, np.float32), planes, err_msg="planes, one program")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("f", [1536, 13824, 14336])
def test_swiglu_prologue_kernels(rng, dtype, f):
    """On the GPU: swiglu_planes within one bf16 rounding of the float64 SwiGLU; swiglu_quantize's
    codes within 1 of the reference quantization of the float64 SwiGLU rounded to the input dtype,
    its scales within that rounding; both spread over programs or not, bitwise the same; every row
    of a 40-row call bitwise equal to that row alone (row-count invariance)."""
    from pallas_kernels import gpu_activations

    gu = _x(rng, 40, 2 * f, dtype)
    g64, u64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (gu[:, :f], gu[:, f:]))
    want = g64 / (1 + np.exp(-g64)) * u64
    planes = gpu_activations.swiglu_planes(gu)  # 40 rows: spread over programs
    np.testing.assert_array_equal(np.asarray(gpu_activations.swiglu_planes(gu, spread=False), np.float32),
                                  np.asarray(planes, np.float32))  # one program per row: same bits
    got = np.asarray(planes, np.float32).reshape(2, 2, 40, f // 64, 16).transpose(2, 3, 1, 4, 0).reshape(40, f)
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=1e-30)
    for bits in (8, 4):
        q, s = gpu_activations.swiglu_quantize(gu, bits)  # 40 rows: spread over programs
        qr, sr = reference.quantize_activations(jnp.asarray(want, jnp.float32).astype(dtype), bits)
        assert np.abs(np.asarray(q, np.int32) - np.asarray(gpu_matmul.activation_planes(qr, 2), np.int32)).max() <= 1
        np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6 if dtype == jnp.float32 else 8e-3)
        q1, s1 = gpu_activations.swiglu_quantize(gu, bits, spread=False)  # one program per row: same bits
        np.testing.assert_array_equal(np.asarray(q1), np.asarray(q))
        np.testing.assert_array_equal(np.asarray(s1), np.asarray(s))
    for bits in (8, 4, None):
        call = (lambda a: gpu_activations.swiglu_planes(a)) if bits is None else (
            lambda a, b=bits: gpu_activations.swiglu_quantize(a, b))
        full = jax.tree.map(np.asarray, call(gu))
        for m in (1, 7):
            alone = jax.tree.map(np.asarray, call(gu[m:m + 1]))
            for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(full), strict=True):
                row = b[:, m:m + 1] if b.ndim == 3 else b[m:m + 1]
                np.testing.assert_array_equal(a.astype(np.float32), row.astype(np.float32), err_msg=f"bits={bits} row {m}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_verify_pass_row_count_invariant(rng, dtype, mode):
    from qspec_jax.model import forward, init_cache

    model = random_model(rng)
    cfg, params = model.config, model.checkpoint.params
    b, p, g = 3, 20, 6
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p + g)))
    cache = init_cache(cfg, b, 512, dtype)  # several cache splits: o's prologue merges them
    _, cache = forward(params, cfg, toks[:, :p], jnp.broadcast_to(jnp.arange(p), (b, p)), cache,
                       precision=W4A16, dtype=dtype, execution=Execution.prefill("pallas"))
    step = jax.jit(lambda t, pos, c: forward(params, cfg, t, pos, c, precision=parse_precision(mode), dtype=dtype,
                                             execution=Execution.decode("pallas")))
    lv, cv = step(toks[:, p:], jnp.broadcast_to(jnp.arange(p, p + g), (b, g)), cache)
    ca, la = cache, []
    for i in range(g):
        l1, ca = step(toks[:, p + i:p + i + 1], jnp.full((b, 1), p + i), ca)
        la.append(l1)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(la, 1)), np.asarray(lv))
    for a, c in zip(jax.tree.leaves(ca), jax.tree.leaves(cv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_qspec_equals_w4a16_random_model(rng, dtype):
    from qspec_jax.api import generate

    model = random_model(rng)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 17, 9, 30)]
    ref = generate(model, prompts, max_new_tokens=48, method="w4a16", dtype=dtype, kernels="pallas")
    runs = [(draft, gamma, None, None) for draft in ("w4a8", "w4a4") for gamma in (1, 3, 5)] + [
        ("w4a8", 3, 8, None), ("w4a4", 1, 4, None), ("w4a8", 3, None, 16), ("w4a8", 3, 8, 16)]
    for draft, gamma, kv, window in runs:
        view = {} if window is None else dict(draft_window=window, draft_sinks=4)
        res = generate(model, prompts, max_new_tokens=48, method="qspec", draft=draft, gamma=gamma,
                       draft_kv=kv, dtype=dtype, kernels="pallas", **view)
        for a, b in zip(res.sequences, ref.sequences):
            np.testing.assert_array_equal(a, b, err_msg=f"{draft} gamma={gamma} draft_kv={kv} window={window}")


def _smollm2():
    from qspec_jax.api import load
    from convert.embedded import cache_dir

    path = cache_dir() / "smollm2-rtn-asym-g32"
    if not (path / "manifest.json").is_file():
        pytest.skip(f"no converted SmolLM2 at {path} (scripts/gpu_carry.sh brings one)")
    return load(path)


# The largest logit difference between the GPU and the CPU at a position where their greedy tokens part
# (rounding differences stay well below it; a wrong GPU path differs by far more)
MAX_BACKEND_LOGIT_DIFF = 0.5


def test_smollm2_generate_gpu_kernels_equal_cpu_reference():
    """Greedy tokens on the GPU (kernels) and on the CPU (references). Where they differ, the first
    differing token must be a near tie: at that position (same prefix) the CPU's margin between the
    two tokens is at most twice the largest logit difference between the two backends there, and that
    difference at most :data:`MAX_BACKEND_LOGIT_DIFF` (else a wrong GPU path would pass as a tie)."""
    from qspec_jax.api import Model, generate
    from qspec_jax.model import forward
    from qspec_jax.tokenizer import chat_prompt

    model = _smollm2()
    prompts = ["What is 15 times 4? Answer briefly.", "Write a haiku about the sea.",
               "Name three prime numbers.", "Explain what a GPU is in one sentence."]
    kw = dict(max_new_tokens=64, chat=True, eos_token_id=-1)
    gpu = {"w4a16": generate(model, prompts, method="w4a16", kernels="pallas", **kw),
           "qspec": generate(model, prompts, method="qspec", gamma=3, draft="w4a8", kernels="pallas", **kw)}
    for i in range(len(prompts)):  # exactness on the GPU itself
        np.testing.assert_array_equal(gpu["qspec"].sequences[i], gpu["w4a16"].sequences[i])
    cpu_dev = jax.devices("cpu")[0]
    cpu_params = jax.device_put(model.checkpoint.params, cpu_dev)
    cpu_model = Model(dataclasses.replace(model.checkpoint, params=cpu_params), model.tokenizer)
    with jax.default_device(cpu_dev):
        cpu = generate(cpu_model, prompts, method="w4a16", kernels="reference", **kw)
    report = []
    for i, want in enumerate(cpu.sequences):
        got = gpu["w4a16"].sequences[i]
        if np.array_equal(got, want):
            continue
        j = int(np.argmax(got != want))
        ids = jnp.asarray([chat_prompt(model.tokenizer, prompts[i]) + want[:j].tolist()], jnp.int32)
        pos = jnp.arange(ids.shape[1])[None]
        with jax.default_device(cpu_dev):
            l_cpu = np.asarray(forward(cpu_params, model.config, jax.device_put(ids, cpu_dev),
                                       jax.device_put(pos, cpu_dev), precision=W4A16,
                                       execution=Execution.prefill("reference"))[0][0, -1])
        l_gpu = np.asarray(forward(model.checkpoint.params, model.config, ids, pos, precision=W4A16,
                                   execution=Execution.prefill("pallas"))[0][0, -1])
        delta = float(np.abs(l_gpu - l_cpu).max())
        margin = float(l_cpu[want[j]] - l_cpu[got[j]])
        report.append(f"prompt {i}: token {j} GPU {got[j]} vs CPU {want[j]}, CPU margin {margin:.4f}, "
                      f"backend logit difference {delta:.4f}")
        assert margin <= 2 * delta and delta <= MAX_BACKEND_LOGIT_DIFF, report[-1]
    print("SmolLM2 GPU kernels vs CPU reference:", report or "identical")
