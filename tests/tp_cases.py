"""Tensor-parallel decoding on 4 CPU devices (run by tests/test_tensor_parallel.py in a process whose XLA
sees 4 host devices; the file's name keeps pytest's collection of tests/ from running it there)."""

from __future__ import annotations

import jax
import numpy as np

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
from qspec_jax import sharding
from qspec_jax.api import generate
from qspec_jax.config import LlamaConfig
from tests.conftest import random_source
from tests.test_qspec import memory_model

# 8 query and 4 KV heads, 256 MLP features: 1, 2 or 4 shards with whole groups of 16; a vocabulary of
# 251 tokens pads to 252 (TP 2, 4) so the lm_head's zero rows must be cut off after the gather
CFG = LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
DEGREES = (1, 2, 4)
DRAFTS = {1: (), 2: ("w4a4",), 4: ("w4a8",)}  # QSPEC's drafts checked at each degree


def test_four_devices():
    assert jax.device_count() == 4


def test_groups_whole_in_each_shard_pass_the_check(rng):
    """Groups of 64 split whole at TP 2 (o: 64 input features per shard, down: 128); at TP 4 the
    module above refuses them."""
    coarse, _, _ = convert_model(random_source(CFG, rng), QuantScheme(64, False), None)
    sharding.check(CFG, 2, None, coarse)


def test_tp_degrees_agree_and_qspec_equals_w4a16_at_each(rng):
    """At TP 2 and 4: greedy QSPEC (W4A4 drafts at 2, W4A8 at 4, gamma 3) gives W4A16's tokens and
    log-probabilities bitwise (both sum o and down over the shards the same way; at TP 1 the other test
    modules check it); W4A16 at TP 2 and 4 gives TP 1's tokens and log-probabilities within the rounding a
    changed summation order allows (:func:`_same_until_near_tie`)."""
    params, cfg, _ = convert_model(random_source(CFG, rng), QuantScheme(16, bool(rng.integers(2))), None)
    model = memory_model(params, cfg)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 12, 3)]
    kw = dict(max_new_tokens=int(rng.integers(12, 20)), eos_token_id=-1, return_logprobs=True)
    ar = {}
    for tp in DEGREES:
        ar[tp] = generate(model, prompts, method="w4a16", tensor_parallel=tp, **kw)
        for draft in DRAFTS[tp]:
            qs = generate(model, prompts, method="qspec", draft=draft, gamma=3, tensor_parallel=tp, **kw)
            assert qs.stats["drafted"] > 0
            for a, b, la, lb in zip(ar[tp].sequences, qs.sequences, ar[tp].logprobs, qs.logprobs):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(la, lb)
    for tp in DEGREES[1:]:
        for a, b, la, lb in zip(ar[1].sequences, ar[tp].sequences, ar[1].logprobs, ar[tp].logprobs):
            _same_until_near_tie(a, b, la, lb)


# W4A16 rounds every matmul input to bfloat16: a float32 summation-order difference that flips one such
# rounding (2**-8 relative) moves a log-probability by up to about 1e-3 in this model
NEAR = 1e-2


def _same_until_near_tie(a: np.ndarray, b: np.ndarray, la: np.ndarray, lb: np.ndarray) -> None:
    """Tokens equal and log-probabilities within :data:`NEAR`, up to a step where the two runs choose
    different tokens; there the two choices must have been nearly tied (their log-probabilities within it)."""
    assert len(a) == len(b)
    diff = np.nonzero(a != b)[0]
    i = int(diff[0]) if diff.size else len(a)
    np.testing.assert_allclose(lb[:i], la[:i], rtol=NEAR, atol=NEAR)
    if i < len(a):
        assert abs(float(la[i]) - float(lb[i])) < NEAR, (i, la[i], lb[i])


def test_tp_sampling_and_window_views_run_sharded(rng):
    """The draft's KV shadow and window views under TP 2 (greedy QSPEC == W4A16 there), and sampling under
    TP 4 (runs to its budget with drafts)."""
    params, cfg, _ = convert_model(random_source(CFG, rng), QuantScheme(16, False), None)
    model = memory_model(params, cfg)
    prompts = [rng.integers(0, cfg.vocab_size, 6).tolist()]
    ref = generate(model, prompts, max_new_tokens=10, method="w4a16", eos_token_id=-1, tensor_parallel=2)
    got = generate(model, prompts, max_new_tokens=10, method="qspec", gamma=2, draft_kv=8, draft_window=8,
                   draft_sinks=2, eos_token_id=-1, tensor_parallel=2)
    np.testing.assert_array_equal(got.sequences[0], ref.sequences[0])
    res = generate(model, prompts, max_new_tokens=10, method="qspec", gamma=2, temperature=0.8, seed=3,
                   eos_token_id=-1, tensor_parallel=4)
    assert len(res.sequences[0]) == 10 and res.stats["drafted"] > 0


def test_tp_benchmark_times_each_method_on_two_shards_and_one_device(tmp_path, monkeypatch, rng):
    """bench.tp at TP 2: W4A16 and QSPEC (replayed) timed on 2 shards and on one device, the efficiency
    their ratio / 2, the same replayed rounds at both degrees, the all-reduce floor from the ring bytes."""
    import json

    import pytest

    from bench import shapes, tp as bench_tp

    monkeypatch.setitem(shapes.MODELS, "tp-tiny", LlamaConfig(256, 128, 512, 2, 8, 2, 32, max_position_embeddings=256))
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "test trace", "w4a8": {"2": rng.integers(0, 3, size=(5, 3)).tolist()}}))
    bench_tp.main(["--tp", "2", "--models", "tp-tiny", "--batches", "2", "--contexts", "32", "--new", "8", "--gammas",
                   "2", "--drafts", "w4a8", "--trace", str(trace), "--kernels", "reference", "--out", str(tmp_path)])
    run = json.loads((tmp_path / "tp.json").read_text())
    (r,) = run["results"]
    assert set(r["methods"]) == {"w4a16", "qspec w4a8 g=2"} and run["tp"] == 2
    for e in r["methods"].values():
        assert e["tokens_per_s_tp2"] > 0 and e["tokens_per_s_tp1"] > 0
        assert e["efficiency"] == pytest.approx(e["tokens_per_s_tp2"] / e["tokens_per_s_tp1"] / 2)
    q = r["methods"]["qspec w4a8 g=2"]
    assert q["tokens_per_round_tp2"] == q["tokens_per_round_tp1"] > 1
    assert q["vs_w4a16"] == pytest.approx(q["tokens_per_s_tp2"] / r["methods"]["w4a16"]["tokens_per_s_tp2"])
    ring = 2 * (2 - 1) / 2 * 2 * 128 * 4  # per psum: 2 (N - 1) / N x [batch, hidden] float32
    assert r["allreduce_floor_ms"] == pytest.approx(1e3 * 2 * 2 * ring / run["bus_bandwidth"])
    assert r["allreduce_ms_per_step"] > 0
    assert "| tp-tiny | 32 | 2 | qspec w4a8 g=2 |" in (tmp_path / "tp.md").read_text()
