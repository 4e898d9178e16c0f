"""GPU check of the decode path on the jnp references (``kernels="reference"``: XLA's own GPU
kernels, no Pallas): on a random model of Llama-like proportions, is the verify pass row-count
invariant (bitwise) and is greedy QSPEC identical to greedy W4A16?
``PYTHONPATH=. python3 -m bench.gpu_decode_check``. (The same checks on the Pallas kernels are
tests/test_gpu.py, which reuses :func:`random_model`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from convert.sources import SourceModel, expected_shapes
from qspec_jax.api import Model, generate
from qspec_jax.checkpoint import Checkpoint
from qspec_jax.config import LlamaConfig
from qspec_jax.decode import ROW_TILE
from qspec_jax.kernels import Execution
from qspec_jax.model import forward, init_cache
from pallas_kernels.precision import W4A16


def random_model(rng: np.random.Generator) -> Model:
    c = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
    layers = [{n: (0.05 * rng.standard_normal(s)).astype(np.float32) for n, s in expected_shapes(c).items()}
              for _ in range(c.num_layers)]
    for layer in layers:
        layer["attn_norm"] = layer["mlp_norm"] = np.ones(c.hidden_size, np.float32)
    src = SourceModel(c, rng.standard_normal((c.vocab_size, c.hidden_size)).astype(np.float32),
                      np.ones(c.hidden_size, np.float32), None, layers, {}, "random")
    params, cfg, manifest = convert_model(src, QuantScheme(32, False, "rtn"), None)
    params = jax.device_put(params)
    return Model(Checkpoint(None, cfg, params, manifest), None)


def main() -> None:
    rng = np.random.default_rng()
    model = random_model(rng)
    cfg, params = model.config, model.checkpoint.params
    print("device:", jax.devices()[0])
    for dtype in (jnp.float32, jnp.bfloat16):
        b, p, g = 3, 20, 4
        toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p + g)))
        cache = init_cache(cfg, b, 64, dtype)
        _, cache = forward(params, cfg, toks[:, :p], jnp.broadcast_to(jnp.arange(p), (b, p)), cache,
                           precision=W4A16, dtype=dtype, execution=Execution.prefill("reference"))
        step = jax.jit(lambda t, pos, c: forward(params, cfg, t, pos, c, precision=W4A16, dtype=dtype,
                                                 execution=Execution.decode("reference", ROW_TILE)))
        lv, cv = step(toks[:, p:], jnp.broadcast_to(jnp.arange(p, p + g), (b, g)), cache)
        ca, la = cache, []
        for i in range(g):
            l1, ca = step(toks[:, p + i:p + i + 1], jnp.full((b, 1), p + i), ca)
            la.append(l1[:, 0])
        la = jnp.stack(la, 1)
        print(f"{jnp.dtype(dtype).name}: verify logits bitwise equal to 1-token steps: {bool(jnp.array_equal(la, lv))} "
              f"(max diff {float(jnp.abs(la - lv).max()):.3g}); KV bitwise: "
              f"{bool(jnp.array_equal(ca.k, cv.k) and jnp.array_equal(ca.v, cv.v))}")
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 9, 30)]
    ref = generate(model, prompts, max_new_tokens=48, method="w4a16", kernels="reference")
    for draft in ("w4a8", "w4a4"):
        for gamma in (1, 3, 5):
            res = generate(model, prompts, max_new_tokens=48, method="qspec", draft=draft, gamma=gamma,
                           kernels="reference")
            same = all(np.array_equal(a, b) for a, b in zip(res.sequences, ref.sequences))
            print(f"qspec {draft} gamma={gamma}: identical to w4a16 {same}, acceptance "
                  f"{res.stats['acceptance_rate']:.3f}")


if __name__ == "__main__":
    main()
