"""bench/prefill.py end to end on the tiny model (CPU): both prefills run, the baseline picks the same
last-position logits the library's prefill commits from, the report names its rate and rows."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import prefill as bp
from bench.decode import random_params
from bench.shapes import MODELS
from pallas_kernels.precision import W4A16
from qspec_jax.core import Decoder, init_state, prefill
from qspec_jax.decode import Runtime


def test_previous_prefill_chooses_what_the_library_prefill_commits(rng):
    """Greedy first tokens from the baseline's last-position logits equal those the library's prefill
    commits (float32: both attend over the same keys, only the summation's extent differs)."""
    cfg = MODELS["smoke"]
    params = random_params(cfg, jax.random.key(int(rng.integers(2**31))))
    rt = Runtime(cfg)
    lengths = jnp.asarray(rng.integers(3, 12, 3), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 12)), jnp.int32)
    make = lambda: init_state(Decoder(rt, W4A16), tokens, lengths, jax.random.key(0), max_new_tokens=4,  # noqa: E731
                              buffer_len=16)
    logits, _ = bp.previous_prefill(params, make(), rt)
    got = prefill(params, Decoder(rt, W4A16), make())
    first = np.asarray(got.tokens)[np.arange(3), np.asarray(lengths)]
    np.testing.assert_array_equal(first, np.argmax(np.asarray(logits), axis=-1))


def test_prefill_bench_writes_its_report(tmp_path, monkeypatch):
    bp.main(["--models", "smoke", "--batches", "2,3", "--prompt", "20", "--new", "4", "--reps", "1",
             "--kernels", "reference", "--out", str(tmp_path)])
    run = json.loads((tmp_path / "prefill.json").read_text())
    assert [(r["batch"], r["prompt"], r["buffer"]) for r in run["results"]] == [(2, 20, 24), (3, 20, 24)]
    for r in run["results"]:
        assert r["seconds"] > 0 and r["previous_seconds"] > 0
        assert r["speedup"] == pytest.approx(r["previous_seconds"] / r["seconds"])
        assert r["of_bf16_rate"] == pytest.approx(r["matmul_tflops"] * 1e12 / run["bf16_rate"])
    md = (tmp_path / "prefill.md").read_text()
    assert md.startswith("# Prefill (") and md.count("| smoke |") == 2 and run["command"] in md
    def out_of_memory(*a):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    monkeypatch.setattr(bp, "previous_prefill", out_of_memory)  # the baseline alone does not fit: recorded
    bp.main(["--models", "smoke", "--batches", "2", "--prompt", "20", "--new", "4", "--reps", "1",
             "--kernels", "reference", "--out", str(tmp_path)])
    (r,) = json.loads((tmp_path / "prefill.json").read_text())["results"]
    assert r["previous"] == "out of memory" and "speedup" not in r and r["seconds"] > 0
    assert "| out of memory | n/a |" in (tmp_path / "prefill.md").read_text()
    with pytest.raises(SystemExit, match="unknown models"):
        bp.main(["--models", "llama9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="exceed"):
        bp.main(["--models", "smoke", "--prompt", "1000", "--new", "100", "--out", str(tmp_path)])


def test_linear_flops_counts_each_weight_twice_per_token():
    cfg = MODELS["llama3-8b"]
    per_token = bp.linear_flops(cfg, 1, 1)
    assert per_token == pytest.approx(2 * 8.03e9 - 2 * cfg.vocab_size * cfg.hidden_size, rel=0.01)
    assert bp.linear_flops(cfg, 10, 0) == pytest.approx(10 * (per_token - 2 * cfg.vocab_size * cfg.hidden_size))
