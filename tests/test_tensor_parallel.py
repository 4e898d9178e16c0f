"""Tensor parallelism: the shard layout against the unsharded weights (exact), bad options, and the
decoding cases of tests/tp_cases.py in a process whose XLA sees 4 CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from pallas_kernels.layout import QuantizedWeight, dequantize
from qspec_jax import sharding
from qspec_jax.api import generate
from tests.conftest import random_source
from tests.test_qspec import memory_model
from tests.tp_cases import CFG

ROOT = Path(__file__).resolve().parent.parent


def _shard(a: np.ndarray, spec, s: int, tp: int) -> np.ndarray:
    axis = list(spec).index(sharding.TP_AXIS)
    return np.split(np.asarray(a), tp, axis=axis)[s]


def _value(w) -> np.ndarray:
    return np.asarray(dequantize(w) if isinstance(w, QuantizedWeight) else w, np.float64)


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_layout_gives_each_shard_its_heads_features_and_vocab_rows(rng, tp):
    """Splitting each laid-out leaf as its spec says gives shard s exactly (float64 of the dequantized
    codes) query heads s*H/tp.., its KV heads, MLP features s*F/tp.., the matching input columns of o and
    down, and lm_head rows s*V'/tp.. of the zero-padded head."""
    params, cfg, _ = convert_model(random_source(CFG, rng), QuantScheme(16, bool(rng.integers(2))), None)
    laid = sharding.shard_layout(params, cfg, tp)
    specs = sharding.param_specs(laid)
    c, d = cfg, cfg.head_dim
    hq, hk, f = c.num_heads * d // tp, c.num_kv_heads * d // tp, c.intermediate_size // tp
    layers, lspecs = laid["layers"], specs["layers"]
    for s in range(tp):
        def local(path):
            w, sp = layers[path[0]][path[1]]["w"], lspecs[path[0]][path[1]]["w"]
            if isinstance(w, QuantizedWeight):
                return QuantizedWeight(*(None if a is None else _shard(a, p, s, tp) for a, p in
                                         ((w.packed, sp.packed), (w.scales, sp.scales), (w.mins, sp.mins))), w.group_size)
            return _shard(w, sp, s, tp)
        full = {k: _value(params["layers"][a][k]["w"]) for a, k in (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"),
                                                                     ("mlp", "down"))}
        q0, k0 = c.num_heads * d, c.num_heads * d + c.num_kv_heads * d
        want_qkv = np.concatenate([full["qkv"][:, s * hq:(s + 1) * hq], full["qkv"][:, q0 + s * hk:q0 + (s + 1) * hk],
                                   full["qkv"][:, k0 + s * hk:k0 + (s + 1) * hk]], axis=1)
        np.testing.assert_array_equal(_value(local(("attn", "qkv"))), want_qkv)
        fi = c.intermediate_size
        want_gu = np.concatenate([full["gate_up"][:, s * f:(s + 1) * f], full["gate_up"][:, fi + s * f:fi + (s + 1) * f]],
                                 axis=1)
        np.testing.assert_array_equal(_value(local(("mlp", "gate_up"))), want_gu)
        np.testing.assert_array_equal(_value(local(("attn", "o"))), full["o"][..., s * hq:(s + 1) * hq])
        np.testing.assert_array_equal(_value(local(("mlp", "down"))), full["down"][..., s * f:(s + 1) * f])
        rows = -(-c.vocab_size // tp)
        head = np.pad(np.asarray(params["lm_head"]), ((0, rows * tp - c.vocab_size), (0, 0)))
        np.testing.assert_array_equal(_shard(laid["lm_head"], specs["lm_head"], s, tp), head[s * rows:(s + 1) * rows])
    assert all(sp == jax.sharding.PartitionSpec() for sp in jax.tree.leaves(
        specs["layers"]["attn_norm"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))


def test_bad_tensor_parallel_options_are_refused(rng):
    params, cfg, _ = convert_model(random_source(CFG, rng), QuantScheme(16, False), None)
    model = memory_model(params, cfg)
    many = 2 * jax.device_count()  # divides the heads and features below 8 devices
    for tp, match in ((0, "integer >= 1"), (True, "integer >= 1"), (2.0, "integer >= 1"), (3, "must divide"),
                      (many, f"needs {many} devices")):
        with pytest.raises(ValueError, match=match):
            generate(model, [[3, 4]], max_new_tokens=2, tensor_parallel=tp)
    coarse, _, _ = convert_model(random_source(CFG, rng), QuantScheme(64, False), None)
    with pytest.raises(ValueError, match="o's 32 input features per shard .* group size 64"):
        sharding.check(cfg, 4, None, coarse)
    with pytest.raises(ValueError, match="--rotate"):
        sharding.check(cfg, 2, 7)


def test_tensor_parallel_decoding_on_four_cpu_devices():
    """tests/tp_cases.py under ``--xla_force_host_platform_device_count=4``."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "tp_cases.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
