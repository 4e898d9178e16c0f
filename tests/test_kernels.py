"""The Pallas GPU matmul kernels (pallas_kernels/gpu_matmul.py), run on the CPU in interpret mode.

W4A8/W4A4: the kernel's epilogue sums the groups in the reference's order (``t = f32(acc)*s
[+ f32(qsum)*m]``, ``tot += t`` for g = 0, 1, ..., then ``s_act * tot``), so with ``split_k=1`` the
results are compared bitwise, as are the int32 group accumulations; with K split, the partial sums
are added after the kernel and results agree to 1e-6 relative. Bitwise holds at M < 16 rows: from
16 rows on, XLA's CPU code for the reference's ``jnp.sum`` over groups reorders the float sum
(~1e-7 relative), so the reference then differs from its own M < 16 rows; these tests use M = 5.
W4A16: against float64 math on the same dequantized weights, and against the reference to float32
rounding. Row-count invariance: each row of an M=1 call equals the same row inside M = 5, 8, 13
calls, bitwise. (W4A16 in interpret mode always takes the activations pre-split by the wrapper, as
the interpreter has no strided loads; the GPU default does too, the stride-load form is only lowered
here.) GPU-only checks (Triton's shape rules, races, timings) live in bench/kernels.py; the
last test here only checks that the kernels lower through Triton for the GPU without a deprecation
warning reaching the user.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_matmul as gm
from pallas_kernels import reference as ref
from pallas_kernels.layout import QuantizedWeight, dequantize, pack_codes

ROOT = Path(__file__).resolve().parents[1]
BN = 16  # small N tiles so the interpreted grids have several programs


def random_weight(rng: np.random.Generator, n: int, k: int, group: int, symmetric: bool) -> QuantizedWeight:
    codes = rng.integers(0, 16, (n, k))
    scales = (0.002 + 0.02 * rng.random((n, k // group))).astype(np.float16)
    mins = None if symmetric else (0.1 * rng.standard_normal((n, k // group))).astype(np.float16)
    return QuantizedWeight(jnp.asarray(pack_codes(codes)), jnp.asarray(scales),
                           None if mins is None else jnp.asarray(mins), group)


def random_x(rng: np.random.Generator, m: int, k: int) -> jnp.ndarray:
    x = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))
    x[:, rng.integers(0, k, 3)] *= 8.0  # a few outlier channels
    return jnp.asarray(x.astype(np.float32))


# (N, K, group, symmetric, block_k): groups 32/64/128 and per-channel, one group per chunk, several
# groups per chunk, and a group spanning several chunks.
CASES = [
    (32, 256, 32, False, 128),
    (32, 256, 64, True, 128),
    (32, 512, 128, False, 256),
    (32, 256, 256, True, 128),
    (16, 256, 256, False, 64),
]


@pytest.mark.parametrize("n,k,group,symmetric,block_k", CASES)
def test_w4ax_bitwise_and_group_accumulations(rng, n, k, group, symmetric, block_k):
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 5, k)
    x = x.at[2].set(0.0)  # an all-zero row (scale 1, codes 0)
    for bits, mode in ((4, "w4a4"), (8, "w4a8")):
        got = np.asarray(gm.w4ax_matmul(x, w, bits, block_n=BN, block_k=block_k, split_k=1, interpret=True))
        want = np.asarray(ref.quantized_matmul(x, w, mode))
        np.testing.assert_array_equal(got, want, err_msg=mode)
    qx, sa = ref.quantize_activations(x, 4)
    acc = gm.w4ax_quantized(qx, sa, w, block_n=BN, block_k=block_k, interpret=True, return_acc=True)
    want_acc = ref.group_accumulate(qx, ref.signed_codes(w), group).transpose(1, 0, 2)  # [G, M, N]
    assert acc.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc))


@pytest.mark.parametrize("phases,block_m", [(8, 16), (2, 32)])
@pytest.mark.parametrize("n,k,group,symmetric,block_k", CASES[:4])
def test_w4a16_against_float64(rng, n, k, group, symmetric, block_k, phases, block_m):
    """Both nibble layouts of the W4A16 kernel (uint32 words / bytes) and two token tiles."""
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 5, k)
    got = np.asarray(gm.w4a16_matmul(x, w, block_n=BN, block_k=block_k, block_m=block_m, phases=phases,
                                     interpret=True))
    assert got.dtype == np.float32 and got.shape == (5, n)
    w64 = np.asarray(dequantize(w, jnp.float32), np.float64)  # s*q (+m): exact in float32
    exact = np.asarray(x, np.float64) @ w64.T
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 1e-2, rel
    # Same bf16 roundings as the reference: only the float32 summation order differs.
    want = np.asarray(ref.quantized_matmul(x, w, "w4a16"), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("symmetric", [True, False])
def test_row_count_invariance(rng, symmetric):
    k, n = 256, 32
    w = random_weight(rng, n, k, 64 if symmetric else 32, symmetric)
    x = random_x(rng, 13, k)
    calls = {
        "w4a16": lambda a: gm.w4a16_matmul(a, w, block_n=BN, interpret=True),
        "w4a4": lambda a: gm.w4ax_matmul(a, w, 4, block_n=BN, interpret=True),
    }
    for name, f in calls.items():
        alone = np.stack([np.asarray(f(x[i:i + 1]))[0] for i in (0, 4, 7)])
        for m in (5, 8, 13):
            inside = np.asarray(f(x[:m]))
            rows = [i for i in (0, 4, 7) if i < m]
            np.testing.assert_array_equal(inside[rows], alone[: len(rows)], err_msg=f"{name} M={m}")


@pytest.mark.parametrize("symmetric", [True, False])
def test_split_k(rng, symmetric):
    """K split over 2 or 4 programs (fixed per weight shape): partial sums added after the kernel."""
    k, n, group = 512, 32, 64
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 13, k)
    for split in (2, 4):
        got = np.asarray(gm.w4ax_matmul(x, w, 4, block_n=BN, split_k=split, interpret=True))
        want = np.asarray(ref.quantized_matmul(x, w, "w4a4"))
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        qx, sa = ref.quantize_activations(x, 4)
        acc = gm.w4ax_quantized(qx, sa, w, block_n=BN, split_k=split, interpret=True, return_acc=True)
        want_acc = ref.group_accumulate(qx, ref.signed_codes(w), group).transpose(1, 0, 2)
        np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc))
        y16 = np.asarray(gm.w4a16_matmul(x, w, block_n=BN, block_k=128, split_k=split, interpret=True))
        w16 = np.asarray(ref.quantized_matmul(x, w, "w4a16"))
        assert np.linalg.norm(y16 - w16) / np.linalg.norm(w16) < 1e-5
        for f in (lambda a: gm.w4ax_matmul(a, w, 4, block_n=BN, split_k=split, interpret=True),
                  lambda a: gm.w4a16_matmul(a, w, block_n=BN, block_k=128, split_k=split, interpret=True)):
            alone = np.asarray(f(x[4:5]))[0]
            np.testing.assert_array_equal(np.asarray(f(x))[4], alone)


def test_unsupported_shapes_raise(rng):
    w = random_weight(rng, 32, 256, 32, True)
    x = random_x(rng, 2, 256)
    with pytest.raises(ValueError, match="multiple of the K block"):
        gm.w4a16_matmul(x, w, block_k=512, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="power of two >= 32"):
        gm.w4ax_matmul(x, w, 4, block_k=16, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="N block"):
        gm.w4ax_matmul(x, w, 4, block_n=64, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        gm.w4ax_matmul(x, w, 3, interpret=True)
    with pytest.raises(ValueError, match="in_features"):
        gm.w4a16_matmul(random_x(rng, 2, 128), w, interpret=True)
    w16 = random_weight(rng, 32, 256, 16, True)
    with pytest.raises(ValueError, match="group size 16"):
        gm.w4ax_matmul(x, w16, 8, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="split_k"):
        gm.w4ax_matmul(x, random_weight(rng, 32, 256, 256, True), 4, block_n=BN, split_k=2, interpret=True)
    w96 = random_weight(rng, 32, 384, 96, True)
    with pytest.raises(ValueError, match="group size 96"):
        gm.w4a16_matmul(random_x(rng, 2, 384), w96, block_n=BN, block_k=128, interpret=True)


def test_lowers_for_gpu_without_deprecation_warning():
    """Lower (not compile) both kernels for an H200 on this CPU-only machine, in a fresh process
    where the Pallas Triton deprecation warning would be an error unless the module filters it."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax._src.pallas.triton import gpu_info
        h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
        gpu_info.get_gpu_info = lambda: h200
        from pallas_kernels import gpu_matmul as gm
        from pallas_kernels.layout import QuantizedWeight
        for n, k, g, sym in [(6144, 4096, 128, True), (4096, 14336, 32, False)]:
            s = jax.ShapeDtypeStruct((n, k // g), jnp.float16)
            w = QuantizedWeight(jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), s, None if sym else s, g)
            x = jax.ShapeDtypeStruct((3, k), jnp.bfloat16)
            for f in (gm.w4a16_matmul, lambda x, w: gm.w4ax_matmul(x, w, 4),
                      lambda x, w: gm.w4a16_matmul(x, w, split_k=2, block_k=128),
                      lambda x, w: gm.w4a16_matmul(x, w, phases=2, x_split=False, block_m=64),
                      lambda x, w: gm.w4ax_matmul(x, w, 8, split_k=2)):
                text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in text or "triton" in text.lower(), text[:500]
        print("lowered")
    """)
    proc = subprocess.run([sys.executable, "-W", "error:The Pallas Triton backend:DeprecationWarning",
                           "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "lowered" in proc.stdout, proc.stderr[-3000:]
