"""pallas_kernels/gpu_specs.py: the SM count from the device where it reports one, else the card's
table row; without a GPU the H100 / H200 values, so the kernels tile (and split sums) as there."""

from __future__ import annotations

import types

import jax
import pytest

from pallas_kernels import gpu_matmul, gpu_specs


@pytest.fixture
def fake_gpu(monkeypatch):
    def use(kind: str, core_count=None):
        device = types.SimpleNamespace(device_kind=kind, **({} if core_count is None else {"core_count": core_count}))
        monkeypatch.setattr(gpu_specs.jax, "devices", lambda backend=None: [device])
        gpu_specs.gpu_spec.cache_clear()

    yield use
    gpu_specs.gpu_spec.cache_clear()


def test_hopper_values(fake_gpu):
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        fake_gpu(kind)
        assert gpu_matmul.min_programs() == 264 and gpu_matmul.pipeline_smem() == 160 * 1024


def test_device_sm_count_wins_over_the_table(fake_gpu):
    fake_gpu("NVIDIA H100 PCIe", core_count=114)
    assert gpu_specs.gpu_spec() == gpu_specs.GpuSpec(114, 227 * 1024) and gpu_matmul.min_programs() == 228
    fake_gpu("Some Future GPU")
    assert gpu_specs.gpu_spec() == gpu_specs.DEFAULT


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the values without a GPU")
def test_no_gpu_tiles_as_on_hopper():
    gpu_specs.gpu_spec.cache_clear()
    assert gpu_specs.gpu_spec() == gpu_specs.CARDS["H200"] == gpu_specs.CARDS["H100"]
    assert gpu_matmul.min_programs() == 264 and gpu_matmul.pipeline_smem() == 160 * 1024
