"""The Pallas GPU kernels (pallas_kernels/gpu_*.py), run on the CPU in interpret mode.

W4A8/W4A4: the kernel's epilogue sums the groups in the reference's order (``t = f32(acc)*s
[+ f32(qsum)*m]``, ``tot += t`` for g = 0, 1, ..., then ``s_act * tot``), so with ``split_k=1`` the
results are compared bitwise (asymmetric weights: within the float32 rounding bound of the group
terms, where FMA contraction of the two products may differ between programs), and the int32 group
accumulations bitwise; with K split, the partial sums
are added after the kernel and results agree to 1e-6 relative. Bitwise holds at M < 16 rows: from
16 rows on, XLA's CPU code for the reference's ``jnp.sum`` over groups reorders the float sum
(~1e-7 relative), so the reference then differs from its own M < 16 rows; these tests use M = 5.
W4A16: against float64 math on the bf16 weights of ``layout.w4a16_weights``, and against the
reference to float32 rounding. Row-count invariance: each row of an M=1 call equals the same row
inside M = 5, 8, 13 calls, bitwise (and M = 37, more than one row tile, for the exact
W4A4 path). Decode attention,
RMSNorm and the dense matmul against float64 numpy, attention also bitwise across query counts. In
interpret mode the kernels' PTX steps run as jnp (the GPU tests check the PTX: tests/test_gpu.py).
The activation prologue kernels against the reference quantization / plane layout, bitwise;
the last test lowers every kernel for an H200 and checks no deprecation warning reaches the user.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_attention, gpu_matmul as gm, gpu_norm, gpu_rope, gpu_activations as gq
from pallas_kernels import reference as ref
from pallas_kernels.layout import QuantizedWeight, pack_codes, w4a16_weights
from pallas_kernels.precision import parse_precision

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


def assert_w4ax_output(got: np.ndarray, want: np.ndarray, x: jnp.ndarray, w: QuantizedWeight, bits: int,
                       msg: str) -> None:
    """Symmetric weights: one float multiply per group, the same bits. Asymmetric: ``f32(acc) * s +
    f32(qsum) * m`` per group, where the compiler may contract either product into an FMA, in each
    program its own way (seen: 1 ulp on 2 of 80 outputs, seed 2775854028), so within the float32
    rounding bound of the group terms' sum: (G + 4) eps x s_act x sum_g (|acc s| + |qsum m|). The
    int32 group accumulations are compared bitwise either way."""
    if w.symmetric:
        np.testing.assert_array_equal(got, want, err_msg=msg)
        return
    qa, sa = ref.quantize_activations(x, bits)
    acc = np.asarray(ref.group_accumulate(qa, ref.signed_codes(w), w.group_size), np.float64)  # [M, G, N]
    groups = acc.shape[1]
    qsum = np.asarray(qa, np.float64).reshape(qa.shape[0], groups, -1).sum(-1)  # [M, G]
    s, m = (np.asarray(a, np.float64).T for a in (w.scales, w.mins))  # [G, N]
    terms = (np.abs(acc * s) + np.abs(qsum[:, :, None] * m)).sum(1)  # [M, N]
    bound = (groups + 4) * np.finfo(np.float32).eps * np.abs(np.asarray(sa, np.float64)) * terms
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), msg


# (N, K, group, symmetric, block_k): groups 32/64/128 and per-channel, one group per chunk, several
# groups per chunk, a group spanning several chunks, and K = 576 (SmolLM2: 9 blocks of 64).
CASES = [
    (32, 256, 32, False, 128),
    (32, 256, 64, True, 128),
    (32, 512, 128, False, 256),
    (32, 256, 256, True, 128),
    (16, 256, 256, False, 64),
    (32, 576, 32, True, None),
]


@pytest.mark.parametrize("n,k,group,symmetric,block_k", CASES)
def test_w4ax_bitwise_and_group_accumulations(rng, n, k, group, symmetric, block_k):
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 5, k)
    x = x.at[2].set(0.0)  # an all-zero row (scale 1, codes 0)
    for rows_first in (False, True):  # tokens on the MMA's M side or the weights
        kw = dict(block_n=BN, block_k=block_k, split_k=1, rows_first=rows_first, interpret=True)
        for bits, mode in ((4, "w4a4"), (8, "w4a8")):
            got = np.asarray(gm.w4ax_matmul(x, w, bits, **kw))
            want = np.asarray(ref.quantized_matmul(x, w, parse_precision(mode)))
            assert_w4ax_output(got, want, x, w, bits, f"{mode} rows_first={rows_first}")
        qx, sa = ref.quantize_activations(x, 4)
        acc = gm.w4ax_quantized(qx, sa, w, return_acc=True, **kw)
        want_acc = ref.group_accumulate(qx, ref.signed_codes(w), group).transpose(1, 0, 2)  # [G, M, N]
        assert acc.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc), err_msg=f"rows_first={rows_first}")
        units = k // max(group, gm.default_config(n, k, group, "w4ax", BN, block_k)[1])
        for split in (1, 2)[:units]:  # a bf16 result: the float32 one rounded once; the partial sums unscaled
            f32 = gm.w4ax_quantized(qx, sa, w, **{**kw, "split_k": split})
            b16 = gm.w4ax_quantized(qx, sa, w, out_dtype=jnp.bfloat16, **{**kw, "split_k": split})
            assert b16.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(b16).view(np.uint16),
                                          np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
            parts = gm.w4ax_quantized(qx, sa, w, parts=True, **{**kw, "split_k": split})
            assert parts.shape == (split, 5, n) and parts.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(ref.split_sum(parts, sa)), np.asarray(f32))


@pytest.mark.parametrize("group,symmetric,block_k", [(32, False, 128), (128, True, 256), (256, True, 128)])
def test_w4ax_words_bitwise(rng, group, symmetric, block_k):
    """The uint16-word path (the packed stack read as words, their bytes interleaved back) on layer 1
    of a stack of 3: the int32 group accumulations and the outputs == the reference's, bitwise."""
    n, k = 32, 512
    layers = [random_weight(rng, n, k, group, symmetric) for _ in range(3)]
    stack = QuantizedWeight(*(None if a[0] is None else jnp.stack(a) for a in
                              zip(*((w.packed, w.scales, w.mins) for w in layers))), group)
    x = random_x(rng, 5, k)
    qx, sa = ref.quantize_activations(x, 8)
    kw = dict(layer=jnp.int32(1), block_n=BN, block_k=block_k, split_k=1, interpret=True)
    acc = gm.w4ax_quantized(qx, sa, stack, words=True, return_acc=True, **kw)
    want_acc = ref.group_accumulate(qx, ref.signed_codes(layers[1]), group).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc))
    got = gm.w4ax_quantized(qx, sa, stack, words=True, **kw)
    assert_w4ax_output(np.asarray(got), np.asarray(ref.quantized_matmul(x, layers[1], parse_precision("w4a8"))), x,
                       layers[1], 8, "words")


@pytest.mark.parametrize("n,k,group,symmetric,block_k", CASES)
def test_w4a16_against_float64(rng, n, k, group, symmetric, block_k):
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 5, k)
    got = np.asarray(gm.w4a16_matmul(x, w, block_n=BN, block_k=block_k, interpret=True))
    assert got.dtype == np.float32 and got.shape == (5, n)
    w64 = np.asarray(w4a16_weights(w).astype(jnp.float32), np.float64)
    x64 = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = x64 @ w64.T
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 1e-5, rel  # same bf16 operands: only the float32 summation differs
    want = np.asarray(ref.quantized_matmul(x, w, parse_precision("w4a16")), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    units = k // max(group, gm.default_config(n, k, group, "w4a16", BN, block_k)[1])  # K ranges a split may take
    for split in (1, 2)[:units]:  # a bf16 result: the float32 one rounded once, by the kernel's store or after the sum
        f32 = gm.w4a16_matmul(x, w, block_n=BN, block_k=block_k, split_k=split, interpret=True)
        b16 = gm.w4a16_matmul(x, w, block_n=BN, block_k=block_k, split_k=split, out_dtype=jnp.bfloat16,
                              interpret=True)
        assert b16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b16).view(np.uint16),
                                      np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
        parts = gm.w4a16_matmul(x, w, block_n=BN, block_k=block_k, split_k=split, parts=True, interpret=True)
        assert parts.shape == (split, 5, n)
        np.testing.assert_array_equal(np.asarray(ref.split_sum(parts)), np.asarray(f32))


def test_w4a16_weights_are_bf16_products_rounded_once(rng):
    """The W4A16 operand: bf16 scale (and minimum), one rounding of the exact value (float64 here)."""
    w = random_weight(rng, 16, 128, 32, False)
    codes = np.asarray(ref.signed_codes(w)).astype(np.float64).reshape(16, 4, 32)
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    exact = codes * bf(w.scales)[..., None] + bf(w.mins)[..., None]
    want = _round_bf16(exact.reshape(16, 128))  # float64 -> bf16 (round to nearest even), once
    np.testing.assert_array_equal(np.asarray(w4a16_weights(w).astype(jnp.float32), np.float64), want)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    """float64 -> nearest bfloat16 (ties to even), with exact integer math on the float64 bits."""
    m, e = np.frexp(a)  # a = m * 2**e, 0.5 <= |m| < 1
    scaled = np.ldexp(m, 8)  # 8 significant bits
    return np.ldexp(np.round(scaled), e - 8)  # np.round: half to even


@pytest.mark.parametrize("symmetric,row_tiles", [(True, 2), (False, 1)])  # each value once: CI's 30 minutes
def test_row_count_invariance(rng, symmetric, row_tiles, monkeypatch):
    monkeypatch.setattr(gm, "ROW_TILES", row_tiles)  # 2: a W4A4 program holds two 128-row tiles at M = 130
    k, n = 256, 32
    w = random_weight(rng, n, k, 64 if symmetric else 32, symmetric)
    x = random_x(rng, 130, k)
    wf = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    calls = {
        "w4a16": lambda a: gm.w4a16_matmul(a, w, block_n=BN, interpret=True),
        "w4a4": lambda a: gm.w4ax_matmul(a, w, 4, block_n=BN, interpret=True),
        "dense": lambda a: gm.dense_matmul(a, wf, interpret=True),
    }
    for name, f in calls.items():
        # Beyond 16 rows the row tile is 32, 64 or 128 rows high (gm.TILE_HEIGHTS; with ROW_TILES > 1 a
        # program holds several); XLA on the CPU may sum an interpreted float dot of another shape, or
        # merged per-tile dots, in another order, so only the exact integer path is checked there on
        # the CPU. tests/test_gpu.py checks M = 1..256 on the GPU.
        ms = (5, 8, 13, 37, 100, 130) if name == "w4a4" else (5, 8, 13)
        picks = (0, 4, 7, 20, 36, 99, 129)
        alone = np.stack([np.asarray(f(x[i:i + 1]))[0] for i in picks])
        for m in ms:
            inside = np.asarray(f(x[:m]))
            rows = [i for i in picks if i < m]
            np.testing.assert_array_equal(inside[rows], alone[: len(rows)], err_msg=f"{name} M={m}")


@pytest.mark.parametrize("n,k,group,symmetric,block_k", [CASES[0], CASES[2], CASES[3]])
def test_scale_prefetch_gives_the_same_bits(rng, n, k, group, symmetric, block_k):
    """The scales loaded one K iteration ahead (carried through the loop, none loaded after a
    program's last iteration) or in the iteration that uses them: the same outputs, partial sums and
    int32 group accumulations, bitwise, for each way a chunk holds its groups (groups of 32 with
    minimums, several groups of 128 with minimums, a group spanning two chunks) and with K split."""
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 5, k)
    qx, sa = ref.quantize_activations(x, 8)
    units = k // max(group, gm.default_config(n, k, group, "w4ax", BN, block_k)[1])
    for split in (1, 2)[:units]:
        kw = dict(block_n=BN, block_k=block_k, split_k=split, interpret=True)
        calls = {"w4a16": lambda pf: gm.w4a16_matmul(x, w, parts=True, prefetch=pf, **kw),
                 "w4ax": lambda pf: gm.w4ax_quantized(qx, sa, w, parts=True, prefetch=pf, **kw),
                 "w4ax acc": lambda pf: gm.w4ax_quantized(qx, sa, w, return_acc=True, prefetch=pf, **kw)}
        for name, call in calls.items():
            np.testing.assert_array_equal(np.asarray(call(True)), np.asarray(call(False)),
                                          err_msg=f"{name} split {split}")


# each split layout once, the weight grids alternating (not the whole product: CI's time)
@pytest.mark.parametrize("symmetric,k,splits", [(False, 512, (2, 4)), (True, 384, (2,)), (False, 896, (4,))])
def test_split_k(rng, symmetric, k, splits):
    """K split over 2 or 4 programs (fixed per weight shape; 384 = 3 chunks of 128 split 2 + 1, 896 =
    7 chunks split 2+2+2+1): partial sums added after the kernel."""
    n, group = 32, 64
    w = random_weight(rng, n, k, group, symmetric)
    x = random_x(rng, 13, k)
    for split in splits:
        got = np.asarray(gm.w4ax_matmul(x, w, 4, block_n=BN, split_k=split, interpret=True))
        want = np.asarray(ref.quantized_matmul(x, w, parse_precision("w4a4")))
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        qx, sa = ref.quantize_activations(x, 4)
        acc = gm.w4ax_quantized(qx, sa, w, block_n=BN, split_k=split, interpret=True, return_acc=True)
        want_acc = ref.group_accumulate(qx, ref.signed_codes(w), group).transpose(1, 0, 2)
        np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc))
        y16 = np.asarray(gm.w4a16_matmul(x, w, block_n=BN, block_k=128, split_k=split, interpret=True))
        w16 = np.asarray(ref.quantized_matmul(x, w, parse_precision("w4a16")))
        assert np.linalg.norm(y16 - w16) / np.linalg.norm(w16) < 1e-5
        # tokens on the MMA's M side (a tuning variant): the same products and K order
        y16t = gm.w4a16_matmul(x, w, block_n=BN, block_k=128, split_k=split, rows_first=True, interpret=True)
        np.testing.assert_array_equal(np.asarray(y16t), y16)
        # W4AX with the tokens on the MMA's M side: exact int32 sums, an elementwise epilogue, the same bits
        gott = gm.w4ax_matmul(x, w, 4, block_n=BN, split_k=split, rows_first=True, interpret=True)
        np.testing.assert_array_equal(np.asarray(gott), got)
        acct = gm.w4ax_quantized(qx, sa, w, block_n=BN, split_k=split, rows_first=True, interpret=True,
                                 return_acc=True)
        np.testing.assert_array_equal(np.asarray(acct), np.asarray(want_acc))
        for f in (lambda a: gm.w4ax_matmul(a, w, 4, block_n=BN, split_k=split, interpret=True),
                  lambda a: gm.w4a16_matmul(a, w, block_n=BN, block_k=128, split_k=split, interpret=True)):
            alone = np.asarray(f(x[4:5]))[0]
            np.testing.assert_array_equal(np.asarray(f(x))[4], alone)


def test_default_w4a16_splits_keep_two_chunks():
    """Every default W4A16 K split but the last holds at least 2 K chunks (where the shape has 2),
    the split still a function of the shape alone; W4AX keeps splitting down to one chunk."""
    for n, k, g in [(6144, 4096, 128), (4096, 4096, 128), (4096, 14336, 128), (5120, 5120, 128),
                    (960, 576, 32), (576, 1536, 32), (4096, 1024, 128)]:
        bn, bk, split = gm.default_config(n, k, g, "w4a16")
        units = k // max(g, bk)
        assert -(-units // split) >= min(2, units), (n, k, g, split)
        assert split == 1 or n // bn * split // 2 < gm.min_programs()  # a split only while programs are few
    assert gm.default_config(4096, 4096, 128, "w4a16")[1:] == (256, 8)  # Llama o: 2 chunks per split
    assert gm.default_config(4096, 4096, 128, "w4ax")[2] == 8


def test_unsupported_shapes_raise(rng):
    w = random_weight(rng, 32, 256, 32, True)
    x = random_x(rng, 2, 256)
    with pytest.raises(ValueError, match="multiple of the K block"):
        gm.w4a16_matmul(x, w, block_k=512, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="power of two >= 64"):
        gm.w4ax_matmul(x, w, 4, block_k=32, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="N block"):
        gm.w4ax_matmul(x, w, 4, block_n=64, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        gm.w4ax_matmul(x, w, 3, interpret=True)
    with pytest.raises(ValueError, match="in_features"):
        gm.w4a16_matmul(random_x(rng, 2, 128), w, interpret=True)
    with pytest.raises(ValueError, match="group size 16"):
        gm.w4ax_matmul(x, random_weight(rng, 32, 256, 16, True), 8, block_n=BN, interpret=True)
    with pytest.raises(ValueError, match="split_k"):
        gm.w4ax_matmul(x, random_weight(rng, 32, 256, 256, True), 4, block_n=BN, split_k=2, interpret=True)
    with pytest.raises(ValueError, match="packing block"):
        gm.w4a16_matmul(random_x(rng, 2, 96), random_weight(rng, 32, 96, 32, True), interpret=True)
    assert not gm.supported("w4a16", 32, 96, 32) and gm.supported("w4ax", 32, 576, 32)
    with pytest.raises(ValueError, match="multiples of 16"):
        gm.dense_matmul(random_x(rng, 2, 40), jnp.zeros((32, 40)), interpret=True)
    with pytest.raises(ValueError, match=r"max_blocks \(64-blocks\) must be an integer >= 1"):
        gq.quantize_rows(random_x(rng, 2, 256), 8, max_blocks=-1, interpret=True)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        gq.quantize_rows(random_x(rng, 2, 256), 6, interpret=True)
    for call in (lambda xx: gm.w4a16_matmul(xx, w, interpret=True), lambda xx: gm.w4ax_matmul(xx, w, 8, interpret=True)):
        with pytest.raises(ValueError, match="M >= 1 rows"):
            call(x[:0])
    zero_group = QuantizedWeight(w.packed, w.scales, None, 0)
    with pytest.raises(ValueError, match="group size 0"):
        gm.w4a16_matmul(x, zero_group, interpret=True)
    qx = jnp.zeros((2, 256), jnp.int8)
    sa = jnp.ones((2, 1), jnp.float32)
    for bad in (qx[0], qx.astype(jnp.int32), jnp.zeros((3, 2, 128), jnp.int8)):
        with pytest.raises(ValueError, match="qx must be int8"):
            gm.w4ax_quantized(bad, sa, w, interpret=True)
    with pytest.raises(ValueError, match="in_features"):
        gm.w4ax_quantized(jnp.zeros((2, 192), jnp.int8), sa, w, interpret=True)
    for call in (lambda xx: gm.w4a16_matmul(xx, w, interpret=True), lambda xx: gm.w4ax_matmul(xx, w, 8, interpret=True)):
        with pytest.raises(ValueError, match="x must be a float array"):
            call(jnp.ones((2, 256), jnp.int32))
    for call in (lambda dt: gm.w4a16_matmul(x, w, out_dtype=dt, interpret=True),
                 lambda dt: gm.w4ax_quantized(qx, sa, w, out_dtype=dt, interpret=True)):
        with pytest.raises(ValueError, match="out_dtype must be a float"):
            call(jnp.int32)
    for kw, match in [(dict(block_n=16.0), "block_n must be an integer >= 1"),
                      (dict(block_k=0), "block_k must be an integer >= 1"),
                      (dict(split_k=2.0), "split_k must be an integer >= 1"),
                      (dict(block_m=16.0), "block_m must be an integer >= 16"),
                      (dict(num_warps=0), "num_warps must be an integer >= 1"),
                      (dict(num_stages=1.5), "num_stages must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            gm.w4a16_matmul(x, w, interpret=True, **kw)
    dense_w = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)
    for xx, ww, name in [(x, dense_w.astype(jnp.int8), "w"), (x.astype(jnp.int32), dense_w, "x")]:
        with pytest.raises(ValueError, match=f"{name} must be a float array"):
            gm.dense_matmul(xx, ww, interpret=True)
    for call, name in ((gq.swiglu_planes, "gate_up"), (lambda a, **kw: gq.swiglu_quantize(a, 8, **kw), "gate_up"),
                       (lambda a, **kw: gq.quantize_rows(a, 4, **kw), "x")):
        with pytest.raises(ValueError, match=f"{name} must be a float array"):
            call(jnp.ones((2, 256), jnp.int32), interpret=True)
    stack = jax.tree.map(lambda a: a[None], w)
    for layer in (0.0, jnp.float32(0), jnp.zeros((1,), jnp.int32)):
        with pytest.raises(ValueError, match="layer must be an integer scalar"):
            gm.w4a16_matmul(x, stack, layer=layer, interpret=True)


def _attention64(q, k, v, pos, sinks: int | None = None, size: int | None = None) -> np.ndarray:
    """float64 grouped-query attention over slots s <= pos (with ``size``: only s < sinks or
    s > pos - size)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    sc = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    slot, p = np.arange(k.shape[1])[None, None, None], np.asarray(pos)[:, None, :, None]
    seen = slot <= p
    if size is not None:
        seen = seen & ((slot < sinks) | (slot > p - size))
    sc = np.where(seen, sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("heads,kv,splits", [(6, 2, 1), (4, 4, 3)])
def test_decode_attention(rng, heads, kv, splits):
    """Against float64; queries of a T-query call equal the same queries of shorter calls (bitwise);
    several cache splits; a sequence whose queries see only part of the cache."""
    b, s, d, t = 2, 96, 16, 5
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    pos = jnp.asarray(np.array([3, 60])[:, None] + np.arange(t)[None], jnp.int32)
    full = np.asarray(gpu_attention.decode_attention(q, k, v, pos, block_s=16, splits=splits, interpret=True))
    np.testing.assert_allclose(full, _attention64(q, k, v, pos), rtol=1e-4, atol=1e-5)
    for n in (1, 3):
        part = gpu_attention.decode_attention(q[:, :n], k, v, pos[:, :n], block_s=16, splits=splits, interpret=True)
        np.testing.assert_array_equal(np.asarray(part), full[:, :n])
    with pytest.raises(ValueError, match="power of two"):
        gpu_attention.decode_attention(q[..., :12], k[..., :12], v[..., :12], pos, interpret=True)
    with pytest.raises(ValueError, match="q_pos"):
        gpu_attention.decode_attention(q, k, v, pos[:, :2], interpret=True)
    with pytest.raises(ValueError, match="q_pos must be >= 0"):
        gpu_attention.decode_attention(q, k, v, pos - 4, interpret=True)
    for block in (0, -16, 8, 16.0):
        with pytest.raises(ValueError, match="block_s must be an integer >= 16"):
            gpu_attention.decode_attention(q, k, v, pos, block_s=block, interpret=True)
    with pytest.raises(ValueError, match="KV block must be a multiple of 16"):
        gpu_attention.decode_attention(q, k, v, pos, block_s=24, interpret=True)
    for bad in (0, -1, 1.0):
        with pytest.raises(ValueError, match="splits must be an integer >= 1"):
            gpu_attention.decode_attention(q, k, v, pos, block_s=16, splits=bad, interpret=True)
    with pytest.raises(ValueError, match="splits must lie in"):
        gpu_attention.decode_attention(q, k, v, pos, block_s=16, splits=s // 16 + 1, interpret=True)
    with pytest.raises(ValueError, match="q must be a float array"):
        gpu_attention.decode_attention(jnp.round(q * 4).astype(jnp.int8), k, v, pos, interpret=True)


@pytest.mark.parametrize("bits", [None, 8])
def test_decode_attention_window(rng, bits):
    """A sinks + sliding-window view: the kernel (float cache or shadow, several splits, 1 or 3
    queries) and the reference against float64 with the window's mask; the blocks wholly outside every
    query's sinks and window are never read (NaN there leaves the output finite)."""
    b, s, kv, heads, d, block = 2, 256, 2, 4, 32, 16
    sinks, size = int(rng.choice([0, 5, 16, 21])), int(rng.integers(20, 70))
    window = ref.AttentionWindow(sinks, size)
    k, v = (rng.standard_normal((b, s, kv, d)).astype(np.float32) for _ in range(2))
    t = int(rng.choice([1, 3]))
    pos = jnp.asarray(np.array([int(rng.integers(30, 60)), int(rng.integers(150, 250))])[:, None] + np.arange(t), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    # whole blocks no query of the sequence sees: past the sink blocks and before the lowest window's block
    for row in range(b):
        lo = -(-sinks // block) * block
        hi = max(lo, (int(pos[row, 0]) - size + 1) // block * block)
        v[row, lo:hi] = np.nan
        k[row, lo:hi] = np.nan
    want = _attention64(q, np.nan_to_num(k), np.nan_to_num(v), pos, sinks, size)
    kj, vj = jnp.asarray(k), jnp.asarray(v)
    got_ref = ref.attention(q, jnp.nan_to_num(kj), jnp.nan_to_num(vj), pos,
                            jnp.broadcast_to(jnp.arange(s), (b, s)), window)
    np.testing.assert_allclose(np.asarray(got_ref), want, rtol=1e-4, atol=1e-5)
    for splits in (None, 3):
        run = functools.partial(gpu_attention.decode_attention, q, window=window, block_s=block, splits=splits,
                                interpret=True)
        if bits is None:
            got = np.asarray(run(kj, vj, pos))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        else:
            (kw, ks), (vw, vs) = ref.quantize_kv(kj, bits), ref.quantize_kv(vj, bits)
            got = np.asarray(run(kw, vw, pos, scales=(jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2))))
            fin = [jnp.nan_to_num(a) for a in (kj, vj)]
            wq = _attention64(q, *(ref.dequantize_kv(*ref.quantize_kv(a, bits), bits) for a in fin), pos, sinks, size)
            assert np.isfinite(got).all() and np.linalg.norm(got - wq) / np.linalg.norm(wq) < 1e-3
    for bad in (dict(sinks=-1, size=4), dict(sinks=0, size=0), dict(sinks=1.5, size=8), dict(sinks=0, size=True)):
        with pytest.raises(ValueError, match="attention window"):
            ref.AttentionWindow(**bad)


def test_kernels_refuse_empty_inputs(rng):
    """Zero rows (or queries) get a clear error from every kernel wrapper, not a division by zero or a
    lowering error (the model refuses an empty forward before any kernel)."""
    w = random_weight(rng, 32, 128, 64, True)
    x0 = jnp.zeros((0, 128), jnp.float32)
    kv = jnp.zeros((1, 16, 1, 16))
    calls = [lambda: gm.dense_matmul(x0, jnp.ones((32, 128)), interpret=True),
             lambda: gm.w4a16_matmul(x0, w, interpret=True), lambda: gm.w4ax_matmul(x0, w, 8, interpret=True),
             lambda: gpu_norm.rms_norm(x0, jnp.ones(128), 1e-5, interpret=True),
             lambda: gq.quantize_rows(x0, 8, interpret=True),
             lambda: gq.rms_norm_planes(x0, jnp.ones(128), 1e-5, interpret=True),
             lambda: gq.swiglu_planes(jnp.zeros((0, 256)), interpret=True),
             lambda: gpu_attention.decode_attention(jnp.zeros((1, 0, 2, 16)), kv, kv, jnp.zeros((1, 0), jnp.int32),
                                                    interpret=True)]
    for call in calls:
        with pytest.raises(ValueError, match="at least one row|M >= 1 rows"):
            call()


def test_decode_attention_query_past_the_cache(rng):
    """A query at or past the cache's end sees every slot, as in the reference, also where the splits do
    not divide the KV blocks (6 blocks in 4 splits of 2: the last split would start past the cache)."""
    b, s, kv, d = 2, 96, 2, 16
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, 2, 4, d)), jnp.float32)
    pos = jnp.asarray([[s - 1, s], [s + int(rng.integers(1, 50)), 2 * s]], jnp.int32)
    got = np.asarray(gpu_attention.decode_attention(q, k, v, pos, block_s=16, splits=4, interpret=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _attention64(q, k, v, pos), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits,d", [(8, 32), (4, 64)])
def test_decode_attention_over_kv_shadow(rng, bits, d):
    """Over the draft's quantized shadow: against float64 attention of the dequantized cache (to
    float16 rounding); a shorter call's queries are the same bits; as a stacked layer read in place; bad shadows raise."""
    b, s, kv, heads, t = 2, 96, 2, 6, 4
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32) for _ in range(2))
    (kw, ks), (vw, vs) = ref.quantize_kv(k, bits), ref.quantize_kv(v, bits)
    hm = lambda sc: jnp.swapaxes(sc, -1, -2)  # noqa: E731  (the kernel takes the scales head-major)
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    pos = jnp.asarray(np.array([5, 70])[:, None] + np.arange(t)[None], jnp.int32)
    run = functools.partial(gpu_attention.decode_attention, block_s=16, splits=2, interpret=True)
    full = np.asarray(run(q, kw, vw, pos, scales=(hm(ks), hm(vs))))
    kd, vd = ref.dequantize_kv(kw, ks, bits), ref.dequantize_kv(vw, vs, bits)
    want = _attention64(q, kd, vd, pos)  # the kernel rounds queries and probabilities to float16
    assert np.linalg.norm(full - want) / np.linalg.norm(want) < 1e-3
    np.testing.assert_array_equal(np.asarray(run(q[:, :1], kw, vw, pos[:, :1], scales=(hm(ks), hm(vs)))), full[:, :1])
    stack = [jnp.stack([jnp.zeros_like(a), a]) for a in (kw, vw, hm(ks), hm(vs))]
    np.testing.assert_array_equal(np.asarray(run(q, *stack[:2], pos, scales=tuple(stack[2:]), layer=jnp.int32(1))), full)
    with pytest.raises(ValueError, match="scales"):
        run(q, kw, vw, pos)
    with pytest.raises(ValueError, match="float32"):
        run(q, kw, vw, pos, scales=(hm(ks).astype(jnp.bfloat16), hm(vs)))
    with pytest.raises(ValueError, match="head-major"):
        run(q, kw, vw, pos, scales=(ks, vs))
    with pytest.raises(ValueError, match="words per head"):
        run(q, kw[..., :-1], vw[..., :-1], pos, scales=(hm(ks), hm(vs)))


# each split count, KV group and dtype at least once (not the whole product: CI's time)
@pytest.mark.parametrize("splits,kv,dtype", [(1, 2, jnp.bfloat16), (4, 2, jnp.bfloat16), (4, 3, jnp.float32)])
def test_attention_merge_prologue(rng, splits, kv, dtype):
    """attention_quantize / attention_planes merge the attention kernel's cache splits themselves,
    as rows [B*T, H*d]: the bf16 planes against float64 attention; the W4AX codes within 1 of the
    reference quantization of the XLA merge of the same partials (checked against float64 by
    test_decode_attention; float32 sums may contract differently) and the scales within its
    rounding; the queries of a shorter call give the same rows, bitwise; heads the kernel cannot
    tile raise."""
    b, s, d, t = 2, 128, 128, 3
    h = 4 * kv  # 3 KV heads: on the GPU the kernel masks a fourth
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    pos = jnp.asarray(np.array([50, 100])[:, None] + np.arange(t)[None], jnp.int32)
    parts = gpu_attention.attention_partials(q, k, v, pos, block_s=16, splits=splits, interpret=True)
    want = _attention64(q, k, v, pos).reshape(b * t, h * d)
    planes = np.asarray(gq.attention_planes(parts, interpret=True), np.float32)
    got = planes.reshape(2, 2, b * t, h * d // 64, 16).transpose(2, 3, 1, 4, 0).reshape(b * t, h * d)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (4e-3 if dtype == jnp.float32 else 1e-2)
    merged = gpu_attention.merge(parts).reshape(b * t, h * d)
    tol = 1e-6 if dtype == jnp.float32 else 8e-3  # a float32 ulp, or one bf16 rounding
    for bits in (8, 4):
        codes, sa = gq.attention_quantize(parts, bits, interpret=True)
        q_ref, s_ref = ref.quantize_activations(merged, bits)
        diff = np.abs(np.asarray(codes, np.int32) - np.asarray(gm.activation_planes(q_ref, 2), np.int32))
        assert diff.max() <= 1 and diff.mean() < 0.01, (bits, diff.max(), diff.mean())
        np.testing.assert_allclose(np.asarray(sa), np.asarray(s_ref), rtol=tol)
        short = gpu_attention.attention_partials(q[:, :1], k, v, pos[:, :1], block_s=16, splits=splits, interpret=True)
        c1, s1 = gq.attention_quantize(short, bits, interpret=True)
        rows = np.arange(b) * t  # query 0 of each sequence
        np.testing.assert_array_equal(np.asarray(c1), np.asarray(codes)[:, rows])
        np.testing.assert_array_equal(np.asarray(s1), np.asarray(sa)[rows])
    # a row's KV heads spread over programs (the default at these few rows) or all in one program: same bits
    assert gq.merge_head_tile(kv, b * t) == 1
    np.testing.assert_array_equal(np.asarray(gq.attention_planes(parts, head_tile=kv, interpret=True), np.float32),
                                  planes)
    for bits in (8, 4):
        for got_one, got_spread in zip(gq.attention_quantize(parts, bits, head_tile=kv, interpret=True),
                                       gq.attention_quantize(parts, bits, interpret=True)):
            np.testing.assert_array_equal(np.asarray(got_one), np.asarray(got_spread))
    with pytest.raises(ValueError, match="head_tile must be all"):
        gq.attention_quantize(parts, 8, head_tile=kv + 1, interpret=True)
    for bad in (0, 1.0):
        with pytest.raises(ValueError, match="head_tile must be an integer >= 1"):
            gq.attention_quantize(parts, 8, head_tile=bad, interpret=True)
    odd = gpu_attention.attention_partials(q[:, :, :3 * kv], k, v, pos, block_s=16, interpret=True)  # groups of 3
    with pytest.raises(ValueError, match="power-of-two"):
        gq.attention_quantize(odd, 8, interpret=True)


def test_merge_head_tile():
    """KV heads per merge program: all of them from MERGE_PROGRAMS rows up, else the largest power of
    two dividing them that still gives that many programs."""
    assert gq.merge_head_tile(32, 1) == 1 and gq.merge_head_tile(40, 1) == 1
    assert gq.merge_head_tile(32, 16) == 4  # 8 tiles x 16 rows = 128 programs
    assert gq.merge_head_tile(40, 64) == 8  # 40 * 64 / 128 = 20: 8 is the largest power of two dividing 40
    assert gq.merge_head_tile(8, 1) == 1 and gq.merge_head_tile(32, gq.MERGE_PROGRAMS) == 32
    for kv in (1, 3, 8, 32, 40):
        for rows in (1, 5, 16, 64, 127, 300):
            tile = gq.merge_head_tile(kv, rows)
            assert kv % tile == 0 and (tile == kv or tile & (tile - 1) == 0)


def test_rms_norm_kernel(rng):
    x = jnp.asarray(rng.standard_normal((7, 96)) * 3, jnp.float32)
    scale = jnp.asarray(rng.random(96) + 0.5, jnp.float32)
    got = np.asarray(gpu_norm.rms_norm(x, scale, 1e-5, interpret=True))
    x64 = np.asarray(x, np.float64)
    want = np.asarray(scale, np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(gpu_norm.rms_norm(x[3:4], scale, 1e-5, interpret=True))[0], got[3])
    with pytest.raises(ValueError, match="scale"):
        gpu_norm.rms_norm(x, scale[:10], 1e-5, interpret=True)
    for eps in (None, -1e-6, float("nan"), float("inf"), "1e-5"):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            gpu_norm.rms_norm(x, scale, eps, interpret=True)
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            gq.rms_norm_planes(jnp.zeros((2, 128)), jnp.ones(128), eps, interpret=True)
    with pytest.raises(ValueError, match="scale must be a float array"):
        gq.rms_norm_planes(jnp.zeros((2, 128)), jnp.ones(128, jnp.int32), 1e-5, interpret=True)
    with pytest.raises(ValueError, match="x must be a float array"):
        gpu_norm.rms_norm(jnp.round(x).astype(jnp.int32), scale, 1e-5, interpret=True)


def rope_numpy(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype) -> np.ndarray:
    """Rotate-half RoPE of ``x[..., d]`` in numpy float32, each product and the sum rounded to ``dtype``
    (ml_dtypes' bfloat16: numpy's own rounding, independent of XLA and Triton)."""
    np_dtype = np.dtype(dtype)
    r = lambda v: v.astype(np_dtype).astype(np.float32)  # noqa: E731
    half = x.shape[-1] // 2
    lo, hi = x[..., :half].astype(np.float32), x[..., half:].astype(np.float32)
    c, s = cos.astype(np.float32), sin.astype(np.float32)
    return np.concatenate([(r(lo * c) - r(hi * s)).astype(np_dtype), (r(hi * c) + r(lo * s)).astype(np_dtype)], -1)


def rope_store_case(rng, dtype, b=2, t=3, heads=6, kv=2, d=64, slots=32, layers=3, parts=0, bits=None, scale=None):
    """Random inputs of :func:`gpu_rope.rope_store` (positions include the cache's last slot and
    one past it) and what it must give: ``(args, q, cache)`` as numpy, computed without the kernel.
    ``parts``: qkv as that many float32 partial sums (added left to right, times the row ``scale
    [b, t, 1]`` if given, then rounded); ``bits``: the cache is a draft's shadow, its codes and scales
    :func:`ref.quantize_kv` of the rotated keys and the values."""
    split = rng.standard_normal((max(parts, 1), b, t, (heads + 2 * kv) * d)).astype(np.float32)
    qkv = split[0]
    for p in split[1:]:
        qkv = qkv + p
    if scale is not None:
        qkv = scale * qkv
    pos = np.stack([rng.choice(slots - 1, t, replace=False) for _ in range(b)]).astype(np.int32)
    pos[-1, -2:] = (slots - 1, slots)  # the last slot is written, one past the end dropped
    freqs = pos[..., None].astype(np.float32) * (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    np_dtype = np.dtype(dtype)
    qkv, cos, sin = (a.astype(np_dtype) for a in (qkv, np.cos(freqs), np.sin(freqs)))
    x = qkv.reshape(b, t, heads + 2 * kv, d)
    q = rope_numpy(x[:, :, :heads], cos[:, :, None], sin[:, :, None], dtype)
    new = [rope_numpy(x[:, :, heads:heads + kv], cos[:, :, None], sin[:, :, None], dtype), x[:, :, heads + kv:]]
    if bits is None:
        cache = [rng.standard_normal((layers, b, slots, kv, d)).astype(np_dtype) for _ in range(2)]
    else:
        cache = [rng.integers(-2 ** 15, 2 ** 15, (layers, b, slots, kv, d * bits // 16)).astype(np.int16)
                 for _ in range(2)] + [rng.random((layers, b, kv, slots)).astype(np.float32) for _ in range(2)]
        with jax.default_device(jax.devices("cpu")[0]):  # XLA's float32 division on a GPU is not correctly rounded
            quantized = [ref.quantize_kv(jnp.asarray(a), bits) for a in new]
        new = [np.asarray(w) for w, _ in quantized] + [np.asarray(sc) for _, sc in quantized]
    want = [c.copy() for c in cache]
    for i in range(b):
        for j in range(t):
            if pos[i, j] < slots:
                for w, n in zip(want[:2], new[:2]):
                    w[1, i, pos[i, j]] = n[i, j]
                for w, n in zip(want[2:], new[2:]):
                    w[1, i, :, pos[i, j]] = n[i, j]
    return (split if parts else qkv, cos, sin, pos, tuple(cache)), q, tuple(want)


def as_jnp(args):
    """``args`` (arrays, or tuples of them) as jnp arrays."""
    return tuple(tuple(map(jnp.asarray, a)) if isinstance(a, tuple) else jnp.asarray(a) for a in args)


@pytest.mark.parametrize("dtype,heads,kv,parts,bits,scaled", [
    *((dtype, *case) for dtype in (jnp.float32, jnp.bfloat16)
      for case in ((6, 2, 0, None, False), (4, 4, 1, None, False), (9, 3, 3, None, True))),
    (jnp.bfloat16, 6, 2, 2, 8, True), (jnp.bfloat16, 4, 4, 0, 4, False)])  # float32 keys' shadow: an ulp apart
def test_rope_store_bitwise(rng, dtype, heads, kv, parts, bits, scaled):
    """The RoPE + KV-write kernel: bf16 queries and written keys bitwise as numpy's op-by-op rounding
    (float32: to its rounding, as XLA and Triton may fuse a product into an FMA), values copied,
    every other cache slot (other layers, positions, and a position past the end) untouched; the
    model's reference rotation gives the same bits. With ``parts``, qkv comes as float32 partial
    sums that the kernel adds left to right (``scaled``: then multiplies by a W4AX row scale) and
    rounds; with ``bits`` the cache is a draft's shadow, its words and scales bitwise as the
    reference quantization of the expected keys and values."""
    scale = rng.uniform(0.5, 2.0, (2, 3, 1)).astype(np.float32) if scaled else None
    args, q, want = rope_store_case(rng, dtype, heads=heads, kv=kv, parts=parts, bits=bits, scale=scale)
    got_q, got = gpu_rope.rope_store(*as_jnp(args), heads=heads, layer=jnp.int32(1), interpret=True,
                                     scale=None if scale is None else jnp.asarray(scale))
    for g, w in zip((got_q, *got), (q, *want)):
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))
        else:
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)
    half = args[0].shape[-1] // (heads + 2 * kv) // 2
    x = jnp.asarray(ref.split_sum(args[0], scale) if parts else args[0]).astype(dtype)[..., :half * 2]
    lo, hi = ref.rope(x[..., :half], x[..., half:], jnp.asarray(args[1]), jnp.asarray(args[2]))
    np.testing.assert_array_equal(np.asarray(jnp.concatenate([lo, hi], -1)).view(np.uint8), q[:, :, 0].view(np.uint8))


def test_rope_store_rejects_bad_input(rng):
    args, *_ = rope_store_case(rng, jnp.bfloat16)
    qkv, cos, sin, pos, (kc, vc) = as_jnp(args)
    def call(*a, **kw):
        return gpu_rope.rope_store(*a, **{"heads": 6, "layer": jnp.int32(1), "interpret": True, **kw})

    with pytest.raises(ValueError, match="query heads"):
        call(qkv, cos, sin, pos, (kc, vc), heads=5)
    with pytest.raises(ValueError, match="dtype"):
        call(qkv.astype(jnp.float32), cos, sin, pos, (kc, vc))
    with pytest.raises(ValueError, match="positions"):
        call(qkv, cos, sin, pos[:, :1], (kc, vc))
    with pytest.raises(ValueError, match="positions must be >= 0"):  # would store before the cache
        call(qkv, cos, sin, pos.at[int(rng.integers(2)), int(rng.integers(3))].set(-1), (kc, vc))
    with pytest.raises(ValueError, match="cache pair"):
        call(qkv, cos, sin, pos, (kc[0], vc[0]))
    with pytest.raises(ValueError, match="float32"):
        call(qkv[None], cos, sin, pos, (kc, vc))
    with pytest.raises(ValueError, match="row scale"):
        call(qkv, cos, sin, pos, (kc, vc), scale=jnp.ones((2, 3, 1), jnp.float32))  # no partial sums to scale
    with pytest.raises(ValueError, match="row scale"):
        call(qkv.astype(jnp.float32)[None], cos, sin, pos, (kc, vc), scale=jnp.ones((2, 3), jnp.float32))
    shadow = as_jnp(rope_store_case(rng, jnp.bfloat16, bits=8)[0])[4]
    with pytest.raises(ValueError, match="scales"):
        call(qkv, cos, sin, pos, (*shadow[:2], shadow[2][..., :-1], shadow[3]))
    odd = as_jnp(rope_store_case(rng, jnp.bfloat16, d=48)[0])
    with pytest.raises(ValueError, match="power of two"):
        call(*odd)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_activation_prologue_kernels(rng, dtype, bits):
    """quantize_rows == the reference quantization in the W4AX plane layout; rms_norm_quantize ==
    that of the RMSNorm kernel's output (stacked scale, layer 2), rms_norm_planes == that output in
    the W4A16 plane layout, bitwise, and the matmuls take them; zero rows get scale 1."""
    m, h = 5, 576  # 9 64-blocks: one tile (9 rows; on the GPU 16, masked)
    x = jnp.asarray(rng.standard_normal((m, h)) * np.exp(rng.standard_normal((m, 1))), dtype).at[1].set(0)
    scales = jnp.asarray(rng.random((3, h)) + 0.5, dtype)
    cases = {"quantize_rows": (gq.quantize_rows(x, bits, interpret=True), x),
             "rms_norm_quantize": (gq.rms_norm_quantize(x, scales, 1e-5, bits, layer=jnp.int32(2), interpret=True),
                                   gpu_norm.rms_norm(x, scales[2], 1e-5, interpret=True))}
    for name, ((planes, sa), values) in cases.items():
        q, s = ref.quantize_activations(values, bits)
        np.testing.assert_array_equal(np.asarray(planes), np.asarray(gm.activation_planes(q, 2)), err_msg=name)
        np.testing.assert_array_equal(np.asarray(sa), np.asarray(s), err_msg=name)
        assert np.asarray(sa)[1, 0] == 1.0 and not np.asarray(planes)[:, 1].any()
    # W4A16: the normalized rows as bf16 planes, and the matmul on them
    bf_planes = gq.rms_norm_planes(x, scales, 1e-5, layer=jnp.int32(2), interpret=True)
    normed = cases["rms_norm_quantize"][1]
    np.testing.assert_array_equal(np.asarray(bf_planes, np.float32),
                                  np.asarray(gm.activation_planes(normed.astype(jnp.bfloat16), 4), np.float32))
    w = random_weight(rng, 32, h, 32, False)  # the planes feed the W4AX kernel as its own quantization would
    planes, sa = cases["quantize_rows"][0]
    assert_w4ax_output(np.asarray(gm.w4ax_quantized(planes, sa, w, interpret=True)),
                       np.asarray(ref.quantized_matmul(x, w, parse_precision(f"w4a{bits}"))), x, w, bits,
                       "quantize_rows planes")
    np.testing.assert_array_equal(np.asarray(gm.w4a16_matmul(bf_planes, w, interpret=True)),
                                  np.asarray(gm.w4a16_matmul(normed, w, interpret=True)))
    with pytest.raises(ValueError, match="planes"):
        gm.w4a16_matmul(bf_planes.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        gq.quantize_rows(x[:, :96], bits, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        gq.quantize_rows(x, 2, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        gq.rms_norm_quantize(x, scales[0, :128], 1e-5, bits, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        gq.quantize_rows(x, None, interpret=True)
    with pytest.raises(ValueError, match="eps"):
        gq.rms_norm_planes(x, scales[0], None, interpret=True)
    with pytest.raises(ValueError, match=r"max_blocks \(64-blocks\) must be an integer >= 1"):
        gq.quantize_rows(x, bits, max_blocks=0, interpret=True)
    # tiles of 3 blocks (the largest divisor of the row's 9 up to 4; 2 rows past it masked on the GPU)
    assert gq.tile_blocks(9, 4) == 3 and gq.tile_blocks(9, 9) == 9 and gq.tile_blocks(7, 4) == 1
    for name, (out, _) in cases.items():
        fn = gq.quantize_rows if name == "quantize_rows" else functools.partial(
            gq.rms_norm_quantize, scale=scales, eps=1e-5, layer=jnp.int32(2))
        narrow = fn(x, bits=bits, max_blocks=4, interpret=True)
        for a, b in zip(narrow, out, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} max_blocks=4")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_prologue_kernels(rng, dtype):
    """swiglu_quantize / swiglu_planes of rows ``[gate | up]`` == the reference SwiGLU (checked
    against float64) then the reference quantization / the W4A16 plane layout, bitwise, in whole-row
    tiles and in tiles of 3 blocks, one program per row or each row's tiles spread over programs
    (quantized in two kernels); bad widths and bits raise."""
    m, f = 4, 576  # 9 64-blocks per half
    gu = jnp.asarray(rng.standard_normal((m, 2 * f)) * 3, dtype)
    h = ref.swiglu(gu[:, :f], gu[:, f:])
    g64, u64 = (np.asarray(a, np.float64) for a in (gu[:, :f].astype(jnp.float32), gu[:, f:].astype(jnp.float32)))
    want = g64 / (1 + np.exp(-g64)) * u64
    tol = 2e-6 if dtype == jnp.float32 else 8e-3  # a few float32 ulps, or one bf16 rounding
    np.testing.assert_allclose(np.asarray(h, np.float64), want, rtol=tol, atol=1e-30)
    for max_blocks in (None, 4):
        for bits in (8, 4):
            q_ref, s_ref = ref.quantize_activations(h, bits)
            for spread in (False, True):  # one program per row, or each row's tiles over programs
                q, s = gq.swiglu_quantize(gu, bits, max_blocks=max_blocks, spread=spread, interpret=True)
                np.testing.assert_array_equal(np.asarray(q), np.asarray(gm.activation_planes(q_ref, 2)))
                np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        for spread in (False, True):
            planes = gq.swiglu_planes(gu, max_blocks=max_blocks, spread=spread, interpret=True)
            np.testing.assert_array_equal(np.asarray(planes, np.float32),
                                          np.asarray(gm.activation_planes(h.astype(jnp.bfloat16), 4), np.float32))
    with pytest.raises(ValueError, match="2 x K"):
        gq.swiglu_quantize(gu[:, :f], 8, interpret=True)  # 576 = 2 x 288: not whole 64-blocks per half
    for spread in (None, True, False):
        with pytest.raises(ValueError, match="2 x K"):
            gq.swiglu_quantize(gu[:, :0], 8, spread=spread, interpret=True)  # empty rows
    with pytest.raises(ValueError, match="bits"):
        gq.swiglu_quantize(gu, 3, interpret=True)


def test_stacked_inputs_read_the_indexed_layer(rng):
    """Kernels given a stack ``[L, ...]`` and a (traced) layer index equal the same kernels on that
    layer's own arrays, bitwise: the model's decode path, which never slices a layer out."""
    import jax

    layers, m, n, k = 3, 5, 32, 256
    x = random_x(rng, m, k)
    scales = jnp.asarray(rng.random((layers, k)) + 0.5, jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((layers, 2, 64, 2, 16)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    pos = jnp.asarray([[10, 11, 12], [40, 41, 42]], jnp.int32)
    calls = {}
    for group, symmetric in ((32, False), (128, True)):  # per-layer scales and minimums differ
        ws = [random_weight(rng, n, k, group, symmetric) for _ in range(layers)]
        stack = QuantizedWeight(jnp.stack([w.packed for w in ws]), jnp.stack([w.scales for w in ws]),
                                None if symmetric else jnp.stack([w.mins for w in ws]), group)
        calls[f"w4a16 g{group}"] = (
            lambda i, stack=stack: gm.w4a16_matmul(x, stack, layer=i, block_n=BN, interpret=True),
            lambda i, ws=ws: gm.w4a16_matmul(x, ws[i], block_n=BN, interpret=True))
        calls[f"w4a8 g{group}"] = (
            lambda i, stack=stack: gm.w4ax_matmul(x, stack, 8, layer=i, block_n=BN, interpret=True),
            lambda i, ws=ws: gm.w4ax_matmul(x, ws[i], 8, block_n=BN, interpret=True))
    calls.update({
        "rmsnorm": (lambda i: gpu_norm.rms_norm(x, scales, 1e-5, layer=i, interpret=True),
                    lambda i: gpu_norm.rms_norm(x, scales[i], 1e-5, interpret=True)),
        "attention": (lambda i: gpu_attention.decode_attention(q, kc, vc, pos, layer=i, block_s=16, interpret=True),
                      lambda i: gpu_attention.decode_attention(q, kc[i], vc[i], pos, block_s=16, interpret=True)),
    })
    for name, (stacked, alone) in calls.items():
        run = jax.jit(stacked)
        outs = [np.asarray(run(jnp.int32(i))) for i in range(layers)]
        for i in range(layers):
            np.testing.assert_array_equal(outs[i], np.asarray(jax.jit(lambda: alone(i))()), err_msg=f"{name} layer {i}")
        assert not np.array_equal(outs[0], outs[1]), name  # the index does select different layers
    with pytest.raises(ValueError, match="out of range"):
        gm.w4a16_matmul(x, stack, layer=3, interpret=True)
    with pytest.raises(ValueError, match="out of range"):
        gpu_norm.rms_norm(x, scales, 1e-5, layer=jnp.int32(-1), interpret=True)
    with pytest.raises(ValueError, match="stacked"):
        gm.w4a16_matmul(x, ws[0], layer=0, interpret=True)
    with pytest.raises(ValueError, match="stacked"):
        gm.w4ax_matmul(x, stack, 8, interpret=True)


def test_stacks_the_lowering_would_misindex_are_sliced():
    """The Triton lowering indexes arrays of <= 2**32 bytes with int32 element offsets: a 1-byte stack
    of 2-4 GiB is read from a slice instead of in place; 2-byte and small stacks stay stacked (and the
    W4AX kernel reads a 1-byte one as 2-byte words)."""
    import jax

    from pallas_kernels.launch import stacked_input

    def shape_after(shape, dtype):
        return jax.eval_shape(lambda a: stacked_input(a, 1)[0], jax.ShapeDtypeStruct(shape, dtype)).shape

    big = (2, 2**30 + 64)  # 2**31 + 128 elements
    assert shape_after(big, jnp.uint8) == (1, 2**30 + 64)
    assert shape_after(big, jnp.uint16) == big  # > 2**32 bytes: 64-bit offsets
    assert shape_after((2, 2**29), jnp.uint8) == (2, 2**29)

    # the W4AX kernel reads such a stack (Llama-2-13B's gate/up) as uint16 words instead, in place
    def jaxpr(words):
        sd = jax.ShapeDtypeStruct
        w = QuantizedWeight(sd((40, 27648, 2560), jnp.uint8), sd((40, 27648, 40), jnp.float16), None, 128)
        fn = lambda q, s, w: gm.w4ax_quantized(q, s, w, layer=jnp.int32(3), words=words)  # noqa: E731
        return str(jax.make_jaxpr(fn)(sd((2, 5120), jnp.int8), sd((2, 1), jnp.float32), w))

    assert "dynamic_slice" not in jaxpr(None) and "dynamic_slice" in jaxpr(False)


def test_dense_kernel_against_float64(rng):
    x = random_x(rng, 19, 128)
    w = jnp.asarray(rng.standard_normal((48, 128)), jnp.float32)
    got = np.asarray(gm.dense_matmul(x, w, interpret=True))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-4)


def test_lowers_for_gpu_without_deprecation_warning():
    """Lower (not compile) every kernel for an H200 on this CPU-only machine, in a fresh process
    where the Pallas Triton deprecation warning would be an error unless the module filters it."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax._src.pallas.triton import gpu_info
        h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
        gpu_info.get_gpu_info = lambda: h200
        from pallas_kernels import gpu_attention, gpu_matmul as gm, gpu_norm, gpu_activations, gpu_rope
        from pallas_kernels.layout import QuantizedWeight
        def lower(f, *args):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text.lower(), text[:500]
        for n, k, g, sym in [(6144, 4096, 128, True), (4096, 14336, 32, False)]:
            s = jax.ShapeDtypeStruct((n, k // g), jnp.float16)
            w = QuantizedWeight(jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), s, None if sym else s, g)
            for m in (3, 40):
                x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
                for f in (gm.w4a16_matmul, lambda x, w: gm.w4ax_matmul(x, w, 4),
                          lambda x, w: gm.w4a16_matmul(x, w, split_k=2, block_k=128),
                          lambda x, w: gm.w4a16_matmul(x, w, rows_first=True, block_m=64),
                          lambda x, w: gm.w4a16_matmul(x, w, rows_first=False),
                          lambda x, w: gm.w4ax_matmul(x, w, 8, rows_first=True),
                          lambda x, w: gm.w4ax_matmul(x, w, 8, split_k=2)):
                    lower(f, x, w)
        bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
        lower(gm.dense_matmul, bf(3, 576), bf(49152, 576))
        lower(lambda x, s: gpu_norm.rms_norm(x, s, 1e-5), bf(3, 576), bf(576))
        lower(lambda x: gpu_activations.quantize_rows(x, 4), bf(3, 14336))
        lower(lambda x: gpu_activations.quantize_rows(x, 4, max_blocks=16), bf(3, 14336))
        lower(lambda x, s: gpu_activations.rms_norm_quantize(x, s, 1e-5, 8, layer=jnp.int32(1)), bf(3, 576), bf(4, 576))
        lower(lambda x, s: gpu_activations.rms_norm_planes(x, s, 1e-5, layer=jnp.int32(1)), bf(3, 576), bf(4, 576))
        lower(lambda x: gpu_activations.swiglu_quantize(x, 4), bf(3, 2 * 14336))
        lower(lambda x: gpu_activations.swiglu_planes(x), bf(3, 2 * 14336))
        lower(lambda x: gpu_activations.swiglu_quantize(x, 8, max_blocks=64), jax.ShapeDtypeStruct((3, 2 * 1536), jnp.float32))
        lower(lambda x: gpu_activations.swiglu_quantize(x, 8, max_blocks=128, spread=False), bf(3, 2 * 13824))
        lower(lambda x: gpu_activations.swiglu_quantize(x, 8), bf(3, 2 * 13824))  # 18 tiles of 12 blocks
        lower(lambda q, s, p, sc: gm.w4ax_quantized(q, s, QuantizedWeight(p, sc, None, 128), layer=jnp.int32(1),
                                                    words=True),
              jax.ShapeDtypeStruct((3, 5120), jnp.int8), jax.ShapeDtypeStruct((3, 1), jnp.float32),
              jax.ShapeDtypeStruct((2, 27648, 2560), jnp.uint8), jax.ShapeDtypeStruct((2, 27648, 40), jnp.float16))
        i16, f32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.int16)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32))
        for qkv, cache in ((bf(2, 4, 48 * 128), (bf(3, 2, 256, 8, 128),) * 2),  # K-split parts, an INT4 shadow
                           (f32(4, 2, 4, 48 * 128), (i16(3, 2, 256, 8, 32),) * 2 + (f32(3, 2, 8, 256),) * 2)):
            lower(lambda q, c, s, p, k: gpu_rope.rope_store(q, c, s, p, k, heads=32, layer=jnp.int32(1)), qkv,
                  bf(2, 4, 64), bf(2, 4, 64), jax.ShapeDtypeStruct((2, 4), jnp.int32), cache)
        lower(gpu_attention.decode_attention, bf(2, 4, 32, 128), bf(2, 256, 8, 128), bf(2, 256, 8, 128),
              jax.ShapeDtypeStruct((2, 4), jnp.int32))
        parts = lambda q, k, v, p: gpu_attention.attention_partials(q, k, v, p)  # Llama-3-8B heads
        lower(lambda *a: gpu_activations.attention_quantize(parts(*a), 8), bf(2, 4, 32, 128), bf(2, 256, 8, 128),
              bf(2, 256, 8, 128), jax.ShapeDtypeStruct((2, 4), jnp.int32))
        lower(lambda *a: gpu_activations.attention_planes(parts(*a)), bf(2, 4, 32, 128), bf(2, 256, 8, 128),
              bf(2, 256, 8, 128), jax.ShapeDtypeStruct((2, 4), jnp.int32))
        for tile in (1, 8):  # a row's KV heads spread over programs (the default at 8 rows), or in one
            lower(lambda *a: gpu_activations.attention_quantize(parts(*a), 8, head_tile=tile), bf(2, 4, 32, 128),
                  bf(2, 256, 8, 128), bf(2, 256, 8, 128), jax.ShapeDtypeStruct((2, 4), jnp.int32))
            lower(lambda *a: gpu_activations.attention_planes(parts(*a), head_tile=tile), bf(2, 4, 32, 128),
                  bf(2, 256, 8, 128), bf(2, 256, 8, 128), jax.ShapeDtypeStruct((2, 4), jnp.int32))
        print("lowered")
    """)
    proc = subprocess.run([sys.executable, "-W", "error:The Pallas Triton backend:DeprecationWarning",
                           "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "lowered" in proc.stdout, proc.stderr[-3000:]


def test_mosaic_w4a16_refuses_operands_it_cannot_take():
    """The Mosaic W4A16 kernel names what is wrong with its operands before anything is lowered, and
    its tiles hold code (n, k) at [n // 128, k // 128, n % 128, k % 128]."""
    from pallas_kernels import mgpu_matmul

    q = np.random.default_rng().integers(-8, 8, (256, 384))
    t = np.asarray(mgpu_matmul.tile_codes(jnp.asarray(q, jnp.int8).astype(jnp.int4)).astype(jnp.int8))
    n, k = np.meshgrid(np.arange(256), np.arange(384), indexing="ij")
    np.testing.assert_array_equal(t[n // 128, k // 128, n % 128, k % 128], q)
    with pytest.raises(ValueError, match="multiple of 128"):
        mgpu_matmul.tile_codes(jnp.zeros((64, 256), jnp.int4))
    x = jnp.zeros((4, 256), jnp.bfloat16)
    codes = mgpu_matmul.tile_codes(jnp.zeros((128, 256), jnp.int4))
    scales = jnp.zeros((2, 128), jnp.bfloat16)
    bad = [((x, codes.astype(jnp.int8), scales), "codes must be int4"),
           ((x, codes, scales.astype(jnp.float16)), "scales bfloat16"),
           ((x[:, :128], codes, scales), "do not form"),
           ((x, codes, jnp.zeros((2, 64), jnp.bfloat16)), "do not form"),
           ((x, codes, jnp.zeros((4, 128), jnp.bfloat16)), "group size must be a multiple of 128"),
           ((x, jnp.zeros((128, 256), jnp.int4), scales), "tiled"),
           ((x, jnp.zeros((1, 2, 64, 128), jnp.int4), scales), "must be tiles"),
           ((jnp.zeros((0, 256), jnp.bfloat16), codes, scales), "1 to 256 tokens"),
           ((jnp.zeros((257, 256), jnp.bfloat16), codes, scales), "1 to 256 tokens"),
           ((x[0], codes, scales), "2-D")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            mgpu_matmul.w4a16_int4_matmul(*args)


def test_mosaic_w4a16_interpret_against_float64_and_row_count_invariant(rng):
    """The persistent Mosaic W4A16 kernel in Mosaic GPU's interpret mode (its barriers and shared
    memory simulated, races detected): within float32 accumulation error of float64 numpy over the
    bf16 weights ``bf16(q * s)``, with row tiles cut between programs (a block running one or several
    programs' shares through its pipeline), and each row bitwise the same
    in calls of 10 and 13 rows (one token tile: the interpreter's wgmma is numpy's matmul, whose
    order changes with the tile; across tiles tests/test_gpu.py checks it on the GPU)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels import mgpu_matmul

    n, k = 128 * int(rng.integers(1, 4)), 128 * int(rng.integers(2, 6))
    group = int(rng.choice([g for g in (128, 256, k) if k % g == 0]))
    programs = int(rng.integers(2, n // 128 * k // 128 + 1))
    blocks = int(rng.choice([b for b in range(1, programs + 1) if programs % b == 0]))  # each runs programs / blocks
    q = rng.integers(-8, 8, (n, k))
    s = np.asarray(jnp.asarray(0.002 + 0.02 * rng.random((k // group, n)), jnp.bfloat16).astype(jnp.float32))
    w = np.asarray(jnp.asarray(q * np.repeat(s, group, axis=0).T, jnp.float32).astype(jnp.bfloat16), np.float64)
    codes = mgpu_matmul.tile_codes(jnp.asarray(q, jnp.int8).astype(jnp.int4))
    x = jnp.asarray(rng.standard_normal((13, k)), jnp.bfloat16)
    call = functools.partial(mgpu_matmul.w4a16_int4_matmul, codes=codes, scales=jnp.asarray(s, jnp.bfloat16),
                             programs=programs, blocks=blocks, interpret=True)
    got = np.asarray(call(x))
    x64 = np.asarray(x, np.float64)
    assert np.all(np.abs(got - x64 @ w.T) <= 1e-5 * (np.abs(x64) @ np.abs(w).T) + 1e-30), (n, k, group, programs,
                                                                                          blocks)
    np.testing.assert_array_equal(np.asarray(call(x[3:])), got[3:])
    assert not get_races().races_found


def test_mosaic_w4a16_lowers_for_hopper_on_the_cpu():
    """Every operation of the Mosaic kernel has a Mosaic GPU lowering rule: it lowers for CUDA here,
    at a token count of each tile size and Llama-3-8B's qkv shape (row tiles cut between programs)."""
    from pallas_kernels import mgpu_matmul

    codes = jax.ShapeDtypeStruct((48, 32, 128, 128), jnp.int4)
    scales = jax.ShapeDtypeStruct((32, 6144), jnp.bfloat16)
    for m in (1, 16, 200):
        x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
        fn = functools.partial(mgpu_matmul.w4a16_int4_matmul, programs=264, blocks=132)  # two shares a block
        text = jax.jit(fn).trace(x, codes, scales).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, text[:500]


@pytest.mark.parametrize("draw", range(3))
def test_mosaic_w4a16_programs_share_the_units_in_order(draw):
    """The persistent Mosaic kernel's schedule: the program shares cover every (row tile, K stage) unit
    once, in order, and ``pieces`` counts the programs each row tile's stages meet, as a direct walk
    over the shares finds them."""
    from pallas_kernels import mgpu_matmul

    rng = np.random.default_rng()
    n = 128 * int(rng.integers(1, 40))
    k = 128 * int(rng.integers(1, 60))
    steps = k // 128
    units = n // 128 * steps
    programs = int(rng.integers(1, units + 1))
    bounds = [p * units // programs for p in range(programs + 1)]
    owner = np.repeat(np.arange(programs), np.diff(bounds))
    assert len(owner) == units and np.all(np.diff(owner) >= 0)
    np.testing.assert_array_equal(mgpu_matmul.first_program(np.arange(units), units, programs), owner)
    walked = [len(set(owner[t * steps:(t + 1) * steps])) for t in range(n // 128)]
    np.testing.assert_array_equal(mgpu_matmul.pieces(n, k, programs), walked)
    # launched blocks: two per SM where two fit its shared memory, else one, each a divisor of the programs
    half, most = (mgpu_matmul.SM_SMEM_BYTES // 2 - 1024, mgpu_matmul.SM_SMEM_BYTES // 2)
    assert mgpu_matmul.default_blocks(264, 132, half) == 264 and mgpu_matmul.default_blocks(264, 132, most) == 132
    assert mgpu_matmul.default_blocks(132, 132, half) == 132 and mgpu_matmul.default_blocks(7, 4, most) == 1
