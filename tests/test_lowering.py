"""The GPU path lowers for CUDA on a machine without a GPU.

jax lowers a Pallas kernel to Triton IR in Python; only Triton's compilation to PTX and the launch
need the GPU. With jax told that the target is an sm_90 GPU, these tests lower the decode-time
forward (every mode, both compute dtypes, 1 to 40 tokens per sequence) and the matmuls at row
counts on both sides of every tile height, for CUDA: a kernel the lowering rejects (a primitive
without a Triton rule, a block shape) fails here, in CI, rather than first on the GPU; and the
forward must run every layer op on a kernel (none falls back to XLA). Triton's own compile, shared
memory and the numbers are checked on the GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.random_model import random_model
from pallas_kernels import gpu_activations, gpu_matmul as gm
from pallas_kernels.layout import dequantize
from qspec_jax.model import forward, init_cache
from tests.test_kernels import random_weight
from pallas_kernels.precision import parse_precision
from qspec_jax.kernels import Execution

TRITON_CALL = "__gpu$xla.gpu.triton"
# Per forward: qkv, the RoPE + KV write, o, gate/up, down, attention and two RMSNorms in the layer
# scan's body (once), the final RMSNorm and the lm_head; in the INT4 modes two prologue kernels prepare the inputs of o
# (merging the attention's cache splits) and down (the SwiGLU of gate/up's output), as bf16 planes
# for W4A16 or quantized for W4A8 / W4A4 (the RMSNorm kernels prepare those of qkv and gate/up); the
# quantized SwiGLU, and the quantized merge, are two kernels where they spread a row over programs
# (few rows: several tiles of the row, several KV-head tiles).
KERNELS_PER_FORWARD = {"w16a16": 10, "w4a16": 12, "w4a8": 12, "w4a4": 12}


def _kernels_per_forward(mode: str, rows: int, cfg) -> int:
    blocks = cfg.intermediate_size // gpu_activations.PACK_BLOCK
    swiglu_spread = rows <= gpu_activations.SPREAD_ROWS and gpu_activations.tile_blocks(
        blocks, gpu_activations.SPREAD_BLOCKS) < blocks
    merge_spread = gpu_activations.merge_head_tile(cfg.num_kv_heads, rows) < cfg.num_kv_heads
    return KERNELS_PER_FORWARD[mode] + (mode in ("w4a8", "w4a4")) * (swiglu_spread + merge_spread)


@pytest.fixture
def cuda_target(monkeypatch):
    """Let jax lower Pallas' Triton kernels for an sm_90 GPU without one present."""
    from jax._src.pallas.triton import gpu_info

    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)  # as test_kernels' lowering test does
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h200)


def _triton_calls(fn, *args) -> int:
    """Triton kernel launches in ``fn``'s program lowered for CUDA."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count(TRITON_CALL)


@pytest.fixture(scope="module")
def model():
    return random_model(np.random.default_rng())


@pytest.mark.parametrize("mode,dtype", [("w4a16", jnp.bfloat16), ("w4a8", jnp.bfloat16), ("w4a4", jnp.bfloat16),
                                        ("w16a16", jnp.bfloat16), ("w4a16", jnp.float32), ("w16a16", jnp.float32)])
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_decode_forward_lowers_for_cuda(cuda_target, model, mode, dtype, tokens):
    cfg, params = model.config, model.checkpoint.params
    b = 3
    cache = init_cache(cfg, b, 64, dtype)
    toks = jnp.zeros((b, tokens), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens), (b, tokens))

    def step(p, t, q, c):
        return forward(p, cfg, t, q, c, precision=parse_precision(mode), dtype=dtype,
                       execution=Execution.decode("pallas"))

    want = _kernels_per_forward(mode, b * tokens, cfg)
    assert _triton_calls(step, params, toks, pos, cache) == want


@pytest.mark.parametrize("mode,bits", [("w4a8", 8), ("w4a4", 4)])
def test_draft_forward_over_the_kv_shadow_lowers_for_cuda(cuda_target, model, mode, bits):
    """A draft step reading the INT8 / INT4 shadow: its attention is the Pallas kernel over the codes
    (the PTX unpacking included), not a fallback, and the kernel count is a plain draft step's (the
    RoPE + KV-write kernel writes the shadow's codes)."""
    cfg, params = model.config, model.checkpoint.params
    b = 3
    cache = init_cache(cfg, b, 64, jnp.bfloat16, bits)
    toks, pos = jnp.zeros((b, 1), jnp.int32), jnp.full((b, 1), 7, jnp.int32)

    def step(p, t, q, c):
        return forward(p, cfg, t, q, c, precision=parse_precision(mode), dtype=jnp.bfloat16,
                       execution=Execution.decode("pallas"),
                       read_shadow=True)

    assert _triton_calls(step, params, toks, pos, cache) == _kernels_per_forward(mode, b, cfg)


@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 64, 65, 128, 129, 256])
def test_matmuls_lower_for_cuda_at_every_tile_height(cuda_target, rng, m):
    n, k = 128, 512
    w = random_weight(rng, n, k, 128, True)
    x = jnp.zeros((m, k), jnp.bfloat16)
    calls = {lambda a: gm.w4a16_matmul(a, w): 1, lambda a: gm.w4ax_matmul(a, w, 8): 2,  # + quantization
             lambda a: gm.dense_matmul(a, dequantize(w, jnp.bfloat16)): 1,
             lambda a: gm.dense_matmul(a.astype(jnp.float32), dequantize(w, jnp.float32)): 1}
    for fn, launches in calls.items():
        assert _triton_calls(fn, x) == launches
