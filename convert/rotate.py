"""QuaRot-style rotation folded into the weights (in float64, stored as float32).

RMSNorm scales are folded into the linears that read the normalized stream; the residual stream
is rotated by an orthogonal ``Q`` (a randomized Hadamard where one exists, or a learned one): ``E <- E Q`` for the
embeddings, ``W <- W diag(g) Q`` for q/k/v/gate/up and the lm_head, ``W <- Q^T W`` for o/down.
The online transforms ``T`` on the o_proj input (per head) and the down_proj input are folded as
``W <- W T``; the model applies ``T`` to the activations (``online_rotation_seed``). Learned value-head
rotations ``R2`` (one per layer) turn v's output heads into ``v R2`` (``W_v <- R2^T W_v`` per KV head)
and o's input back (``W_o <- W_o R2`` per query head, before ``T``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from convert.sources import SourceModel, as_float
from qspec_jax.checkpoint import check_head_rotations, check_rotation_matrix
from qspec_jax.rotation import random_hadamard, transform_matrix


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


def rotate(src: SourceModel, seed: int, q: np.ndarray | None = None, heads: np.ndarray | None = None) -> SourceModel:
    """The rotated model (float weights, norm scales all ones); its logits equal the source's.
    ``q``: the residual-stream rotation (default: the randomized Hadamard of ``seed``); ``seed``
    also picks the online transforms; ``heads``: value-head rotations ``[layers, head_dim, head_dim]``."""
    c = src.config
    if q is None:
        q = random_hadamard(c.hidden_size, seed)
    else:
        check_rotation_matrix(q, c.hidden_size, "the rotation")
    if heads is not None:
        check_head_rotations(heads, c.num_layers, c.head_dim, "the value-head rotations")
    t = transform_matrix(c.head_dim, seed)
    t_d = transform_matrix(c.intermediate_size, seed)
    layers = []
    for i, layer in enumerate(src.layers):
        r2 = np.eye(c.head_dim) if heads is None else np.asarray(heads[i], np.float64)
        t_o = np.kron(np.eye(c.num_heads), r2 @ t)
        ga = as_float(layer["attn_norm"]).astype(np.float64)
        gm = as_float(layer["mlp_norm"]).astype(np.float64)
        new = dict(layer)
        for name, g in (("q", ga), ("k", ga), ("v", ga), ("gate", gm), ("up", gm)):
            w = (as_float(layer[name]) * g) @ q
            if name == "v":  # R2^T W_v per KV head
                w = np.einsum("ji,hjk->hik", r2, w.reshape(c.num_kv_heads, c.head_dim, -1)).reshape(w.shape)
            new[name] = _f32(w)
        if "v_bias" in layer:
            new["v_bias"] = _f32((as_float(layer["v_bias"]).astype(np.float64).reshape(c.num_kv_heads, -1) @ r2)
                                 .reshape(-1))
        new["o"] = _f32(q.T @ as_float(layer["o"]) @ t_o)
        new["down"] = _f32(q.T @ as_float(layer["down"]) @ t_d)
        new["attn_norm"] = np.ones_like(ga, np.float32)
        new["mlp_norm"] = np.ones_like(gm, np.float32)
        layers.append(new)
    head = src.embed if src.lm_head is None else src.lm_head
    gf = as_float(src.final_norm).astype(np.float64)
    return dataclasses.replace(
        src,
        config=dataclasses.replace(c, tie_word_embeddings=False),
        embed=_f32(src.embed @ q),
        lm_head=_f32((head * gf) @ q),
        final_norm=np.ones_like(gf, np.float32),
        layers=layers,
    )
