"""A W4A16 matmul as a Mosaic GPU kernel for Hopper, over signed INT4 codes in 128 x 128 tiles.

The weights sit on the wgmma's M side (64 rows per compute warpgroup, two per block) and the call's
tokens on its N side (8 to 256), so each weight tile is dequantized once for every token of the call.
The kernel is persistent: the (row tile, K stage) units are cut into one contiguous share per program
(by default one program per SM), and each launched block walks the shares of one or more programs in
order while a third warpgroup streams their weight, scale and activation tiles through one ring of
shared-memory stages with TMA, so the pipeline fills once per block and no wave is left half empty.
Each weight is ``bf16(q * s)`` (one rounding, as :func:`pallas_kernels.layout.w4a16_weights`),
accumulated in float32 over the K stages of a row tile in order; where a row tile's stages are cut
between programs, the pieces are added left to right. The cuts depend on N, K and the program count
only, so a token's result does not depend on the other tokens of the call.

Its operands are not the packed layout's (:mod:`pallas_kernels.layout`): ``jnp.int4`` codes in tiles
``[N / 128, K / 128, 128, 128]`` (:func:`tile_codes`: each stage's weight tile one contiguous 8 KiB
block, which TMA streams faster than 64-byte pieces of 128 rows) and bfloat16 scales ``[K // group, N]``;
the model does not call it yet.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dtypes
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.launch import check_count

COMPUTE_WGS = 2  # compute warpgroups per block, BLOCK_N weight rows each
BLOCK_N = 64  # weight rows per compute warpgroup (the wgmma's M)
BLOCK_K = 128  # K per pipeline stage: a group of 128 has one scale per row and stage
SMEM_BYTES = 200 * 1024  # shared memory the stages may take
SM_SMEM_BYTES = 228 * 1024  # shared memory of one SM (Hopper), which resident blocks share
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


def first_program(unit, units: int, programs: int, div=operator.floordiv):
    """The program whose share holds ``unit`` (``div``: floor division of non-negative ints): program p
    takes units ``[p * units // programs, (p + 1) * units // programs)``."""
    return div((unit + 1) * programs + units - 1, units) - 1


def pieces(n: int, k: int, programs: int) -> np.ndarray:
    """How many programs share each 128-row tile's K stages (its partial sums, added in order)."""
    stages = k // BLOCK_K
    units = n // (COMPUTE_WGS * BLOCK_N) * stages
    first = np.arange(0, units, stages)
    return first_program(first + stages - 1, units, programs) - first_program(first, units, programs) + 1


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


def default_blocks(programs: int, sms: int, smem_bytes: int) -> int:
    """The blocks to launch for ``programs`` shares: the most that fit the GPU at once (two per SM where
    their shared memory fits, else one) and divide ``programs``."""
    resident = sms * (2 if 2 * (smem_bytes + 1024) <= SM_SMEM_BYTES else 1)
    return next(b for b in range(min(programs, resident), 0, -1) if programs % b == 0)


@functools.partial(jax.jit, static_argnames=("programs", "blocks", "stages", "interpret"))
def w4a16_int4_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, programs: int | None = None,
                      blocks: int | None = None, stages: int | None = None, interpret: bool = False) -> jax.Array:
    """``x[M, K] @ W.T`` in float32 with ``W[n, k] = bf16(q[n, k] * scales[k // group, n])``, ``codes`` the
    int4 ``q`` as :func:`tile_codes` arranges them.
    ``programs`` (default: the GPU's SM count, which M does not change) sets where a row tile's K
    stages are cut, hence the order of its partial sums; ``blocks`` (a divisor of ``programs``; default
    :func:`default_blocks`) are launched, each running ``programs / blocks`` consecutive shares through one
    pipeline, and ``stages`` change only timing. ``interpret``:
    run on the CPU in Mosaic GPU's interpret mode, whose wgmma reads its A operand only from shared
    memory, so there the dequantized tile is stored to shared memory first."""
    check_operands(x, codes, scales)
    (m, k), n = x.shape, scales.shape[1]
    g = k // scales.shape[0]
    bm = token_tile(m)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, bm - m), (0, 0)))
    rows, steps = COMPUTE_WGS * BLOCK_N, k // BLOCK_K
    units = n // rows * steps
    sms = jax.devices()[0].core_count if programs is None or blocks is None else programs
    programs = min(sms if programs is None else programs, units)
    check_count("programs", programs)
    shares = pieces(n, k, programs)
    stage_bytes = bm * BLOCK_K * 2 + rows * BLOCK_K // 2 + rows * 2
    stages = min(MAX_STAGES, SMEM_BYTES // stage_bytes) if stages is None else stages
    check_count("stages", stages)
    blocks = default_blocks(programs, sms, stages * stage_bytes) if blocks is None else blocks
    check_count("blocks", blocks)
    if programs % blocks:
        raise ValueError(f"blocks must divide the {programs} programs, got {blocks}")
    per = programs // blocks

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, x_smem, w_smem, s_smem, loaded, consumed, a_smem=None):
        block, wg = lax.axis_index("b"), lax.axis_index("wg")
        first = lambda share: lax.div(share * units, programs)  # noqa: E731  (a share's first unit)
        start, end = first(block * per), first(block * per + per)

        def tile_part(prog, t):
            """Row tile ``t``'s K stages in share ``prog``: accumulated in order, stored as one piece."""
            def accumulate(acc):
                @pl.loop(jnp.maximum(first(prog), t * steps), jnp.minimum(first(prog + 1), t * steps + steps))
                def _step(u):
                    st = lax.rem(u - start, stages)
                    plgpu.barrier_wait(loaded.at[st])
                    w = plgpu.load(w_smem.at[st, pl.ds(wg * BLOCK_N, BLOCK_N)], layout=_UPCAST_4X)
                    s = plgpu.load(s_smem.at[st, pl.ds(wg * BLOCK_N, BLOCK_N)], layout=_WGMMA_ROW)
                    w = plgpu.layout_cast(w, _WGMMA).astype(jnp.bfloat16)
                    a = w * lax.broadcast_in_dim(s, w.shape, [0])
                    if interpret:
                        a_smem[wg] = a
                        plgpu.commit_smem()
                        a = a_smem.at[wg]
                    plgpu.wgmma(acc, a, x_smem.at[st].T)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[st])
                return acc[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_N, bm), jnp.float32))
            piece = prog - first_program(t * steps, units, programs, lax.div)
            o_gmem.at[piece, pl.ds(t * rows + wg * BLOCK_N, BLOCK_N)][...] = acc

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            @pl.loop(block * per, block * per + per)
            def _share(prog):
                @pl.loop(lax.div(first(prog), steps), lax.div(first(prog + 1) - 1, steps) + 1)
                def _tile(t):
                    tile_part(prog, t)

        @pl.when(wg == COMPUTE_WGS)
        def _stream():
            @pl.loop(0, end - start)
            def _step(j):
                st = lax.rem(j, stages)

                @pl.when(j >= stages)
                def _wait():
                    plgpu.barrier_wait(consumed.at[st])

                t, kk = lax.div(start + j, steps), lax.rem(start + j, steps)
                plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(kk * BLOCK_K, BLOCK_K)], x_smem.at[st], loaded.at[st])
                plgpu.copy_gmem_to_smem(w_gmem.at[t, kk], w_smem.at[st], loaded.at[st])
                plgpu.copy_gmem_to_smem(s_gmem.at[kk * BLOCK_K // g, pl.ds(t * rows, rows)], s_smem.at[st],
                                        loaded.at[st])

            @pl.loop(jnp.maximum(end - start - stages, 0), end - start)
            def _drain(j):  # the ring's last uses, so that every barrier phase is observed before exit
                plgpu.barrier_wait(consumed.at[lax.rem(j, stages)])

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((int(shares.max()), n, bm), jnp.float32),
        grid=(blocks,),
        grid_names=("b",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=dict(
            x_smem=_smem((stages, bm, BLOCK_K), jnp.bfloat16, "rhs"),
            w_smem=_smem((stages, rows, BLOCK_K), jnp.int4, "lhs"),
            s_smem=plgpu.SMEM((stages, rows), jnp.bfloat16),
            loaded=plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            **({"a_smem": _smem((COMPUTE_WGS, BLOCK_N, BLOCK_K), jnp.bfloat16, "lhs")} if interpret else {}),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else None,
    )(x, codes, scales)
    total = out[0]
    for i in range(1, out.shape[0]):  # left to right; a tile of fewer pieces leaves the rest unwritten
        total = total + jnp.where(np.repeat(shares > i, rows)[:, None], out[i], 0.0)
    return total[:, :m].T
