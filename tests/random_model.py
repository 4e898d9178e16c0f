"""A small random Llama-like model, converted like a real checkpoint (RTN, asymmetric, group 32), for
the tests that run the whole decode path on the Pallas kernels (tests/test_gpu.py, test_lowering.py)."""

from __future__ import annotations

import jax
import numpy as np

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from convert.sources import SourceModel, expected_shapes
from qspec_jax.api import Model
from qspec_jax.checkpoint import Checkpoint
from qspec_jax.config import LlamaConfig


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
