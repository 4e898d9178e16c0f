"""A W4A16 matmul as a Mosaic GPU kernel for Hopper, over signed INT4 codes in 128 x 128 tiles.

The weights sit on the wgmma's M side (64 rows per compute warpgroup, two per block) and the call's
tokens on its N side (8 to 256), so each weight tile is dequantized once for every token of the call;
a third warpgroup streams the weight, scale and activation tiles through a ring of shared-memory
stages with TMA. Each weight is ``bf16(q * s)`` (one rounding, as :func:`pallas_kernels.layout.w4a16_weights`),
accumulated in float32 over K tiles of :data:`BLOCK_K` in order; the K splits are added left to
right, so a token's result does not depend on the other tokens of the call.

Its operands are not the packed layout's (:mod:`pallas_kernels.layout`): ``jnp.int4`` codes in tiles
``[N / 128, K / 128, 128, 128]`` (:func:`tile_codes`: each stage's weight tile one contiguous 8 KiB
block, which TMA streams faster than 64-byte pieces of 128 rows) and bfloat16 scales ``[K // group, N]``;
the model does not call it yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dtypes
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.launch import check_count

COMPUTE_WGS = 2  # compute warpgroups per block, BLOCK_N weight rows each
BLOCK_N = 64  # weight rows per compute warpgroup (the wgmma's M)
BLOCK_K = 128  # K per pipeline stage: a group of 128 has one scale per row and stage
SMEM_BYTES = 200 * 1024  # shared memory the stages may take
MAX_STAGES = 6
MAX_TOKENS = 256  # the wgmma's N at most

_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)
_UPCAST_4X = plgpu.Layout.WGMMA_UPCAST_4X


def _smem(shape: tuple[int, ...], dtype, what: str):
    """A tiled, swizzled shared-memory buffer that TMA fills and wgmma / upcast loads read."""
    bits = dtypes.itemsize_bits(jnp.dtype(dtype))
    swizzle = plgpu.find_swizzle(shape[-1] * bits, what)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                                plgpu.SwizzleTransform(swizzle)))


def token_tile(m: int) -> int:
    """The wgmma N for ``m`` tokens: the next power of two, at least 8."""
    return max(8, 1 << (m - 1).bit_length())


def default_split(n: int, k: int, sms: int) -> int:
    """The fewest K splits (a divisor of the K stages) that give every SM a block."""
    tiles, steps = n // (COMPUTE_WGS * BLOCK_N), k // BLOCK_K
    return next(s for s in range(1, steps + 1) if steps % s == 0 and (tiles * s >= sms or s == steps))


def tile_codes(codes: jax.Array) -> jax.Array:
    """int4 codes ``[N, K]`` as the kernel's tiles ``[N / 128, K / 128, 128, 128]``."""
    n, k = codes.shape
    rows = COMPUTE_WGS * BLOCK_N
    if n % rows or k % BLOCK_K:
        raise ValueError(f"codes [N, K] need N a multiple of {rows} and K of {BLOCK_K}, got {codes.shape}")
    return codes.reshape(n // rows, rows, k // BLOCK_K, BLOCK_K).transpose(0, 2, 1, 3)


def check_operands(x: jax.Array, codes: jax.Array, scales: jax.Array) -> None:
    """Shapes and dtypes the kernel takes, with the reason for a refusal."""
    if x.ndim != 2 or codes.ndim != 4 or scales.ndim != 2:
        raise ValueError(f"x and scales must be 2-D and codes tiled (tile_codes), got {x.shape}, {codes.shape}, "
                         f"{scales.shape}")
    rows = COMPUTE_WGS * BLOCK_N
    if codes.shape[2:] != (rows, BLOCK_K):
        raise ValueError(f"codes must be tiles [N / {rows}, K / {BLOCK_K}, {rows}, {BLOCK_K}] (tile_codes), "
                         f"got {codes.shape}")
    (m, k), n, kc = x.shape, codes.shape[0] * rows, codes.shape[1] * BLOCK_K
    if codes.dtype != jnp.int4 or scales.dtype != jnp.bfloat16 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"codes must be int4, scales bfloat16 and x float, got {codes.dtype}, {scales.dtype}, "
                         f"{x.dtype}")
    if kc != k or scales.shape[1] != n or not scales.shape[0] or k % scales.shape[0]:
        raise ValueError(f"x {x.shape}, codes {codes.shape} and scales {scales.shape} do not form "
                         "[M, K] @ [N, K].T with scales [K // group, N]")
    if (k // scales.shape[0]) % BLOCK_K:
        raise ValueError(f"the group size must be a multiple of {BLOCK_K}, got {k // scales.shape[0]}")
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"1 to {MAX_TOKENS} tokens per call, got {m}")


@functools.partial(jax.jit, static_argnames=("split_k", "stages"))
def w4a16_int4_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, split_k: int | None = None,
                      stages: int | None = None) -> jax.Array:
    """``x[M, K] @ W.T`` in float32 with ``W[n, k] = bf16(q[n, k] * scales[k // group, n])``, ``codes`` the
    int4 ``q`` as :func:`tile_codes` arranges them.
    ``split_k`` (a divisor of K / BLOCK_K; default :func:`default_split`, which M does not change) sets
    the order of the partial sums; ``stages`` changes only timing."""
    check_operands(x, codes, scales)
    (m, k), n = x.shape, scales.shape[1]
    g = k // scales.shape[0]
    bm = token_tile(m)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, bm - m), (0, 0)))
    split = default_split(n, k, jax.devices()[0].core_count) if split_k is None else split_k
    check_count("split_k", split)
    if (k // BLOCK_K) % split:
        raise ValueError(f"split_k must divide the {k // BLOCK_K} K stages, got {split}")
    steps = k // BLOCK_K // split
    rows = COMPUTE_WGS * BLOCK_N
    stage_bytes = bm * BLOCK_K * 2 + rows * BLOCK_K // 2 + rows * 2
    stages = min(MAX_STAGES, SMEM_BYTES // stage_bytes, steps) if stages is None else stages
    check_count("stages", stages)

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, x_smem, w_smem, s_smem, loaded, consumed):
        tile, part, wg = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("wg")

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            ns = pl.ds(wg * BLOCK_N, BLOCK_N)

            def accumulate(acc):
                @pl.loop(0, steps)
                def _step(j):
                    st = lax.rem(j, stages)
                    plgpu.barrier_wait(loaded.at[st])
                    w = plgpu.load(w_smem.at[st, ns], layout=_UPCAST_4X)
                    s = plgpu.load(s_smem.at[st, ns], layout=_WGMMA_ROW)
                    w = plgpu.layout_cast(w, _WGMMA).astype(jnp.bfloat16)
                    plgpu.wgmma(acc, w * lax.broadcast_in_dim(s, w.shape, [0]), x_smem.at[st].T)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[st])
                return acc[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_N, bm), jnp.float32))
            o_gmem.at[part, pl.ds(tile * rows + wg * BLOCK_N, BLOCK_N)][...] = acc

        @pl.when(wg == COMPUTE_WGS)
        def _stream():
            @pl.loop(0, steps)
            def _step(j):
                st = lax.rem(j, stages)

                @pl.when(j >= stages)
                def _wait():
                    plgpu.barrier_wait(consumed.at[st])

                kk = part * steps + j
                ks = pl.ds(kk * BLOCK_K, BLOCK_K)
                plgpu.copy_gmem_to_smem(x_gmem.at[:, ks], x_smem.at[st], loaded.at[st])
                plgpu.copy_gmem_to_smem(w_gmem.at[tile, kk], w_smem.at[st], loaded.at[st])
                plgpu.copy_gmem_to_smem(s_gmem.at[kk * BLOCK_K // g, pl.ds(tile * rows, rows)], s_smem.at[st],
                                        loaded.at[st])

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((split, n, bm), jnp.float32),
        grid=(n // rows, split),
        grid_names=("n", "s"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=dict(
            x_smem=_smem((stages, bm, BLOCK_K), jnp.bfloat16, "rhs"),
            w_smem=_smem((stages, rows, BLOCK_K), jnp.int4, "lhs"),
            s_smem=plgpu.SMEM((stages, rows), jnp.bfloat16),
            loaded=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             unsafe_no_auto_barriers=True),
    )(x, codes, scales)
    total = out[0]
    for i in range(1, split):  # left to right, whatever M is
        total = total + out[i]
    return total[:, :m].T
