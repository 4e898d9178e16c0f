"""QuaRot-style rotation folded into the weights (in float64, stored as float32).

RMSNorm scales are folded into the linears that read the normalized stream; the residual stream
is rotated by an orthogonal ``Q`` (a randomized Hadamard where one exists, or a learned one): ``E <- E Q`` for the
embeddings, ``W <- W diag(g) Q`` for q/k/v/gate/up and the lm_head, ``W <- Q^T W`` for o/down.
The online transforms ``T`` on the o_proj input (per head) and the down_proj input are folded as
``W <- W T``; the model applies ``T`` to the activations (``online_rotation_seed``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from convert.sources import SourceModel, as_float
from qspec_jax.checkpoint import check_rotation_matrix
from qspec_jax.rotation import random_hadamard, transform_matrix


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


def rotate(src: SourceModel, seed: int, q: np.ndarray | None = None) -> SourceModel:
    """The rotated model (float weights, norm scales all ones); its logits equal the source's.
    ``q``: the residual-stream rotation (default: the randomized Hadamard of ``seed``); ``seed``
    also picks the online transforms."""
    c = src.config
    if q is None:
        q = random_hadamard(c.hidden_size, seed)
    else:
        check_rotation_matrix(q, c.hidden_size, "the rotation")
    t_o = np.kron(np.eye(c.num_heads), transform_matrix(c.head_dim, seed))
    t_d = transform_matrix(c.intermediate_size, seed)
    layers = []
    for layer in src.layers:
        ga = as_float(layer["attn_norm"]).astype(np.float64)
        gm = as_float(layer["mlp_norm"]).astype(np.float64)
        new = dict(layer)
        for name, g in (("q", ga), ("k", ga), ("v", ga), ("gate", gm), ("up", gm)):
            new[name] = _f32((as_float(layer[name]) * g) @ q)
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
