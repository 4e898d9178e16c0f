"""The GPU facts the kernels' tile choices read, in one place: the SM count (from the device where
JAX exposes it) and the shared memory a thread block may use (JAX does not expose it: a table)."""

from __future__ import annotations

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    sms: int  # streaming multiprocessors
    smem_per_block: int  # bytes of shared memory one thread block may opt in to


# by a name in jax's device_kind ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
CARDS = {"H100": GpuSpec(132, 227 * 1024), "H200": GpuSpec(132, 227 * 1024)}
# without a GPU (interpret mode on the CPU) or on a card not in the table: tile as on an H100 / H200,
# so that a CPU run splits its sums as the GPUs the kernels target do
DEFAULT = CARDS["H200"]


@functools.cache
def gpu_spec() -> GpuSpec:
    """The first visible GPU's facts: its SM count where the device reports one, else the table's."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:  # no GPU backend
        return DEFAULT
    table = next((spec for name, spec in CARDS.items() if name in device.device_kind), DEFAULT)
    sms = getattr(device, "core_count", None)
    return dataclasses.replace(table, sms=sms) if isinstance(sms, int) and sms > 0 else table


def programs_per_wave(per_sm: int = 2) -> int:
    """Programs that keep every SM busy with ``per_sm`` programs each (264 on an H100 / H200)."""
    return per_sm * gpu_spec().sms
