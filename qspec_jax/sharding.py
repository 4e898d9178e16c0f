"""Tensor parallelism over the devices of one host: Megatron-style shards of the packed weights and the
KV cache, and a decode function run on every shard under ``shard_map``.

Shard ``s`` of ``tp`` holds query heads ``s*H/tp ..`` with their KV heads (qkv's rows, the cache's KV
axis), the MLP features ``s*F/tp ..`` (gate/up's rows), the matching input slices of o and down, and
rows ``s*V'/tp ..`` of the lm_head padded to ``V'`` rows. Each forward sums o's and down's float32
results over the shards (one ``psum`` each, the same for every method) and gathers the logits, so the
residual stream, the sampling and everything else in the state are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.layout import QuantizedWeight, pack_codes, unpack_codes
from qspec_jax.config import LlamaConfig
from qspec_jax.decode import Runtime

TP_AXIS = "tp"
ROW_SPLIT = ("qkv", "gate_up")  # output features split (column-parallel)
INPUT_SPLIT = ("o", "down")  # input features split (row-parallel), results summed over the shards


def check(config: LlamaConfig, tp: int, online_rotation_seed: int | None, params: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` unless ``config``'s heads, KV heads and MLP features split into ``tp`` shards on
    as many devices, with o's and down's INT4 groups and pack blocks whole in each (where ``params`` are given)."""
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    c = config
    for name, n in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads),
                    ("intermediate_size", c.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel={tp} must divide the model's {name} ({n})")
    layers = {} if params is None else params["layers"]
    for name, path, k in (("o", "attn", c.num_heads * c.head_dim), ("down", "mlp", c.intermediate_size)):
        w = layers.get(path, {}).get(name, {}).get("w") if isinstance(layers, dict) else None
        group = w.group_size if isinstance(w, QuantizedWeight) else 2
        if (k // tp) % group or (k // tp) % 2:
            raise ValueError(f"{name}'s {k // tp} input features per shard must be even and a multiple of the "
                             f"checkpoint's group size {group}")
    if online_rotation_seed is not None:
        raise ValueError("a rotated checkpoint's online transform of down's input spans every MLP feature: "
                         "tensor_parallel needs a checkpoint converted without --rotate")
    if tp > jax.device_count():
        raise ValueError(f"tensor_parallel={tp} needs {tp} devices; JAX sees {jax.device_count()} "
                         f"({jax.default_backend()})")


def local_config(config: LlamaConfig, tp: int) -> LlamaConfig:
    """The config one shard's forward runs with (the vocabulary stays whole: token ids are global)."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp, tie_word_embeddings=False)


def local_runtime(rt: Runtime, tp: int) -> Runtime:
    return dataclasses.replace(rt, config=local_config(rt.config, tp), tp_axis=TP_AXIS)


def mesh(tp: int) -> Mesh:
    """The first ``tp`` devices along :data:`TP_AXIS`."""
    return Mesh(np.array(jax.devices()[:tp]), (TP_AXIS,))


def _rows(config: LlamaConfig, name: str, tp: int) -> np.ndarray:
    """qkv's or gate/up's row order that puts each shard's rows in one contiguous block."""
    c = config
    if name == "qkv":
        hq, hk, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        parts = [np.arange(hq), hq + np.arange(hk), hq + hk + np.arange(hk)]
    else:
        parts = [np.arange(c.intermediate_size), c.intermediate_size + np.arange(c.intermediate_size)]
    return np.concatenate([p.reshape(tp, -1) for p in parts], axis=1).reshape(-1)


def _input_split(w: Any, tp: int) -> Any:
    """A row-parallel weight whose contiguous last-axis slices are the shards' own weights: packed
    nibbles re-packed per shard (a pack block must not straddle two shards); scales split as they are."""
    if not isinstance(w, QuantizedWeight):
        return w
    codes = np.asarray(unpack_codes(jnp.asarray(w.packed)))
    packed = np.concatenate([pack_codes(c) for c in np.split(codes, tp, axis=-1)], axis=-1)
    return dataclasses.replace(w, packed=packed)


def _row_split(tree: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """qkv / gate_up's weight (and bias) with the output rows in ``rows`` order."""
    out = dict(tree)
    w = tree["w"]
    take = lambda a: None if a is None else np.take(np.asarray(a), rows, axis=-2)  # noqa: E731
    out["w"] = (dataclasses.replace(w, packed=take(w.packed), scales=take(w.scales), mins=take(w.mins))
                if isinstance(w, QuantizedWeight) else take(w))
    if "b" in tree:
        out["b"] = np.take(np.asarray(tree["b"]), rows, axis=-1)
    return out


def shard_layout(params: dict[str, Any], config: LlamaConfig, tp: int) -> dict[str, Any]:
    """``params`` rearranged (host arrays, same total size) so that splitting every sharded leaf into
    ``tp`` contiguous blocks (:func:`param_specs`) gives each shard a model of :func:`local_config`."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        raise ValueError("tensor_parallel needs stacked layer params (a loaded checkpoint's)")
    attn, mlp = dict(layers["attn"]), dict(layers["mlp"])
    attn["qkv"] = _row_split(attn["qkv"], _rows(config, "qkv", tp))
    mlp["gate_up"] = _row_split(mlp["gate_up"], _rows(config, "gate_up", tp))
    attn["o"] = {**attn["o"], "w": _input_split(attn["o"]["w"], tp)}
    mlp["down"] = {**mlp["down"], "w": _input_split(mlp["down"]["w"], tp)}
    head = np.asarray(params["embed"] if config.tie_word_embeddings else params["lm_head"])
    pad = -config.vocab_size % tp  # zero rows: their logits are cut off after the gather
    return {**params, "layers": {**layers, "attn": attn, "mlp": mlp},
            "lm_head": np.pad(head, ((0, pad), (0, 0)))}


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_specs(params: dict[str, Any]) -> Any:
    """Each leaf's :class:`PartitionSpec` over :data:`TP_AXIS` for params laid out by :func:`shard_layout`."""
    def spec(path, leaf):
        names = _names(path)
        if names[0] == "lm_head":
            return P(TP_AXIS, None)
        if names[0] == "layers" and len(names) > 2 and names[2] in ROW_SPLIT:
            return P(None, TP_AXIS) if names[3] == "b" else P(None, TP_AXIS, None)
        if names[0] == "layers" and len(names) > 2 and names[2] in INPUT_SPLIT:
            return P(None, None, TP_AXIS)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def state_specs(state: Any) -> Any:
    """A decode state's specs: the KV cache and its shadow split by KV heads, the rest replicated."""
    def spec(path, leaf):
        names = _names(path)
        if names[0] != "cache":
            return P()
        if names[-1].endswith("scales"):  # [L, B, KV, S]
            return P(None, None, TP_AXIS, None)
        return P(None, None, None, TP_AXIS, None)  # k, v and the shadow's words: [L, B, S, KV, ...]
    return jax.tree_util.tree_map_with_path(spec, state)


def shard_params(params: dict[str, Any], config: LlamaConfig, tp: int) -> dict[str, Any]:
    """:func:`shard_layout` placed on the mesh's devices, each shard's blocks on its own device."""
    laid = shard_layout(params, config, tp)
    m = mesh(tp)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(m, s)), laid, param_specs(laid))


def run_sharded(fn: Callable, tp: int, params: dict[str, Any], state: Any, *rest: Any) -> Any:
    """``fn(params, state, *rest) -> state`` on every shard of the mesh (``rest`` replicated)."""
    specs = state_specs(state)
    mapped = jax.shard_map(fn, mesh=mesh(tp), in_specs=(param_specs(params), specs, *(P() for _ in rest)),
                           out_specs=specs, check_vma=False)
    return mapped(params, state, *rest)
