"""Row-count invariance: evaluate a row-wise function on fixed-size tiles of rows.

A token's result must not depend on how many tokens share the call (a 1-token decode step and a
(gamma+1)-token verify pass must give bitwise the same logits). XLA on CPU picks matmul and
reduction code paths by shape — a 1-row product and a 2-row product sum in different orders — but
a fixed shape always runs the same code, whatever the row's position in the tile or its
neighbours. So rows are padded to a multiple of ``tile`` and mapped over tile by tile.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def map_row_tiles(fn: Callable[[jax.Array], jax.Array], x: jax.Array, tile: int | None) -> jax.Array:
    """``fn`` over the rows of ``x[..., D]`` in tiles of ``tile`` rows (``None``: one call on all rows).

    ``fn`` maps ``[R, D] -> [R, ...]`` row by row (no mixing across rows).
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if tile is None:
        out = fn(rows)
        return out.reshape(*lead, *out.shape[1:])
    m = rows.shape[0]
    pad = (-m) % tile
    tiles = jnp.pad(rows, ((0, pad), (0, 0))).reshape(-1, tile, rows.shape[-1])
    out = jax.lax.map(fn, tiles)
    out = out.reshape(-1, *out.shape[2:])[:m]
    return out.reshape(*lead, *out.shape[1:])
