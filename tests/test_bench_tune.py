"""bench/tune.py on the CPU: every variant it sweeps runs (interpret mode) and those that only change
timing (rows per tile, warps, stages) give the default's bits; without a GPU it refuses clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import tune
from tests.test_kernels import random_weight, random_x


@pytest.mark.parametrize("kind", ["w4a16", "w4a8"])
def test_variants_keep_bits_unless_they_reorder(rng, kind):
    n, k = 64, 512
    w = random_weight(rng, n, k, 128, True)
    for m in (16, 100):
        x = random_x(rng, m, k).astype(jnp.bfloat16)
        configs = tune.variants(kind, m, n, k)
        assert configs[0] == {}
        base = np.asarray(tune.KINDS[kind](x, w, {"interpret": True}))
        timing_only = 0
        for kw in configs[1:]:
            try:
                out = np.asarray(tune.KINDS[kind](x, w, {**kw, "interpret": True}))
            except ValueError as e:  # a K chunk larger than K: the sweep records it as n/a
                assert "block" in str(e), e
                continue
            if not any(key in kw for key in tune.ORDER_KEYS):
                timing_only += 1
                np.testing.assert_array_equal(out, base, err_msg=f"{kind} M={m} {kw}")
        assert timing_only >= 1


def test_dense_variants_are_launch_settings_only():
    """The dense lm_head kernel has no INT4 tiles to vary: warps and stages at small M, rows per tile above."""
    for m in (1, 16, 100):
        configs = tune.variants("dense", m, 256, 512)
        assert configs[0] == {} and len(configs) > 1
        assert all(set(kw) <= {"num_warps", "num_stages", "block_m"} for kw in configs), configs


def test_select_keeps_the_default_and_the_named_keys():
    configs = tune.variants("w4a16", 16, 64, 512)
    picked = tune.select(configs, {"rows_first"})
    assert picked[0] == {} and len(picked) >= 2 and all("rows_first" in kw for kw in picked[1:])
    assert tune.select(configs, None) == configs
    assert all(set(kw) <= tune.MATMUL_KEYS for m in (1, 16, 32, 100) for kind in ("w4a16", "w4a8", "dense")
               for kw in tune.variants(kind, m, 64, 512))
    with pytest.raises(SystemExit, match="unknown keys"):
        tune.main(["--only", "row_first"])
    for bad in ("12", "8,x", ""):
        with pytest.raises(SystemExit, match="--attn-kv"):
            tune.main(["--attn", "8:1024", "--attn-kv", bad])


@pytest.mark.parametrize("bits", [16, 8])
def test_attention_variants_agree(rng, bits):
    """Every KV block / split (and, over the draft's shadow, pipeline-depth) configuration the sweep
    tries runs and matches the default to float tolerance (only the grouping of the partial-softmax
    merge differs)."""
    from pallas_kernels import gpu_attention, reference

    b, ctx, h, kvh, d = 2, 512, 4, 2, 32
    k, v = (jnp.asarray(rng.standard_normal((b, ctx, kvh, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, 3, h, d)), jnp.float32)
    q_pos = jnp.asarray([[100, 101, 102], [509, 510, 511]], jnp.int32)
    extra = {}
    if bits < 16:  # the shadow: codes, and head-major scales [B, KV, S]
        (k, ks), (v, vs) = reference.quantize_kv(k, bits), reference.quantize_kv(v, bits)
        extra = {"scales": (jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2))}
    configs = tune.attention_variants(ctx, bits)
    assert configs[0] == {} and len(configs) > 5
    assert any("num_stages" in kw for kw in configs) == (bits < 16)
    base = np.asarray(gpu_attention.decode_attention(q, k, v, q_pos, interpret=True, **extra))
    for kw in configs[1:]:
        out = np.asarray(gpu_attention.decode_attention(q, k, v, q_pos, interpret=True, **extra, **kw))
        # over the shadow, the probabilities are rounded to float16 against each split's own maximum
        tol = 1e-5 if bits == 16 else 1e-3
        np.testing.assert_allclose(out, base, rtol=tol, atol=tol, err_msg=str(kw))


@pytest.mark.parametrize("kind", sorted(tune.PROLOGUES))
def test_prologue_tile_widths_keep_bits(rng, kind):
    """The tile widths the prologue sweep tries (e.g. 2 tiles of 32 blocks per 4096-wide row, or the whole
    row) give the default's bits: the row's absmax and statistics do not depend on the tiling."""
    k = 4096
    configs = tune.prologue_variants(k)
    assert configs == [{}, {"max_blocks": 32}]  # 64 blocks: 64- and 128-block tiles are the whole row
    # the largest divisors of 224 = 2^5 * 7, 172 = 4 * 43, 216 = 2^3 * 3^3 up to 32, 64, 128
    assert tune.prologue_variants(14336) == [{}, {"max_blocks": 32}, {"max_blocks": 56}, {"max_blocks": 112}]
    assert tune.prologue_variants(11008) == [{}, {"max_blocks": 4}, {"max_blocks": 43}, {"max_blocks": 86}]
    assert tune.prologue_variants(13824) == [{}, {"max_blocks": 27}, {"max_blocks": 54}, {"max_blocks": 108}]
    # the spread SwiGLU quantization's default tile (up to 16 blocks: 4 of 172) is not repeated as a variant
    assert tune.prologue_variants(11008, 16) == [{}, {"max_blocks": 43}, {"max_blocks": 86}]
    x = random_x(rng, 5, tune.PROLOGUE_PARTS.get(kind, 1) * k).astype(jnp.bfloat16)
    scale = jnp.asarray(rng.random(k) + 0.5, jnp.bfloat16)
    base = jax.tree.leaves(tune.PROLOGUES[kind](x, scale, {"interpret": True}))
    for kw in configs[1:]:
        out = jax.tree.leaves(tune.PROLOGUES[kind](x, scale, {**kw, "interpret": True}))
        for a, b in zip(out, base, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"{kind} {kw}")


def test_refuses_without_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("runs on a GPU")
    with pytest.raises(SystemExit, match="GPU"):
        tune.main(["--shapes", "o"])


@pytest.mark.parametrize("bad, message", [(["--attn-queries", "0,1"], "--attn-queries"),
                                          (["--attn-queries", "x"], "--attn-queries"),
                                          (["--attn-heads", "40,3,128"], "--attn-heads")])
def test_bad_attention_flags_are_clear_errors(bad, message):
    with pytest.raises(SystemExit, match=message):  # checked before the GPU is looked for
        tune.main(["--attn", "16:4096", *bad])
