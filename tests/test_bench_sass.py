"""bench/sass.py: the Triton modules of a CUDA lowering made on the CPU, and the loops of a SASS
listing (hand-written here, so the counts are known); the compile step with the pinned triton."""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import pytest

from bench import sass
from pallas_kernels import gpu_attention

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;           /* 0x0000000402027981 */
        /*0020*/                   FFMA R3, R2, R2, R3 ;                  /* 0x0000000202037223 */
        /*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;       /* 0x0000000c0804723c */
        /*0040*/               @P0 BRA 0x60 ;                             /* 0x0000000000080947 */
        /*0050*/                   FADD R3, R3, 1 ;                       /* 0x3f80000003037421 */
        /*0060*/                   ISETP.GE.AND P1, PT, R3, R5, PT ;      /* 0x000000050300720c */
        /*0070*/              @!P1 BRA 0x20 ;                             /* 0xfffffffc0900a947 */
        /*0080*/                   LOP3.LUT R6, R3, 0xf, RZ, 0xc0, !PT ;  /* 0x0000000f03067812 */
        /*0090*/               @P2 BRA 0x80 ;                             /* 0xfffffff400002947 */
        /*00a0*/                   BRA 0xa0;                              /* 0xfffffffc00fc7947 */
        /*00b0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_loops_of_a_listing():
    """A backward branch closes a loop from its target to itself (a forward branch inside it does
    not, nor does the kernel's closing self-branch); the shortest loop comes first."""
    found = sass.loops(LISTING)
    assert [(lp["start"], lp["end"], lp["instructions"]) for lp in found] == [(0x80, 0x90, 2), (0x20, 0x70, 6)]
    assert found[1]["opcodes"] == {"FFMA": 1, "HMMA": 1, "BRA": 2, "FADD": 1, "ISETP": 1}
    assert found[0]["opcodes"] == {"LOP3": 1, "BRA": 1}


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_triton_modules_of_the_attention_kernel(kv_bits):
    """The decode attention lowered for CUDA on the CPU: one module, named after the kernel, with the
    warps and stages the kernel asks for; the lowering hooks are put back afterwards."""
    b, h, d, s = 2, 4, 128, 256
    q = jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    if kv_bits is None:
        kv = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
        mods = sass.triton_modules(lambda q, k, v, p: gpu_attention.decode_attention(q, k, v, p), q, kv, kv, pos)
    else:
        w = jax.ShapeDtypeStruct((b, s, h, d * kv_bits // 16), jnp.int16)
        sc = jax.ShapeDtypeStruct((b, h, s), jnp.float32)
        mods = sass.triton_modules(lambda q, k, v, x, y, p: gpu_attention.decode_attention(q, k, v, p, scales=(x, y)),
                                   q, w, w, sc, sc, pos)
    (m,) = mods
    assert m["name"] == "_attention_kernel"
    assert m["num_warps"] == (gpu_attention.FLOAT_WARPS if kv_bits is None else gpu_attention.SHADOW_WARPS)
    assert m["num_stages"] == (2 if kv_bits is None else gpu_attention.SHADOW_STAGES)
    assert "tt.func public @_attention_kernel" in m["module"] and "tt.dot" in m["module"]
    assert "loc(" not in m["module"]  # plain text, parseable by another MLIR
    with pytest.raises(RuntimeError, match="GPU"):  # the H200 stand-in is gone again
        jax.jit(lambda q, k, v, p: gpu_attention.decode_attention(q, k, v, p)).trace(
            q, jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
            pos).lower(lowering_platforms=("cuda",))


def test_compile_counts_the_kernel_loop():
    """With a local triton: the bf16 attention kernel has one loop over KV blocks, with its two MMAs
    of 16 x 64 x 128 (q k^T, p v) as m16n8k16 HMMAs per warp."""
    b, h, d, s = 2, 4, 128, 4096  # 16 cache splits of 4 blocks: a loop (one block each would be none)
    q = jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    (m,) = sass.triton_modules(lambda q, k, v, p: gpu_attention.decode_attention(q, k, v, p), q, kv, kv,
                               jax.ShapeDtypeStruct((b, 1), jnp.int32))
    (loop,) = sass.loops(sass.compile_sass(m["module"], m["num_warps"], m["num_stages"])["sass"])
    # a 64-slot block, 16 query rows, the warps side by side on the MMA's N: per warp (of 2), q k^T is
    # 16 x 32 x 128 (4 n8 tiles x 8 k16 steps) and p v 16 x 64 x 64 (8 n8 tiles x 4 k16 steps)
    warps = m["num_warps"]
    assert warps == gpu_attention.FLOAT_WARPS
    assert loop["opcodes"]["HMMA"] == 64 // warps // 8 * 8 + 128 // warps // 8 * 4


def test_occupancy_matches_nsight_compute_on_the_h200():
    """CTAs per SM from registers, shared memory and warps, against Nsight Compute's block limits for
    the W4A16 kernel on the H200 (session 13: 92 registers, 66,560 bytes at M = 16 -> shared memory 3,
    registers 5, warps 16; 239 registers, 230,400 bytes at M = 64 -> 1 CTA, 1 warp per scheduler)."""
    assert sass.occupancy(92, 66560, 4) == (3, "shared memory")
    assert sass.occupancy(92, 0, 4) == (5, "registers") and sass.occupancy(8, 0, 4) == (16, "warps")
    assert sass.occupancy(239, 230400, 4) == (1, "shared memory")
    # registers bound: 255 per thread x 8 warps = 65,280 of 65,536 -> 1 CTA; none fits past the file
    assert sass.occupancy(255, 0, 8) == (1, "registers") and sass.occupancy(255, 0, 16)[0] == 0
    assert sass.occupancy(32, 0, 1) == (32, "CTAs") and sass.occupancy(16, 0, 32) == (2, "warps")
    # registers by sub-partition: 200 per thread -> 6400 per warp, 2 warps in each 16384 -> 8 per SM:
    # 4 CTAs of 2 warps (dividing the SM's 65536 by 12800 would say 5)
    assert sass.occupancy(200, 0, 2) == (4, "registers")
    # shared memory in 128 B units: 45,600 B takes 45,696 + 1,024 -> 4 CTAs in 233,472 B, where
    # 45,600 + 1,024 would fit 5
    assert sass.occupancy(32, 45600, 4) == (4, "shared memory") and sass.occupancy(32, 45568, 4)[0] == 5


def test_compile_reports_registers_and_shared_memory():
    """With a local triton: the W4A16 kernel at M = 16 and 64 as Nsight Compute saw it on the H200 in
    session 13, with 512-wide K chunks and the scales loaded in the iteration that uses them (the shared
    memory to the byte; registers within the compilers' difference, XLA's being 92 / 239)."""
    from bench.kernels import make_weight
    from pallas_kernels import gpu_matmul

    w = jax.eval_shape(lambda: make_weight(jax.random.key(0), 22016, 4096, 128, True))
    for m, shared, registers in ((16, 66560, 92), (64, 230400, 239)):
        (k,) = sass.triton_modules(lambda x, w: gpu_matmul.w4a16_matmul(x, w, block_k=512, prefetch=False),
                                   jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), w)
        built = sass.compile_sass(k["module"], k["num_warps"], k["num_stages"])
        assert built["shared"] == shared and abs(built["registers"] - registers) <= 8


def test_compile_runs_the_ttir_passes_as_xla_does():
    """With a local triton: the module goes through Triton's TTIR passes before compiling, as XLA's
    pipeline runs them, so the combine pass folds the Pallas ``acc + dot(a, b)`` (a dot with a zero
    accumulator and an add) into one dot accumulating into ``acc``: no add of a dot result is left."""
    from jax.experimental import pallas as pl

    from pallas_kernels.launch import call_kernel

    def kernel(x_ref, y_ref, o_ref):
        def body(i, acc):
            return acc + jnp.dot(x_ref[:, pl.ds(i * 32, 32)], y_ref[pl.ds(i * 32, 32), :],
                                 preferred_element_type=jnp.float32)

        o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros((64, 64), jnp.float32))

    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
    spec = lambda shape: pl.BlockSpec(shape, lambda: (0, 0))  # noqa: E731
    (m,) = sass.triton_modules(lambda x, y: call_kernel(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32), (),
                                                        [spec((64, 128)), spec((128, 64))], spec((64, 64)), False,
                                                        4, 2, x, y), x, y)
    assert "arith.addf" in m["module"]  # what the Pallas lowering hands over
    ttgir = sass.compile_sass(m["module"], m["num_warps"], m["num_stages"])["ttgir"]
    assert "dot" in ttgir and "arith.addf" not in ttgir


def _matmul_module(kind: str, n: int, k: int, group: int = 128, prefetch: bool | None = None,
                   words: bool | None = None) -> dict:
    """The Triton module of bench.sass's matmul (16 rows, default tiles) as its CLI would build it."""
    args = argparse.Namespace(kernel=kind, m=16, n=n, k=k, group=group, block_m=None, num_warps=None,
                              num_stages=None, rows_first=None, prefetch=prefetch, words=words)
    fn, fn_args = sass._matmul(args)
    (module,) = sass.triton_modules(fn, *fn_args)
    return module


@pytest.mark.parametrize("kind", ["w4a16", "w4ax"])
def test_scale_prefetch_carries_the_next_scales(kind):
    """The CUDA lowering of both matmuls: with the scales prefetched, the K loop carries the next
    iteration's scale tiles (``[64, groups]`` of the weight tile's rows) beside its accumulator; the
    default prefetches where a program has 5 or more K iterations (Llama-3-8B's down, 56 chunks in 8
    splits) and not with 2 (its o, 16 chunks in 8)."""
    from pallas_kernels import gpu_matmul

    def carried(n: int, k: int, prefetch: bool | None) -> list[str]:
        m = _matmul_module(kind, n, k, prefetch=prefetch)
        (loop,) = [line for line in m["module"].splitlines() if "scf.for" in line]
        return re.findall(r"tensor<[^>]*>", loop.split("->")[-1])

    assert len(carried(4096, 14336, False)) == 1  # the accumulator alone
    with_scales = carried(4096, 14336, True)
    assert len(with_scales) > 1 and all(re.fullmatch(r"tensor<64x\d+xf(16|32)>", t) for t in with_scales[1:])
    assert carried(4096, 14336, None) == with_scales
    assert len(carried(4096, 4096, None)) == 1 and len(carried(4096, 4096, True)) > 1
    assert gpu_matmul.PREFETCH_MIN_ITERATIONS == 5
    mode = "w4a16" if kind == "w4a16" else "w4ax"  # what bench.tune reads as the default
    assert gpu_matmul.default_prefetch(4096, 14336, 128, mode)
    assert not gpu_matmul.default_prefetch(4096, 4096, 128, mode)


@pytest.mark.parametrize("group", [128, 32])
def test_words_weight_tile_goes_through_the_pipeline(group):
    """The W4AX kernel reading the packed weights as uint16 words (Llama-2-13B's gate/up): Triton's
    pipeliner turns the word tile's load into a ``cp.async`` copy into shared memory, as it does the
    byte path's. A word offset computed by floor division hid its alignment and left a plain 2-byte
    load per element in the loop (session 21: 36 LDG per iteration, 460 instructions against 232)."""
    module = _matmul_module("w4ax", 1024, 5120, group=group, words=True)
    ttgir = sass.compile_sass(module["module"], module["num_warps"], module["num_stages"])["ttgir"]
    words = r"tensor<64x\d+x!tt.ptr<i16>"
    assert re.search(r"async_copy_global_to_local[^\n]*" + words, ttgir)
    assert not re.search(r"tt\.load[^\n]*" + words, ttgir)
